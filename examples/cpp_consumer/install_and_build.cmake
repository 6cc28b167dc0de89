# CTest driver (examples/CMakeLists.txt): installs kerf from KERF_BUILD_DIR into
# a fresh prefix under WORK_DIR, configures and builds examples/cpp_consumer
# against that prefix alone, and runs it.
#   cmake -DKERF_BUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=... -P install_and_build.cmake
include("${CMAKE_CURRENT_LIST_DIR}/../../cmake/script_helpers.cmake")
kerf_require_vars(install_and_build.cmake KERF_BUILD_DIR CONSUMER_DIR WORK_DIR GENERATOR CXX)

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
# The library, headers and CMake package (the Python module has its own component).
kerf_run("cmake --install" "${CMAKE_COMMAND}" --install "${KERF_BUILD_DIR}" --prefix "${prefix}" --component Unspecified)
kerf_run("configuring the consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
kerf_run("building the consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
kerf_run("running the consumer" "${WORK_DIR}/build/kerf_consumer")
