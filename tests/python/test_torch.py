"""PyTorch: zero-copy tensors, outputs as torch tensors, autograd wrappers
(gradcheck in float64 on the CPU back end; against PyTorch's own autograd on
CUDA), the DoRA norm cache.

Skipped where torch is not installed. tools/test.sh installs Debian's CPU build
(python3-torch) where the archive has it, so that the CPU cases run with the
rest of the suite; the GPU machine runs them all with its CUDA build:
KERF_BUILD_DIR=<build> python3 -m pytest tests/python. Cases that need what an
old torch lacks (optimizer step hooks: 2.0; fused AdamW on the CPU: 2.4) say so
when they skip."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (tools/test.sh installs Debian's python3-torch)")

import torch.nn.functional as F  # noqa: E402

import kerf  # noqa: E402
import kerf.autograd as ka  # noqa: E402

view_info = kerf._kerf._view_info
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# DoraNormCache empties itself from optimizer step hooks, which PyTorch 2.0 added.
STEP_HOOKS = pytest.mark.skipif(not hasattr(torch.optim.Optimizer, "register_step_post_hook"),
                                reason=f"torch {torch.__version__} has no optimizer step hooks (2.0 added them)")


def devices():
    out = []
    if kerf.cpu_available():
        out.append("cpu")
    if torch.cuda.is_available() and kerf.cuda_available():
        out.append("cuda")
    return out or [pytest.param("none", marks=pytest.mark.skip(reason="neither kerf's CPU back end nor CUDA"))]


DEVICES = devices()
CPU_ONLY = pytest.mark.skipif(not kerf.cpu_available(), reason="kerf was built without its CPU back end")
CUDA_ONLY = pytest.mark.skipif(not (torch.cuda.is_available() and kerf.cuda_available()),
                               reason="needs a CUDA device (torch and kerf)")


def dora_ref(W, A, B, m, s, eps=0.0):
    V = W.double() + s * (B.double() @ A.double())
    norm = torch.sqrt((V * V).sum(dim=1) + eps)
    return norm, m.double() / norm


# ---------------------------------------------------------------- tensors in and out
@pytest.mark.parametrize("device", DEVICES)
def test_torch_tensors_are_read_in_place_with_their_strides(device):
    t = torch.zeros(6, 10, device=device)
    v = t[1:, 2::3]
    info = view_info(v)
    assert info["data_ptr"] == v.data_ptr() and info["shape"] == [5, 3] and info["strides"] == [10, 3]
    assert info["device"] == ("cpu" if device == "cpu" else f"cuda:{t.device.index}")
    p = torch.nn.Parameter(torch.ones(3, 4, device=device))
    assert view_info(p)["data_ptr"] == p.data_ptr()  # parameters requiring grad too
    assert view_info(t.t())["strides"] == [1, 10]
    assert view_info(torch.zeros(2, dtype=torch.bfloat16, device=device))["dtype"] == "bf16"


# ---------------------------------------------------------------- kerf._torch_bridge
def bridge_built():
    import glob
    import os

    return bool(glob.glob(os.path.join(os.path.dirname(kerf.__file__), "_torch_bridge*.so")))


def test_torch_bridge_is_active_where_it_was_built():
    torch.zeros(1)  # torch imported: kerf looks for its bridge on the first torch tensor
    view_info(torch.zeros(1))
    status = kerf._kerf._torch_bridge_status()
    if not bridge_built():
        pytest.skip(f"kerf._torch_bridge was not built for this torch ({status})")
    assert status.startswith("active"), status
    assert torch.__version__ in status


@pytest.fixture(params=["bridge", "attributes"])
def torch_path(request):
    """Runs a test once with torch tensors read by kerf._torch_bridge (when built) and
    once through their Python attributes."""
    was = kerf._kerf._set_torch_bridge(request.param == "bridge")
    yield request.param
    kerf._kerf._set_torch_bridge(was)


def tensor_zoo(device):
    base = torch.randn(6, 10, device=device)
    out = [base, base.t(), base[1:, 2::3], base[2:4], base[:, 5], base.expand(3, 6, 10),
           torch.tensor(2.5, device=device), torch.empty(0, 3, device=device),
           torch.nn.Parameter(torch.ones(3, 4, device=device)),
           torch.randn(1, 2, 1, 2, 1, 2, 1, 2, device=device).permute(7, 6, 5, 4, 3, 2, 1, 0)]
    for dt in (torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64):
        out.append(torch.ones(5, 7, device=device, dtype=dt)[:, 1::2])
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
def test_bridge_and_attribute_paths_read_tensors_alike(device):
    if not kerf._kerf._torch_bridge_status().startswith("active"):
        pytest.skip(f"no kerf._torch_bridge: {kerf._kerf._torch_bridge_status()}")
    was = kerf._kerf._set_torch_bridge(True)
    try:
        for t in tensor_zoo(device):
            kerf._kerf._set_torch_bridge(True)
            fast = view_info(t)
            kerf._kerf._set_torch_bridge(False)
            slow = view_info(t)
            assert fast == slow, (t.shape, t.stride(), t.dtype)
            assert fast["data_ptr"] == t.data_ptr() and fast["shape"] == list(t.shape)
            assert fast["strides"] == list(t.stride())
    finally:
        kerf._kerf._set_torch_bridge(was)


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_into_a_tensor_autograd_saved_fails_its_backward_as_an_in_place_op_would(device, torch_path):
    # Every path bumps the version counter: the bridge in C++, the attribute path through
    # torch.autograd.graph.increment_version (torch >= 2.1) or an in-place op on an empty
    # view (older torch, as Debian's 1.13: without it the backward used the new values).
    x = torch.randn(3, 24, device=device, requires_grad=True)
    W = torch.randn(16, 24, device=device)
    y = (x @ W.t()).sum()  # saves W for x's gradient
    before = W._version
    kerf.ops.lora_merge(W, torch.randn(4, 24, device=device), torch.randn(16, 4, device=device), 1.0)
    assert W._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # Outputs kerf is given count as written too.
    Wd, A, B, m = (torch.randn(8, 16, device=device), torch.randn(2, 16, device=device),
                   torch.randn(8, 2, device=device), torch.rand(8, device=device) + 0.5)
    norm, scale = torch.empty(8, device=device), torch.empty(8, device=device)
    v = norm._version
    kerf.ops.dora_norm(Wd, A, B, m, 0.5, norm=norm, scale=scale)
    assert norm._version > v
    # An inference tensor keeps no version counter; kerf writes it all the same.
    with torch.inference_mode():
        Wi = torch.randn(16, 24, device=device)
    A4, B16 = torch.randn(4, 24, device=device), torch.randn(16, 4, device=device)
    want = Wi.double() + B16.double() @ A4.double()
    kerf.ops.lora_merge(Wi, A4, B16, 1.0)
    assert torch.allclose(Wi.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_call_leaves_the_version_counters_of_its_outputs_as_they_were(device, torch_path):
    # As a torch in-place op refused for its shapes: nothing written, nothing for autograd to
    # notice, so a backward that saved the tensor still runs.
    x = torch.randn(3, 24, device=device, requires_grad=True)
    W = torch.randn(16, 24, device=device)
    y = (x @ W.t()).sum()
    W0, before = W.clone(), W._version
    with pytest.raises(ValueError, match="A"):
        kerf.ops.lora_merge(W, torch.randn(2, 9, device=device), torch.randn(16, 2, device=device), 0.5)
    assert W._version == before and torch.equal(W, W0)
    norm, scale = torch.empty(8, device=device), torch.empty(8, device=device)
    versions = (norm._version, scale._version)
    with pytest.raises(ValueError):  # m of the wrong length
        kerf.ops.dora_norm(torch.randn(8, 16, device=device), torch.randn(2, 16, device=device),
                           torch.randn(8, 2, device=device), torch.rand(9, device=device), 0.5,
                           norm=norm, scale=scale)
    assert (norm._version, scale._version) == versions
    y.backward()
    assert torch.allclose(x.grad, W.sum(0).expand(3, 24), rtol=1e-5, atol=1e-5)  # float32 sums


@pytest.mark.parametrize("device", DEVICES)
def test_writing_into_a_tensor_that_requires_grad_needs_no_grad_mode(device, torch_path):
    W = torch.nn.Parameter(torch.randn(16, 24, device=device))
    A, B = torch.randn(4, 24, device=device), torch.randn(16, 4, device=device)
    W0 = W.detach().clone()
    want = W0.double() + 0.5 * (B.double() @ A.double())
    with pytest.raises(ValueError, match="W requires grad, and kerf writes into it in place"):
        kerf.ops.lora_merge(W, A, B, 0.5)
    assert torch.equal(W.detach(), W0)  # untouched
    with torch.no_grad():  # as PEFT merges adapters into weights
        kerf.ops.lora_merge(W, A, B, 0.5)
    assert torch.allclose(W.detach().double(), want, rtol=1e-5, atol=1e-5)


def test_both_torch_paths_refuse_the_same_tensors(torch_path):
    with pytest.raises(TypeError, match="torch.int16"):
        view_info(torch.zeros(3, dtype=torch.int16))
    with pytest.raises(TypeError, match="complex64"):
        view_info(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="device 'meta'"):
        view_info(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="rank 9"):
        view_info(torch.zeros([1] * 9))
    with pytest.raises(TypeError, match=r"a torch.sparse_coo tensor; kerf takes dense \(torch.strided\) tensors"):
        view_info(torch.eye(3).to_sparse())
    negated = torch.randn(4, dtype=torch.complex64).conj().imag  # memory holds -imag
    assert negated.is_neg()
    with pytest.raises(ValueError, match="negative bit"):
        view_info(negated)
    view_info(negated.resolve_neg())


def test_torch_subclasses_go_through_dlpack():
    class Tagged(torch.Tensor):
        pass

    t = torch.arange(6.0).reshape(2, 3).as_subclass(Tagged)
    info = view_info(t)
    assert info["data_ptr"] == t.data_ptr() and info["shape"] == [2, 3]
    # One that requires grad: torch's DLPack export refuses it (RuntimeError in torch 1.x/2.x
    # before 2.11, BufferError since); kerf names the argument and passes torch's words on.
    g = torch.arange(6.0).reshape(2, 3).requires_grad_().as_subclass(Tagged)
    with pytest.raises(ValueError,
                       match=r"W: its __dlpack__\(\) refused: (RuntimeError|BufferError): .*require"):
        kerf.ops.dora_norm(g, torch.ones(1, 3), torch.ones(2, 1), torch.ones(2), 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_allocate_torch_outputs_on_the_inputs_device(device, torch_path):
    W = torch.randn(48, 64, device=device)
    A = torch.randn(4, 64, device=device) / 8
    B = torch.randn(48, 4, device=device)
    m = torch.rand(48, device=device) + 0.5
    norm, scale = kerf.ops.dora_norm(W, A, B, m, 0.5)
    assert isinstance(norm, torch.Tensor) and norm.device == W.device and norm.dtype == torch.float32
    ref_norm, ref_scale = dora_ref(W, A, B, m, 0.5)
    torch.testing.assert_close(norm.double(), ref_norm, rtol=2e-5, atol=0)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=2e-5, atol=0)
    out_n, out_s = torch.empty_like(m), torch.empty_like(m)
    n2, s2 = kerf.ops.dora_norm(W, A, B, m, 0.5, norm=out_n, scale=out_s)
    assert n2 is out_n and s2 is out_s
    torch.testing.assert_close(out_n, norm)


@CUDA_ONLY
def test_single_cuda_outputs_are_ordinary_torch_tensors(torch_path):
    # One output left to kerf: with kerf._torch_bridge it comes from PyTorch's caching
    # allocator without torch.empty; it must behave as torch.empty's tensor would.
    norm = torch.rand(40, device="cuda") + 0.5
    g = torch.randn(40, device="cuda", dtype=torch.bfloat16)
    grad_m = kerf.ops.dora_norm_backward(norm, g)
    W = torch.randn(3, 24, 16, device="cuda")
    A, B = torch.randn(3, 4, 16, device="cuda") / 4, torch.randn(3, 24, 4, device="cuda")
    W_eff = kerf.ops.moe_lora_materialize(W, A, B, 0.5)
    empty = kerf.ops.moe_lora_materialize(W[:0], A[:0], B[:0], 0.5)
    for t, shape, dtype in ((grad_m, (40,), torch.bfloat16), (W_eff, (3, 24, 16), torch.float32),
                            (empty, (0, 24, 16), torch.float32)):
        assert type(t) is torch.Tensor and t.device == norm.device and t.dtype == dtype
        assert t.shape == shape and t.is_contiguous() and t._base is None and t.storage_offset() == 0
        assert not t.requires_grad and t.grad_fn is None
        assert t.data_ptr() % 256 == 0 or t.numel() == 0
    torch.testing.assert_close(grad_m.double(), (g.double() / norm.double()), rtol=1e-2, atol=0)
    torch.testing.assert_close(W_eff.double(), W.double() + 0.5 * (B.double() @ A.double()), rtol=1e-5, atol=1e-5)
    # An ordinary tensor: in-place ops bump its own version, its storage resizes, autograd takes it.
    v = W_eff._version
    W_eff.mul_(2.0)
    assert W_eff._version == v + 1
    grad_m.resize_(1000)  # past its allocation: the storage grows as a torch.empty tensor's would
    grad_m.fill_(1.0)
    assert grad_m.shape == (1000,) and float(grad_m.float().sum()) == 1000.0
    leaf = W_eff.requires_grad_(True)
    (leaf * 3.0).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full_like(leaf, 3.0))


@CUDA_ONLY
@pytest.mark.parametrize("rows", [1, 48, 64])
def test_cuda_outputs_made_together_are_independent_tensors(rows, torch_path):
    # norm and scale may come from one allocation (kerf._torch_bridge): each must
    # still be a tensor of its own, aligned, apart in memory, with its own version.
    W = torch.randn(rows, 64, device="cuda")
    A = torch.randn(4, 64, device="cuda") / 8
    B = torch.randn(rows, 4, device="cuda")
    m = torch.rand(rows, device="cuda") + 0.5
    norm, scale = kerf.ops.dora_norm(W, A, B, m, 0.5)
    ref_norm, ref_scale = dora_ref(W, A, B, m, 0.5)
    for t in (norm, scale):
        assert t.shape == (rows,) and t.is_contiguous() and t._base is None
        assert t.data_ptr() % 256 == 0
    lo, hi = sorted((norm.data_ptr(), scale.data_ptr()))
    assert hi - lo >= rows * 4
    version = norm._version
    scale.add_(1.0)
    assert norm._version == version
    torch.testing.assert_close(norm.double(), ref_norm, rtol=2e-5, atol=0)
    del norm
    torch.cuda.synchronize()
    torch.testing.assert_close(scale.double() - 1.0, ref_scale, rtol=2e-5, atol=1e-6)
    # Saved by autograd and the other changed in place: no false version conflict.
    Bp = B.clone().requires_grad_(True)
    mp = m.clone().requires_grad_(True)
    out = ka.dora_scale(W, A, Bp, mp, 0.5)
    out.add_(0.0)  # scale changed in place; the norm it was made with is saved for backward
    (out * torch.arange(rows, device="cuda")).sum().backward()
    torch.testing.assert_close(mp.grad.double(), torch.arange(rows, device="cuda").double() / ref_norm,
                               rtol=2e-5, atol=0)


@CUDA_ONLY
def test_cuda_lora_embedding_defers_its_id_report_when_asked():
    V, H, r = 50, 32, 4
    W = torch.randn(V, H, device="cuda")
    A = torch.randn(r, V, device="cuda")
    B = torch.randn(H, r, device="cuda")
    x = torch.tensor([1, V + 5, 7], device="cuda")
    out = kerf.ops.lora_embedding(x, W, A, B, 0.5, id_check="deferred")  # queued; nothing raised yet
    torch.cuda.synchronize()
    keep = torch.tensor([1, 7], device="cuda")
    ref = W.double()[keep] + 0.5 * (A.double().T[keep] @ B.double().T)
    torch.testing.assert_close(out[[0, 2]].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[1]) == 0  # the bad id's row: zeros, never read
    with pytest.raises(ValueError, match=r"x\[1\] = 55 is outside the vocabulary \[0, 50\)"):
        kerf.ops.check_embedding_ids(x)
    kerf.ops.check_embedding_ids(x)  # reported once: the record is clear again
    g = torch.randn(3, H, device="cuda")
    kerf.ops.lora_embedding_backward(x, A, B, g, 0.5, id_check="deferred")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kerf.ops.check_embedding_ids(W)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kerf.ops.lora_embedding(x, W, A, B, 0.5)  # the default waits and raises at once
    kerf.ops.check_embedding_ids(W)
    # Through autograd: forward and backward queued, the report at the check.
    Ap, Bp = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    ka.lora_embedding(x, W, Ap, Bp, 0.5, id_check="deferred").sum().backward()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kerf.ops.check_embedding_ids(W)
    assert torch.count_nonzero(Ap.grad[:, 1]) > 0 and torch.count_nonzero(Ap.grad[:, 2]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_moe_on_peft_layout_views_matches_torch(device):
    E, N, K, r = 4, 32, 48, 4
    W = torch.randn(E, N, K, device=device)
    lora_A = torch.randn(r * E, K, device=device)
    lora_B = torch.randn(N, r * E, device=device)
    A3 = lora_A.view(E, r, K)
    B3 = lora_B.view(N, r, E).permute(2, 0, 1)
    W_eff = kerf.ops.moe_lora_materialize(W, A3, B3, 0.5)
    ref = torch.baddbmm(W.double(), B3.double(), A3.double(), alpha=0.5)
    torch.testing.assert_close(W_eff.double(), ref, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- autograd, float64 gradcheck
@pytest.mark.parametrize("device", DEVICES)
def test_dora_scale_gradcheck_float64(device):
    torch.manual_seed(0)
    W = torch.randn(12, 20, dtype=torch.float64, device=device)
    A = torch.randn(3, 20, dtype=torch.float64, device=device) / 4
    B = torch.randn(12, 3, dtype=torch.float64, device=device)
    m = (torch.rand(12, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda m_: ka.dora_scale(W, A, B, m_, 0.5), (m,))


@pytest.mark.parametrize("device", DEVICES)
def test_dora_scale_is_the_detached_peft_scale(device):
    torch.manual_seed(1)
    W = torch.randn(16, 24, device=device)
    A = (torch.randn(4, 24, device=device) / 4).requires_grad_()
    B = torch.randn(16, 4, device=device).requires_grad_()
    m = (torch.rand(16, device=device) + 0.5).requires_grad_()
    scale = ka.dora_scale(W, A, B, m, 2.0)
    # PEFT: weight_norm = ||W + s * B @ A||.detach(); mag_norm_scale = m / weight_norm
    m_ref = m.detach().clone().requires_grad_()
    ref = m_ref / torch.linalg.norm(W + 2.0 * (B @ A), dim=1).detach()
    torch.testing.assert_close(scale, ref, rtol=2e-5, atol=0)
    g = torch.randn_like(scale)
    scale.backward(g)
    ref.backward(g)
    torch.testing.assert_close(m.grad, m_ref.grad, rtol=2e-5, atol=0)
    assert A.grad is None and B.grad is None  # nothing flows through the detached norm


@pytest.mark.parametrize("device", DEVICES)
def test_moe_materialize_gradcheck_float64(device):
    torch.manual_seed(2)
    E, N, K, r = 2, 6, 8, 2
    W = torch.randn(E, N, K, dtype=torch.float64, device=device)
    A = (torch.randn(E, r, K, dtype=torch.float64, device=device) / 2).requires_grad_()
    B = (torch.randn(E, N, r, dtype=torch.float64, device=device) / 2).requires_grad_()
    # kerf computes in float32: finite differences need a larger step and float32 tolerances.
    assert torch.autograd.gradcheck(lambda a, b: ka.moe_lora_materialize(W, a, b, 0.5), (A, B),
                                    eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_materialize_peft_layout_matches_torch_autograd(device):
    torch.manual_seed(3)
    E, N, K, r = 4, 16, 24, 2
    W = torch.randn(E, N, K, device=device)
    lora_A = torch.randn(r * E, K, device=device).requires_grad_()
    lora_B = torch.randn(N, r * E, device=device).requires_grad_()
    out = ka.moe_lora_materialize_peft(W, lora_A, lora_B, 0.5)
    A_ref = lora_A.detach().clone().requires_grad_()
    B_ref = lora_B.detach().clone().requires_grad_()
    ref = torch.baddbmm(W, B_ref.view(N, r, E).permute(2, 0, 1), A_ref.view(E, r, K), alpha=0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(lora_A.grad, A_ref.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lora_B.grad, B_ref.grad, rtol=1e-5, atol=1e-4)


def test_moe_materialize_passes_the_gradient_to_a_trainable_base():
    if not kerf.cpu_available():
        pytest.skip("kerf was built without its CPU back end")
    W = torch.randn(1, 4, 4, requires_grad=True)
    A = torch.randn(1, 1, 4, requires_grad=True)
    B = torch.randn(1, 4, 1)
    ka.moe_lora_materialize(W, A, B, 1.0).sum().backward()
    torch.testing.assert_close(W.grad, torch.ones_like(W))
    assert B.grad is None


# ---------------------------------------------------------------- LoRA embedding
@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_gradcheck_float64(device):
    torch.manual_seed(7)
    V, H, r = 20, 6, 3
    x = torch.tensor([[1, 0, 5, 19], [5, 5, 2, 0]], device=device)
    W = torch.randn(V, H, dtype=torch.float64, device=device)
    A = torch.randn(r, V, dtype=torch.float64, device=device).requires_grad_()
    B = torch.randn(H, r, dtype=torch.float64, device=device).requires_grad_()
    # kerf computes in float32: finite differences need a larger step and float32 tolerances.
    # padding_idx is an id x does not hold: at a padding id the forward still reads A (as
    # F.embedding does) while the gradient is zero by definition, which finite differences
    # cannot agree with; the next test checks padding against torch's own autograd.
    assert torch.autograd.gradcheck(lambda a, b: ka.lora_embedding(x, W, a, b, 0.5, padding_idx=3), (A, B),
                                    eps=1e-3, atol=2e-3, rtol=2e-3)
    m = (torch.rand(H, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    # With DoRA the norm is detached: the magnitude is what gets a gradient through it.
    assert torch.autograd.gradcheck(lambda m_: ka.lora_embedding(x, W, A.detach(), B.detach(), 0.5, magnitude=m_),
                                    (m,))


@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_with_dora_matches_peft_semantics_under_torch_autograd(device):
    torch.manual_seed(8)
    V, H, r, s = 50, 16, 4, 2.0
    x = torch.randint(0, V, (3, 7), device=device)
    x[0, 0] = 1
    W = torch.randn(V, H, device=device)
    A = torch.randn(r, V, device=device).requires_grad_()
    B = torch.randn(H, r, device=device).requires_grad_()
    m = (torch.rand(H, device=device) + 0.5).requires_grad_()
    out = ka.lora_embedding(x, W, A, B, s, padding_idx=1, magnitude=m)
    Ar, Br, mr = (t.detach().clone().requires_grad_() for t in (A, B, m))
    n = torch.linalg.norm(W.t() + s * (Br @ Ar), dim=1).detach()
    pre = F.embedding(x, W, padding_idx=1) + s * (F.embedding(x, Ar.t(), padding_idx=1) @ Br.t())
    ref = (mr / n) * pre
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for got, want in ((A.grad, Ar.grad), (B.grad, Br.grad), (m.grad, mr.grad)):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_padding_idx_as_torch_reads_it(device):
    """padding_idx within [-V, V), a negative one counting from the end, for every gradient
    (W's too); outside it, ValueError before anything runs, as F.embedding."""
    torch.manual_seed(10)
    V, H, r, s = 10, 4, 2, 0.5
    x = torch.tensor([3, 5, 7, 9, 9], device=device)
    W = torch.randn(V, H, device=device).requires_grad_()
    A = torch.randn(r, V, device=device).requires_grad_()
    B = torch.randn(H, r, device=device).requires_grad_()
    for bad in (10, 15, -11):
        with pytest.raises(ValueError, match=r"lora_embedding: padding_idx must be within \[-10, 10\)"):
            ka.lora_embedding(x, W, A, B, s, padding_idx=bad)
        with pytest.raises((AssertionError, RuntimeError, ValueError)):  # torch's own refusal
            F.embedding(x, W, padding_idx=bad)
    with pytest.raises(ValueError, match=r"magnitude must be \[H\] = \[4\]"):
        ka.lora_embedding(x, W, A, B, s, magnitude=torch.ones(5, device=device))
    with pytest.raises(TypeError, match=r"lora_embedding: W must be a torch.Tensor, got ndarray"):
        ka.lora_embedding(x, W.detach().cpu().numpy(), A, B, s)
    g = torch.randn(5, H, device=device)
    for pad in (-1, 9, -5, 5):
        for t in (W, A, B):
            t.grad = None
        ka.lora_embedding(x, W, A, B, s, padding_idx=pad).backward(g)
        Wr, Ar, Br = (t.detach().clone().requires_grad_() for t in (W, A, B))
        ref = F.embedding(x, Wr, padding_idx=pad) + s * (F.embedding(x, Ar.t(), padding_idx=pad) @ Br.t())
        ref.backward(g)
        for got, want in ((W.grad, Wr.grad), (A.grad, Ar.grad), (B.grad, Br.grad)):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-5)
        assert torch.count_nonzero(W.grad[pad]) == 0


