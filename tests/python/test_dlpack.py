"""Tensors cross into kerf without copies: NumPy arrays, DLPack producers, raw
capsules of both DLPack generations, kerf.Buffer."""

import sys

import numpy as np
import pytest

import kerf
from dlpack_ctypes import (
    FLAG_IS_COPIED,
    FLAG_READ_ONLY,
    kDLCUDAHost,
    kDLFloat,
    kDLOpenCL,
    kDLUInt,
    capsule,
)

rng = np.random.default_rng(7)
view_info = kerf._kerf._view_info


def dora_inputs(out=16, inn=32, r=4):
    W = rng.standard_normal((out, inn)).astype(np.float32)
    A = (rng.standard_normal((r, inn)) / 4).astype(np.float32)
    B = rng.standard_normal((out, r)).astype(np.float32)
    m = rng.uniform(0.5, 2.0, out).astype(np.float32)
    return W, A, B, m


def ref_norm(W, A, B, s):
    return np.linalg.norm(W.astype(np.float64) + s * B.astype(np.float64) @ A, axis=1)


def test_kerf_sees_the_arrays_own_memory_shape_and_element_strides():
    a = np.zeros((6, 10), np.float32)
    v = a[1:, 2::3]
    info = view_info(v)
    assert info["data_ptr"] == v.ctypes.data  # the address inside the parent: no copy
    assert info["shape"] == [5, 3] and info["strides"] == [10, 3]
    assert info["dtype"] == "f32" and info["device"] == "cpu"
    t = view_info(a.T)
    assert t["data_ptr"] == a.ctypes.data and t["strides"] == [1, 10]


def test_outputs_given_are_written_in_place_and_returned(kerf_cpu):
    W, A, B, m = dora_inputs()
    norm = np.full(16, -1.0, np.float32)
    scale = np.full(16, -1.0, np.float32)
    n, s = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)
    assert n is norm and s is scale
    np.testing.assert_allclose(norm, ref_norm(W, A, B, 0.5), rtol=2e-5)
    np.testing.assert_allclose(scale, m / ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_the_producers_export_is_released_after_the_call(kerf_cpu):
    W, A, B, m = dora_inputs()
    before = [sys.getrefcount(x) for x in (W, A, B, m)]
    for _ in range(3):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5)
    assert [sys.getrefcount(x) for x in (W, A, B, m)] == before


