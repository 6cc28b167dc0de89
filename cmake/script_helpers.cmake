# Helpers of kerf's `cmake -P` test drivers (examples/cpp_consumer/install_and_build.cmake,
# bindings/venv_install_test.cmake).

# Fails unless each of the variables after `script` was given with -D.
function(kerf_require_vars script)
  foreach(var ${ARGN})
    if(NOT DEFINED ${var})
      message(FATAL_ERROR "${script}: -D${var}=... is required")
    endif()
  endforeach()
endfunction()

# Runs the command after `what`, prints its output and leaves its stdout in
# run_output; fails naming `what` when it fails. The command is a CMake list: an
# argument holding a semicolon must be written without one.
function(kerf_run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc})")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()
