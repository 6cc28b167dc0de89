"""kerf's operations on tensors of any DLPack framework.

Every op takes tensors as PyTorch tensors, NumPy/CuPy/JAX arrays, kerf.Buffer
objects or raw DLPack capsules, all on one device, and never copies them:
kerf reads and writes the caller's memory in place (strides are honoured).

Outputs: pass ``out=``-style arguments to have kerf write into tensors you
own; the ones you leave out are allocated on the inputs' device by the
inputs' library (torch.empty for torch, numpy.empty for NumPy) or as a
:class:`kerf.Buffer` (CuPy, JAX, capsules; ``cupy.from_dlpack(buf)`` etc.
view it without a copy).

Streams: on CUDA an op is queued on ``stream`` (an int CUstream, a
torch.cuda.Stream, a CuPy stream or any object with ``__cuda_stream__``);
by default on PyTorch's current stream of the device for torch tensors, on
CuPy's current stream for CuPy arrays, else on the legacy default stream. The
call returns once the work is queued. On the CPU the op runs (on all cores)
before the call returns.

Sharding: ops that take ``layout=`` receive each operand's local shard and a
dict like ``{"mesh": {"tp": 4}, "specs": {"W": (None, "tp"), "A": (None, "tp")}}``
(a spec is a jax.sharding.PartitionSpec, or a tuple or list like one: per
dimension an axis name, None, or a tuple of names for a dimension split over
several axes, major to minor, as ``("dp", "tp")``; ``"coords"``: this device's
coordinate per mesh axis where an op needs it). See docs/ops.md.
The specs name each op's operands, outputs too (allocated ones included):

- dora_norm: W (out, in), A (r, in), B (out, r), m, norm, scale (out); "out" local.
- dora_norm_partial: W, A, B, sumsq (out); "in" split: sumsq is a partial sum.
- dora_norm_finish: sumsq, m, norm, scale; dora_norm_backward: norm, grad_scale, grad_m.
- moe_lora_materialize: W, W_eff (E, N, K), A (E, r, K), B (E, N, r).
- moe_lora_materialize_backward: dW_eff (E, N, K), A, dA (E, r, K), B, dB (E, N, r);
  dA is a partial sum over N's axis, dB over K's.
- lora_embedding: x (x0, ...), weight (vocab, dim), A (r, vocab), B (dim, r),
  out (x0, ..., dim), after_a (x0, ..., r); out is a partial sum over the vocab axis.
- lora_embedding_backward: x, A, B, grad_out, grad_A (r, vocab), grad_B (dim, r),
  after_a; grad_B is a partial sum over vocab and token axes, grad_A over token and
  dim axes. (The forward's "weight" and "out" are not its operands.)

These functions are not differentiable: ``kerf.autograd`` wraps them in
torch.autograd.Function objects.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from . import _kerf
from ._kerf import Config

#: Anything kerf takes as a tensor: torch.Tensor, numpy.ndarray, a CuPy or JAX
#: array, kerf.Buffer, any object with __dlpack__, or a DLPack capsule.
TensorLike = Any
#: None, an int CUstream, torch.cuda.Stream, cupy.cuda.Stream, or an object with __cuda_stream__.
StreamLike = Any
#: None or {"mesh": {axis: size}, "specs": {operand: (axis, None or (axis, ...), ...)}, "coords": [...]}.
LayoutLike = Optional[Dict[str, Any]]

__all__ = [
    "Config",
    "bnb_weight4bit",
    "check_embedding_ids",
    "dora_norm",
    "dora_norm_4bit",
    "dora_norm_backward",
    "dora_norm_finish",
    "dora_norm_partial",
    "layout_text",
    "lora_embedding",
    "lora_embedding_backward",
    "lora_merge",
    "lora_merge_flax",
    "lora_unmerge",
    "lora_unmerge_flax",
    "moe_lora_materialize",
    "moe_lora_materialize_backward",
    "nf4_code",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def _bound(core: Callable[..., Any]) -> Callable[[_F], _F]:
    """The op is ``core``, its binding in kerf._kerf, under the decorated
    function's signature (parameter order, defaults, keyword-only marker),
    name, docstring and module: a call reaches C++ with no Python frame in
    between, which a launch-bound call would notice. The decorated functions
    have no body of their own; importing kerf fails if one's parameters and
    its binding's differ."""

    def bind(python_function: _F) -> _F:
        return _kerf._with_signature(core, python_function)

    return bind