class Producer:
    """A DLPack producer that records how kerf calls it (NumPy does the work)."""

    def __init__(self, array, legacy=False):
        self.array, self.legacy, self.calls = array, legacy, []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if self.legacy and "max_version" in kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_producers_are_asked_for_dlpack_1_and_given_no_stream_on_the_cpu(kerf_cpu):
    W, A, B, m = dora_inputs()
    p = Producer(W)
    norm, _ = kerf_cpu.ops.dora_norm(p, A, B, m, 0.5)
    assert p.calls == [{"max_version": (1, 0)}]
    assert isinstance(norm, kerf.Buffer)  # the first tensor is no NumPy array: kerf allocates
    np.testing.assert_allclose(np.from_dlpack(norm), ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_legacy_producers_that_refuse_max_version_are_asked_again_without_it(kerf_cpu):
    W, A, B, m = dora_inputs()
    p = Producer(W, legacy=True)
    kerf_cpu.ops.dora_norm(p, A, B, m, 0.5)
    assert p.calls == [{"max_version": (1, 0)}, {}]
    p.calls.clear()
    kerf_cpu.ops.dora_norm(p, A, B, m, 0.5)  # remembered for the type
    assert p.calls == [{}]


def test_outputs_for_non_numpy_inputs_are_kerf_buffers_numpy_can_view(kerf_cpu):
    W, A, B, m = dora_inputs()
    norm, scale = kerf_cpu.ops.dora_norm(capsule(W), capsule(A), capsule(B), capsule(m), 0.5)
    assert isinstance(norm, kerf.Buffer) and norm.shape == (16,) and norm.dtype == "f32"
    n = np.from_dlpack(norm)
    assert n.ctypes.data == norm.data_ptr()
    np.testing.assert_allclose(n, ref_norm(W, A, B, 0.5), rtol=2e-5)
    np.testing.assert_allclose(np.from_dlpack(scale), m / ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_buffers_go_back_into_ops(kerf_cpu):
    E, N, K, r = 2, 8, 16, 2
    W = rng.standard_normal((E, N, K)).astype(np.float32)
    A = rng.standard_normal((E, r, K)).astype(np.float32)
    B = rng.standard_normal((E, N, r)).astype(np.float32)
    W_buf = kerf.empty(W.shape, "f32")
    W_buf.numpy()[...] = W
    out = kerf.empty(W.shape, "f32")
    assert kerf_cpu.ops.moe_lora_materialize(W_buf, A, B, 1.0, out=out) is out
    ref = W + np.einsum("enr,erk->enk", B.astype(np.float64), A)
    np.testing.assert_allclose(np.from_dlpack(out), ref, rtol=1e-5, atol=1e-5)
    assert view_info(out)["data_ptr"] == out.data_ptr()


@pytest.mark.parametrize("versioned", [False, True])
def test_raw_capsules_of_both_generations_are_read_not_consumed(kerf_cpu, versioned):
    W, A, B, m = dora_inputs()
    caps = [capsule(x, versioned=versioned) for x in (W, A, B, m)]
    norm = np.empty(16, np.float32)
    kerf_cpu.ops.dora_norm(*caps, 0.5, norm=norm, scale=np.empty(16, np.float32))
    np.testing.assert_allclose(norm, ref_norm(W, A, B, 0.5), rtol=2e-5)
    name = "dltensor_versioned" if versioned else "dltensor"
    assert f'"{name}"' in repr(caps[0])  # still the caller's, unconsumed
    kerf_cpu.ops.dora_norm(*caps, 0.5, norm=norm, scale=np.empty(16, np.float32))  # and usable again


def test_versioned_buffer_capsules_are_read(kerf_cpu):
    W, A, B, m = dora_inputs()
    W_buf = kerf.empty(W.shape, "f32")
    W_buf.numpy()[...] = W
    norm, _ = kerf_cpu.ops.dora_norm(W_buf.__dlpack__(max_version=(1, 0)), A, B, m, 0.5)
    np.testing.assert_allclose(np.from_dlpack(norm), ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_null_strides_mean_row_major_and_byte_offsets_are_added(kerf_cpu):
    W, A, B, m = dora_inputs()
    padded = np.concatenate([np.zeros(5, np.float32), W.ravel()])
    W_cap = capsule(padded[5:], shape=W.shape, strides=None, byte_offset=20)
    info = view_info(W_cap)
    assert info["data_ptr"] == padded[5:].ctypes.data and info["strides"] == [32, 1]
    norm, _ = kerf_cpu.ops.dora_norm(W_cap, A, B, m, 0.5)
    np.testing.assert_allclose(np.from_dlpack(norm), ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_pinned_host_memory_runs_on_the_cpu():
    a = np.zeros(4, np.float32)
    assert view_info(capsule(a, device=(kDLCUDAHost, 0)))["device"] == "cpu"


def test_read_only_or_copied_exports_are_refused_as_outputs_but_read_as_inputs(kerf_cpu):
    W, A, B, m = dora_inputs()
    out = np.empty(16, np.float32)
    with pytest.raises(ValueError, match="norm is read-only"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, norm=capsule(out, versioned=True, flags=FLAG_READ_ONLY))
    with pytest.raises(ValueError, match="scale was exported as a copy"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, scale=capsule(out, versioned=True, flags=FLAG_IS_COPIED))
    W_ro = capsule(W, versioned=True, flags=FLAG_READ_ONLY | FLAG_IS_COPIED)
    norm, _ = kerf_cpu.ops.dora_norm(W_ro, A, B, m, 0.5)
    np.testing.assert_allclose(np.from_dlpack(norm), ref_norm(W, A, B, 0.5), rtol=2e-5)


def test_capsules_kerf_cannot_read_are_refused_with_the_reason():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="DLPack 2.0 tensor"):
        view_info(capsule(a, versioned=True, version=(2, 0)))
    with pytest.raises(ValueError, match="already consumed"):
        view_info(capsule(a, name=b"used_dltensor"))
    with pytest.raises(TypeError, match="not a DLPack tensor"):
        view_info(capsule(a, name=b"something_else"))
    with pytest.raises(ValueError, match="DLPack device type 4"):
        view_info(capsule(a, device=(kDLOpenCL, 0)))
    with pytest.raises(TypeError, match="float32x4"):
        view_info(capsule(a, lanes=4))
    with pytest.raises(TypeError, match="uint16"):
        view_info(capsule(a.view(np.uint16), code=kDLUInt, bits=16))
    with pytest.raises(TypeError, match="float8"):
        view_info(capsule(a, code=kDLFloat, bits=8))
    with pytest.raises(ValueError, match="rank 9"):
        view_info(capsule(np.zeros([1] * 9, np.float32)))


def test_a_buffer_too_large_to_exist_is_refused_and_one_too_large_for_memory_is_a_memory_error():
    # The byte count is checked before anything is allocated: a wrapped product used to
    # make a small buffer that claimed an enormous shape.
    with pytest.raises(ValueError, match=r"its sizes multiply past 2\^62 bytes"):
        kerf.empty((1 << 62, 1 << 62), "float32", "cpu")
    # 2^61 bytes: more than any process's address space, whatever the overcommit policy.
    with pytest.raises(MemoryError, match="could not allocate 2305843009213693952 bytes of host memory"):
        kerf.empty((1 << 59,), "float32", "cpu")
    # Empty, its other sizes count too (as NumPy's do): its strides are their products.
    with pytest.raises(ValueError, match=r"its sizes multiply past 2\^62 bytes"):
        kerf.empty((0, 1 << 62, 1 << 62), "float32", "cpu")
    assert kerf.empty((0, 1 << 30, 1 << 30), "float32", "cpu").strides == (1 << 60, 1 << 30, 1)
