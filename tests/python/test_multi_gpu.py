"""Several GPUs: torch tensors on a GPU other than the current one run there
(kerf.ops and kerf.autograd), on that device's current torch stream, and leave
torch's current device as it was; a row-parallel DoRA norm over two processes,
one GPU each, its partial sums all-reduced by torch.distributed (NCCL), as a
tensor-parallel training job would call it. Skipped with fewer than two GPUs."""

import datetime
import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (tools/test.sh installs Debian's python3-torch)")

import kerf  # noqa: E402
import kerf.autograd as ka  # noqa: E402

TWO_GPUS = pytest.mark.skipif(
    not (torch.cuda.is_available() and kerf.cuda_available() and torch.cuda.device_count() >= 2),
    reason="needs two CUDA devices (torch and kerf)",
)


def dora_ref(W, A, B, m, s):
    V = W.double() + s * (B.double() @ A.double())
    norm = V.square().sum(dim=1).sqrt()
    return norm, m.double() / norm


@TWO_GPUS
def test_tensors_on_another_gpu_run_there_and_leave_the_current_device():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        g = torch.Generator(device=dev).manual_seed(7)
        out, inn, r, s = 301, 259, 16, 0.5
        W = torch.randn(out, inn, device=dev, generator=g).bfloat16()
        A = torch.randn(r, inn, device=dev, generator=g) * 0.2
        B = torch.randn(out, r, device=dev, generator=g) * 0.2
        m = torch.rand(out, device=dev, generator=g) + 0.5
        norm, scale = kerf.ops.dora_norm(W, A, B, m, s)
        assert norm.device == dev and scale.device == dev
        ref_n, ref_s = dora_ref(W, A, B, m, s)
        torch.testing.assert_close(norm.double(), ref_n, rtol=1e-2, atol=0)
        torch.testing.assert_close(scale.double(), ref_s, rtol=1e-2, atol=0)
        assert torch.cuda.current_device() == 0

        # An autograd graph on that device, on a stream of its own (kerf runs on torch's
        # current stream of the tensors' device).
        side = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(side):
            V, H, T = 1000, 64, 77
            x = torch.randint(0, V, (T,), device=dev, generator=g)
            E = torch.randn(V, H, device=dev, generator=g)
            Ae = (torch.randn(r, V, device=dev, generator=g) * 0.1).requires_grad_()
            Be = (torch.randn(H, r, device=dev, generator=g) * 0.1).requires_grad_()
            y = ka.lora_embedding(x, E, Ae, Be, s)
            gy = torch.randn(T, H, device=dev, generator=g)
            y.backward(gy)
            Ar, Br = Ae.detach().clone().requires_grad_(), Be.detach().clone().requires_grad_()
            yr = E[x] + s * (Ar.t()[x] @ Br.t())
            yr.backward(gy)
        side.synchronize()
        assert y.device == dev and Ae.grad.device == dev
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(Ae.grad, Ar.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(Be.grad, Br.grad, rtol=1e-5, atol=1e-5)
        assert torch.cuda.current_device() == 0
    finally:
        torch.cuda.set_device(before)


def _row_parallel_rank(rank, world, init_file, result_dir):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails the test, not the run
    try:
        dev = torch.device("cuda", rank)
        g = torch.Generator().manual_seed(11)  # the same whole tensors on every rank
        out, inn, r, s = 384, 2 * 700, 32, 0.25
        W = torch.randn(out, inn, generator=g).bfloat16()
        A = (torch.randn(r, inn, generator=g) * 0.1).bfloat16()
        B = (torch.randn(out, r, generator=g) * 0.1).bfloat16()
        m = torch.rand(out, generator=g) + 0.5
        cols = slice(rank * inn // world, (rank + 1) * inn // world)
        layout = {"mesh": {"tp": world}, "specs": {"W": (None, "tp"), "A": (None, "tp")}}
        sumsq = kerf.ops.dora_norm_partial(W[:, cols].contiguous().to(dev), A[:, cols].contiguous().to(dev),
                                           B.to(dev), s, layout=layout)
        dist.all_reduce(sumsq)
        norm, scale = kerf.ops.dora_norm_finish(sumsq, m.to(dev))
        torch.save({"norm": norm.cpu(), "scale": scale.cpu(), "ref": dora_ref(W, A, B, m, s)},
                   os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@TWO_GPUS
def test_row_parallel_dora_norm_over_two_processes_with_nccl():
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_row_parallel_rank, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        for rank in range(2):
            got = torch.load(os.path.join(tmp, f"rank{rank}.pt"))
            ref_n, ref_s = got["ref"]
            torch.testing.assert_close(got["norm"].double(), ref_n, rtol=1e-2, atol=0)
            torch.testing.assert_close(got["scale"].double(), ref_s, rtol=1e-2, atol=0)