def peft_embedding(x, W, A, B, s, padding_idx, by_freq, m=None):
    """PEFT's LoRA (and DoRA) embedding in PyTorch: the reference kerf's autograd follows."""
    kw = {"padding_idx": padding_idx, "scale_grad_by_freq": by_freq}
    pre = F.embedding(x, W, **kw) + s * (F.embedding(x, A.t(), **kw) @ B.t())
    if m is None:
        return pre
    return pre * (m / torch.linalg.vector_norm(W.t() + s * B @ A, dim=1).detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("by_freq", [False, True])
def test_lora_embedding_follows_f_embedding_in_first_and_second_derivatives(device, dora, padding_idx, by_freq):
    """padding_idx and scale_grad_by_freq as F.embedding (PEFT passes the base layer's) in
    the gradients of W, A, B and m, also with create_graph=True; and second derivatives
    with padding_idx (they reached A's and W's padding row). With scale_grad_by_freq,
    torch's own double backward of F.embedding ignores the scaling, so only first
    derivatives are compared there."""
    torch.manual_seed(11)
    x = torch.tensor([[1, 3, 3, 7], [5, 1, 1, 3]], device=device)
    W, A, B = (torch.randn(*sh, dtype=torch.float64, device=device).requires_grad_() for sh in [(9, 5), (3, 9), (5, 3)])
    m = (torch.rand(5, dtype=torch.float64, device=device) + 0.5).requires_grad_() if dora else None
    ins = [W, A, B] + ([m] if dora else [])
    got = ka.lora_embedding(x, W, A, B, 0.7, padding_idx=padding_idx, magnitude=m, scale_grad_by_freq=by_freq)
    want = peft_embedding(x, W, A, B, 0.7, padding_idx, by_freq, m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    # kerf's backward (no create_graph), then the differentiable one.
    for create_graph in (False, True):
        g_got = torch.autograd.grad(got, ins, g, retain_graph=True, create_graph=create_graph)
        g_want = torch.autograd.grad(want, ins, g, retain_graph=True, create_graph=create_graph)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if by_freq:
        return
    h_got = torch.autograd.grad(sum((t * t).sum() for t in g_got), ins, allow_unused=True)
    h_want = torch.autograd.grad(sum((t * t).sum() for t in g_want), ins, allow_unused=True)
    for t, a, b in zip(ins, h_got, h_want):
        torch.testing.assert_close(torch.zeros_like(t) if a is None else a, torch.zeros_like(t) if b is None else b,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_takes_ids_as_f_embedding_does(device):
    """A single id (0-dim), ids that do not flatten (transposed, expanded), a NumPy integer
    padding_idx; and an inference-mode base weight with a trainable magnitude (it was saved
    for second derivatives, which torch refuses for inference tensors)."""
    torch.manual_seed(12)
    W, A, B = torch.randn(8, 4, device=device), torch.randn(2, 8, device=device), torch.randn(4, 2, device=device)
    for x in (torch.tensor(3, device=device), torch.tensor([[1, 2], [3, 4]], device=device).t(),
              torch.tensor([1, 6], device=device).expand(3, 2)):
        torch.testing.assert_close(ka.lora_embedding(x, W, A, B, 0.5), peft_embedding(x, W, A, B, 0.5, None, False),
                                   rtol=1e-5, atol=1e-6)
    x = torch.tensor([1, 3, 3], device=device)
    torch.testing.assert_close(ka.lora_embedding(x, W, A, B, 0.5, padding_idx=np.int64(3)),
                               peft_embedding(x, W, A, B, 0.5, 3, False), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="padding_idx must be an int, got float"):
        ka.lora_embedding(x, W, A, B, 0.5, padding_idx=3.0)
    with torch.inference_mode():
        Wi = torch.randn(8, 4, device=device)
    m = torch.ones(4, device=device, requires_grad=True)
    ka.lora_embedding(x, Wi, A.clone().requires_grad_(), B, 0.5, magnitude=m).sum().backward()
    assert m.grad is not None and torch.isfinite(m.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_int32_ids_empty_rows_and_in_place_bases_under_autograd(device):
    """int32 ids with scale_grad_by_freq (torch before 2.0 indexes with int64 only), rows of
    no columns (H = 0), and a base weight or magnitude changed in place between the forward
    and a create_graph backward, which computes from them: refused, as a saved tensor's is."""
    torch.manual_seed(13)
    x32 = torch.tensor([1, 3, 3, 7], dtype=torch.int32, device=device)
    W, A, B = (torch.randn(*sh, dtype=torch.float64, device=device).requires_grad_() for sh in [(9, 4), (2, 9), (4, 2)])
    got = ka.lora_embedding(x32, W, A, B, 0.5, scale_grad_by_freq=True)
    want = peft_embedding(x32.long(), W, A, B, 0.5, None, True)
    g = torch.randn_like(want)
    for create_graph in (False, True):
        for a, b in zip(torch.autograd.grad(got, (W, A, B), g, retain_graph=True, create_graph=create_graph),
                        torch.autograd.grad(want, (W, A, B), g, retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # H = 0: zero gradients of the shapes PyTorch gives.
    A0 = torch.randn(2, 9, device=device, requires_grad=True)
    B0 = torch.randn(0, 2, device=device, requires_grad=True)
    out = ka.lora_embedding(torch.tensor([1, 2, 2], device=device), torch.randn(9, 0, device=device), A0, B0, 0.5)
    assert out.shape == (3, 0)
    out.sum().backward()
    assert A0.grad.shape == (2, 9) and not A0.grad.any() and B0.grad.shape == (0, 2)
    # In place after the forward.
    m = (torch.rand(4, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    for changed in ("W", "magnitude"):
        out = ka.lora_embedding(x32.long(), W, A, B, 0.5, magnitude=m)
        with torch.no_grad():
            (W if changed == "W" else m).mul_(1.5)
        with pytest.raises(RuntimeError, match=f"{changed} was modified by an inplace operation after the forward"):
            torch.autograd.grad(out.sum(), (m, A), create_graph=True)


@CUDA_ONLY
@pytest.mark.parametrize("adapters", [torch.bfloat16, torch.float32])
def test_cuda_lora_embedding_gradients_in_the_adapters_dtype_match_float64(adapters):
    """bf16 adapters get bf16 gradients (kerf then groups the ids and writes grad_A once);
    fp32 adapters fp32 ones (added into at scattered ids): both against float64 autograd."""
    torch.manual_seed(9)
    V, H, r, s = 300, 64, 16, 2.0
    x = torch.randint(0, V, (4, 50), device="cuda")
    x[:, ::7] = 5  # an id many tokens share
    x[0, 1] = 1    # padding
    W = torch.randn(V, H, device="cuda").to(adapters)
    A = (0.3 * torch.randn(r, V, device="cuda")).to(adapters).requires_grad_()
    B = (0.3 * torch.randn(H, r, device="cuda")).to(adapters).requires_grad_()
    out = ka.lora_embedding(x, W, A, B, s, padding_idx=1)
    g = torch.randn(out.shape, device="cuda").to(out.dtype)
    out.backward(g)
    assert A.grad.dtype == adapters and B.grad.dtype == adapters
    Ar, Br = (t.detach().double().requires_grad_() for t in (A, B))
    ref = F.embedding(x, W.double(), padding_idx=1) + s * (F.embedding(x, Ar.t(), padding_idx=1) @ Br.t())
    ref.backward(g.double())
    tol = 1e-2 if adapters == torch.bfloat16 else 1e-5
    for got, want in ((A.grad, Ar.grad), (B.grad, Br.grad)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err <= tol, (got.dtype, err.item())
    assert torch.count_nonzero(A.grad[:, 1]) == 0  # no gradient at padding_idx


# ---------------------------------------------------------------- DoRA norm cache
@STEP_HOOKS
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True])
def test_norm_cache_agrees_with_a_fresh_norm_at_every_step(device, fused):
    """AdamW(fused=True) changes weights without bumping _version or data_ptr; the
    step hook must still drop the cached norm."""
    if fused and device == "cpu" and TORCH_VERSION < (2, 4):
        pytest.skip("fused AdamW on the CPU needs torch >= 2.4")
    torch.manual_seed(4)
    out_f, in_f, r, s = 64, 96, 8, 2.0
    W = torch.randn(out_f, in_f, device=device)
    A = torch.nn.Parameter(torch.randn(r, in_f, device=device) / 8)
    B = torch.nn.Parameter(torch.randn(out_f, r, device=device) / 8)  # non-zero: the norm moves from step 1
    m = torch.nn.Parameter(torch.rand(out_f, device=device) + 0.5)
    opt = torch.optim.AdamW([A, B, m], lr=5e-2, fused=fused)
    cache = ka.DoraNormCache(opt)
    x = torch.randn(32, in_f, device=device)
    previous = None
    for step in range(5):
        for micro in range(2):  # two forwards per step: the second one hits the cache
            cached = cache.norm(W, A, B, s)
            fresh = ka.dora_weight_norm(W, A, B, s)
            torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=0)
            torch.testing.assert_close(cached.double(), dora_ref(W, A.detach(), B.detach(), m, s)[0],
                                       rtol=2e-5, atol=0)
        if previous is not None:  # the weights moved, so a stale norm would have been caught
            assert (cached - previous).abs().max() > 1e-3
        previous = cached.clone()
        scale = ka.dora_scale(W, A, B, m, s, cache=cache)
        y = (x @ (W + s * B @ A).t()) * scale
        opt.zero_grad()
        y.square().mean().backward()
        opt.step()
    assert cache.hits == 5 * 2 and cache.misses == 5  # per step: norm() misses, norm() and dora_scale hit
    cache.close()


@pytest.mark.skipif(hasattr(torch.optim.Optimizer, "register_step_post_hook"),
                    reason=f"torch {torch.__version__} has optimizer step hooks")
def test_norm_cache_refuses_a_torch_without_optimizer_step_hooks():
    """Nothing would empty the cache there: it must not be made, with a message that says why."""
    with pytest.raises(kerf.NotAvailableError, match="needs PyTorch >= 2.0"):
        ka.DoraNormCache()
    with pytest.raises(RuntimeError):  # NotAvailableError is a RuntimeError
        ka.DoraNormCache(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


@STEP_HOOKS
def test_norm_cache_without_optimizers_hooks_every_optimizer_and_invalidate_works():
    if not kerf.cpu_available():
        pytest.skip("kerf was built without its CPU back end")
    W = torch.randn(8, 16)
    A = torch.nn.Parameter(torch.randn(2, 16))
    B = torch.nn.Parameter(torch.randn(8, 2))
    cache = ka.DoraNormCache()
    n0 = cache.norm(W, A, B, 1.0)
    assert len(cache) == 1 and cache.norm(W, A, B, 1.0) is n0
    opt = torch.optim.SGD([A, B], lr=0.1)
    (A.sum() + B.sum()).backward()
    opt.step()
    assert len(cache) == 0  # the global step hook fired
    n1 = cache.norm(W, A, B, 1.0)
    with torch.no_grad():
        A.data.add_(1.0)  # no version bump: only an explicit invalidate() can know
    cache.invalidate()
    assert not torch.equal(cache.norm(W, A, B, 1.0), n1)
    cache.close()
    opt.step()
    assert len(cache) == 0


# ---------------------------------------------------------------- CUDA specifics
@CUDA_ONLY
def test_cuda_ops_run_on_the_current_torch_stream(torch_path):
    W = torch.randn(256, 512, device="cuda")
    A = torch.randn(16, 512, device="cuda") / 16
    B = torch.randn(256, 16, device="cuda")
    m = torch.rand(256, device="cuda") + 0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        norm, _ = kerf.ops.dora_norm(W, A, B, m, 0.5)
        again = norm * 1.0  # torch work queued after kerf's on the same stream
    side.synchronize()
    ref = dora_ref(W, A, B, m, 0.5)[0]
    torch.testing.assert_close(again.double(), ref, rtol=2e-5, atol=0)
    # An explicit stream= wins over the current one.
    norm2 = torch.empty_like(m)
    kerf.ops.dora_norm(W, A, B, m, 0.5, norm=norm2, stream=side)
    side.synchronize()
    torch.testing.assert_close(norm2, norm)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dora_scale_matches_torch_autograd(dtype):
    torch.manual_seed(5)
    W = torch.randn(512, 1024, device="cuda", dtype=dtype)
    A = (torch.randn(16, 1024, device="cuda") / 32).requires_grad_()
    B = torch.randn(512, 16, device="cuda").requires_grad_()
    m = (torch.rand(512, device="cuda") + 0.5).requires_grad_()
    scale = ka.dora_scale(W, A, B, m, 0.5)
    m_ref = m.detach().clone().requires_grad_()
    ref = m_ref / torch.linalg.norm(W.float() + 0.5 * (B @ A), dim=1).detach()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(scale, ref, rtol=tol, atol=0)
    g = torch.randn_like(scale)
    scale.backward(g)
    ref.backward(g)
    torch.testing.assert_close(m.grad, m_ref.grad, rtol=tol, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
@pytest.mark.parametrize("mtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dora_scale_graph_node_of_the_bridge(device, mtype):
    """kerf._torch_bridge's C++ node (where built) gives what DoraScale's Python one
    gives: the scale in m's dtype, grad_m = grad / norm, none without grad mode."""
    if not bridge_built():
        pytest.skip(f"kerf._torch_bridge was not built for this torch ({kerf._kerf._torch_bridge_status()})")
    assert ka._scale_with_grad is not None, kerf._kerf._torch_bridge_status()
    if device == "cpu" and not kerf.cpu_available():
        pytest.skip("kerf was built without its CPU back end")
    torch.manual_seed(8)
    W = torch.randn(40, 72, device=device)
    A = torch.randn(4, 72, device=device) / 8
    B = torch.randn(40, 4, device=device)
    m = (torch.rand(40, device=device) + 0.5).to(mtype).requires_grad_()
    scale = ka.dora_scale(W, A, B, m, 0.5)
    assert "kerf::DoraScale" in scale.grad_fn.name() and scale.dtype == mtype  # CppNode<kerf::DoraScale>
    m_py = m.detach().clone().requires_grad_()
    ref = ka.DoraScale.apply(W, A, B, m_py, 0.5, 0.0)  # the Python node
    assert ref.grad_fn.name() == "DoraScaleBackward"
    torch.testing.assert_close(scale, ref, rtol=0, atol=0)  # one kernel's result, cast alike
    g = torch.randn(40, device=device).to(mtype)
    scale.backward(g, retain_graph=True)
    ref.backward(g)  # kerf's dora_norm_backward there, ATen's division here: one rounding each
    same = dict(rtol=2e-6, atol=0) if mtype == torch.float32 else dict(rtol=8e-3, atol=0)
    torch.testing.assert_close(m.grad, m_py.grad, **same)
    norm, _ = dora_ref(W, A, B, m, 0.5)
    tol = 2e-5 if mtype == torch.float32 else 1e-2
    torch.testing.assert_close(m.grad.double(), g.double() / norm, rtol=tol, atol=0)
    scale.backward(g)  # retained once: a second backward adds the same again
    torch.testing.assert_close(m.grad, 2 * m_py.grad, rtol=tol, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        scale.backward(g)
    with torch.no_grad():
        assert ka.dora_scale(W, A, B, m, 0.5).grad_fn is None
    assert ka.dora_scale(W, A, B, m.detach(), 0.5).grad_fn is None
    # In a larger graph, with the gradient of a use downstream.
    m.grad = None
    ka.dora_scale(W, A, B, m, 0.5).float().pow(2).sum().backward()
    s64 = m.detach().double() / norm
    torch.testing.assert_close(m.grad.double(), 2 * s64.to(mtype).double() / norm, rtol=tol, atol=0)


@CUDA_ONLY
@pytest.mark.parametrize("wrapper", ["dora_scale", "DoraScale.apply"])
def test_cuda_dora_scale_under_compiled_autograd(wrapper):
    """torch._dynamo's compiled autograd traces the backward of either graph node."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    enable = getattr(compiled_autograd, "_enable", None)
    if enable is None:
        pytest.skip("this torch has no torch._dynamo.compiled_autograd._enable")
    torch.manual_seed(9)
    W = torch.randn(64, 96, device="cuda")
    A = torch.randn(4, 96, device="cuda") / 8
    B = torch.randn(64, 4, device="cuda")
    m = (torch.rand(64, device="cuda") + 0.5).requires_grad_()
    fn = ka.dora_scale if wrapper == "dora_scale" else (lambda *a: ka.DoraScale.apply(*a, 0.0))
    w = torch.randn(64, device="cuda")
    loss = (fn(W, A, B, m, 0.5) * w).sum()
    with enable(torch.compile(backend="eager")):
        loss.backward()
    norm, _ = dora_ref(W, A, B, m, 0.5)
    torch.testing.assert_close(m.grad.double(), w.double() / norm, rtol=2e-5, atol=0)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_moe_materialize_matches_torch_autograd(dtype):
    torch.manual_seed(6)
    E, N, K, r = 8, 256, 512, 16
    W = torch.randn(E, N, K, device="cuda", dtype=dtype)
    lora_A = (torch.randn(r * E, K, device="cuda", dtype=dtype) / 8).requires_grad_()
    lora_B = (torch.randn(N, r * E, device="cuda", dtype=dtype) / 8).requires_grad_()
    out = ka.moe_lora_materialize_peft(W, lora_A, lora_B, 0.5)
    A_ref = lora_A.detach().clone().requires_grad_()
    B_ref = lora_B.detach().clone().requires_grad_()
    ref = torch.baddbmm(W.float(), B_ref.float().view(N, r, E).permute(2, 0, 1), A_ref.float().view(E, r, K),
                        alpha=0.5)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.float())
    torch.testing.assert_close(lora_A.grad.float(), A_ref.grad.float(), **tol)
    torch.testing.assert_close(lora_B.grad.float(), B_ref.grad.float(), **tol)


@CUDA_ONLY
def test_cuda_moe_materialize_in_place_into_the_weights():
    E, N, K, r = 4, 128, 256, 8
    W = torch.randn(E, N, K, device="cuda")
    A = torch.randn(E, r, K, device="cuda")
    B = torch.randn(E, N, r, device="cuda")
    ref = torch.baddbmm(W, B, A, alpha=0.5)
    assert kerf.ops.moe_lora_materialize(W, A, B, 0.5, out=W) is W
    torch.testing.assert_close(W, ref, rtol=1e-4, atol=1e-4)


@CUDA_ONLY
def test_kerf_buffers_on_cuda_follow_torchs_current_device():
    before = torch.cuda.current_device()
    try:
        for d in reversed(range(torch.cuda.device_count())):
            torch.cuda.set_device(d)
            buf = kerf.empty((4,), "f32", "cuda")
            assert buf.device == f"cuda:{d}" and buf.__dlpack_device__() == (2, d)
            assert torch.cuda.current_device() == d
    finally:
        torch.cuda.set_device(before)


@CUDA_ONLY
def test_cupy_arrays_cross_without_copies_and_get_kerf_buffers_back():
    cupy = pytest.importorskip("cupy")
    W = cupy.random.standard_normal((64, 128), dtype=cupy.float32)
    A = cupy.random.standard_normal((4, 128), dtype=cupy.float32) / 8
    B = cupy.random.standard_normal((64, 4), dtype=cupy.float32)
    m = cupy.ones(64, dtype=cupy.float32)
    assert view_info(W)["data_ptr"] == W.data.ptr
    norm, _ = kerf.ops.dora_norm(W, A, B, m, 0.5)
    assert isinstance(norm, kerf.Buffer) and norm.device.startswith("cuda")
    n = cupy.from_dlpack(norm)
    ref = cupy.linalg.norm(W.astype(cupy.float64) + 0.5 * B.astype(cupy.float64) @ A.astype(cupy.float64), axis=1)
    cupy.testing.assert_allclose(n, ref, rtol=2e-5)


@CUDA_ONLY
def test_jax_arrays_cross_through_dlpack():
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU's memory to torch
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU here")
    key = jax.random.PRNGKey(0)
    W = jax.device_put(jax.random.normal(key, (64, 128), jnp.float32), gpus[0])
    A = jax.device_put(jax.random.normal(key, (4, 128), jnp.float32) / 8, gpus[0])
    B = jax.device_put(jax.random.normal(key, (64, 4), jnp.float32), gpus[0])
    m = jax.device_put(jnp.ones(64, jnp.float32), gpus[0])
    norm, _ = kerf.ops.dora_norm(W, A, B, m, 0.5)
    n = torch.from_dlpack(norm).cpu().double()
    Wt, At, Bt = (torch.from_dlpack(x).cpu().double() for x in (W, A, B))
    torch.testing.assert_close(n, torch.linalg.norm(Wt + 0.5 * Bt @ At, dim=1), rtol=2e-5, atol=0)


# ---------------------------------------------------------------- 4-bit weights
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapters", [torch.float32, torch.bfloat16])
def test_dora_norm_4bit_on_torch_uint8_matches_a_dequantized_reference(device, adapters, torch_path):
    out, inn, r, bs = 96, 320, 16, 64
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (out * inn // 2, 1), dtype=torch.uint8, generator=g).to(device)
    absmax = (torch.rand(out * inn // bs, generator=g) + 0.5).to(device)
    A = (torch.randn(r, inn, generator=g) / inn ** 0.5).to(device, adapters)
    B = torch.randn(out, r, generator=g).to(device, adapters)
    m = (torch.rand(out, generator=g) + 0.5).to(device)
    norm, scale = kerf.ops.dora_norm_4bit(packed, absmax, A, B, m, 0.5)
    assert isinstance(norm, torch.Tensor) and norm.device == packed.device and norm.dtype == torch.float32
    code = torch.tensor(kerf.ops.nf4_code(), dtype=torch.float64, device=device)
    b = packed.reshape(-1).long()
    q = torch.stack([b >> 4, b & 15], dim=1).reshape(-1)
    W = (code[q] * absmax.double().repeat_interleave(bs)).reshape(out, inn)
    ref_norm, ref_scale = dora_ref(W, A, B, m, 0.5)
    torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-2, atol=0)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-2, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_dora_scale_of_a_4bit_weight_reads_its_quant_state(device):
    # A stand-in for bitsandbytes' Params4bit: a uint8 parameter carrying a quant_state.
    import types

    out, inn, r, bs = 64, 256, 8, 64
    g = torch.Generator().manual_seed(12)
    packed = torch.randint(0, 256, (out * inn // 2, 1), dtype=torch.uint8, generator=g).to(device)
    W4 = torch.nn.Parameter(packed, requires_grad=False)
    code = torch.tensor(kerf.ops.nf4_code(), device=device)
    W4.quant_state = types.SimpleNamespace(absmax=(torch.rand(out * inn // bs, generator=g) + 0.5).to(device),
                                           code=code, blocksize=bs, nested=False)
    A = (torch.randn(r, inn, generator=g) / inn ** 0.5).to(device)
    B = torch.randn(out, r, generator=g).to(device)
    m = (torch.rand(out, generator=g) + 0.5).to(device).requires_grad_()
    scale = ka.dora_scale(W4, A, B, m, 0.5)
    b = packed.reshape(-1).long()
    q = torch.stack([b >> 4, b & 15], dim=1).reshape(-1)
    W = (code.double()[q] * W4.quant_state.absmax.double().repeat_interleave(bs)).reshape(out, inn)
    ref_norm, ref_scale = dora_ref(W, A, B, m.detach(), 0.5)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-2, atol=0)
    scale.sum().backward()
    torch.testing.assert_close(m.grad.double(), 1 / ref_norm, rtol=1e-2, atol=0)
    torch.testing.assert_close(ka.dora_weight_norm(W4, A, B, 0.5).double(), ref_norm, rtol=1e-2, atol=0)


# ---------------------------------------------------------------- second derivatives, review fixes
@pytest.mark.parametrize("device", DEVICES)
def test_second_derivatives_through_kerfs_functions_match_torch(device):
    """create_graph=True: the backward passes run as PyTorch ops, so second derivatives keep
    every term (kerf's kernels record no history; the terms through them were lost)."""
    torch.manual_seed(11)
    # DoRA scale, float32: d2/dm2 of sum(scale^2) + sum(m^3) is 2/n^2 + 6m.
    W, A, B = torch.randn(5, 9, device=device), torch.randn(2, 9, device=device), torch.randn(5, 2, device=device)
    m = (torch.rand(5, device=device) + 0.5).requires_grad_()
    for fn in (ka.dora_scale, lambda *a: ka.DoraScale.apply(*a, 0.0)):
        scale = fn(W, A, B, m, 0.5)
        (g,) = torch.autograd.grad((scale ** 2).sum() + (m ** 3).sum(), m, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), m)
        n = torch.linalg.norm(W + 0.5 * B @ A, dim=1)
        torch.testing.assert_close(h, 2 / n ** 2 + 6 * m.detach(), rtol=1e-4, atol=1e-4)
    # MoE materialization: gradgradcheck in float64 (the second-order pass is PyTorch's).
    Wm = torch.randn(2, 5, 7, dtype=torch.float64, device=device)
    Am = torch.randn(2, 3, 7, dtype=torch.float64, device=device).requires_grad_()
    Bm = torch.randn(2, 5, 3, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: ka.moe_lora_materialize(Wm, a, b, 0.5), (Am, Bm),
                                        eps=1e-3, atol=2e-3, rtol=2e-3)
    # The embedding (DoRA-scaled, with padding): d/dB of |dL/dA|^2 against torch's own.
    V, H, r = 12, 6, 3
    x = torch.tensor([[1, 4, 4, 0], [7, 11, 2, 4]], device=device)
    We = torch.randn(V, H, device=device)
    Ae = torch.randn(r, V, device=device).requires_grad_()
    Be = torch.randn(H, r, device=device).requires_grad_()
    me = (torch.rand(H, device=device) + 0.5).requires_grad_()

    def second(emb):
        out = emb(Ae, Be, me)
        (gA,) = torch.autograd.grad((out ** 2).sum(), Ae, create_graph=True)
        return torch.autograd.grad((gA ** 2).sum(), (Be, me))

    def torch_emb(a, b, mm):
        n = torch.linalg.norm(We.t() + 0.5 * (b @ a), dim=1).detach()
        pre = F.embedding(x, We, padding_idx=4) + 0.5 * (F.embedding(x, a.t(), padding_idx=4) @ b.t())
        return (mm / n) * pre

    got = second(lambda a, b, mm: ka.lora_embedding(x, We, a, b, 0.5, padding_idx=4, magnitude=mm))
    want = second(torch_emb)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_refusals_name_the_op_and_argument(device):
    W = torch.randn(2, 5, 7, device=device)
    lora_A = torch.randn(3 * 2, 7, device=device)
    with pytest.raises(ValueError, match=r"moe_lora_materialize_peft: lora_B must be \[N, r\*E\] = \[5, 6\]"):
        ka.moe_lora_materialize_peft(W, lora_A, torch.randn(6, 5, device=device), 0.5)  # transposed
    with pytest.raises(ValueError, match=r"lora_A must be \[r\*E, K\]"):
        ka.moe_lora_materialize_peft(W, torch.randn(6, 8, device=device), torch.randn(5, 6, device=device), 0.5)
    with pytest.raises(ValueError, match="W has no experts"):
        ka.moe_lora_materialize_peft(W[:0], lora_A, torch.randn(5, 6, device=device), 0.5)
    with pytest.raises(TypeError, match="dora_scale: m must be a torch.Tensor, got NoneType"):
        ka.dora_scale(W[0], torch.randn(2, 7, device=device), torch.randn(5, 2, device=device), None, 0.5)
    with pytest.raises(TypeError, match="dora_weight_norm: B must be a torch.Tensor, got list"):
        ka.dora_weight_norm(W[0], torch.randn(2, 7, device=device), [[1.0]], 0.5)
    with pytest.raises(TypeError, match="moe_lora_materialize: A must be a torch.Tensor, got NoneType"):
        ka.moe_lora_materialize(W, None, torch.randn(2, 5, 3, device=device), 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_embedding_apply_reads_a_negative_padding_idx_from_the_end(device):
    torch.manual_seed(12)
    V, H, r = 10, 4, 2
    x = torch.tensor([3, 9, 9, 5], device=device)
    W = torch.randn(V, H, device=device).requires_grad_()
    A, B = torch.randn(r, V, device=device), torch.randn(H, r, device=device)
    ka.LoraEmbedding.apply(x, W, A, B, 0.5, -1, None).sum().backward()
    assert torch.count_nonzero(W.grad[9]) == 0 and torch.count_nonzero(W.grad[3]) == H


def test_star_import_does_not_need_torch_for_autograd():
    assert "autograd" not in kerf.__all__  # `from kerf import *` would import it (and need PyTorch)


@STEP_HOOKS
@pytest.mark.parametrize("device", DEVICES)
def test_norm_cache_copies_start_empty_inference_mode_is_not_cached_dead_entries_go(device):
    import copy
    import pickle
    torch.manual_seed(13)
    W, A, B = torch.randn(6, 8, device=device), torch.randn(2, 8, device=device), torch.randn(6, 2, device=device)
    cache = ka.DoraNormCache()
    cache.norm(W, A, B, 0.5)
    assert len(cache) == 1
    for clone in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert isinstance(clone, ka.DoraNormCache) and len(clone) == 0
        clone.norm(W, A, B, 0.5)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        opt.step()  # any optimizer's step empties a copy (the global hook)
        assert len(clone) == 0
        clone.close()
    cache.norm(W, A, B, 0.5)  # the steps above emptied the original too (its hook is the global one)
    assert len(cache) == 1
    with torch.inference_mode():
        Wi = torch.randn(6, 8, device=device)
        n = cache.norm(Wi, A, B, 0.5)
    assert len(cache) == 1  # computed, not kept
    torch.testing.assert_close(n, torch.linalg.norm(Wi + 0.5 * B @ A, dim=1), rtol=1e-5, atol=1e-6)
    for _ in range(5):
        cache.norm(W.t().t(), A, B, 0.5)  # a fresh view each time: misses, the dead ones dropped
    assert len(cache) <= 2
    cache.close()


def test_dora_weight_norm_refuses_a_b_that_is_not_a_matrix():
    W, A = torch.randn(4, 6), torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"dora_weight_norm: B must be \[out, r\], got shape \[\]"):
        ka.dora_weight_norm(W, A, torch.tensor(1.0), 0.5)  # was an IndexError from B.shape[0]
