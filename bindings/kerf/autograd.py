"""torch.autograd.Function wrappers of kerf's ops (needs PyTorch).

- :func:`dora_scale` / :class:`DoraScale`: ``scale = m / ||W + s * B @ A||_row``
  with the norm detached as in PEFT (DoRA paper section 4.3): the gradient
  reaches ``m`` only (``grad_m = grad_scale / norm``); W, A and B get none
  through the norm. Where kerf._torch_bridge is built, :func:`dora_scale`
  records that gradient as a graph node written in C++
  (``kerf::DoraScale``) rather than through :class:`DoraScale`, whose
  Python forward and context cost about ten microseconds per call.
- :class:`DoraNormCache`: reuses norms between optimizer steps and drops them
  on every step (an ``Optimizer.register_step_post_hook``), fused AdamW's
  included; writes outside a step need its ``invalidate()``.
- :func:`moe_lora_materialize` / :class:`MoeLoraMaterialize`:
  ``W_eff[e] = W[e] + s * B[e] @ A[e]``, gradients for A and B (and for W
  when it requires one); :func:`moe_lora_materialize_peft` takes PEFT's flat
  ``lora_A [r*E, K]`` / ``lora_B [N, r*E]``.
- :func:`lora_embedding` / :class:`LoraEmbedding`: ``W[x] + s * A^T[x] @ B^T``,
  optionally DoRA-scaled (PEFT's embedding DoRA: the norm over the vocabulary).

Backward passes are kerf's backward ops (moe_lora_materialize_backward,
lora_embedding_backward, dora_norm_backward in :class:`DoraScale`); the DoRA
magnitude gradient of the C++ node (one division), the DoRA embedding's
magnitude gradient and rescaling, and a trainable base weight's gradient are
PyTorch code. Under ``create_graph=True`` (second derivatives) the backward
passes run as PyTorch ops instead, which record the history kerf's kernels do
not.

kerf's kernels compute in float32 at most: float64 tensors (``gradcheck``)
are given to kerf as float32 and the results cast back, so forward and
backward are float32-accurate (gradcheck then needs a larger eps and float32
tolerances), except the DoRA magnitude's path, which is exact in float64 for
the norm kerf computed.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Dict, Optional, Tuple

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised on machines without torch
    raise ImportError("kerf.autograd needs PyTorch (kerf.ops works without it)") from e

import torch.nn.functional as F

from . import _kerf
from . import ops as _ops

__all__ = [
    "DoraNormCache",
    "DoraScale",
    "LoraEmbedding",
    "MoeLoraMaterialize",
    "dora_scale",
    "dora_weight_norm",
    "lora_embedding",
    "moe_lora_materialize",
    "moe_lora_materialize_peft",
]

Tensor = torch.Tensor


def _expect_tensors(op: str, **named: Any) -> None:
    """TypeError naming the op and argument for anything that is not a torch.Tensor."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


# Tensors kerf reads in place as they are: it records no autograd history, so a plain
# tensor that requires grad needs no detach() (a dispatcher call and a new tensor each).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _for_kerf(t: Tensor) -> Tensor:
    """The tensor kerf reads: float64 becomes float32 (kerf has no float64 kernels);
    subclasses are detached (they cross through DLPack, whose export refuses a
    tensor that requires grad)."""
    if t.dtype == torch.float64:
        return t.detach().float()
    return t if type(t) in _PLAIN_TENSORS else t.detach()


def _dense_grad(g: Tensor) -> Tensor:
    """Gradients of sums arrive expanded (stride 0): give kerf real memory."""
    return g.contiguous() if 0 in g.stride() else g


# ---------------------------------------------------------------- DoRA
def _dora_norm_and_scale(W: Tensor, A: Tensor, B: Tensor, m: Tensor, s: float, eps: float):
    """kerf's (norm, m / norm) for a dense W, or for a bitsandbytes 4-bit weight
    (a Params4bit with its quant_state: QLoRA), dequantized in registers."""
    if getattr(W, "quant_state", None) is not None:  # any tensor may carry one, not only Params4bit
        return _ops.dora_norm_4bit(A=_for_kerf(A), B=_for_kerf(B), m=_for_kerf(m), s=float(s), eps=float(eps),
                                   **_ops.bnb_weight4bit(W))
    return _ops.dora_norm(_for_kerf(W), _for_kerf(A), _for_kerf(B), _for_kerf(m), float(s), eps=float(eps))


