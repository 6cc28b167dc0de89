"""Reference timings for kerf's benchmark: PyTorch eager and Triton versions of
the same math, on the same shapes, timed the same way (CUDA events around each
launch, medians, random inputs rotated over several sets, bytes over a
same-size device copy measured in this run). Writes JSON for bench_table.py.

    python3 tests/bench/reference_bench.py --json out.json
"""
import argparse
import functools
import json
import math
import statistics

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None


def median_us(fn, sets, iters=100):
    for i in range(5):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(sets[i % len(sets)])
        stops[i].record()
    torch.cuda.synchronize()
    return statistics.median(1000.0 * s.elapsed_time(e) for s, e in zip(starts, stops))


def copy_gbps(nbytes):
    half = int(nbytes // 2)
    nsets = max(2, math.ceil(400e6 / nbytes))
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda").random_(),
              torch.empty(half, dtype=torch.uint8, device="cuda")) for _ in range(nsets)]
    us = median_us(lambda p: p[1].copy_(p[0]), pairs, 200)
    return nbytes / (us * 1e3)


if triton is not None:

    @triton.jit
    def dora_norm_tiled(W, A, B, M, S, NORM, SCALE, n_out, n_in, rank, s,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr):
        # norm[i] = || W[i,:] + s * B[i,:] @ A ||, one program per BLOCK_M rows, tl.dot on tiles.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, R_PAD)
        b = tl.load(B + rows[:, None] * rank + rk[None, :],
                    mask=(rows[:, None] < n_out) & (rk[None, :] < rank), other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(A + rk[:, None] * n_in + cols[None, :],
                        mask=(rk[:, None] < rank) & (cols[None, :] < n_in), other=0.0)
            w = tl.load(W + rows[:, None] * n_in + cols[None, :],
                        mask=(rows[:, None] < n_out) & (cols[None, :] < n_in), other=0.0)
            v = w.to(tl.float32) + s * tl.dot(b, a)
            acc += v * v
        n = tl.sqrt(tl.sum(acc, axis=1))
        ok = rows < n_out
        tl.store(NORM + rows, n, mask=ok)
        tl.store(SCALE + rows, tl.load(M + rows, mask=ok, other=1.0) / n, mask=ok)

    @triton.jit
    def moe_materialize_tiled(W, A, B, OUT, N, K, rank, s,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr):
        # OUT[e] = W[e] + s * B[e] @ A[e]; one program per (BLOCK_N rows, expert).
        e = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, R_PAD)
        b = tl.load(B + e * N * rank + rows[:, None] * rank + rk[None, :],
                    mask=(rows[:, None] < N) & (rk[None, :] < rank), other=0.0)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(A + e * rank * K + rk[:, None] * K + cols[None, :],
                        mask=(rk[:, None] < rank) & (cols[None, :] < K), other=0.0)
            ok = (rows[:, None] < N) & (cols[None, :] < K)
            off = e * N * K + rows[:, None] * K + cols[None, :]
            w = tl.load(W + off, mask=ok, other=0.0)
            tl.store(OUT + off, (w.to(tl.float32) + s * tl.dot(b, a)).to(w.dtype), mask=ok)

    @triton.jit
    def merge_tiled(W, A, B, n_out, n_in, rank, s, COLS_PER_PROGRAM,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr):
        # W += s * B @ A in place; program (i, j) owns BLOCK_M rows and COLS_PER_PROGRAM
        # columns from j * COLS_PER_PROGRAM (BLOCK_K of them: one tile per program).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, R_PAD)
        b = tl.load(B + rows[:, None] * rank + rk[None, :],
                    mask=(rows[:, None] < n_out) & (rk[None, :] < rank), other=0.0)
        start = tl.program_id(1) * COLS_PER_PROGRAM
        for k0 in range(start, tl.minimum(start + COLS_PER_PROGRAM, n_in), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(A + rk[:, None] * n_in + cols[None, :],
                        mask=(rk[:, None] < rank) & (cols[None, :] < n_in), other=0.0)
            ok = (rows[:, None] < n_out) & (cols[None, :] < n_in)
            off = rows[:, None] * n_in + cols[None, :]
            w = tl.load(W + off, mask=ok, other=0.0)
            tl.store(W + off, (w.to(tl.float32) + s * tl.dot(b, a)).to(w.dtype), mask=ok)


def best_triton(run_with_config, configs, sets):
    best = None
    for cfg in configs:
        try:
            us = median_us(lambda x: run_with_config(x, cfg), sets)
        except Exception:  # a config that does not fit this GPU
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def bench_dora(out, inn, r, results, adapters=torch.bfloat16, partial=False):
    """DoRA's norm; `adapters` is A's and B's dtype (PEFT keeps them in fp32 on a
    bf16 base, and then forms W + s*B@A in fp32). `partial`: a shard's sums of
    squares only (dora_norm_partial, W split on in)."""
    dt = torch.bfloat16
    at = adapters
    nbytes = (out * inn) * 2 + (r * inn + out * r) * at.itemsize + out * 4 * (1 if partial else 3)
    nsets = max(2, math.ceil(300e6 / nbytes))
    sets = []
    for _ in range(nsets):
        sets.append(dict(W=torch.randn(out, inn, device="cuda", dtype=dt),
                         A=0.1 * torch.randn(r, inn, device="cuda", dtype=at),
                         B=0.1 * torch.randn(out, r, device="cuda", dtype=at),
                         m=torch.rand(out, device="cuda") + 0.5,
                         norm=torch.empty(out, device="cuda"),
                         scale=torch.empty(out, device="cuda")))
    s = 2.0
    shape = f"{out}x{inn}"
    op = ("dora_norm_partial" if partial else "dora_norm") + f" r={r}" + ("" if at == dt else " f32 adapters")
    cg = copy_gbps(nbytes)

    def eager(x):
        v = x["W"] + s * (x["B"] @ x["A"])
        if partial:
            return v.float().square().sum(1)
        return x["m"] / torch.linalg.norm(v, dim=1).float()

    us = median_us(eager, sets)
    results.append(dict(impl="torch eager", op=op, shape=shape, median_us=us, bytes=nbytes,
                        gbps=nbytes / (us * 1e3), copy_gbps=cg))
    if triton is not None and at == dt and not partial:
        def run(x, cfg):
            bm, bk, warps = cfg
            dora_norm_tiled[(triton.cdiv(out, bm),)](
                x["W"], x["A"], x["B"], x["m"], None, x["norm"], x["scale"], out, inn, r, s,
                BLOCK_M=bm, BLOCK_K=bk, R_PAD=max(16, triton.next_power_of_2(r)), num_warps=warps)
        best = best_triton(run, [(bm, bk, w) for bm in (32, 64, 128) for bk in (64, 128)
                                 for w in (4, 8)], sets)
        if best:
            results.append(dict(impl="triton tl.dot", op=op, shape=shape, median_us=best[0],
                                bytes=nbytes, gbps=nbytes / (best[0] * 1e3), copy_gbps=cg,
                                config=str(best[1])))


NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]


