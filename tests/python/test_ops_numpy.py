"""Every bound op on the CPU back end against a float64 NumPy reference."""

import numpy as np
import pytest

from dlpack_ctypes import capsule, from_bf16_bits, kDLBfloat, to_bf16_bits

rng = np.random.default_rng(1234)


def dora_reference(W, A, B, m, s, eps=0.0):
    W, A, B, m = (np.asarray(x, dtype=np.float64) for x in (W, A, B, m))
    norm = np.sqrt(((W + s * B @ A) ** 2).sum(axis=1) + eps)
    return norm, m / norm


def moe_reference(W, A, B, s):
    W, A, B = (np.asarray(x, dtype=np.float64) for x in (W, A, B))
    return W + s * np.einsum("enr,erk->enk", B, A)


def make_dora(out, inn, r, dtype=np.float32, adapter_dtype=np.float32):
    W = rng.standard_normal((out, inn)).astype(dtype)
    A = (rng.standard_normal((r, inn)) / np.sqrt(inn)).astype(adapter_dtype)
    B = rng.standard_normal((out, r)).astype(adapter_dtype)
    m = rng.uniform(0.5, 2.0, out).astype(np.float32)
    return W, A, B, m


@pytest.mark.parametrize("out,inn,r", [(64, 128, 8), (37, 91, 3), (1, 1, 1), (130, 300, 16), (48, 64, 256)])
def test_dora_norm_matches_float64_in_float32(kerf_cpu, out, inn, r):
    W, A, B, m = make_dora(out, inn, r)
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B, m, 0.75)
    assert isinstance(norm, np.ndarray) and norm.dtype == np.float32 and norm.shape == (out,)
    ref_norm, ref_scale = dora_reference(W, A, B, m, 0.75)
    np.testing.assert_allclose(norm, ref_norm, rtol=2e-5)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-5)


def test_dora_norm_with_float16_weight_and_float32_adapters(kerf_cpu):
    W, A, B, m = make_dora(96, 160, 8, dtype=np.float16)
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B, m.astype(np.float16), 0.5)
    ref_norm, ref_scale = dora_reference(W, A, B, m.astype(np.float16), 0.5)
    # The low-rank product runs in W's dtype (tensor cores on a GPU): half precision.
    np.testing.assert_allclose(norm, ref_norm, rtol=2e-3)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-3)


def test_dora_norm_rounds_float32_adapters_once_when_asked(kerf_cpu):
    # CAST_A: one launch rounds A to the product's dtype first; the same rounding.
    W, A, B, m = make_dora(96, 160, 8, dtype=np.float16)
    m = m.astype(np.float16)
    plain, _ = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, config=kerf_cpu.Config(block_m=16, split_k=2))
    cast, scale = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5,
                                         config=kerf_cpu.Config(block_m=16, split_k=2, meta={"CAST_A": 1}))
    np.testing.assert_allclose(cast, plain, rtol=1e-6)
    ref_norm, ref_scale = dora_reference(W, A, B, m, 0.5)
    np.testing.assert_allclose(cast, ref_norm, rtol=2e-3)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-3)
    with pytest.raises(kerf_cpu.InvalidArgumentError, match="CAST_A"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, config=kerf_cpu.Config(meta={"CAST_A": 2}))


def test_layout_and_prefetch_hints_pass_through_config_meta(kerf_cpu):
    # WARPS_N and L2_PREFETCH change only how a GPU runs the op: the same answer, and
    # values the GPU could not use are refused with the op's message on any device.
    W, A, B, m = make_dora(64, 96, 8, dtype=np.float16)
    plain, _ = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5)
    hinted, _ = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5,
                                       config=kerf_cpu.Config(meta={"WARPS_N": 2, "L2_PREFETCH": 128}))
    np.testing.assert_allclose(hinted, plain, rtol=1e-6)
    with pytest.raises(kerf_cpu.InvalidArgumentError, match="WARPS_N must be 0 .kerf chooses. or a power of two"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, config=kerf_cpu.Config(meta={"WARPS_N": 3}))
    with pytest.raises(kerf_cpu.InvalidArgumentError, match="L2_PREFETCH must be 0, 64, 128 or 256"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, config=kerf_cpu.Config(meta={"L2_PREFETCH": 32}))


