#!/usr/bin/env python3
"""Host time per call of a kerf op from Python, next to a Triton kernel launch
and PyTorch ops, on small CUDA tensors (launch-bound) in the same process.

    KERF_BUILD_DIR=build python3 tests/bench/python_overhead.py [--calls 500] [--json out.json]

Each figure is the median over several rounds of (wall time of N back-to-back
calls) / N: what the Python thread spends per call. During a round the GPU is
held by a sleep kernel, so the host never waits for it (N stays well under the
launch queue's depth); the GPU's own time per call, measured with CUDA events
from the end of the hold, is printed beside it. The goal of the kerf binding
is < 5 us per call on an H100 machine.

Also printed: the same kerf call captured 1 and 100 times in one CUDA graph
(torch.cuda.graph), host time per call as graph.replay() time over the calls.

Prints "SKIPPED: <why>" and exits 0 without torch or CUDA.
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

# The floor of any kernel launched from Python: one tiny kernel, one bound C++ call.
BAREST = "torch.cuda._sleep(1) (a bare launch from Python)"
# The case the goal is about.
GOAL = "kerf dora_norm, outputs given"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=500, help="calls per round (stay under the launch queue depth)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="run only the cases whose names match this regular expression "
                    "(the barest launch and kerf's goal case always run)")
    args = ap.parse_args()

    if os.environ.get("KERF_BUILD_DIR"):
        sys.path.insert(0, os.path.join(os.path.abspath(os.environ["KERF_BUILD_DIR"]), "python"))
    try:
        import torch
    except ImportError:
        print("SKIPPED: PyTorch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device for PyTorch")
        return 0
    import kerf

    if not kerf.cuda_available():
        print(f"SKIPPED: kerf sees no CUDA device ({kerf.cuda_unavailable_reason()})")
        return 0

    dev = torch.device("cuda")
    R, C, r = args.rows, args.cols, args.rank
    W = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
    A = torch.randn(r, C, device=dev) / 16
    B = torch.randn(R, r, device=dev)
    m = torch.rand(R, device=dev) + 0.5
    norm, scale = torch.empty(R, device=dev), torch.empty(R, device=dev)
    x, y, z = torch.randn(R, device=dev), torch.randn(R, device=dev), torch.empty(R, device=dev)

    cases = {}
    ops = kerf.ops
    core = kerf._kerf
    cases[GOAL] = lambda: ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)
    cases["kerf dora_norm, outputs allocated"] = lambda: ops.dora_norm(W, A, B, m, 0.5)
    # The autograd wrapper PEFT-style code calls (m trainable): outputs allocated, a graph node.
    import kerf.autograd
    m_param = torch.nn.Parameter(m.clone())
    cases["kerf.autograd.dora_scale (m trainable)"] = lambda: kerf.autograd.dora_scale(W, A, B, m_param, 0.5)
    # The same through the torch.autograd.Function (a Python graph node; dora_scale uses the
    # C++ node of kerf._torch_bridge where that is built).
    cases["kerf.autograd.DoraScale.apply (m trainable; Python graph node)"] = lambda: kerf.autograd.DoraScale.apply(
        W, A, B, m_param, 0.5, 0.0)
    grad_out = torch.randn(R, device=dev)
    cases["kerf.autograd.dora_scale forward + backward"] = lambda: kerf.autograd.dora_scale(
        W, A, B, m_param, 0.5).backward(grad_out)
    cases["kerf.autograd.DoraScale.apply forward + backward"] = lambda: kerf.autograd.DoraScale.apply(
        W, A, B, m_param, 0.5, 0.0).backward(grad_out)
    # PEFT's own computation of the same scale (five ATen ops and their graph nodes).
    cases["PEFT-style eager DoRA scale (m trainable)"] = lambda: m_param / torch.linalg.vector_norm(
        W + 0.5 * (B @ A), dim=1).detach()
    # kerf.ops.dora_norm is this binding; here every argument comes by position, in the binding's order.
    cases["kerf._kerf.dora_norm, all positional (no keyword matching)"] = lambda: core.dora_norm(
        W, A, B, m, 0.5, norm, scale, 0.0, None, None)
    # One output: the op on DoRA's backward path, its grad_m given or left to kerf.
    grad_scale, grad_m = torch.randn(R, device=dev), torch.empty(R, device=dev)
    cases["kerf dora_norm_backward, grad_m given"] = lambda: ops.dora_norm_backward(norm, grad_scale, grad_m=grad_m)
    cases["kerf dora_norm_backward, grad_m allocated"] = lambda: ops.dora_norm_backward(norm, grad_scale)
    # The whole call but the launch: an op on zero rows returns after its checks.
    W0, B0, m0 = W[:0], B[:0], m[:0]
    norm0, scale0 = norm[:0], scale[:0]
    cases["kerf dora_norm on 0 rows (all but the launch)"] = lambda: ops.dora_norm(W0, A, B0, m0, 0.5, norm=norm0,
                                                                                  scale=scale0)
    six = (W, A, B, m, norm, scale)
    cases["kerf tensor conversion only (6 tensors, no launch)"] = lambda: core._convert(six)
    # The same two without kerf._torch_bridge: torch tensors read through Python attributes.
    attribute_path = {"kerf dora_norm, outputs given, no torch bridge",
                      "kerf tensor conversion only, no torch bridge"}
    cases["kerf dora_norm, outputs given, no torch bridge"] = cases[GOAL]
    cases["kerf tensor conversion only, no torch bridge"] = lambda: core._convert(six)
    cases["kerf call with no tensors (pybind11 floor)"] = lambda: core._convert(())
    # The default is PyTorch's current stream, the legacy default stream unless a
    # `with torch.cuda.stream(...)` says otherwise; launches onto a created stream may cost less.
    side = torch.cuda.Stream()
    on_side_stream = {"kerf dora_norm, outputs given, on a torch.cuda.Stream()"}
    cases["kerf dora_norm, outputs given, on a torch.cuda.Stream()"] = cases[GOAL]
    cases[BAREST] = lambda: torch.cuda._sleep(1)
    cases["torch.add(x, y, out=z)"] = lambda: torch.add(x, y, out=z)
    cases["torch.empty(rows, device='cuda') (no launch)"] = lambda: torch.empty(R, device=dev)
    cases["2x torch.empty(rows, device='cuda') (no launch)"] = lambda: (torch.empty(R, device=dev),
                                                                         torch.empty(R, device=dev))
    cases["torch.linalg.vector_norm(W, dim=1)"] = lambda: torch.linalg.vector_norm(W, dim=1)

    try:
        import triton
        import triton.language as tl

        @triton.jit
        def row_norm(W_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                w = tl.load(W_ptr + row * stride + start + cols, mask=start + cols < n_cols, other=0.0)
                w = w.to(tl.float32)
                acc += w * w
            tl.store(out_ptr + row, tl.sqrt(tl.sum(acc, axis=0)))

        cases[f"triton {triton.__version__} launch (row norm)"] = lambda: row_norm[(R,)](W, norm, C, W.stride(0),
                                                                                         BLOCK=128)
    except ImportError:
        print("note: triton is not installed; its row is left out")

    if args.only:
        keep = re.compile(args.only)
        cases = {name: fn for name, fn in cases.items() if name in (BAREST, GOAL) or keep.search(name)}

    # Warm up: compiles, autotuning, caching allocators.
    for fn in cases.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()

    # Hold the GPU for longer than the host needs to queue a round: about 30 us per call at 2 GHz.
    hold_cycles = args.calls * 60_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    core._convert(six)  # torch is imported: kerf has looked for its bridge
    bridge = core._torch_bridge_status()
    # Rounds go case by case in turn (round 1 of every case, then round 2, ...), so that
    # a drift of this machine's launch cost during the run falls on every case alike.
    per_call = {name: [] for name in cases}
    gpu_per_call = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            core._set_torch_bridge(name not in attribute_path)
            stream_ctx = torch.cuda.stream(side) if name in on_side_stream else contextlib.nullcontext()
            with stream_ctx:
                torch.cuda.synchronize()
                # The GPU is held busy while the host queues the round, so the host never
                # waits on it (calls stay well under the launch queue's depth); the GPU's
                # own time per call is measured from the end of the hold.
                torch.cuda._sleep(hold_cycles)
                start.record()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                per_call[name].append((t1 - t0) / args.calls * 1e6)
                gpu_per_call[name].append(start.elapsed_time(end) * 1e3 / args.calls)
    torch.cuda.synchronize()
    # Each case minus the barest launch of the same round: these machines' launch cost
    # drifts by a microsecond between rounds, the difference much less.
    floor = per_call[BAREST]
    results = {name: {"median_us": statistics.median(per_call[name]), "min_us": min(per_call[name]),
                      "over_barest_us": statistics.median(a - b for a, b in zip(per_call[name], floor)),
                      "gpu_us_per_call": statistics.median(gpu_per_call[name])} for name in cases}
    core._set_torch_bridge(True)

    # kerf's calls captured in a CUDA graph (torch.cuda.graph): a replay launches them all
    # with one host call, so a launch-bound step pays the driver's launch once per graph.
    in_graph = {}
    for n_ops in (1, 100):
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph):
            for _ in range(n_ops):
                ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)
        torch.cuda.synchronize()
        replays = max(1, args.calls // n_ops) if n_ops > 1 else args.calls
        host, dev_t = [], []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            torch.cuda._sleep(hold_cycles)
            start.record()
            t0 = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            host.append((t1 - t0) / (replays * n_ops) * 1e6)
            dev_t.append(start.elapsed_time(end) * 1e3 / (replays * n_ops))
        in_graph[n_ops] = {"median_us": statistics.median(host), "min_us": min(host),
                           "gpu_us_per_call": statistics.median(dev_t)}

    gpu = torch.cuda.get_device_name()
    print(f"host time per call, {gpu}, W bf16[{R},{C}], r={r}, {args.calls} calls x {args.rounds} rounds")
    print(f"kerf._torch_bridge: {bridge}")
    width = max(len(k) for k in results)
    for name, v in results.items():
        print(f"  {name:<{width}}  {v['median_us']:7.2f} us  (min {v['min_us']:.2f}; "
              f"{v['over_barest_us']:+.2f} over the barest launch; GPU {v['gpu_us_per_call']:.2f} us per call)")
    for n_ops, v in in_graph.items():
        name = f"kerf dora_norm x{n_ops} in one CUDA graph, per call"
        print(f"  {name:<{width}}  {v['median_us']:7.2f} us  (min {v['min_us']:.2f}; "
              f"GPU {v['gpu_us_per_call']:.2f} us per call; graph.replay() time / {n_ops})")
    goal = results[GOAL]["median_us"]
    print(f"kerf goal < 5 us per call: {'met' if goal < 5.0 else 'NOT met'} ({goal:.2f} us; "
          f"{results[GOAL]['over_barest_us']:+.2f} us over this machine's barest launch from Python, "
          f"{results[BAREST]['median_us']:.2f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu, "shape": [R, C, r], "results": results, "torch_bridge": bridge,
                       "in_cuda_graph": {str(k): v for k, v in in_graph.items()},
                       "torch": torch.__version__, "python": sys.version.split()[0]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
