"""kerf.ops.dora_norm_4bit (a 4-bit NF4 weight, bitsandbytes' layout) on the
CPU back end against a float64 NumPy reference, and bnb_weight4bit on quant
states shaped like bitsandbytes'."""

import types

import numpy as np
import pytest

rng = np.random.default_rng(4321)

# QLoRA's NormalFloat-4 values, as published (bitsandbytes' create_normal_map).
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]


def dequantize(packed, absmax, code, out, inn, blocksize):
    """bitsandbytes' order: high nibble first, one scale per `blocksize` elements of the flat weight."""
    b = np.asarray(packed, dtype=np.uint8).reshape(-1)
    q = np.empty(b.size * 2, dtype=np.int64)
    q[0::2], q[1::2] = b >> 4, b & 15
    flat = np.asarray(code, dtype=np.float64)[q] * np.repeat(np.asarray(absmax, dtype=np.float64), blocksize)[:q.size]
    return flat.reshape(out, inn)


def bf16(x):
    """Round float32 values to bfloat16 (nearest even), as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def make(out, inn, r, blocksize):
    packed = rng.integers(0, 256, (out * inn // 2, 1), dtype=np.uint8)
    absmax = rng.uniform(0.5, 2.0, -(-out * inn // blocksize)).astype(np.float32)
    A = (rng.standard_normal((r, inn)) / np.sqrt(inn)).astype(np.float32)
    B = rng.standard_normal((out, r)).astype(np.float32)
    m = rng.uniform(0.5, 2.0, out).astype(np.float32)
    return packed, absmax, A, B, m


@pytest.mark.parametrize("out,inn,r,blocksize", [(64, 128, 8, 64), (37, 90, 3, 64), (130, 300, 16, 128), (5, 2, 1, 2)])
def test_dora_norm_4bit_matches_float64(kerf_cpu, out, inn, r, blocksize):
    packed, absmax, A, B, m = make(out, inn, r, blocksize)
    s, eps = 0.75, 1e-6
    norm, scale = kerf_cpu.ops.dora_norm_4bit(packed, absmax, A, B, m, s, blocksize=blocksize, eps=eps)
    assert norm.dtype == np.float32 and norm.shape == (out,)
    W = dequantize(packed, absmax, NF4, out, inn, blocksize)
    exact = np.sqrt(((W + s * B.astype(np.float64) @ A) ** 2).sum(axis=1) + eps)
    np.testing.assert_allclose(norm, exact, rtol=1e-2)
    np.testing.assert_allclose(scale, m / exact, rtol=1e-2)
    # What the kernel promises: s*B and A rounded once to bfloat16, the rest exact.
    promised = np.sqrt(((W + bf16(B * np.float32(s)) @ bf16(A)) ** 2).sum(axis=1) + eps)
    np.testing.assert_allclose(norm, promised, rtol=1e-5)


def test_the_default_code_is_nf4_and_another_code_can_be_given(kerf_cpu):
    np.testing.assert_allclose(kerf_cpu.ops.nf4_code(), NF4, rtol=1e-7)
    packed, absmax, A, B, m = make(16, 64, 4, 64)
    fp4_like = np.linspace(-6.0, 6.0, 16).astype(np.float32)
    norm, _ = kerf_cpu.ops.dora_norm_4bit(packed, absmax, A, B, m, 0.5, code=fp4_like)
    W = dequantize(packed, absmax, fp4_like, 16, 64, 64)
    np.testing.assert_allclose(norm, np.sqrt(((W + 0.5 * B.astype(np.float64) @ A) ** 2).sum(axis=1)), rtol=1e-2)


def test_bnb_weight4bit_reads_a_quant_state(kerf_cpu):
    packed, absmax, A, B, m = make(32, 64, 4, 64)
    state = types.SimpleNamespace(absmax=absmax, code=np.asarray(NF4, np.float32), blocksize=64, nested=False)
    weight = types.SimpleNamespace(data=packed, quant_state=state)
    kw = kerf_cpu.ops.bnb_weight4bit(weight)
    assert kw["blocksize"] == 64 and kw["packed"] is packed
    norm, _ = kerf_cpu.ops.dora_norm_4bit(A=A, B=B, m=m, s=1.0, **kw)
    direct, _ = kerf_cpu.ops.dora_norm_4bit(packed, absmax, A, B, m, 1.0)
    np.testing.assert_array_equal(norm, direct)
    with pytest.raises(TypeError, match="no quant_state"):
        kerf_cpu.ops.bnb_weight4bit(packed)


def test_a_wrong_blocksize_is_caught_by_the_absmax_count(kerf_cpu):
    packed, absmax, A, B, m = make(16, 64, 4, 64)
    with pytest.raises(ValueError, match="is blocksize right"):
        kerf_cpu.ops.dora_norm_4bit(packed, absmax, A, B, m, 1.0, blocksize=128)
    with pytest.raises(ValueError, match="must be even"):
        kerf_cpu.ops.dora_norm_4bit(packed, absmax, A[:, :63], B, m, 1.0)
