"""kerf: JIT-compiled LoRA/DoRA/MoE kernels, callable on any DLPack tensor.

    import kerf
    norm, scale = kerf.ops.dora_norm(W, A, B, m, s)    # torch, NumPy, CuPy, JAX ...

Tensors cross into kerf without copies: PyTorch tensors directly, every other
array through the DLPack protocol (``__dlpack__``/``__dlpack_device__``) or as
a raw DLPack capsule. CUDA tensors run on the GPU, on PyTorch's current stream
(or ``stream=``); CPU tensors run on kerf's CPU back end (LLVM). Outputs kerf
allocates are torch tensors for torch inputs, NumPy arrays for NumPy inputs and
:class:`kerf.Buffer` (a DLPack producer) otherwise.

Errors derive from :class:`kerf.Error` and from ValueError (bad shapes,
values, devices), TypeError (dtypes, non-tensors) or RuntimeError (compile,
CUDA, missing back end). ``kerf.autograd`` holds torch.autograd.Function
wrappers; it imports torch when first used.
"""

from __future__ import annotations

from typing import Sequence

from . import ops
from ._kerf import (
    Buffer,
    CacheError,
    CompileError,
    Config,
    CudaError,
    DefinitionError,
    DTypeError,
    Error,
    InternalError,
    InvalidArgumentError,
    NotAvailableError,
    WorkInterruptedError,
    __version__,
    clear_kernel_cache,
    cpu_available,
    cuda_available,
    cuda_unavailable_reason,
    device_count,
    llvm_version,
)

# kerf.autograd is not listed: it needs PyTorch, and `from kerf import *` must work
# without it (import kerf.autograd by name).
__all__ = [
    "Buffer",
    "CacheError",
    "CompileError",
    "Config",
    "CudaError",
    "DTypeError",
    "DefinitionError",
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "NotAvailableError",
    "WorkInterruptedError",
    "__version__",
    "clear_kernel_cache",
    "cpu_available",
    "cuda_available",
    "cuda_unavailable_reason",
    "device_count",
    "empty",
    "llvm_version",
    "ops",
]


def empty(shape: Sequence[int], dtype: str = "float32", device: str = "cpu") -> Buffer:
    """Uninitialised kerf-owned memory (a :class:`kerf.Buffer`), e.g. for ``out=``.

    ``dtype``: "float32"/"f32"/"float", "float16"/"f16"/"half", "bfloat16"/"bf16",
    "float64"/"f64"/"double", "int32"/"i32", "int64"/"i64", "bool"/"i1",
    "uint8"/"u8" (4-bit codes' bytes). ``device``: "cpu", "cuda:N", or "cuda": the
    thread's current CUDA device, as PyTorch and CuPy mean it (the device of the
    thread's current CUDA context, made current by ``torch.cuda.set_device`` or
    ``with cupy.cuda.Device(n)``; device 0 when there is none).
    """
    try:
        dims = list(shape)
    except TypeError:
        raise TypeError(f"kerf.empty: shape must be a sequence of ints, got {type(shape).__name__}") from None
    return Buffer(dims, dtype, device)


def __getattr__(name: str):
    # `kerf.autograd` imports torch, so it is loaded on first use only.
    if name == "autograd":
        import importlib

        return importlib.import_module(".autograd", __name__)
    raise AttributeError(f"module 'kerf' has no attribute {name!r}")