def test_dora_norm_on_bfloat16_weights_from_a_dlpack_capsule(kerf_cpu):
    # NumPy has no bfloat16: the bits travel in a hand-made capsule typed kDLBfloat.
    W32, A, B, m = make_dora(64, 96, 8)
    W_bits = to_bf16_bits(W32)
    W_cap = capsule(W_bits, code=kDLBfloat, bits=16)
    norm, scale = kerf_cpu.ops.dora_norm(W_cap, A, B, m, 0.5, norm=np.empty(64, np.float32),
                                         scale=np.empty(64, np.float32))
    ref_norm, ref_scale = dora_reference(from_bf16_bits(W_bits), A, B, m, 0.5)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-2)
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-2)


def test_dora_norm_eps_and_zero_rows(kerf_cpu):
    W, A, B, m = make_dora(8, 32, 4)
    W[3] = 0.0
    B[3] = 0.0
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B, m, 1.0)
    assert norm[3] == 0.0 and np.isinf(scale[3])  # PEFT's behaviour with eps = 0
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B, m, 1.0, eps=1e-6)
    ref_norm, ref_scale = dora_reference(W, A, B, m, 1.0, eps=1e-6)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-5)


def test_dora_norm_of_zero_rows_returns_empty_outputs(kerf_cpu):
    W, A, B, m = make_dora(0, 16, 2)
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B, m, 1.0)
    assert norm.shape == (0,) and scale.shape == (0,)


def test_dora_norm_reads_strided_inputs(kerf_cpu):
    out, inn, r = 40, 72, 6
    W_t = rng.standard_normal((inn, out)).astype(np.float32)  # W = W_t.T: column-major
    A_wide = rng.standard_normal((r, 2 * inn)).astype(np.float32) / 10
    B_f = np.asfortranarray(rng.standard_normal((out, r)).astype(np.float32))
    m_wide = rng.uniform(0.5, 2.0, 2 * out).astype(np.float32)
    W, A, m = W_t.T, A_wide[:, ::2], m_wide[1::2]
    assert not W.flags.c_contiguous and not A.flags.c_contiguous and not B_f.flags.c_contiguous
    norm, scale = kerf_cpu.ops.dora_norm(W, A, B_f, m, 0.25)
    ref_norm, ref_scale = dora_reference(W, A, B_f, m, 0.25)
    np.testing.assert_allclose(norm, ref_norm, rtol=2e-5)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-5)


def test_dora_norm_writes_strided_outputs(kerf_cpu):
    W, A, B, m = make_dora(32, 64, 4)
    both = np.zeros((2, 64), np.float32)
    norm, scale = both[0, ::2], both[1, 1::2]
    kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)
    ref_norm, ref_scale = dora_reference(W, A, B, m, 0.5)
    np.testing.assert_allclose(both[0, ::2], ref_norm, rtol=2e-5)
    np.testing.assert_allclose(both[1, 1::2], ref_scale, rtol=2e-5)
    assert not both[0, 1::2].any() and not both[1, ::2].any()  # nothing written between


def test_dora_norm_takes_an_explicit_config(kerf_cpu):
    W, A, B, m = make_dora(50, 70, 5)
    norm, _ = kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, config=kerf_cpu.Config(block_m=16, block_k=32))
    np.testing.assert_allclose(norm, dora_reference(W, A, B, m, 0.5)[0], rtol=2e-5)