def dora_weight_norm(W: Tensor, A: Tensor, B: Tensor, s: float, eps: float = 0.0) -> Tensor:
    """``||W + s * B @ A||`` per output row (float32, no gradient): PEFT's ``get_weight_norm``
    computed from the factors, without materializing ``B @ A``. W may be a
    bitsandbytes 4-bit weight (its quant_state is read; nothing is dequantized
    into memory)."""
    _expect_tensors("dora_weight_norm", W=W, A=A, B=B)
    if B.dim() != 2:
        raise ValueError(f"dora_weight_norm: B must be [out, r], got shape {list(B.shape)}")
    # The op also produces m / norm; a ones magnitude keeps that output harmless.
    m = torch.ones(B.shape[0], dtype=torch.float32, device=B.device)
    norm, _ = _dora_norm_and_scale(W, A, B, m, s, eps)
    return norm


def _scale_from_norm(m: Tensor, norm: Tensor) -> Tensor:
    # m / norm with the norm a constant: autograd gives grad_m = grad_scale / norm.
    if m.dtype in (torch.float32, torch.float64):
        return m / norm.to(m.dtype)
    return (m.float() / norm).to(m.dtype)


class DoraScale(torch.autograd.Function):
    """``scale = m / ||W + s * B @ A||_row``, the norm detached (PEFT semantics).

    ``DoraScale.apply(W, A, B, m, s, eps)``; prefer :func:`dora_scale`.
    """

    @staticmethod
    def forward(ctx: Any, W: Tensor, A: Tensor, B: Tensor, m: Tensor, s: float, eps: float = 0.0) -> Tensor:
        norm, scale = _dora_norm_and_scale(W, A, B, m, s, eps)
        ctx.save_for_backward(norm)
        ctx.m_dtype = m.dtype
        if m.dtype == torch.float32:
            return scale
        if m.dtype == torch.float64:
            return m.detach() / norm.double()  # exact in float64 for the given norm (gradcheck)
        return scale.to(m.dtype)

    @staticmethod
    def backward(ctx: Any, grad_scale: Tensor):
        (norm,) = ctx.saved_tensors
        grad_m = None
        if ctx.needs_input_grad[3]:
            if grad_scale.dtype == torch.float64:  # gradcheck: exact in float64
                grad_m = grad_scale / norm.double()
            elif torch.is_grad_enabled():  # create_graph=True: a differentiable grad_m (double backward)
                grad_m = (grad_scale.float() / norm).to(ctx.m_dtype)
            else:  # kerf's ops::dora_norm_backward: grad_m = grad_scale / norm
                g = _dense_grad(grad_scale)
                if g.dtype == ctx.m_dtype:  # grad_m allocated by the binding, in g's dtype
                    grad_m = _ops.dora_norm_backward(norm, g)
                else:
                    grad_m = torch.empty(norm.shape, dtype=ctx.m_dtype, device=norm.device)
                    _ops.dora_norm_backward(norm, g, grad_m=grad_m)
        # No gradient reaches W, A or B through the detached norm (DoRA section 4.3).
        return None, None, None, grad_m, None, None


def dora_scale(
    W: Tensor,
    A: Tensor,
    B: Tensor,
    m: Tensor,
    s: float,
    eps: float = 0.0,
    *,
    cache: Optional["DoraNormCache"] = None,
) -> Tensor:
    """DoRA's ``mag_norm_scale = m / ||W + s * B @ A||_row`` (shape [out], m's dtype).

    Differentiable in ``m`` only, like PEFT (the norm is detached). With
    ``cache`` the norm is reused until the next optimizer step. W may be a
    bitsandbytes 4-bit weight (QLoRA + DoRA): kerf reads its packed codes and
    quant_state and never builds the 16-bit weight.
    """
    _expect_tensors("dora_scale", W=W, A=A, B=B, m=m)
    if cache is not None:
        return cache.scale(W, A, B, m, s, eps)
    if _scale_with_grad is not None and type(m) in _PLAIN_TENSORS and m.dtype in _HALF_OR_FLOAT:
        # The same function, its history recorded by kerf._torch_bridge's C++ node
        # (kerf::DoraScale) instead of DoraScale's Python one.
        norm, scale = _dora_norm_and_scale(W, A, B, m, s, eps)
        return _scale_with_grad(m, norm, scale)
    return DoraScale.apply(W, A, B, m, float(s), float(eps))