@_bound(_kerf.dora_norm)
def dora_norm(
    W: TensorLike,
    A: TensorLike,
    B: TensorLike,
    m: TensorLike,
    s: float,
    *,
    eps: float = 0.0,
    norm: Optional[TensorLike] = None,
    scale: Optional[TensorLike] = None,
    stream: StreamLike = None,
    config: Optional[Config] = None,
    layout: LayoutLike = None,
) -> Tuple[TensorLike, TensorLike]:
    """DoRA weight norm and magnitude scale, without materializing ``B @ A``.

    ``norm[i] = sqrt(sum_j (W[i, j] + s * (B @ A)[i, j])**2 + eps)`` and
    ``scale[i] = m[i] / norm[i]`` (PEFT's ``get_weight_norm`` and
    ``mag_norm_scale``; eps=0 reproduces PEFT).

    Args:
        W: base weight [out, in], bfloat16/float16/float32.
        A: lora_A weight [r, in] (r <= 256), any of those dtypes.
        B: lora_B weight [out, r], any of those dtypes.
        m: DoRA magnitude [out], any of those dtypes.
        s: LoRA scaling (lora_alpha / r).
        eps: added under the square root (>= 0).
        norm, scale: float32 [out] outputs to write into; allocated when None.
        stream: CUDA stream to run on (see the module docstring).
        config: block sizes (kerf.Config); None lets kerf choose.
        layout: sharding layout (module docstring): W split on "out" is local;
            split on "in" use dora_norm_partial / dora_norm_finish.

    Returns:
        ``(norm, scale)``: the given outputs, or new ones.
    """


@_bound(_kerf.dora_norm_4bit)
def dora_norm_4bit(
    packed: TensorLike,
    absmax: TensorLike,
    A: TensorLike,
    B: TensorLike,
    m: TensorLike,
    s: float,
    *,
    blocksize: int = 64,
    code: Optional[TensorLike] = None,
    eps: float = 0.0,
    norm: Optional[TensorLike] = None,
    scale: Optional[TensorLike] = None,
    stream: StreamLike = None,
    config: Optional[Config] = None,
) -> Tuple[TensorLike, TensorLike]:
    """:func:`dora_norm` of a weight kept as 4-bit codes in blocks (QLoRA +
    DoRA), dequantized in registers: no 16-bit copy of W is ever made.

    The layout is bitsandbytes' (``Linear4bit``, NF4 or FP4): element
    ``f = i * in + j`` of the row-major weight ``[out, in]`` is
    ``code[q] * absmax[f // blocksize]``, with ``q`` the high nibble of
    ``packed[f // 2]`` for even ``f`` and its low nibble for odd ``f``.
    :func:`bnb_weight4bit` reads these from a bitsandbytes weight.

    Args:
        packed: uint8, contiguous, ``out * in / 2`` bytes (any shape; bitsandbytes
            keeps ``[out * in / 2, 1]``). ``out`` is B's rows, ``in`` A's columns
            (even).
        absmax: float32, contiguous, one scale per block of ``blocksize`` elements.
        A, B, m, s, eps, norm, scale, stream, config: as :func:`dora_norm`.
        blocksize: elements per scale, a power of two (bitsandbytes' default 64).
        code: float32 [16], each code's value; None uses NF4's (kerf keeps a copy
            per device).

    The LoRA term is formed on tensor cores in float16 when A and B are
    float16, else in bfloat16 (s*B and A rounded once), accumulating in float32.

    Returns:
        ``(norm, scale)``: the given outputs, or new ones (float32 [out]).
    """


