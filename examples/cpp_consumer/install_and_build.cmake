# CTest driver (examples/CMakeLists.txt): installs kerf from KERF_BUILD_DIR into
# a fresh prefix under WORK_DIR, configures and builds examples/cpp_consumer
# against that prefix alone, and runs it.
#   cmake -DKERF_BUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=... -P install_and_build.cmake
foreach(var KERF_BUILD_DIR CONSUMER_DIR WORK_DIR GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_and_build.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
# The library, headers and CMake package (the Python module has its own component).
run("cmake --install" "${CMAKE_COMMAND}" --install "${KERF_BUILD_DIR}" --prefix "${prefix}" --component Unspecified)
run("configuring the consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
run("building the consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("running the consumer" "${WORK_DIR}/build/kerf_consumer")