def bench_dora_4bit(out, inn, r, results):
    """What PEFT does for QLoRA + DoRA: dequantize the NF4 weight to bf16 (here
    with a table lookup, as bitsandbytes' kernel does), then the eager norm."""
    dt = torch.bfloat16
    blocks = -(-out * inn // 64)
    nbytes = out * inn // 2 + blocks * 4 + (r * inn + out * r + out) * 2 + out * 8
    nsets = max(2, math.ceil(300e6 / nbytes))
    code = torch.tensor(NF4, device="cuda")
    sets = [dict(packed=torch.randint(0, 256, (out * inn // 2,), dtype=torch.uint8, device="cuda"),
                 absmax=torch.rand(blocks, device="cuda") + 0.5,
                 A=0.1 * torch.randn(r, inn, device="cuda", dtype=dt),
                 B=0.1 * torch.randn(out, r, device="cuda", dtype=dt),
                 m=torch.rand(out, device="cuda", dtype=dt) + 0.5) for _ in range(nsets)]
    s = 2.0

    def eager(x):
        p = x["packed"]
        q = torch.stack((p >> 4, p & 15), dim=1).reshape(-1).long()
        W = (code[q].view(blocks, -1) * x["absmax"][:, None]).to(dt).view(out, inn)
        n = torch.linalg.norm(W + s * (x["B"] @ x["A"]), dim=1)
        return x["m"].float() / n.float()

    us = median_us(eager, sets)
    results.append(dict(impl="torch eager", op=f"dora_norm_4bit r={r}", shape=f"{out}x{inn}", median_us=us,
                        bytes=nbytes, gbps=nbytes / (us * 1e3), copy_gbps=copy_gbps(nbytes)))


def bench_moe(E, N, K, r, results, adapters=torch.bfloat16, peft=False):
    """MoE LoRA materialization; `adapters` is A's and B's dtype (fp32: PEFT's). With peft,
    they are PEFT's flat lora_A [r*E, K] and lora_B [N, r*E], taken as axolotl's
    MoELoRAMaterialize does (B permuted into [E, N, r] first)."""
    dt = torch.bfloat16
    at = adapters
    nbytes = 2 * E * N * K * 2 + (E * r * K + E * N * r) * at.itemsize
    nsets = max(2, math.ceil(300e6 / nbytes))
    sets = []
    for _ in range(nsets):
        sets.append(dict(W=torch.randn(E, N, K, device="cuda", dtype=dt),
                         A=0.1 * torch.randn(*((r * E, K) if peft else (E, r, K)), device="cuda", dtype=at),
                         B=0.1 * torch.randn(*((N, r * E) if peft else (E, N, r)), device="cuda", dtype=at),
                         out=torch.empty(E, N, K, device="cuda", dtype=dt)))
    s = 0.5
    shape = f"{E}x{N}x{K}"
    op = f"moe_materialize r={r}" + ("" if at == dt else " f32 adapters") + (" peft" if peft else "")
    cg = copy_gbps(nbytes)
    if peft:
        def permuted(x):
            B3 = x["B"].reshape(N, r, E).permute(2, 0, 1).contiguous()
            return torch.baddbmm(x["W"], B3, x["A"].reshape(E, r, K), alpha=s, out=x["out"])
        us = median_us(permuted, sets, 50)
        results.append(dict(impl="torch eager", op=op, shape=shape, median_us=us, bytes=nbytes,
                            gbps=nbytes / (us * 1e3), copy_gbps=cg))
        return
    if at == dt:
        us = median_us(lambda x: torch.baddbmm(x["W"], x["B"], x["A"], alpha=s, out=x["out"]), sets, 50)
    else:  # the product in fp32, added to W and rounded into out
        us = median_us(lambda x: torch.add(x["W"], torch.bmm(x["B"], x["A"]), alpha=s, out=x["out"]), sets, 50)
    results.append(dict(impl="torch eager", op=op, shape=shape, median_us=us, bytes=nbytes,
                        gbps=nbytes / (us * 1e3), copy_gbps=cg))
    if triton is not None and at == dt:
        def run(x, cfg):
            bn, bk, warps = cfg
            moe_materialize_tiled[(triton.cdiv(N, bn), E)](
                x["W"], x["A"], x["B"], x["out"], N, K, r, s,
                BLOCK_N=bn, BLOCK_K=bk, R_PAD=max(16, triton.next_power_of_2(r)), num_warps=warps)
        best = best_triton(run, [(bn, bk, w) for bn in (32, 64, 128) for bk in (64, 128)
                                 for w in (4, 8)], sets)
        if best:
            results.append(dict(impl="triton tl.dot", op=op, shape=shape, median_us=best[0],
                                bytes=nbytes, gbps=nbytes / (best[0] * 1e3), copy_gbps=cg,
                                config=str(best[1])))


def bench_merge(out, inn, r, results, adapters=torch.bfloat16):
    """W.add_(s * (B @ A)) in place (the PEFT merge) on a bf16 W; `adapters` is A's and B's
    dtype (fp32: PEFT's, the product in fp32 added to W)."""
    dt = torch.bfloat16
    at = adapters
    nbytes = 2 * out * inn * 2 + (r * inn + out * r) * at.itemsize
    nsets = max(2, math.ceil(300e6 / nbytes))
    sets = [dict(W=torch.randn(out, inn, device="cuda", dtype=dt),
                 A=0.1 * torch.randn(r, inn, device="cuda", dtype=at),
                 B=0.1 * torch.randn(out, r, device="cuda", dtype=at)) for _ in range(nsets)]
    s = 1e-3
    cg = copy_gbps(nbytes)
    op = f"lora_merge r={r}" + ("" if at == dt else " f32 adapters")
    us = median_us(lambda x: x["W"].add_(s * (x["B"] @ x["A"])), sets, 50)
    results.append(dict(impl="torch eager", op=op, shape=f"{out}x{inn}", median_us=us,
                        bytes=nbytes, gbps=nbytes / (us * 1e3), copy_gbps=cg))
    if triton is not None and at == dt:
        # Each timed call adds s*B@A to W once more; with s = 1e-3 and |B@A| < 1 the
        # values stay in range over all the calls.
        def run(x, cfg):
            bm, bk, warps, cols = cfg
            cols = triton.cdiv(cols or bk, bk) * bk
            merge_tiled[(triton.cdiv(out, bm), triton.cdiv(inn, cols))](
                x["W"], x["A"], x["B"], out, inn, r, s, cols,
                BLOCK_M=bm, BLOCK_K=bk, R_PAD=max(16, triton.next_power_of_2(r)), num_warps=warps)
        # One tile per program, or a row block's columns walked in a loop by 1-4 programs.
        cfgs = [(bm, bk, w, c) for bm in (32, 64, 128) for bk in (64, 128) for w in (4, 8)
                for c in (0, inn // 4, inn)]
        best = best_triton(run, cfgs, sets)
        if best:  # the chosen config must give torch's answer
            x = dict(W=sets[0]["W"].clone(), A=sets[0]["A"], B=sets[0]["B"])
            want = (x["W"].float() + s * (x["B"].float() @ x["A"].float())).to(dt)
            run(x, best[1])
            if not torch.allclose(x["W"].float(), want.float(), rtol=1e-2, atol=1e-2):
                print(f"triton merge {best[1]} gives a wrong answer; its row is left out", flush=True)
                best = None
        if best:
            results.append(dict(impl="triton tl.dot", op=f"lora_merge r={r}", shape=f"{out}x{inn}",
                                median_us=best[0], bytes=nbytes, gbps=nbytes / (best[0] * 1e3), copy_gbps=cg,
                                config=str(best[1])))


def bench_moe_backward(E, N, K, r, results, peft=False):
    """dA = s * bmm(B^T, dW), dB = s * bmm(dW, A^T): MoELoRAMaterialize.backward, bf16. With
    peft, the adapters and gradients are PEFT's flat lora_A [r*E, K] and lora_B [N, r*E] (rank
    columns E apart), taken as axolotl's MoELoRAMaterialize does: B permuted into [E, N, r]
    first, dB permuted back into lora_B's layout after."""
    dt = torch.bfloat16
    nbytes = (2 * (E * N * K + E * r * K + E * N * r)) + 2 * (E * r * K + E * N * r)
    nsets = max(2, math.ceil(300e6 / nbytes))
    if peft:
        sets = [dict(dW=torch.randn(E, N, K, device="cuda", dtype=dt),
                     A=0.1 * torch.randn(r * E, K, device="cuda", dtype=dt),
                     B=0.1 * torch.randn(N, r * E, device="cuda", dtype=dt)) for _ in range(nsets)]
    else:
        sets = [dict(dW=torch.randn(E, N, K, device="cuda", dtype=dt),
                     A=0.1 * torch.randn(E, r, K, device="cuda", dtype=dt),
                     B=0.1 * torch.randn(E, N, r, device="cuda", dtype=dt)) for _ in range(nsets)]
    s = 0.5

    def two_bmms(x):
        dA = torch.bmm(x["B"].transpose(1, 2), x["dW"]).mul_(s)
        dB = torch.bmm(x["dW"], x["A"].transpose(1, 2)).mul_(s)
        return dA, dB

    def two_bmms_peft(x):
        A3 = x["A"].reshape(E, r, K)
        B3 = x["B"].reshape(N, r, E).permute(2, 0, 1).contiguous()
        dA = torch.bmm(B3.transpose(1, 2), x["dW"]).mul_(s).reshape(E * r, K)
        dB = torch.bmm(x["dW"], A3.transpose(1, 2)).mul_(s).permute(1, 2, 0).contiguous().reshape(N, E * r)
        return dA, dB

    us = median_us(two_bmms_peft if peft else two_bmms, sets, 50)
    results.append(dict(impl="torch eager", op=f"moe_backward r={r} bf16 grads" + (" peft" if peft else ""),
                        shape=f"{E}x{N}x{K}", median_us=us, bytes=nbytes, gbps=nbytes / (us * 1e3),
                        copy_gbps=copy_gbps(nbytes)))


def bench_embedding(T, V, D, r, results, grads=torch.float32, by_freq=False, forward=False, after_a=False):
    """PEFT's LoRA embedding: forward F.embedding + (F.embedding(x, A^T) @ B^T) * s (with
    forward=True, instead of the backward); backward with index_add_ for dA and a matmul for dB
    (what autograd runs), bf16 table/adapters, fp32 grads (grads=torch.bfloat16: in bf16 as the
    adapters'; by_freq: scale_grad_by_freq). after_a: the activations F.embedding(x, A^T)
    (PEFT's after_A) kept by the forward, which writes them, and read by the backward for dB
    in place of the gather (kerf_bench's "... after_a" cases)."""
    dt = torch.bfloat16
    F = torch.nn.functional
    table = torch.randn(V, D, device="cuda", dtype=dt)
    A = 0.1 * torch.randn(r, V, device="cuda", dtype=dt)
    B = 0.1 * torch.randn(D, r, device="cuda", dtype=dt)
    nsets = max(2, math.ceil(300e6 / (T * D * 4)))
    sets = [dict(x=torch.randint(0, V, (T,), device="cuda"),
                 g=torch.randn(T, D, device="cuda", dtype=dt)) for _ in range(nsets)]
    if after_a and not forward:
        for z in sets:
            z["act"] = F.embedding(z["x"], A.T)
    s = 2.0
    suffix = " after_a" if after_a else ""
    if forward:
        # With after_a the activations are an output as well (PEFT keeps after_A).
        fwd_bytes = T * 8 + (T * D + T * r + D * r + T * D + (T * r if after_a else 0)) * 2
        us = median_us(lambda z: F.embedding(z["x"], table) + (F.embedding(z["x"], A.T) @ B.T) * s, sets, 50)
        results.append(dict(impl="torch eager", op=f"embedding r={r}" + suffix, shape=f"{T}x{V}x{D}",
                            median_us=us, bytes=fwd_bytes, gbps=fwd_bytes / (us * 1e3),
                            copy_gbps=copy_gbps(fwd_bytes)))
        return

    def backward(z):
        gB = (z["g"] @ B).float() * s  # [T, r]
        if by_freq:  # what F.embedding's backward does with scale_grad_by_freq
            gB = gB / torch.bincount(z["x"], minlength=V)[z["x"]].float()[:, None]
        gB = gB.to(grads)
        dA = torch.zeros(r, V, device="cuda", dtype=grads)
        dA.index_add_(1, z["x"], gB.T)
        act = z["act"] if after_a else F.embedding(z["x"], A.T)
        dB = ((z["g"].T @ act).float() * s).to(grads)
        return dA, dB

    gsize = torch.empty((), dtype=grads).element_size()
    bwd_bytes = T * 8 + (T * D + T * r + D * r) * 2 + (r * V + D * r) * gsize
    us = median_us(backward, sets, 50)
    name = f"embedding_backward r={r}" + ("" if grads == torch.float32 else " bf16 grads") + \
        (" by_freq" if by_freq else "") + suffix
    results.append(dict(impl="torch eager", op=name, shape=f"{T}x{V}x{D}", median_us=us,
                        bytes=bwd_bytes, gbps=bwd_bytes / (us * 1e3), copy_gbps=copy_gbps(bwd_bytes)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--op", default="",
                   help="only the cases whose op name contains one of these (comma-separated)")
    args = p.parse_args()
    filters = [f for f in args.op.split(",") if f]
    results = []

    def wanted(op):
        return not filters or any(f in op for f in filters)

    def run(op, bench, *shape):
        """Runs one case when wanted, prints its rows and rewrites the JSON (a run
        stopped part way keeps what it measured)."""
        if not wanted(op):
            return
        before = len(results)
        bench(*shape, results)
        for row in results[before:]:
            print(row, flush=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=getattr(triton, "__version__", None), results=results), f, indent=1)

    shapes = [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)]
    for r in (16, 32, 64):
        for out, inn in shapes:
            run(f"dora_norm r={r}", bench_dora, out, inn, r)
    for r in (16, 64):
        for out, inn in [(8192, 4096), (4096, 7168)]:
            run(f"dora_norm_partial r={r}", functools.partial(bench_dora, partial=True), out, inn, r)
    for out, inn in [(4096, 4096), (8192, 8192)]:
        run("dora_norm r=16 f32 adapters", functools.partial(bench_dora, adapters=torch.float32), out, inn, 16)
    # Also eight large experts (Mixtral 8x7B's gate and up, and down), and rank 32, as kerf_bench
    # has them.
    for E, N, K, r in [(128, 1536, 2048, 16), (128, 2048, 768, 16), (64, 2816, 2048, 64),
                       (8, 14336, 4096, 16), (8, 4096, 14336, 16), (128, 1536, 2048, 32)]:
        run(f"moe_materialize r={r}", bench_moe, E, N, K, r)
    for r in (16, 32):
        run(f"moe_materialize r={r} f32 adapters", functools.partial(bench_moe, adapters=torch.float32),
            128, 1536, 2048, r)
    run("moe_materialize r=64 peft", functools.partial(bench_moe, peft=True), 64, 2816, 2048, 64)
    for r in (16, 32, 64):
        for out, inn in [(4096, 4096), (8192, 8192), (14336, 4096)]:
            run(f"lora_merge r={r}", bench_merge, out, inn, r)
    for r in (16, 32, 64):
        run(f"lora_merge r={r} f32 adapters", functools.partial(bench_merge, adapters=torch.float32), 8192, 8192, r)
    for out, inn in [(4096, 4096), (8192, 8192), (14336, 4096)]:
        run("dora_norm_4bit r=16", bench_dora_4bit, out, inn, 16)
    for E, N, K, r in [(128, 1536, 2048, 16), (128, 2048, 768, 16), (64, 2816, 2048, 64)]:
        run(f"moe_backward r={r} bf16 grads", bench_moe_backward, E, N, K, r)
    run("moe_backward r=64 bf16 grads peft", functools.partial(bench_moe_backward, peft=True), 64, 2816, 2048, 64)
    run("embedding r=16", functools.partial(bench_embedding, forward=True), 8192, 128256, 4096, 16)
    run("embedding_backward r=16", bench_embedding, 8192, 128256, 4096, 16)
    run("embedding_backward r=16 bf16 grads", functools.partial(bench_embedding, grads=torch.bfloat16),
        8192, 128256, 4096, 16)
    run("embedding_backward r=16 by_freq", functools.partial(bench_embedding, by_freq=True),
        8192, 128256, 4096, 16)
    run("embedding r=16 after_a", functools.partial(bench_embedding, forward=True, after_a=True),
        8192, 128256, 4096, 16)
    run("embedding_backward r=16 bf16 grads after_a",
        functools.partial(bench_embedding, grads=torch.bfloat16, after_a=True), 8192, 128256, 4096, 16)
    run("embedding_backward r=16 by_freq after_a", functools.partial(bench_embedding, by_freq=True, after_a=True),
        8192, 128256, 4096, 16)


if __name__ == "__main__":
    main()
