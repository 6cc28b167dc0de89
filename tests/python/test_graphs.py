"""kerf's ops and autograd wrappers inside CUDA graphs captured by PyTorch
(torch.cuda.graph): a captured training step, replayed on new data, gives the
gradients of PyTorch's own float64 autograd; what kerf cannot do during a
capture is refused with a message and leaves the capture usable.

CUDA only (a capture needs a GPU); skipped elsewhere."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import kerf  # noqa: E402
import kerf.autograd as ka  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kerf.cuda_available()),
                                reason="needs a CUDA device (torch and kerf): graphs are captured on a GPU")


class Step:
    """A small training step over kerf's three autograd wrappers, with static inputs."""

    def __init__(self, gen):
        dev = "cuda"
        self.s = 0.5
        out, inp, r = 96, 160, 8
        self.W = torch.randn(out, inp, device=dev, generator=gen)
        self.A = torch.randn(r, inp, device=dev, generator=gen) / 8
        self.B = torch.randn(out, r, device=dev, generator=gen) / 8
        self.m = torch.nn.Parameter(torch.rand(out, device=dev, generator=gen) + 0.5)
        V, H, T = 300, 64, 40
        self.x = torch.randint(0, V, (T,), device=dev, generator=gen)
        self.table = torch.randn(V, H, device=dev, generator=gen)
        self.eA = torch.nn.Parameter(torch.randn(r, V, device=dev, generator=gen) / 4)
        self.eB = torch.nn.Parameter(torch.randn(H, r, device=dev, generator=gen) / 4)
        E, N, K = 3, 48, 40
        self.Wm = torch.randn(E, N, K, device=dev, generator=gen)
        self.mA = torch.nn.Parameter(torch.randn(E, r, K, device=dev, generator=gen) / 4)
        self.mB = torch.nn.Parameter(torch.randn(E, N, r, device=dev, generator=gen) / 4)
        self.c1 = torch.randn(out, device=dev, generator=gen)
        self.c2 = torch.randn(T, H, device=dev, generator=gen)
        self.c3 = torch.randn(E, N, K, device=dev, generator=gen)
        self.params = [self.m, self.eA, self.eB, self.mA, self.mB]

    def loss(self, lib):
        """The step's loss through kerf (lib is ka) or PyTorch float64 (lib is None)."""
        s = self.s
        if lib is None:
            d = {p: p.detach().double().requires_grad_() for p in self.params}
            W, A, B = self.W.double(), self.A.double(), self.B.double()
            norm = torch.linalg.vector_norm(W + s * (B @ A), dim=1).detach()
            scale = d[self.m] / norm
            emb = self.table.double()[self.x] + s * (d[self.eA].t()[self.x] @ d[self.eB].t())
            W_eff = self.Wm.double() + s * (d[self.mB] @ d[self.mA])
            loss = (scale * self.c1).sum() + (emb * self.c2).sum() + (W_eff * self.c3).sum()
            return loss, [d[p] for p in self.params]
        scale = ka.dora_scale(self.W, self.A, self.B, self.m, s)
        emb = ka.lora_embedding(self.x, self.table, self.eA, self.eB, s)
        W_eff = ka.moe_lora_materialize(self.Wm, self.mA, self.mB, s)
        return (scale * self.c1).sum() + (emb * self.c2).sum() + (W_eff * self.c3).sum(), self.params

    def redraw(self, gen):
        """New values in every static input and parameter, in place."""
        with torch.no_grad():
            V = self.table.shape[0]
            self.x.copy_(torch.randint(0, V, self.x.shape, device="cuda", generator=gen))
            for t in [self.W, self.A, self.B, self.table, self.Wm, self.c1, self.c2, self.c3, *self.params]:
                t.copy_(torch.randn(t.shape, device="cuda", generator=gen) * t.std())
            self.m.abs_().add_(0.5)


def test_a_captured_training_step_replays_with_pytorchs_float64_gradients():
    gen = torch.Generator(device="cuda").manual_seed(7)
    step = Step(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as PyTorch asks before a capture: compiles kerf's kernels
        for _ in range(2):
            for p in step.params:
                p.grad = None
            step.loss(ka)[0].backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in step.params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, _ = step.loss(ka)
        static_loss.backward()
    grads = [p.grad for p in step.params]
    for replay in range(3):
        step.redraw(gen)
        graph.replay()
        torch.cuda.synchronize()
        ref_loss, ref_params = step.loss(None)
        ref_loss.backward()
        assert static_loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
        for name, got, ref in zip(["m", "eA", "eB", "mA", "mB"], grads, ref_params):
            err = ((got.double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
            assert err < 1e-5, f"replay {replay}: grad of {name} off by {err:.2e}"


def test_an_output_kerf_would_allocate_itself_is_refused_during_a_capture():
    W = torch.randn(32, 64, device="cuda")
    A = torch.randn(4, 64, device="cuda")
    B = torch.randn(32, 4, device="cuda")
    m = torch.rand(32, device="cuda") + 0.5
    caps = [torch.utils.dlpack.to_dlpack(t) for t in (W, A, B, m)]
    norm, scale = torch.empty(32, device="cuda"), torch.empty(32, device="cuda")
    kerf.ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        # Capsules in: kerf would return kerf.Buffers, which it cannot allocate now.
        with pytest.raises(ValueError, match="cannot allocate it while the stream captures a CUDA graph"):
            kerf.ops.dora_norm(*caps, 0.5, stream=stream)
        kerf.ops.dora_norm(W, A, B, m, 0.5, norm=norm, scale=scale)  # the capture goes on
    W.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.linalg.vector_norm(W.double() + 0.5 * (B.double() @ A.double()), dim=1)
    assert torch.allclose(norm.double(), want, rtol=1e-5)
