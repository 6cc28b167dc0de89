"""Hand-made DLPack capsules (ctypes), to test what NumPy cannot produce:
bfloat16, NULL strides, byte offsets, versioned capsules and their flags,
unknown devices and versions."""

import ctypes

import numpy as np

kDLCPU, kDLCUDA, kDLCUDAHost, kDLOpenCL = 1, 2, 3, 4
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool = 0, 1, 2, 4, 6
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_keep = []  # the structs and arrays behind capsules made here live as long as the test process


def capsule(
    array,
    *,
    code=None,
    bits=None,
    shape=None,
    strides="from-array",
    byte_offset=0,
    versioned=False,
    version=(1, 0),
    flags=0,
    device=(kDLCPU, 0),
    lanes=1,
    name=None,
):
    """A DLPack capsule over `array`'s memory (never consumed, no deleter)."""
    array = np.asarray(array)
    if code is None:
        code = {"f": kDLFloat, "i": kDLInt, "u": kDLUInt, "b": kDLBool}[array.dtype.kind]
    if bits is None:
        bits = array.dtype.itemsize * 8
    shape = tuple(array.shape if shape is None else shape)
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    if strides == "from-array":
        strides = tuple(s // array.dtype.itemsize for s in array.strides)
    strides_arr = None if strides is None else (ctypes.c_int64 * max(1, len(strides)))(*strides)
    t = DLTensor()
    t.data = array.ctypes.data - byte_offset
    t.device = DLDevice(*device)
    t.ndim = len(shape)
    t.dtype = DLDataType(code, bits, lanes)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = None if strides_arr is None else ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = byte_offset
    if versioned:
        m = DLManagedTensorVersioned()
        m.version = DLPackVersion(*version)
        m.flags = flags
        m.dl_tensor = t
        default_name = b"dltensor_versioned"
    else:
        m = DLManagedTensor()
        m.dl_tensor = t
        default_name = b"dltensor"
    name = default_name if name is None else name
    _keep.append((array, shape_arr, strides_arr, m, name))
    return _PyCapsule_New(ctypes.addressof(m), name, None)


def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