def nf4_code() -> List[float]:
    """The 16 values of QLoRA's 4-bit NormalFloat codes (the ``code`` that
    :func:`dora_norm_4bit` uses when given none)."""
    return _kerf.nf4_code()


def bnb_weight4bit(weight: Any) -> Dict[str, Any]:
    """The 4-bit arrays of a bitsandbytes ``Params4bit`` weight (a QLoRA base
    layer's ``weight``), as keyword arguments of :func:`dora_norm_4bit`:
    ``packed``, ``absmax``, ``code`` and ``blocksize``.

    A nested quant state (``compress_statistics=True``, QLoRA's double
    quantization) keeps absmax itself quantized; it is dequantized here with
    bitsandbytes (a small tensor: one value per block).
    """
    state = getattr(weight, "quant_state", None)
    if state is None:
        raise TypeError("bnb_weight4bit: the weight has no quant_state (not a bitsandbytes 4-bit weight)")
    absmax = state.absmax
    if getattr(state, "nested", False):
        try:
            import bitsandbytes.functional as bnbf
        except ImportError as e:
            raise ImportError("bnb_weight4bit: a nested quant state needs bitsandbytes to dequantize absmax") from e
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    if hasattr(absmax, "float"):
        absmax = absmax.float()
    return {"packed": getattr(weight, "data", weight), "absmax": absmax, "code": state.code,
            "blocksize": int(state.blocksize)}


@_bound(_kerf.moe_lora_materialize)
def moe_lora_materialize(
    W: TensorLike,
    A: TensorLike,
    B: TensorLike,
    s: float,
    *,
    out: Optional[TensorLike] = None,
    stream: StreamLike = None,
    config: Optional[Config] = None,
    layout: LayoutLike = None,
) -> TensorLike:
    """``W_eff[e] = W[e] + s * B[e] @ A[e]`` for every expert of a MoE layer.

    Args:
        W: expert weights [E, N, K], bfloat16/float16/float32.
        A: [E, r, K], any float dtype kerf takes, any strides.
        B: [E, N, r], any strides: PEFT's flat ``lora_B [N, r*E]`` is
            ``lora_B.view(N, r, E).permute(2, 0, 1)`` (no copy).
        s: LoRA scaling.
        out: W_eff [E, N, K] in W's dtype to write into (named W_eff in error
            messages); allocated when None.
            ``out=W`` updates the weights in place.
        stream: CUDA stream to run on.
        config: block sizes (kerf.Config); None lets kerf choose.
        layout: sharding layout (operands W, A, B, W_eff; dims "E", "N", "K",
            "r"): experts, N or K split alike are local.

    Returns:
        W_eff: ``out``, or a new tensor.
    """


@_bound(_kerf.dora_norm_partial)
def dora_norm_partial(W: TensorLike, A: TensorLike, B: TensorLike, s: float, *, sumsq: Optional[TensorLike] = None,
                      stream: StreamLike = None, config: Optional[Config] = None,
                      layout: LayoutLike = None) -> TensorLike:
    """Partial sums of squares of the DoRA norm over this shard's columns:
    ``sumsq[i] = sum_j (W[i, j] + s * (B @ A)[i, j])**2`` (float32 [out]).

    With W and A split on "in", sum ``sumsq`` over that mesh axis (all-reduce),
    then :func:`dora_norm_finish`. Unsharded it is the whole row's sum.
    """


@_bound(_kerf.dora_norm_finish)
def dora_norm_finish(sumsq: TensorLike, m: TensorLike, *, eps: float = 0.0, norm: Optional[TensorLike] = None,
                     scale: Optional[TensorLike] = None, stream: StreamLike = None,
                     layout: LayoutLike = None) -> Tuple[TensorLike, TensorLike]:
    """``norm = sqrt(sumsq + eps)``, ``scale = m / norm`` (float32 [out] each)."""


