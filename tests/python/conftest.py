"""pytest setup for kerf's Python tests.

Finds the package: $KERF_BUILD_DIR/python when KERF_BUILD_DIR is set (any
build directory, e.g. on the GPU machine), else whatever `import kerf` finds
(PYTHONPATH, an installed package), else <repo>/build/python.

Kernels compile into a private cache directory for the session unless
KERF_CACHE_DIR is set; autotuning is off unless KERF_AUTOTUNE is set.
"""

import os
import sys
import tempfile

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("KERF_BUILD_DIR"):
    sys.path.insert(0, os.path.join(os.path.abspath(os.environ["KERF_BUILD_DIR"]), "python"))
else:
    try:
        import kerf  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(_ROOT, "build", "python"))

if "KERF_CACHE_DIR" not in os.environ:
    os.environ["KERF_CACHE_DIR"] = tempfile.mkdtemp(prefix="kerf-pytest-cache-")
# The tests check results, not tuning (the C++ suite covers the autotuner): each op's
# defaults keep a GPU run short. KERF_AUTOTUNE=1 tunes as a user's first call would.
os.environ.setdefault("KERF_AUTOTUNE", "0")


def pytest_report_header(config):
    try:
        import kerf
    except ImportError as e:
        return f"kerf: NOT IMPORTABLE ({e}); set KERF_BUILD_DIR or PYTHONPATH=<build>/python"
    lines = [f"kerf {kerf.__version__} from {os.path.dirname(kerf.__file__)}",
             f"kerf: cpu back end {'on (LLVM ' + kerf.llvm_version() + ')' if kerf.cpu_available() else 'off'}; "
             f"cuda {'on, ' + str(kerf.device_count()) + ' device(s)' if kerf.cuda_available() else 'off (' + kerf.cuda_unavailable_reason() + ')'}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__} (cuda: {torch.cuda.is_available()})")
    except ImportError:
        lines.append("torch: not installed (the torch tests are skipped)")
    return lines


@pytest.fixture(scope="session")
def kerf_cpu():
    """kerf, with its CPU back end (tests that run kernels on NumPy arrays need it)."""
    import kerf

    if not kerf.cpu_available():
        pytest.skip("kerf was built without its CPU back end (no LLVM)")
    return kerf
