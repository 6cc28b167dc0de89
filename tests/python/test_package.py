"""The package itself: what `import kerf` gives, errors, kerf.Buffer, typing files."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kerf


def test_import_gives_version_ops_and_backend_queries():
    assert kerf.__version__.count(".") == 2
    assert callable(kerf.ops.dora_norm) and callable(kerf.ops.moe_lora_materialize)
    assert isinstance(kerf.cpu_available(), bool)
    assert isinstance(kerf.cuda_available(), bool)
    assert kerf.device_count() >= 0
    if not kerf.cuda_available():
        assert kerf.cuda_unavailable_reason()


def run_python(code):
    """`code` in a fresh interpreter that imports this kerf; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(kerf.__file__)),
                                                        os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_import_kerf_does_not_import_torch():
    assert run_python("import sys, kerf, kerf.ops; print('torch' in sys.modules)") == "False"


def test_kerf_autograd_without_torch_says_what_is_missing():
    # torch made unimportable in a fresh interpreter (a None entry in sys.modules), so
    # that this runs where torch is installed too.
    code = """
import sys
sys.modules["torch"] = None
import kerf
try:
    kerf.autograd
except ImportError as e:
    print(e)
"""
    assert "kerf.autograd needs PyTorch" in run_python(code)


def test_errors_derive_from_kerf_error_and_the_builtin_their_kind_maps_to():
    assert issubclass(kerf.InvalidArgumentError, ValueError)
    assert issubclass(kerf.DefinitionError, ValueError)
    assert issubclass(kerf.DTypeError, TypeError)
    for cls in (kerf.CompileError, kerf.CudaError, kerf.NotAvailableError, kerf.CacheError, kerf.InternalError,
                kerf.WorkInterruptedError):
        assert issubclass(cls, RuntimeError)
    for cls in (kerf.InvalidArgumentError, kerf.DTypeError, kerf.CompileError, kerf.NotAvailableError):
        assert issubclass(cls, kerf.Error)
    assert kerf.InvalidArgumentError.__module__ == "kerf"


def test_the_package_ships_type_stubs_and_the_typed_marker():
    pkg = os.path.dirname(kerf.__file__)
    assert os.path.isfile(os.path.join(pkg, "py.typed"))
    assert os.path.isfile(os.path.join(pkg, "_kerf.pyi"))


def test_ops_have_docstrings_and_keyword_only_options():
    import inspect

    sig = inspect.signature(kerf.ops.dora_norm)
    assert list(sig.parameters)[:5] == ["W", "A", "B", "m", "s"]
    for name in ("eps", "norm", "scale", "stream", "config"):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "without materializing" in kerf.ops.dora_norm.__doc__
    assert "W_eff" in kerf.ops.moe_lora_materialize.__doc__


def test_config_takes_keywords_and_prints_them():
    c = kerf.Config(block_m=32, num_warps=8)
    assert (c.block_m, c.block_k, c.num_warps) == (32, 0, 8)
    assert repr(c).startswith("kerf.Config(block_m=32") and "meta" not in repr(c)
    c = kerf.Config(meta={"ROTATE": 1})
    assert c.meta == {"ROTATE": 1} and repr(c).endswith("meta={'ROTATE': 1})")
    with pytest.raises(TypeError):  # a copy written into would change nothing: refused instead
        c.meta["EVICT"] = 1
    c.meta = {**c.meta, "EVICT": 1}
    assert c.meta == {"ROTATE": 1, "EVICT": 1}


def test_a_buffer_is_a_dlpack_producer_numpy_views_without_copying():
    buf = kerf.empty((3, 5), "float32")
    assert buf.shape == (3, 5) and buf.strides == (5, 1) and buf.dtype == "f32" and buf.device == "cpu"
    assert buf.nbytes == 60 and repr(buf) == "kerf.Buffer(f32[3, 5] on cpu)"
    assert buf.__dlpack_device__() == (1, 0)
    a = np.from_dlpack(buf)
    assert a.shape == (3, 5) and a.ctypes.data == buf.data_ptr()
    w = buf.numpy()  # a writable view (NumPy 1.x imports DLPack read-only)
    assert w.ctypes.data == buf.data_ptr() and w.flags.writeable
    w[...] = 7.0
    assert a[2, 4] == 7.0  # same memory


def test_a_buffer_outlives_its_python_object_while_a_view_holds_it():
    buf = kerf.empty((1000,), "float64")
    buf.numpy()[:] = np.arange(1000)
    a = np.from_dlpack(buf)
    del buf
    import gc

    gc.collect()
    assert a[999] == 999.0


def test_a_buffer_exports_versioned_capsules_when_asked():
    buf = kerf.empty((4,), "f32")
    assert type(buf.__dlpack__()).__name__ == "PyCapsule"
    cap = buf.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap)
    assert "dltensor_versioned" not in repr(buf.__dlpack__(max_version=(0, 8)))
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    # Arguments of the wrong kind are named; a CPU buffer has no stream to order against.
    with pytest.raises(TypeError, match="dl_device must be a .device type, device id. tuple of ints, got str"):
        buf.__dlpack__(dl_device="cpu")
    with pytest.raises(TypeError, match="max_version must be a .major, minor. tuple of ints, got int"):
        buf.__dlpack__(max_version=1)
    with pytest.raises(ValueError, match="stream must be None for a buffer on the CPU, got 5"):
        buf.__dlpack__(stream=5)
    assert type(buf.__dlpack__(stream=None)).__name__ == "PyCapsule"


def test_buffer_arguments_are_checked():
    with pytest.raises(TypeError, match="unknown dtype"):
        kerf.empty((2,), "complex64")
    with pytest.raises(ValueError, match="device must be"):
        kerf.empty((2,), "f32", "tpu")
    with pytest.raises(ValueError, match=">= 0"):
        kerf.empty((-1,), "f32")
    assert kerf.empty((0, 4), "bf16").shape == (0, 4)
    # A shape that is no sequence.
    with pytest.raises(TypeError, match="shape must be a sequence of ints, got int"):
        kerf.empty(5)
    assert kerf.empty((3,), "u8").dtype == "u8" and kerf.empty((3,), "half").dtype == "f16"
    with pytest.raises(BufferError, match="NumPy has no bf16"):
        kerf.empty((2,), "bf16").numpy()