@pytest.mark.parametrize("E,N,K,r", [(4, 48, 80, 8), (3, 17, 33, 2), (1, 64, 64, 16)])
def test_moe_lora_materialize_matches_float64(kerf_cpu, E, N, K, r):
    W = rng.standard_normal((E, N, K)).astype(np.float32)
    A = rng.standard_normal((E, r, K)).astype(np.float32)
    B = rng.standard_normal((E, N, r)).astype(np.float32)
    W_eff = kerf_cpu.ops.moe_lora_materialize(W, A, B, 0.5)
    assert isinstance(W_eff, np.ndarray) and W_eff.dtype == np.float32 and W_eff.shape == (E, N, K)
    np.testing.assert_allclose(W_eff, moe_reference(W, A, B, 0.5), rtol=1e-5, atol=1e-5)


def test_moe_lora_materialize_float16(kerf_cpu):
    E, N, K, r = 2, 32, 48, 4
    W = rng.standard_normal((E, N, K)).astype(np.float16)
    A = rng.standard_normal((E, r, K)).astype(np.float32)
    B = rng.standard_normal((E, N, r)).astype(np.float32)
    W_eff = kerf_cpu.ops.moe_lora_materialize(W, A, B, 0.5)
    assert W_eff.dtype == np.float16
    np.testing.assert_allclose(W_eff, moe_reference(W, A, B, 0.5), rtol=1e-2, atol=1e-2)


def test_moe_lora_materialize_on_peft_flat_layout_views(kerf_cpu):
    # PEFT ParamWrapper: lora_A [r*E, K] (row e*r + j), lora_B [N, r*E] (column j*E + e).
    E, N, K, r = 4, 24, 40, 3
    W = rng.standard_normal((E, N, K)).astype(np.float32)
    lora_A = rng.standard_normal((r * E, K)).astype(np.float32)
    lora_B = rng.standard_normal((N, r * E)).astype(np.float32)
    A3 = lora_A.reshape(E, r, K)
    B3 = lora_B.reshape(N, r, E).transpose(2, 0, 1)  # a strided view, no copy
    assert np.shares_memory(B3, lora_B)
    W_eff = kerf_cpu.ops.moe_lora_materialize(W, A3, B3, 2.0)
    ref = np.stack([W[e] + 2.0 * lora_B[:, e::E].astype(np.float64) @ lora_A[e * r:(e + 1) * r] for e in range(E)])
    np.testing.assert_allclose(W_eff, ref, rtol=1e-5, atol=1e-5)


def test_moe_lora_materialize_into_out_and_in_place(kerf_cpu):
    E, N, K, r = 2, 16, 24, 4
    W = rng.standard_normal((E, N, K)).astype(np.float32)
    A = rng.standard_normal((E, r, K)).astype(np.float32)
    B = rng.standard_normal((E, N, r)).astype(np.float32)
    ref = moe_reference(W, A, B, 0.5)
    out = np.empty_like(W)
    assert kerf_cpu.ops.moe_lora_materialize(W, A, B, 0.5, out=out) is out
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert kerf_cpu.ops.moe_lora_materialize(W, A, B, 0.5, out=W) is W  # merge into the weights
    np.testing.assert_allclose(W, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [0, 3])