def _load_scale_with_grad():
    """kerf._torch_bridge's dora_scale_with_grad where kerf._kerf uses the bridge, else None
    (not built, built for another torch or kerf, or turned off with KERF_TORCH_BRIDGE=0:
    kerf._kerf._torch_bridge_status() says which)."""
    if not _kerf._torch_bridge_status().startswith("active"):
        return None
    from . import _torch_bridge

    return getattr(_torch_bridge, "dora_scale_with_grad", None)


_scale_with_grad = _load_scale_with_grad()
_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _fingerprint(t: Tensor) -> Tuple[Any, ...]:
    return (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


class DoraNormCache:
    """Reuses DoRA weight norms between optimizer steps.

    The norm ``||W + s * B @ A||`` changes only when W, A or B change, which in
    training happens in ``optimizer.step()``. The cache is emptied after every
    step by an ``Optimizer.register_step_post_hook`` it installs on the
    optimizers you give it, or, when you give none, by a global hook on every
    optimizer (``torch.optim.optimizer.register_optimizer_step_post_hook``).
    Neither ``data_ptr()`` nor ``tensor._version`` alone is trusted:
    ``AdamW(fused=True).step()`` and ``p.data.add_()`` leave both unchanged.
    They are still checked, so an entry also dies when a tensor is replaced or
    bumped by an ordinary in-place op.

    Writing weights outside an optimizer step (``p.data.copy_(...)``,
    ``load_state_dict``), or a step of an optimizer the cache is not attached
    to, needs an explicit :meth:`invalidate`. Entries are keyed by the tensor
    objects: a view or cast made anew each forward (``W.T``, ``W.to(dtype)``)
    never hits, and entries of tensors that died are dropped. Under
    ``torch.inference_mode()`` (or for inference tensors) norms are computed and
    not cached. A copy (``copy.deepcopy``, pickling a module that holds one)
    starts empty, emptied after every optimizer's step. Needs PyTorch 2.0 or
    later (the step hooks): on an older one it raises
    :class:`kerf.NotAvailableError`.

    Useful with gradient accumulation or activation checkpointing, where the
    same layer runs several forwards per step::

        cache = kerf.autograd.DoraNormCache(optimizer)
        scale = kerf.autograd.dora_scale(W, A, B, m, s, cache=cache)
    """

    def __init__(self, *optimizers: "torch.optim.Optimizer") -> None:
        self._norms: Dict[Tuple[Any, ...], Tuple[Tuple[Any, ...], Tuple[Any, ...], Tensor]] = {}
        self._handles: list = []
        # Without step hooks (PyTorch < 2.0) nothing would empty the cache: refuse.
        if not hasattr(torch.optim.Optimizer, "register_step_post_hook"):
            raise _kerf.NotAvailableError(
                "kerf.autograd.DoraNormCache needs PyTorch >= 2.0 (Optimizer.register_step_post_hook, "
                f"which empties it after every step); this is torch {torch.__version__}")
        self.hits = 0
        self.misses = 0
        me = weakref.ref(self)

        def on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            cache = me()
            if cache is not None:
                cache.invalidate()

        self._on_step = on_step
        if optimizers:
            for opt in optimizers:
                self.attach(opt)
        else:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(on_step))

    def attach(self, optimizer: "torch.optim.Optimizer") -> "DoraNormCache":
        """Empty the cache after every ``optimizer.step()`` (also of further optimizers)."""
        self._handles.append(optimizer.register_step_post_hook(self._on_step))
        return self

    def invalidate(self) -> None:
        """Forget every cached norm (call it after writing weights outside an optimizer step)."""
        self._norms.clear()

    def close(self) -> None:
        """Remove the hooks and empty the cache."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.invalidate()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __len__(self) -> int:
        return len(self._norms)

    # Its hooks belong to the optimizers of the original: a copy starts empty, with the global
    # hook (emptied after every optimizer's step), and pickles as such.
    def __reduce__(self):
        return (DoraNormCache, ())

    def __copy__(self) -> "DoraNormCache":
        return DoraNormCache()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "DoraNormCache":
        return DoraNormCache()

    def norm(self, W: Tensor, A: Tensor, B: Tensor, s: float, eps: float = 0.0) -> Tensor:
        """The (detached, float32) norm, cached until the next optimizer step.

        The tensor returned is the cached one, shared by every hit: read it, do not
        modify it in place (a copy, ``.clone()``, is yours to change)."""
        _expect_tensors("DoraNormCache.norm", W=W, A=A, B=B)
        if torch.is_inference_mode_enabled() or any(t.is_inference() for t in (W, A, B)):
            # An inference tensor would be served to a later training forward, which cannot
            # save it for backward; nor do inference tensors keep a version counter.
            return dora_weight_norm(W, A, B, s, eps)
        key = (id(W), id(A), id(B), float(s), float(eps))
        prints = (_fingerprint(W), _fingerprint(A), _fingerprint(B))
        entry = self._norms.get(key)
        if entry is not None:
            refs, old_prints, norm = entry
            if all(r() is t for r, t in zip(refs, (W, A, B))) and old_prints == prints:
                self.hits += 1
                return norm
        self.misses += 1
        norm = dora_weight_norm(W, A, B, s, eps)
        # Entries of tensors that died go now: their ids may come back for other tensors.
        for k in [k for k, (refs, _, _) in self._norms.items() if any(r() is None for r in refs)]:
            del self._norms[k]
        self._norms[key] = ((weakref.ref(W), weakref.ref(A), weakref.ref(B)), prints, norm)
        return norm

    def scale(self, W: Tensor, A: Tensor, B: Tensor, m: Tensor, s: float, eps: float = 0.0) -> Tensor:
        """``m / norm`` with the cached norm; differentiable in ``m``."""
        return _scale_from_norm(m, self.norm(W, A, B, s, eps))


# ---------------------------------------------------------------- MoE LoRA materialization
def _moe_backward(dW: Tensor, A: Tensor, B: Tensor, s: float, need_a: bool, need_b: bool):
    """dA[e] = s * B[e]^T @ dW[e], dB[e] = s * dW[e] @ A[e]^T (kerf, fp32 accumulation)."""
    if not (need_a or need_b):
        return None, None
    dA, dB = _ops.moe_lora_materialize_backward(_for_kerf(_dense_grad(dW)), _for_kerf(A), _for_kerf(B), s)
    return (dA.to(A.dtype) if need_a else None), (dB.to(B.dtype) if need_b else None)


class MoeLoraMaterialize(torch.autograd.Function):
    """``W_eff[e] = W[e] + s * B[e] @ A[e]`` with A [E, r, K], B [E, N, r] (any strides).

    Backward: ``dA[e] = s * B[e]^T dW_eff[e]``, ``dB[e] = s * dW_eff[e] A[e]^T``;
    W gets ``dW_eff`` when it requires a gradient (a frozen base never does).
    """

    @staticmethod
    def forward(ctx: Any, W: Tensor, A: Tensor, B: Tensor, s: float) -> Tensor:
        ctx.s = float(s)
        ctx.save_for_backward(A, B)
        if W.dtype == torch.float64:
            return _ops.moe_lora_materialize(_for_kerf(W), _for_kerf(A), _for_kerf(B), ctx.s).double()
        return _ops.moe_lora_materialize(W.detach(), _for_kerf(A), _for_kerf(B), ctx.s)

    @staticmethod
    def backward(ctx: Any, dW: Tensor):
        A, B = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the same products in PyTorch, so that they have a history
            # (kerf's kernels give none, and second derivatives would lose their terms).
            dt = torch.promote_types(torch.promote_types(dW.dtype, A.dtype), torch.float32)
            g = dW.to(dt)
            dA = (ctx.s * B.to(dt).transpose(1, 2) @ g).to(A.dtype) if ctx.needs_input_grad[1] else None
            dB = (ctx.s * g @ A.to(dt).transpose(1, 2)).to(B.dtype) if ctx.needs_input_grad[2] else None
        else:
            dA, dB = _moe_backward(dW, A, B, ctx.s, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (dW if ctx.needs_input_grad[0] else None), dA, dB, None


def moe_lora_materialize(W: Tensor, A: Tensor, B: Tensor, s: float) -> Tensor:
    """Differentiable ``W_eff[e] = W[e] + s * B[e] @ A[e]`` (A [E, r, K], B [E, N, r])."""
    _expect_tensors("moe_lora_materialize", W=W, A=A, B=B)
    return MoeLoraMaterialize.apply(W, A, B, float(s))


def moe_lora_materialize_peft(W: Tensor, lora_A: Tensor, lora_B: Tensor, s: float) -> Tensor:
    """:func:`moe_lora_materialize` on PEFT's ParamWrapper layout.

    W [E, N, K]; ``lora_A [r*E, K]`` (rows expert-major: row e*r + j);
    ``lora_B [N, r*E]`` (columns rank-major, expert fastest: column j*E + e).
    Both are viewed, not copied; their gradients come back in the same layout.
    """
    op = "moe_lora_materialize_peft"
    _expect_tensors(op, W=W, lora_A=lora_A, lora_B=lora_B)
    if W.dim() != 3:
        raise ValueError(f"{op}: W must be [E, N, K], got shape {list(W.shape)}")
    E, N, K = W.shape
    if E == 0:
        raise ValueError(f"{op}: W has no experts (E = 0): lora_A's rank cannot be read from its rows")
    if lora_A.dim() != 2 or lora_A.shape[0] % E != 0 or lora_A.shape[1] != K:
        raise ValueError(f"{op}: lora_A must be [r*E, K] = [r*{E}, {K}], got shape {list(lora_A.shape)}")
    r = lora_A.shape[0] // E
    if lora_B.dim() != 2 or tuple(lora_B.shape) != (N, r * E):
        raise ValueError(f"{op}: lora_B must be [N, r*E] = [{N}, {r * E}] (lora_A gives r = {r}), "
                         f"got shape {list(lora_B.shape)}")
    A3 = lora_A.view(E, r, K)
    B3 = lora_B.view(N, r, E).permute(2, 0, 1)
    return moe_lora_materialize(W, A3, B3, s)


# ---------------------------------------------------------------- LoRA embedding
def _table_rows(g: Tensor, xf: Tensor, padding_idx: Optional[int], by_freq: bool, vocab: int) -> Tensor:
    """The rows of ``g`` [T, n] as F.embedding's backward adds them into its table at ids
    ``xf``: none at padding_idx, each divided by its id's count with scale_grad_by_freq."""
    if padding_idx is not None:
        g = g.masked_fill((xf == padding_idx)[:, None], 0)
    if by_freq:
        xl = xf.long()  # int32 ids index a tensor only from torch 2.0 on
        g = g / torch.bincount(xl, minlength=vocab)[xl].to(g.dtype)[:, None]
    return g