@_bound(_kerf.dora_norm_backward)
def dora_norm_backward(norm: TensorLike, grad_scale: TensorLike, *, grad_m: Optional[TensorLike] = None,
                       stream: StreamLike = None, layout: LayoutLike = None) -> TensorLike:
    """Backward of ``scale = m / norm`` with the norm a constant (DoRA detaches it):
    ``grad_m = grad_scale / norm`` (grad_m allocated in grad_scale's dtype)."""


@_bound(_kerf.lora_merge)
def lora_merge(W: TensorLike, A: TensorLike, B: TensorLike, s: float, *, stream: StreamLike = None,
               config: Optional[Config] = None) -> TensorLike:
    """In place ``W <- W + s * B @ A`` (one pass, the sum formed in float32 and rounded
    once); returns W. W [out, in], A [r, in], B [out, r], any strides (PEFT's
    fan_in_fan_out weight is the view ``W.T``); A and B must not overlap W."""


@_bound(_kerf.lora_unmerge)
def lora_unmerge(W: TensorLike, A: TensorLike, B: TensorLike, s: float, *, stream: StreamLike = None,
                 config: Optional[Config] = None) -> TensorLike:
    """In place ``W <- W - s * B @ A``; returns W. Merge then unmerge gives W back
    within rounding of its dtype."""


@_bound(_kerf.lora_merge_flax)
def lora_merge_flax(kernel: TensorLike, lora_a: TensorLike, lora_b: TensorLike, s: float, *,
                    stream: StreamLike = None, config: Optional[Config] = None) -> TensorLike:
    """MaxText/Flax layout, in place: ``kernel <- kernel + s * einsum("i...r,ro...->i...o...", lora_a, lora_b)``.

    kernel [in..., out...], lora_a [in..., r], lora_b [r, out...]; returns kernel."""


@_bound(_kerf.lora_unmerge_flax)
def lora_unmerge_flax(kernel: TensorLike, lora_a: TensorLike, lora_b: TensorLike, s: float, *,
                      stream: StreamLike = None, config: Optional[Config] = None) -> TensorLike:
    """The inverse of :func:`lora_merge_flax` (subtracts); returns kernel."""


@_bound(_kerf.moe_lora_materialize_backward)
def moe_lora_materialize_backward(dW_eff: TensorLike, A: TensorLike, B: TensorLike, s: float, *,
                                  dA: Optional[TensorLike] = None, dB: Optional[TensorLike] = None,
                                  stream: StreamLike = None, config: Optional[Config] = None,
                                  layout: LayoutLike = None) -> Tuple[TensorLike, TensorLike]:
    """Backward of :func:`moe_lora_materialize` (no gradient for W):
    ``dA[e] = s * B[e]^T @ dW_eff[e]`` [E, r, K], ``dB[e] = s * dW_eff[e] @ A[e]^T`` [E, N, r].

    dA and dB (allocated in A's and B's dtypes when None) are overwritten and may
    be strided views (PEFT's flat layouts); they must not overlap the inputs."""