def test_programs_walking_the_rows_give_the_same_answer(kerf_cpu, split):
    # Config.meta WALK_ROWS: programs own a block of columns and walk the rows (the planner's
    # row slices, or split_k of them); rows and columns past the blocks, in place and out of
    # place, PEFT's flat expert layout read through strides.
    E, N, K, r = 3, 70, 52, 5
    config = kerf_cpu.Config(block_m=16, block_k=16, split_k=split, meta={"WALK_ROWS": 1})
    W = rng.standard_normal((E, N, K)).astype(np.float32)
    lora_A = rng.standard_normal((r * E, K)).astype(np.float32)
    lora_B = rng.standard_normal((N, r * E)).astype(np.float32)
    A3, B3 = lora_A.reshape(E, r, K), lora_B.reshape(N, r, E).transpose(2, 0, 1)
    ref = moe_reference(W, A3, B3, 0.5)
    np.testing.assert_allclose(kerf_cpu.ops.moe_lora_materialize(W, A3, B3, 0.5, config=config), ref,
                               rtol=1e-5, atol=1e-5)
    assert kerf_cpu.ops.moe_lora_materialize(W, A3, B3, 0.5, out=W, config=config) is W
    np.testing.assert_allclose(W, ref, rtol=1e-5, atol=1e-5)
    W2 = rng.standard_normal((N, K)).astype(np.float32)
    W2_0 = W2.copy()
    kerf_cpu.ops.lora_merge(W2, A3[0], B3[0], 2.0, config=config)
    np.testing.assert_allclose(W2, W2_0 + 2.0 * B3[0].astype(np.float64) @ A3[0], rtol=1e-5, atol=1e-5)
    for op, args in ((kerf_cpu.ops.moe_lora_materialize, (W, A3, B3, 0.5)),
                     (kerf_cpu.ops.lora_merge, (W2, A3[0], B3[0], 2.0))):
        with pytest.raises(kerf_cpu.InvalidArgumentError, match="WALK_ROWS"):
            op(*args, config=kerf_cpu.Config(meta={"WALK_ROWS": 2}))


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_one_tile_programs_give_the_same_answer(kerf_cpu, dtype, tol):
    # Config.meta ONE_TILE with STREAM: one tile a program, W's tile asked for before the
    # adapters' and added after the product; rows and columns past the tile, the merge in place,
    # the MoE forward in PEFT's flat expert layout read through strides.
    E, N, K, r = 3, 70, 52, 5
    config = kerf_cpu.Config(block_m=16, block_k=16, meta={"STREAM": 1, "ONE_TILE": 1})
    W = rng.standard_normal((E, N, K)).astype(dtype)
    lora_A = (rng.standard_normal((r * E, K)) / 4).astype(dtype)
    lora_B = (rng.standard_normal((N, r * E)) / 4).astype(dtype)
    A3, B3 = lora_A.reshape(E, r, K), lora_B.reshape(N, r, E).transpose(2, 0, 1)
    ref = moe_reference(W, A3, B3, 0.5)
    np.testing.assert_allclose(kerf_cpu.ops.moe_lora_materialize(W, A3, B3, 0.5, config=config), ref,
                               rtol=tol, atol=tol)
    W2 = W[0].copy()
    kerf_cpu.ops.lora_merge(W2, A3[1], B3[1], 2.0, config=config)
    np.testing.assert_allclose(W2, W[0].astype(np.float64) + 2.0 * B3[1].astype(np.float64) @ A3[1],
                               rtol=4 * tol, atol=4 * tol)
    for op, args in ((kerf_cpu.ops.moe_lora_materialize, (W, A3, B3, 0.5)),
                     (kerf_cpu.ops.lora_merge, (W2, A3[0], B3[0], 2.0))):
        with pytest.raises(kerf_cpu.InvalidArgumentError, match="ONE_TILE"):
            op(*args, config=kerf_cpu.Config(meta={"STREAM": 1, "ONE_TILE": 2}))


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_lora_merge_and_unmerge_in_place(kerf_cpu, dtype, tol):
    out, inn, r = 40, 56, 4
    W = rng.standard_normal((out, inn)).astype(dtype)
    A = rng.standard_normal((r, inn)).astype(np.float32) / 4
    B = rng.standard_normal((out, r)).astype(np.float32) / 4
    W0 = W.copy()
    assert kerf_cpu.ops.lora_merge(W, A, B, 0.5) is W
    np.testing.assert_allclose(W, W0.astype(np.float64) + 0.5 * B.astype(np.float64) @ A, rtol=tol, atol=tol)
    assert kerf_cpu.ops.lora_unmerge(W, A, B, 0.5) is W
    np.testing.assert_allclose(W, W0, rtol=4 * tol, atol=4 * tol)