def _version_of(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


class LoraEmbedding(torch.autograd.Function):
    """``pre = W[x] + s * A^T[x] @ B^T``; ``out = pre``, or ``(m / n) * pre`` with a DoRA
    magnitude m [H] and ``n = ||W^T + s * B @ A||`` over the vocabulary (detached).

    x int [...]; W [V, H]; A [r, V]; B [H, r] (PEFT's lora_embedding_A/B). Backward:
    ``dA[:, v] = s * sum_{x[t]=v} g'[t] @ B`` (none at padding_idx),
    ``dB = s * g'^T @ A^T[x]``, ``dm = sum_t g * pre / n``, with ``g' = g * m / n``
    (``g`` without DoRA); W gets ``index_add(x, g')`` only when it requires a gradient.
    The output has the half dtype W, A and B share, else float32 (float64 when they are
    float64, computed in float32). The lookup, the A/B
    gradients (ops::lora_embedding, ops::lora_embedding_backward) and the norm
    (dora_norm on the strided view W^T) are kerf's. When B needs a gradient the
    forward also writes the activations ``A^T[x]`` (``after_a``, [*x.shape, r]) and
    the backward reads them instead of gathering A's columns again.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, A: Tensor, B: Tensor, s: float, padding_idx: Optional[int],
                m: Optional[Tensor], id_check: str = "sync", scale_grad_by_freq: bool = False) -> Tensor:
        same_half = W.dtype == A.dtype == B.dtype and W.dtype in (torch.float16, torch.bfloat16)
        dt = W.dtype if same_half else torch.promote_types(torch.promote_types(W.dtype, A.dtype), torch.float32)
        if padding_idx is not None and padding_idx < 0:  # as F.embedding: counted from the end
            padding_idx += W.shape[0]
        ctx.s, ctx.padding_idx, ctx.vocab, ctx.id_check = float(s), padding_idx, W.shape[0], id_check
        ctx.by_freq = bool(scale_grad_by_freq)
        ctx.dtypes = (W.dtype, A.dtype, B.dtype, None if m is None else m.dtype)
        out = torch.empty(*x.shape, W.shape[1], dtype=torch.float32 if dt == torch.float64 else dt,
                          device=W.device)
        # B's gradient needs the activations A[:, x[t]]: written by the forward (PEFT keeps
        # its after_A too) so that the backward reads them by token instead of gathering.
        act = None
        if ctx.needs_input_grad[3]:
            a_kerf = _for_kerf(A)
            act = torch.empty(*x.shape, A.shape[0], dtype=a_kerf.dtype, device=A.device)
        pre = _ops.lora_embedding(x.detach(), _for_kerf(W), _for_kerf(A), _for_kerf(B), float(s), out=out,
                                  id_check=id_check, after_a=act).to(dt)
        ctx.act = act
        if m is None:
            ctx.save_for_backward(x, A, B)
            return pre
        # n[h] = ||W[:, h] + s * (B @ A)[h, :]|| over the vocabulary: kerf's dora_norm on the view W^T.
        n = dora_weight_norm(W.t(), A, B, s).to(dt)
        ms = m.detach().to(dt) / n
        ctx.save_for_backward(x, A, B, pre, n, ms)
        # W and m only for second derivatives (create_graph=True), kept as they are: not saved
        # tensors, so a frozen or inference-mode W works, as in PEFT, which saves nothing of W.
        # Their versions stand in for a saved tensor's check: that backward recomputes from them.
        ctx.W, ctx.m = W, m
        ctx.versions = (_version_of(W), _version_of(m))
        return pre * ms

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        x, A, B, *dora = ctx.saved_tensors
        s, (w_dtype, a_dtype, b_dtype, m_dtype) = ctx.s, ctx.dtypes
        # As F.embedding(x, table, padding_idx, scale_grad_by_freq=...) differentiates its table.
        table_grad = {"padding_idx": ctx.padding_idx, "scale_grad_by_freq": ctx.by_freq}
        dt = torch.promote_types(grad.dtype, torch.float32)
        H, T = grad.shape[-1], x.numel()
        g = grad.reshape(T, H).to(dt)  # by T, not -1: H may be 0
        dm = dW = dA = dB = None
        if dora:
            pre, n, ms = dora
            W, m = ctx.W, ctx.m
            if torch.is_grad_enabled():  # create_graph=True: pre and m / n with their history
                for name, t, then in (("W", W, ctx.versions[0]), ("magnitude", m, ctx.versions[1])):
                    if then is not None and _version_of(t) != then:
                        raise RuntimeError(
                            f"kerf.autograd.lora_embedding: {name} was modified by an inplace operation "
                            f"after the forward (version {then} then, {_version_of(t)} now), and a backward "
                            "with create_graph=True computes from it")
                pre = (F.embedding(x, W.to(dt), **table_grad) +
                       s * (F.embedding(x, A.to(dt).t(), **table_grad) @ B.to(dt).t()))
                ms = m.to(dt) / n.to(dt)
            if ctx.needs_input_grad[6]:
                dm = ((g * pre.reshape(T, H).to(dt)).sum(0) / n.to(dt)).to(m_dtype)  # out = m * pre / n
            g = g * ms.to(dt)
        if (ctx.needs_input_grad[2] or ctx.needs_input_grad[3]) and torch.is_grad_enabled():
            # create_graph=True: the same sums in PyTorch, which keep a history (kerf's do not).
            xf = x.reshape(-1)
            At, Bt = A.to(dt), B.to(dt)
            gp = _table_rows(g, xf, ctx.padding_idx, ctx.by_freq, ctx.vocab)
            if ctx.needs_input_grad[2]:
                dA = (ctx.s * torch.zeros(A.shape[1], A.shape[0], dtype=dt, device=g.device)
                      .index_add(0, xf, gp @ Bt)).t().to(a_dtype)
            if ctx.needs_input_grad[3]:
                # The activations as a lookup that, differentiated again, passes no gradient to
                # A's padding column (and divides by the counts), as PEFT's F.embedding does.
                dB = (ctx.s * g.t() @ F.embedding(xf, At.t(), **table_grad)).to(b_dtype)
            ctx.act = None
        elif ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            gA, gB = _ops.lora_embedding_backward(x.detach(), _for_kerf(A), _for_kerf(B),
                                                  _for_kerf(g).reshape(*x.shape, H), s, padding_idx=ctx.padding_idx,
                                                  scale_grad_by_freq=ctx.by_freq, id_check=ctx.id_check,
                                                  after_a=ctx.act)
            ctx.act = None
            dA = gA.to(a_dtype) if ctx.needs_input_grad[2] else None
            dB = gB.to(b_dtype) if ctx.needs_input_grad[3] else None
        if ctx.needs_input_grad[1]:  # a trainable base weight (PEFT freezes it)
            xf = x.reshape(-1)
            # padding_idx is in [0, V): the forward counted a negative one from the end.
            g = _table_rows(g, xf, ctx.padding_idx, ctx.by_freq, ctx.vocab)
            dW = torch.zeros(ctx.vocab, H, dtype=dt, device=g.device).index_add_(0, xf, g).to(w_dtype)
        return None, dW, dA, dB, None, None, dm, None, None


def lora_embedding(
    x: Tensor,
    W: Tensor,
    A: Tensor,
    B: Tensor,
    s: float,
    *,
    padding_idx: Optional[int] = None,
    magnitude: Optional[Tensor] = None,
    id_check: str = "sync",
    scale_grad_by_freq: bool = False,
) -> Tensor:
    """LoRA embedding lookup ``W[x] + s * A^T[x] @ B^T`` (in the half dtype W, A and B share, else
    float32, or float64 for float64 inputs), DoRA-scaled by
    ``magnitude / ||W^T + s * B @ A||`` when a magnitude [H] is given (PEFT's DoraEmbedding).

    x int [...]; W [V, H]; A = lora_embedding_A [r, V]; B = lora_embedding_B [H, r].
    An id outside [0, V) raises ValueError; on CUDA, ``id_check="deferred"`` keeps
    the forward and backward asynchronous and leaves the report to
    :func:`kerf.ops.check_embedding_ids` (e.g. once per training step).
    ``padding_idx`` and ``scale_grad_by_freq`` as :func:`torch.nn.functional.embedding`
    (PEFT passes the base layer's): no gradient for the padding row, and each row's
    gradient divided by its id's count in x. x may have any shape (a single id too).
    """
    _expect_tensors("lora_embedding", x=x, W=W, A=A, B=B, **({} if magnitude is None else {"magnitude": magnitude}))
    if W.dim() != 2:
        raise ValueError(f"lora_embedding: W must be [V, H], got shape {list(W.shape)}")
    vocab, dim = W.shape
    if padding_idx is not None:
        # As torch.nn.functional.embedding: within [-V, V), a negative one counting from the end.
        if isinstance(padding_idx, bool) or not hasattr(type(padding_idx), "__index__"):
            raise TypeError(f"lora_embedding: padding_idx must be an int, got {type(padding_idx).__name__}")
        padding_idx = operator.index(padding_idx)  # a NumPy or torch integer too
        if not -vocab <= padding_idx < vocab:
            raise ValueError(f"lora_embedding: padding_idx must be within [-{vocab}, {vocab}) "
                             f"(W has {vocab} rows), got {padding_idx}")
    if magnitude is not None and tuple(magnitude.shape) != (dim,):
        raise ValueError(f"lora_embedding: magnitude must be [H] = [{dim}] (one per column of W), "
                         f"got shape {list(magnitude.shape)}")
    # Ids of any layout, as F.embedding takes them: kerf's op wants token dims that flatten
    # to one (a contiguous copy of the ids where they do not; ids are small) and at least one dim.
    ids = x if x.is_contiguous() else x.contiguous()
    out = LoraEmbedding.apply(ids.reshape(1) if ids.dim() == 0 else ids, W, A, B, float(s), padding_idx, magnitude,
                              id_check, bool(scale_grad_by_freq))
    return out.reshape(dim) if ids.dim() == 0 else out
