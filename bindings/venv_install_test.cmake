# CTest driver (bindings/CMakeLists.txt): kerf's Python package in a virtual
# environment, as README.md's Python section describes it.
#   1. a venv of the build's interpreter (--system-site-packages for NumPy,
#      --without-pip: nothing is fetched);
#   2. kerf configured with the venv's interpreter must choose the venv's
#      site-packages as the install directory (configure only, nothing built);
#   3. this build's `python` install component, staged under WORK_DIR, must
#      import with the venv's interpreter as a self-contained package (its own
#      libkerf beside the module) and run an op on the CPU.
#   cmake -DPYTHON=... -DSOURCE_DIR=... -DKERF_BUILD_DIR=... -DWORK_DIR=... -DGENERATOR=...
#         -P venv_install_test.cmake
include("${CMAKE_CURRENT_LIST_DIR}/../cmake/script_helpers.cmake")
kerf_require_vars(venv_install_test.cmake PYTHON SOURCE_DIR KERF_BUILD_DIR WORK_DIR GENERATOR)

# A cache entry of a build tree.
function(cache_value build name out)
  file(STRINGS "${build}/CMakeCache.txt" line REGEX "^${name}:[A-Z]+=")
  string(REGEX REPLACE "^${name}:[A-Z]+=" "" value "${line}")
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(venv "${WORK_DIR}/venv")
kerf_run("creating the virtual environment" "${PYTHON}" -m venv --without-pip --system-site-packages "${venv}")
set(venv_python "${venv}/bin/python")
# (No semicolons in the scripts: kerf_run() takes its command as a CMake list.)
kerf_run("asking the venv for its site-packages" "${venv_python}" -c [=[
import sys, sysconfig
assert sys.prefix != sys.base_prefix
print(sysconfig.get_path("platlib"))
]=])
string(STRIP "${run_output}" venv_site)

# 2. Configured with the venv's interpreter, the package installs into the venv.
kerf_run("configuring kerf with the venv's interpreter" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/configured"
    -G "${GENERATOR}" "-DPython_EXECUTABLE=${venv_python}" -DKERF_BUILD_TESTS=OFF -DKERF_BUILD_BENCHMARKS=OFF
    -DKERF_WITH_LLVM=OFF)
if(NOT run_output MATCHES "Python module with pybind11 [^\n]* for ${venv_python}")
  message(FATAL_ERROR "configuring with ${venv_python} did not build the module for it:\n${run_output}")
endif()
cache_value("${WORK_DIR}/configured" KERF_PYTHON_INSTALL_DIR chosen)
if(NOT chosen STREQUAL venv_site)
  message(FATAL_ERROR "with ${venv_python}, KERF_PYTHON_INSTALL_DIR is '${chosen}', not the venv's '${venv_site}'")
endif()

# 3. This build's package, installed under a staging root, imported by the venv's
# interpreter (the same interpreter underneath: the module's ABI is the venv's).
cache_value("${KERF_BUILD_DIR}" KERF_PYTHON_INSTALL_DIR installed_dir)
if(NOT IS_ABSOLUTE "${installed_dir}")
  cache_value("${KERF_BUILD_DIR}" CMAKE_INSTALL_PREFIX prefix)
  set(installed_dir "${prefix}/${installed_dir}")
endif()
set(stage "${WORK_DIR}/stage")
kerf_run("installing the python component" "${CMAKE_COMMAND}" -E env "DESTDIR=${stage}"
    "${CMAKE_COMMAND}" --install "${KERF_BUILD_DIR}" --component python)
set(site "${stage}${installed_dir}")
kerf_run("importing kerf in the venv" "${CMAKE_COMMAND}" -E env "PYTHONPATH=${site}" "KERF_CACHE_DIR=${WORK_DIR}/cache"
    "${venv_python}" -c [=[
import os, sys
import numpy as np
import kerf
site = os.environ["PYTHONPATH"]
assert sys.prefix != sys.base_prefix, "not in a virtual environment"
assert kerf.__file__.startswith(site), kerf.__file__
here = os.path.dirname(kerf.__file__)
assert any(f.startswith("libkerf.so") for f in os.listdir(here)), os.listdir(here)
if kerf.cpu_available():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((7, 40)).astype(np.float32)
    A = rng.standard_normal((3, 40)).astype(np.float32)
    B = rng.standard_normal((7, 3)).astype(np.float32)
    m = rng.uniform(0.5, 1.5, 7).astype(np.float32)
    norm, scale = kerf.ops.dora_norm(W, A, B, m, 0.5)
    ref = np.linalg.norm(W.astype(np.float64) + 0.5 * B.astype(np.float64) @ A.astype(np.float64), axis=1)
    np.testing.assert_allclose(np.asarray(norm), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(scale), m / ref, rtol=1e-5)
    print("dora_norm in the venv matches float64")
print("kerf", kerf.__version__, "imports in the venv from", here)
]=])