def test_lora_merge_into_a_transposed_view(kerf_cpu):
    # PEFT's fan_in_fan_out weight is stored [in, out]: merge into its transpose.
    out, inn, r = 24, 32, 2
    W_io = rng.standard_normal((inn, out)).astype(np.float32)
    A = rng.standard_normal((r, inn)).astype(np.float32)
    B = rng.standard_normal((out, r)).astype(np.float32)
    ref = W_io.T.astype(np.float64) + 2.0 * B.astype(np.float64) @ A
    kerf_cpu.ops.lora_merge(W_io.T, A, B, 2.0)
    np.testing.assert_allclose(W_io.T, ref, rtol=1e-5, atol=1e-5)


def test_lora_merge_flax_layout(kerf_cpu):
    emb, heads, hd, r = 32, 4, 8, 3
    kernel = rng.standard_normal((emb, heads, hd)).astype(np.float32)
    a = rng.standard_normal((emb, r)).astype(np.float32)
    b = rng.standard_normal((r, heads, hd)).astype(np.float32)
    k0 = kernel.copy()
    kerf_cpu.ops.lora_merge_flax(kernel, a, b, 0.5)
    np.testing.assert_allclose(kernel, k0 + 0.5 * np.einsum("ir,rho->iho", a.astype(np.float64), b),
                               rtol=1e-5, atol=1e-5)
    kerf_cpu.ops.lora_unmerge_flax(kernel, a, b, 0.5)
    np.testing.assert_allclose(kernel, k0, rtol=1e-5, atol=1e-5)


def test_dora_norm_partial_then_finish_equals_dora_norm_over_column_shards(kerf_cpu):
    W, A, B, m = make_dora(48, 96, 4)
    halves = [kerf_cpu.ops.dora_norm_partial(W[:, c:c + 48], A[:, c:c + 48], B, 0.5) for c in (0, 48)]
    sumsq = (halves[0] + halves[1]).astype(np.float32)  # the all-reduce over the "in" shards
    norm, scale = kerf_cpu.ops.dora_norm_finish(sumsq, m, eps=1e-6)
    ref_norm, ref_scale = dora_reference(W, A, B, m, 0.5, eps=1e-6)
    np.testing.assert_allclose(norm, ref_norm, rtol=2e-5)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-5)
    layout = {"mesh": {"tp": 2}, "specs": {"W": (None, "tp"), "A": (None, "tp")}}
    part = kerf_cpu.ops.dora_norm_partial(W[:, :48], A[:, :48], B, 0.5, layout=layout)
    np.testing.assert_allclose(part, halves[0], rtol=1e-6)


def test_dora_norm_with_a_layout_refuses_an_in_split_naming_the_remedy(kerf_cpu):
    W, A, B, m = make_dora(16, 32, 2)
    layout = {"mesh": {"tp": 2}, "specs": {"W": (None, "tp"), "A": (None, "tp")}}
    with pytest.raises(ValueError, match="dora_norm_partial"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, layout=layout)
    with pytest.raises(ValueError, match="unknown key"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, layout={"axes": {}})
    # in split over two mesh axes at once: the same remedy, naming both.
    both = {"mesh": {"tp": 2, "dp": 2}, "specs": {"W": (None, ("dp", "tp")), "A": (None, ("dp", "tp"))}}
    with pytest.raises(ValueError, match=r"splits in over \('dp', 'tp'\): a row's norm needs every column"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, layout=both)
    # Operands sharing a dimension list the same axes in the same order.
    swapped = {"mesh": {"tp": 2, "dp": 2}, "specs": {"W": (None, ("dp", "tp")), "A": (None, ("tp", "dp"))}}
    with pytest.raises(ValueError, match=r"differently \(\('tp', 'dp'\) vs \('dp', 'tp'\)\)"):
        kerf_cpu.ops.dora_norm_partial(W, A, B, 0.5, layout=swapped)


def test_dora_norm_backward_divides_by_the_norm(kerf_cpu):
    norm = rng.uniform(1, 3, 33).astype(np.float32)
    g = rng.standard_normal(33).astype(np.float32)
    grad_m = kerf_cpu.ops.dora_norm_backward(norm, g)
    np.testing.assert_allclose(grad_m, g / norm, rtol=1e-6)