@_bound(_kerf.lora_embedding)
def lora_embedding(x: TensorLike, weight: TensorLike, A: TensorLike, B: TensorLike, s: float, *,
                   out: Optional[TensorLike] = None, padding_idx: Optional[int] = None,
                   scale_grad_by_freq: bool = False, stream: StreamLike = None,
                   config: Optional[Config] = None, layout: LayoutLike = None,
                   id_check: str = "sync", after_a: Optional[TensorLike] = None,
                   vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> TensorLike:
    """``out[t] = weight[x[t]] + s * A[:, x[t]] @ B^T`` (PEFT's layout).

    x int32/int64 ids (any shape of at least one dimension); weight [vocab, dim]; A = lora_embedding_A
    [r, vocab]; B = lora_embedding_B [dim, r]; out [*x.shape, dim] (allocated in
    the inputs' dtype when they agree, else float32). An id outside [0, vocab)
    raises ValueError and is never read: on the CPU before anything is written
    (out untouched), on CUDA after the kernel (its row of out is zeros). On CUDA,
    ``id_check="sync"`` (the default) waits for the kernel to say so at once;
    ``"deferred"`` returns as soon as the work is queued and leaves the report
    to :func:`check_embedding_ids` (as a call captured into a CUDA graph does:
    it cannot wait). padding_idx (checked here too) / scale_grad_by_freq only
    matter to the backward. ``after_a`` [*x.shape, r] (any float dtype), when
    given, is written with the activations ``A[:, x[t]]`` (PEFT's ``after_A``)
    for :func:`lora_embedding_backward` (in a layout: operand "after_a", split as x).
    ``vocab_start``, ``vocab_size`` (together, with a layout that splits "vocab"):
    this shard holds ids ``[vocab_start, vocab_start + vocab)`` of ``vocab_size``,
    for shards of unequal sizes (``torch.chunk``, ``np.array_split``); without them
    shard c of n holds ``[c * vocab, (c + 1) * vocab)`` (even splits, needs coords).
    """


@_bound(_kerf.lora_embedding_backward)
def lora_embedding_backward(x: TensorLike, A: TensorLike, B: TensorLike, grad_out: TensorLike, s: float, *,
                            grad_A: Optional[TensorLike] = None, grad_B: Optional[TensorLike] = None,
                            padding_idx: Optional[int] = None, scale_grad_by_freq: bool = False,
                            stream: StreamLike = None, config: Optional[Config] = None,
                            layout: LayoutLike = None, id_check: str = "sync",
                            after_a: Optional[TensorLike] = None, vocab_start: Optional[int] = None,
                            vocab_size: Optional[int] = None) -> Tuple[TensorLike, TensorLike]:
    """Gradients of A and B for :func:`lora_embedding` given grad_out [*x.shape, dim]
    (the base weight gets none): ``grad_A[:, v] = s * sum_{x[t]=v} grad_out[t] @ B``
    (none at padding_idx; divided by v's count with scale_grad_by_freq),
    ``grad_B = s * sum_t grad_out[t]^T A[:, x[t]]^T``; allocated in A's and B's dtypes.
    id_check as in :func:`lora_embedding`. ``after_a``: the forward's activations
    (written by :func:`lora_embedding`), read by token instead of gathered from A's
    columns by id (faster on a GPU; they must be what A held at the forward). With the
    vocabulary split, a shard counts the rows of ids outside its range as zeros: its own
    forward's after_a or their sum over shards give the same gradients. vocab_start,
    vocab_size: a shard of its own size, as in :func:`lora_embedding`."""


def layout_text(layout: LayoutLike) -> str:
    """The canonical text of a sharding layout (``layout=`` of the ops): the same
    for layouts that mean the same thing, ``""`` when nothing is split, e.g.
    ``"mesh(tp=4) A[,tp] W[,tp]"``. kerf keys a sharded call's kernels by it, and
    ``kerf-cache warm --layout`` takes it to warm them. A mesh axis without a name, of
    size below 1 or named twice, or a spec naming an axis the mesh lacks, is a
    ValueError, as the ops say."""
    return _kerf._layout_text(layout)


@_bound(_kerf.check_embedding_ids)
def check_embedding_ids(tensor: TensorLike, *, stream: StreamLike = None) -> None:
    """Raises ValueError when a CUDA :func:`lora_embedding` or
    :func:`lora_embedding_backward` call with ``id_check="deferred"`` on
    ``tensor``'s device and ``stream`` (by default the current one, as for the
    ops) met an id outside the vocabulary since the last check, then clears
    that record; then the same for calls captured into CUDA graphs on that
    device (their launches record into one record of the device's; synchronize
    the stream a graph ran on first). Waits for the stream; refused while the
    stream captures a graph. Does nothing for CPU tensors, whose ids are
    checked before each call."""