def test_moe_lora_materialize_backward_matches_float64(kerf_cpu):
    E, N, K, r = 3, 20, 28, 4
    dW = rng.standard_normal((E, N, K)).astype(np.float32)
    A = rng.standard_normal((E, r, K)).astype(np.float32)
    B = rng.standard_normal((E, N, r)).astype(np.float32)
    d64 = dW.astype(np.float64)
    # kerf's choice, and row blocks walking their columns from different steps (Config.meta ROTATE).
    for config in (None, kerf_cpu.Config(block_m=8, block_k=16, meta={"ROTATE": 1})):
        dA, dB = kerf_cpu.ops.moe_lora_materialize_backward(dW, A, B, 0.5, config=config)
        assert dA.shape == (E, r, K) and dB.shape == (E, N, r)
        np.testing.assert_allclose(dA, 0.5 * np.einsum("enr,enk->erk", B.astype(np.float64), d64), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(dB, 0.5 * np.einsum("enk,erk->enr", d64, A.astype(np.float64)), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="does not take"):
        kerf_cpu.ops.moe_lora_materialize(dW, A, B, 0.5, config=kerf_cpu.Config(meta={"ROTATE": 1}))


def embedding_tensors(V, H, r, tokens=(1,)):
    """A table [V, H], PEFT's adapters A [r, V] and B [H, r], and a gradient for tokens of that shape, fp32."""
    return (rng.standard_normal((V, H)).astype(np.float32), rng.standard_normal((r, V)).astype(np.float32),
            rng.standard_normal((H, r)).astype(np.float32),
            rng.standard_normal((*tokens, H)).astype(np.float32))


def test_lora_embedding_forward_and_backward_match_float64(kerf_cpu):
    V, H, r, s = 30, 12, 4, 0.5
    x = np.array([[1, 0, 7, 29], [7, 7, 2, 0]], np.int64)
    W, A, B, _ = embedding_tensors(V, H, r)
    out = kerf_cpu.ops.lora_embedding(x, W, A, B, s)
    assert out.shape == (2, 4, H)
    ref = W[x].astype(np.float64) + s * A.T[x].astype(np.float64) @ B.T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    g = rng.standard_normal((2, 4, H)).astype(np.float32)
    gA, gB = kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s, padding_idx=0)
    g64, xf = g.reshape(-1, H).astype(np.float64), x.reshape(-1)
    d_aA = s * g64 @ B
    d_aA[xf == 0] = 0
    ref_gA = np.zeros((V, r))
    np.add.at(ref_gA, xf, d_aA)
    np.testing.assert_allclose(gA, ref_gA.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gB, s * g64.T @ A.T[xf].astype(np.float64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        kerf_cpu.ops.lora_embedding(np.array([V]), W, A, B, s)
    # The forward writes the activations A[:, x[t]] when given after_a; the backward reads
    # them instead of A's columns (twice them: twice grad_B, the same grad_A).
    act = np.full((2, 4, r), np.nan, np.float32)
    out2 = kerf_cpu.ops.lora_embedding(x, W, A, B, s, after_a=act)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(act, A.T[x])
    gA2, gB2 = kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s, padding_idx=0, after_a=2 * act)
    np.testing.assert_allclose(gA2, gA, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gB2, 2 * s * g64.T @ A.T[xf].astype(np.float64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="after_a must have shape"):
        kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s, after_a=act[0])


def test_lora_embedding_after_a_over_vocab_shards_sums_to_the_unsharded_op(kerf_cpu):
    V, H, r, s, n = 30, 12, 4, 0.5, 3
    x = np.array([[1, 0, 7, 29], [7, 7, 12, 20]], np.int64)
    W, A, B, g = embedding_tensors(V, H, r, x.shape)
    gA, gB = kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s)
    lo = V // n
    acts, parts = [], []
    for c in range(n):
        fwd = {"mesh": {"vp": n}, "specs": {"weight": ("vp",), "A": (None, "vp")}, "coords": (c,)}
        act = np.full((2, 4, r), np.nan, np.float32)
        kerf_cpu.ops.lora_embedding(x, W[c * lo:(c + 1) * lo], A[:, c * lo:(c + 1) * lo], B, s, after_a=act,
                                    layout=fwd)
        acts.append(act)
    # Each shard wrote its own ids' activations and zeros elsewhere.
    np.testing.assert_array_equal(sum(acts), A.T[x])
    for given in ("own", "sum"):
        gB_sum = np.zeros_like(gB)
        for c in range(n):
            bwd = {"mesh": {"vp": n}, "specs": {"A": (None, "vp"), "grad_A": (None, "vp")}, "coords": (c,)}
            a = acts[c] if given == "own" else sum(acts)
            pA, pB = kerf_cpu.ops.lora_embedding_backward(x, A[:, c * lo:(c + 1) * lo], B, g, s, after_a=a,
                                                          layout=bwd)
            np.testing.assert_allclose(pA, gA[:, c * lo:(c + 1) * lo], rtol=1e-5, atol=1e-5)
            gB_sum += pB
        np.testing.assert_allclose(gB_sum, gB, rtol=1e-5, atol=1e-5)


def test_lora_embedding_over_a_vocab_split_over_two_mesh_axes_sums_to_the_unsharded_op(kerf_cpu):
    # JAX's P(None, ("dp", "tp")): 2 x 3 shards of 8 ids, shard dp * 3 + tp; coordinates in
    # the mesh's order (tp first here), the shard number in the spec's.
    V, H, r, s, ndp, ntp = 48, 12, 4, 0.5, 2, 3
    x = np.array([[1, 0, 7, 47], [9, 33, 12, 20]], np.int64)
    W, A, B, g = embedding_tensors(V, H, r, x.shape)
    out = kerf_cpu.ops.lora_embedding(x, W, A, B, s)
    gA, gB = kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s)
    lo = V // (ndp * ntp)
    out_sum, gB_sum = np.zeros_like(out), np.zeros_like(gB)
    for dp in range(ndp):
        for tp in range(ntp):
            mesh = [("tp", ntp), ("dp", ndp)]
            fwd = {"mesh": mesh, "specs": {"weight": (("dp", "tp"),), "A": (None, ["dp", "tp"])}, "coords": [tp, dp]}
            bwd = {"mesh": mesh, "specs": {"A": (None, ("dp", "tp")), "grad_A": (None, ("dp", "tp"))},
                   "coords": [tp, dp]}
            c = dp * ntp + tp
            cols = slice(c * lo, (c + 1) * lo)
            out_sum += kerf_cpu.ops.lora_embedding(x, W[cols], A[:, cols], B, s, layout=fwd)
            pA, pB = kerf_cpu.ops.lora_embedding_backward(x, A[:, cols], B, g, s, layout=bwd)
            np.testing.assert_allclose(pA, gA[:, cols], rtol=1e-5, atol=1e-5)
            gB_sum += pB
    np.testing.assert_allclose(out_sum, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gB_sum, gB, rtol=1e-5, atol=1e-5)


def test_lora_embedding_over_uneven_vocab_shards_sums_to_the_unsharded_op(kerf_cpu):
    # np.array_split's shards of 31 ids over 3: 11, 10, 10; each says where it starts.
    V, H, r, s = 31, 12, 4, 0.5
    x = np.array([[1, 0, 7, 30], [11, 21, 12, 20]], np.int64)
    W, A, B, g = embedding_tensors(V, H, r, x.shape)
    out = kerf_cpu.ops.lora_embedding(x, W, A, B, s)
    gA, gB = kerf_cpu.ops.lora_embedding_backward(x, A, B, g, s, padding_idx=7)
    bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(V), 3)])
    out_sum, gB_sum = np.zeros_like(out), np.zeros_like(gB)
    fwd = {"mesh": {"vp": 3}, "specs": {"weight": ("vp",), "A": (None, "vp")}}
    bwd = {"mesh": {"vp": 3}, "specs": {"A": (None, "vp"), "grad_A": (None, "vp")}}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out_sum += kerf_cpu.ops.lora_embedding(x, W[lo:hi], A[:, lo:hi], B, s, layout=fwd,
                                               vocab_start=int(lo), vocab_size=V)
        pA, pB = kerf_cpu.ops.lora_embedding_backward(x, A[:, lo:hi], B, g, s, padding_idx=7, layout=bwd,
                                                      vocab_start=np.int64(lo), vocab_size=V)
        np.testing.assert_allclose(pA, gA[:, lo:hi], rtol=1e-5, atol=1e-5)
        gB_sum += pB
    np.testing.assert_allclose(out_sum, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gB_sum, gB, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vocab_start and vocab_size go together"):
        kerf_cpu.ops.lora_embedding(x, W[:11], A[:, :11], B, s, layout=fwd, vocab_size=V)
    with pytest.raises(TypeError, match="vocab_start must be an int"):
        kerf_cpu.ops.lora_embedding(x, W[:11], A[:, :11], B, s, layout=fwd, vocab_start=1.5, vocab_size=V)


def test_lora_embedding_id_check_options_on_the_cpu(kerf_cpu):
    # CPU ids are checked before every call: "deferred" still raises at once, and
    # check_embedding_ids has nothing to report.
    V, H, r = 10, 8, 2
    W, A, B, _ = embedding_tensors(V, H, r)
    x = np.array([3, V + 2], np.int64)
    with pytest.raises(ValueError, match="outside"):
        kerf_cpu.ops.lora_embedding(x, W, A, B, 0.5, id_check="deferred")
    assert kerf_cpu.ops.check_embedding_ids(W) is None
    with pytest.raises(ValueError, match='id_check must be "sync" or "deferred", got "later"'):
        kerf_cpu.ops.lora_embedding(x[:1], W, A, B, 0.5, id_check="later")
    with pytest.raises(TypeError, match="id_check must be"):
        kerf_cpu.ops.lora_embedding_backward(x[:1], A, B, np.ones((1, H), np.float32), 0.5, id_check=1)
    out = kerf_cpu.ops.lora_embedding(x[:1], W, A, B, 0.5, id_check="deferred")
    np.testing.assert_allclose(out[0], W[3] + 0.5 * A[:, 3] @ B.T, rtol=1e-5, atol=1e-6)


def test_read_only_arrays_are_inputs_but_never_outputs(kerf_cpu):
    # NumPy before 2.1 exports no read-only array through DLPack (np.broadcast_to,
    # np.frombuffer and read-only memory maps give such arrays): kerf reads them
    # through __array_interface__ instead, and refuses them as outputs.
    rng = np.random.default_rng(11)
    W = rng.standard_normal((24, 40)).astype(np.float32)
    A = rng.standard_normal((4, 40)).astype(np.float32)
    B = rng.standard_normal((24, 4)).astype(np.float32)
    m = np.broadcast_to(np.float32(1.5), (24,))  # read-only, stride 0
    W_ro = np.frombuffer(W.tobytes(), np.float32).reshape(24, 40)
    A_ro = np.broadcast_to(A[None], (2, 4, 40))[1]  # read-only view
    assert not W_ro.flags.writeable and not A_ro.flags.writeable and not m.flags.writeable
    want_norm, want_scale = kerf_cpu.ops.dora_norm(W, A, B, np.full(24, 1.5, np.float32), 0.5)
    norm, scale = kerf_cpu.ops.dora_norm(W_ro, A_ro, B, m, 0.5)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    with pytest.raises(ValueError, match="norm is read-only; kerf writes into it"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, norm=np.broadcast_to(np.float32(0), (24,)))
    with pytest.raises(ValueError, match="W is read-only"):
        kerf_cpu.ops.lora_merge(W_ro, A, B, 0.5)
