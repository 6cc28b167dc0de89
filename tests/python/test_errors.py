"""C++ errors arrive as ValueError / TypeError / RuntimeError with kerf's message."""

import sys

import numpy as np
import pytest

import kerf
from dlpack_ctypes import kDLCUDA, capsule


def dora_inputs(out=8, inn=16, r=2, dtype=np.float32):
    return (np.ones((out, inn), dtype), np.ones((r, inn), np.float32), np.ones((out, r), np.float32),
            np.ones(out, np.float32))


def test_a_shape_mismatch_is_a_value_error_naming_the_op_and_argument(kerf_cpu):
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match=r"dora_norm: A must have shape \[\*, 16\], got \[2, 15\]") as e:
        kerf_cpu.ops.dora_norm(W, A[:, :15], B, m, 1.0)
    assert isinstance(e.value, kerf.InvalidArgumentError) and isinstance(e.value, kerf.Error)
    with pytest.raises(ValueError, match="W_eff must have shape"):
        kerf_cpu.ops.moe_lora_materialize(np.ones((2, 4, 4), np.float32), np.ones((2, 1, 4), np.float32),
                                          np.ones((2, 4, 1), np.float32), 1.0, out=np.ones((2, 4, 5), np.float32))


def test_a_wrong_dtype_is_a_type_error(kerf_cpu):
    W, A, B, m = dora_inputs(dtype=np.float64)
    with pytest.raises(TypeError, match=r"dora_norm: W must be one of \{bf16, f16, f32\}, got f64") as e:
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0)
    assert isinstance(e.value, kerf.DTypeError)
    W, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match="norm must be one of"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0, norm=np.empty(8, np.float64))
    with pytest.raises(TypeError, match="W_eff must be one of"):
        kerf_cpu.ops.moe_lora_materialize(np.ones((1, 2, 2), np.float32), np.ones((1, 1, 2), np.float32),
                                          np.ones((1, 2, 1), np.float32), 1.0, out=np.empty((1, 2, 2), np.float16))


def test_dtypes_kerf_has_no_kernels_for_are_type_errors():
    with pytest.raises(TypeError, match="int16"):
        kerf.ops.dora_norm(np.ones((2, 2), np.int16), *dora_inputs(2, 2, 1)[1:], 1.0)
    # uint8 crosses (packed 4-bit weights), but an op that wants floats says so.
    with pytest.raises(TypeError, match="W must be one of .*got u8"):
        kerf.ops.dora_norm(np.ones((2, 2), np.uint8), *dora_inputs(2, 2, 1)[1:], 1.0)
    with pytest.raises(TypeError, match="complex"):
        kerf.ops.dora_norm(np.ones((2, 2), np.complex64), *dora_inputs(2, 2, 1)[1:], 1.0)


@pytest.mark.parametrize("bad", [None, [[1.0]], "W", 3.0])
def test_something_that_is_not_a_tensor_is_a_type_error_naming_the_argument(bad):
    _, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match="dora_norm: W"):
        kerf.ops.dora_norm(bad, A, B, m, 1.0)


def test_a_rank_kerf_does_not_support_is_a_value_error(kerf_cpu):
    W, A, B, m = dora_inputs(8, 16, 257)
    with pytest.raises(ValueError, match="rank 257 is above the supported 256"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0)
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match="eps must be >= 0"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0, eps=float("nan"))


def test_tensors_on_different_devices_are_refused_before_any_launch():
    W, A, B, m = dora_inputs()
    # A CUDA capsule over host memory: kerf must refuse the mix before touching it.
    fake_cuda_A = capsule(A, device=(kDLCUDA, 0))
    with pytest.raises(ValueError, match="A is on cuda:0 but W is on cpu"):
        kerf.ops.dora_norm(W, fake_cuda_A, B, m, 1.0, norm=np.empty(8, np.float32), scale=np.empty(8, np.float32))


def test_cuda_tensors_without_a_driver_are_a_runtime_error_saying_so():
    if kerf.cuda_available():
        pytest.skip("a CUDA driver is present")
    caps = [capsule(x, device=(kDLCUDA, 0)) for x in dora_inputs()]
    with pytest.raises(RuntimeError, match="no CUDA driver") as e:
        kerf.ops.dora_norm(*caps, 1.0)
    assert isinstance(e.value, kerf.NotAvailableError)


def test_bad_streams_are_refused():
    W, A, B, m = dora_inputs()
    caps = [capsule(x, device=(kDLCUDA, 0)) for x in (W, A, B, m)]
    with pytest.raises(TypeError, match="stream must be"):
        kerf.ops.dora_norm(*caps, 1.0, stream="fast")
    with pytest.raises(ValueError, match="CUstream handle"):
        kerf.ops.dora_norm(*caps, 1.0, stream=-5)


def test_errors_leave_the_inputs_untouched_and_kerf_usable(kerf_cpu):
    W, A, B, m = dora_inputs()
    keep = [x.copy() for x in (W, A, B, m)]
    with pytest.raises(ValueError):
        kerf_cpu.ops.dora_norm(W, A, B[:4], m, 1.0)
    for x, k in zip((W, A, B, m), keep):
        np.testing.assert_array_equal(x, k)
    norm, _ = kerf_cpu.ops.dora_norm(W, A, B, m, 1.0)
    np.testing.assert_allclose(norm, np.full(8, np.sqrt(16 * 9.0)), rtol=1e-6)


def test_a_config_that_is_not_a_kerf_config_is_a_type_error():
    W, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match="config must be a kerf.Config or None, got dict"):
        kerf.ops.dora_norm(W, A, B, m, 1.0, config={"block_m": 16})
    with pytest.raises(TypeError, match="config must be a kerf.Config or None, got int"):
        kerf.ops.lora_merge(W, A, B, 1.0, config=3)


def test_int_and_bool_options_refuse_what_is_not_one_and_name_the_argument(kerf_cpu):
    x = np.array([1, 2, 3], np.int64)
    W = np.random.rand(10, 4).astype(np.float32)
    A, B = np.random.rand(2, 10).astype(np.float32), np.random.rand(4, 2).astype(np.float32)
    g = np.random.rand(3, 4).astype(np.float32)
    for bad in ("a", 1.5, True):
        with pytest.raises(TypeError, match="lora_embedding\\(\\): padding_idx must be an int, got"):
            kerf_cpu.ops.lora_embedding(x, W, A, B, 1.0, padding_idx=bad)
    with pytest.raises(ValueError, match="padding_idx must fit in 64 bits"):
        kerf_cpu.ops.lora_embedding(x, W, A, B, 1.0, padding_idx=2**70)
    kerf_cpu.ops.lora_embedding(x, W, A, B, 1.0, padding_idx=np.int64(3))  # NumPy ints are ints
    with pytest.raises(TypeError, match="scale_grad_by_freq must be a bool, got str"):
        kerf_cpu.ops.lora_embedding_backward(x, A, B, g, 1.0, scale_grad_by_freq="no")
    kerf_cpu.ops.lora_embedding_backward(x, A, B, g, 1.0, scale_grad_by_freq=np.bool_(True))
    for flag in (1, 0, np.int64(1)):  # a flag written as 0 or 1
        kerf_cpu.ops.lora_embedding_backward(x, A, B, g, 1.0, scale_grad_by_freq=flag)
    with pytest.raises(ValueError, match=r"scale_grad_by_freq must be a bool \(or 0 or 1\), got 2"):
        kerf_cpu.ops.lora_embedding_backward(x, A, B, g, 1.0, scale_grad_by_freq=2)
    with pytest.raises(ValueError, match="a mesh axis size must fit in 64 bits"):
        kerf_cpu.ops.dora_norm(*dora_inputs(), 1.0, layout={"mesh": {"tp": 2**63}, "specs": {}})


def test_an_output_kerf_would_make_with_too_many_dims_is_refused_naming_it(kerf_cpu):
    x = np.zeros([1] * 8, np.int64)
    W, A, B = np.random.rand(4, 3).astype(np.float32), np.random.rand(2, 4).astype(np.float32), \
        np.random.rand(3, 2).astype(np.float32)
    with pytest.raises(ValueError, match="lora_embedding: out would have 9 dims, and kerf's tensors have at most 8"):
        kerf_cpu.ops.lora_embedding(x, W, A, B, 1.0)


def test_a_config_tile_that_is_not_a_power_of_two_is_a_value_error(kerf_cpu):
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match="Config.block_m must be a power of two up to 1024"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 1.0, config=kerf.Config(block_m=3))


@pytest.mark.parametrize("layout,message", [
    ({"mesh": [("tp",)], "specs": {}}, r"mesh entries must be \(axis name, size\) pairs"),
    ({"mesh": {"tp": "2"}, "specs": {}}, "a mesh axis size must be an int, got str"),
    ({"mesh": {"tp": 2}, "specs": {"W": "tp"}}, "the spec of W must be a jax.sharding.PartitionSpec or a tuple"),
    ({"mesh": {"tp": 2}, "specs": {"W": (1, None)}}, "an entry of W's spec must be an axis name"),
    ({"mesh": {"tp": 2, "dp": 2}, "specs": {"W": (None, ("tp", None))}},
     "each axis in an entry of W's spec must be an axis name \\(str\\), got NoneType"),
    ({"mesh": {"tp": 2}, "specs": {"W": (None, "tp")}, "coords": 1}, "coords must be a list"),
    ([("tp", 2)], "layout must be None or a dict"),
])
def test_a_malformed_layout_is_a_type_error_saying_what_was_expected(layout, message):
    W, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match=message):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout=layout)


class PartitionSpec:
    """A stand-in for jax.sharding.PartitionSpec as newer JAX has it: a sequence, no tuple,
    with the axes it leaves unreduced."""

    def __init__(self, *entries, unreduced=()):
        self._entries = entries
        self.unreduced = frozenset(unreduced)

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]


class Unconstrained:
    def __repr__(self):
        return "UNCONSTRAINED"


def swapped_axes_layout(P):
    return {"mesh": {"tp": 2, "dp": 2}, "specs": {"W": P(None, ("dp", "tp")), "A": P(None, ("tp", "dp"))}}


SWAPPED_AXES = r"A P\(None, \('tp', 'dp'\)\) and W P\(None, \('dp', 'tp'\)\) split dimension 'in'"


def test_a_partition_spec_that_is_no_tuple_is_read_as_one():
    # The layout check reads the specs (and refuses the swapped axis order) before anything runs.
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match=SWAPPED_AXES):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout=swapped_axes_layout(PartitionSpec))
    mesh = {"tp": 2, "dp": 2}
    with pytest.raises(ValueError, match=r"the spec of W has unreduced axes frozenset\(\{'dp'\}\); kerf's layouts "
                                         "take no unreduced operands"):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout={"mesh": mesh, "specs": {"W": PartitionSpec(None, "tp",
                                                                                                     unreduced=("dp",))}})
    with pytest.raises(TypeError, match=r"an entry of W's spec must be an axis name \(str\), a tuple of axis names "
                                        r"or None, got UNCONSTRAINED \(kerf needs each dimension's split"):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout={"mesh": mesh, "specs": {"W": PartitionSpec(None,
                                                                                                     Unconstrained())}})
    # Other sequences are not specs: a str is no tuple of its letters, a mapping no tuple of its keys.
    import collections
    for spec in ("tp", collections.OrderedDict([(None, 0), ("tp", 1)]), collections.UserString("tp")):
        with pytest.raises(TypeError, match="the spec of W must be a jax.sharding.PartitionSpec or a tuple"):
            kerf.ops.dora_norm_partial(W, A, B, 1.0, layout={"mesh": mesh, "specs": {"W": spec}})


def test_a_partition_spec_is_known_by_its_class_where_jax_sharding_is_imported(monkeypatch):
    # Newer JAX names the class P: an instance of jax.sharding.PartitionSpec is a spec
    # whatever its class is called.
    import types

    class P(PartitionSpec):
        pass

    fake = types.ModuleType("jax.sharding")
    fake.PartitionSpec = P
    monkeypatch.setitem(sys.modules, "jax.sharding", fake)
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match=SWAPPED_AXES):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout=swapped_axes_layout(P))


def test_layout_text_is_the_text_sharded_kernels_are_keyed_by():
    # What kerf-cache warm --layout takes: the same for layouts that mean the same.
    tp = {"mesh": {"tp": 4, "dp": 2}, "specs": {"W": (None, "tp"), "A": [None, "tp", None], "m": None}}
    assert kerf.ops.layout_text(tp) == "mesh(tp=4) A[,tp] W[,tp]"
    assert kerf.ops.layout_text(None) == ""
    assert kerf.ops.layout_text({"mesh": {"tp": 1}, "specs": {"W": ("tp",)}}) == ""
    both = {"mesh": [("tp", 4), ("dp", 2)], "specs": {"weight": (("dp", "tp"),)}}
    assert kerf.ops.layout_text(both) == "mesh(dp=2,tp=4) weight[(dp,tp)]"
    with pytest.raises(TypeError, match="layout must be None or a dict"):
        kerf.ops.layout_text([("tp", 2)])
    # Layouts every op refuses have no text (it would not parse back for kerf-cache warm).
    for (mesh, spec), message in ((({"t p": 2}, ("t p",)), "mesh axis name 't p' holds one of"),
                                  (({"tp": -2}, ("tp",)), "mesh axis 'tp' must have size >= 1, got -2"),
                                  (({}, ("zz",)), "names mesh axis 'zz', which the mesh lacks")):
        with pytest.raises(ValueError, match=message):
            kerf.ops.layout_text({"mesh": mesh, "specs": {"W": spec}})


def test_jax_partition_specs_are_taken_as_they_are():
    P = pytest.importorskip("jax.sharding").PartitionSpec
    W, A, B, m = dora_inputs()
    with pytest.raises(ValueError, match=SWAPPED_AXES):
        kerf.ops.dora_norm_partial(W, A, B, 1.0, layout=swapped_axes_layout(P))


@pytest.mark.parametrize("stream,error,message", [
    ("x", TypeError, "stream must be None, an int CUstream handle"),
    (2.5, TypeError, "got float"),
    (-1, ValueError, r"an int >= 0\), got -1"),
    (1 << 70, ValueError, "does not fit in 64 bits"),
    (True, TypeError, "got bool"),
    (np.int64(-1), ValueError, r"an int >= 0\), got -1"),  # NumPy ints are ints
])
def test_a_stream_that_is_not_one_is_refused_even_on_the_cpu(stream, error, message):
    W, A, B, m = dora_inputs()
    with pytest.raises(error, match=message):
        kerf.ops.dora_norm(W, A, B, m, 1.0, stream=stream)


def test_core_functions_take_arguments_like_python_functions_and_say_what_is_wrong():
    # kerf._kerf's ops parse their own arguments (METH_FASTCALL): positional or by
    # name, with the signature inspect and help() show, and Python's own messages.
    import inspect

    core = kerf._kerf
    sig = inspect.signature(core.dora_norm)
    assert list(sig.parameters) == ["W", "A", "B", "m", "s", "norm", "scale", "eps", "stream", "config", "layout"]
    assert sig.parameters["layout"].default is None
    assert sig.parameters["W"].default is inspect.Parameter.empty
    assert "kerf.ops.dora_norm" in core.dora_norm.__doc__
    with pytest.raises(TypeError, match=r"dora_norm\(\) missing required argument 'A'"):
        core.dora_norm(1)
    with pytest.raises(TypeError, match=r"dora_norm\(\) got an unexpected keyword argument 'bogus'"):
        core.dora_norm(1, 2, 3, 4, 0.5, None, None, 0.0, None, None, bogus=1)
    with pytest.raises(TypeError, match=r"dora_norm\(\) got multiple values for argument 'W'"):
        core.dora_norm(1, W=1)
    with pytest.raises(TypeError, match=r"dora_norm\(\) takes at most 11 arguments \(12 given\)"):
        core.dora_norm(*range(12))
    W, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match=r"dora_norm\(\): s must be a float, got str"):
        core.dora_norm(W, A, B, m, "0.5", None, None, 0.0, None, None)
    with pytest.raises(TypeError, match=r"dora_norm_4bit\(\): blocksize must be an int, got float"):
        core.dora_norm_4bit(W, A, None, 64.0, A, B, m, 0.5, None, None, 0.0, None, None)


def test_core_functions_take_keywords_in_any_order(kerf_cpu):
    W, A, B, m = dora_inputs()
    by_position = kerf_cpu._kerf.dora_norm(W, A, B, m, 0.5, None, None, 0.0, None, None)
    by_name = kerf_cpu._kerf.dora_norm(layout=None, config=None, stream=None, eps=0.0, scale=None, norm=None,
                                       s=0.5, m=m, B=B, A=A, W=W)
    np.testing.assert_array_equal(np.asarray(by_position[0]), np.asarray(by_name[0]))
    np.testing.assert_array_equal(np.asarray(by_position[1]), np.asarray(by_name[1]))
    # A kerf error from inside still arrives as its own class.
    with pytest.raises(ValueError, match=r"dora_norm: A must have shape") as e:
        kerf_cpu._kerf.dora_norm(W, A[:, :15], B, m, 0.5, None, None, 0.0, None, None)
    assert isinstance(e.value, kerf.InvalidArgumentError)


def test_ops_are_their_bindings_under_the_documented_signatures():
    # kerf.ops' functions are kerf._kerf's bindings called with the Python
    # declarations' signatures: keyword-only parameters refuse positions, the
    # docstring and module are the declaration's, and they pickle by name.
    import inspect
    import pickle

    f = kerf.ops.dora_norm
    assert repr(f) == "<built-in function dora_norm>"
    assert f.__module__ == "kerf.ops"
    assert "DoRA weight norm" in f.__doc__
    sig = inspect.signature(f)
    assert list(sig.parameters)[:6] == ["W", "A", "B", "m", "s", "eps"]
    assert sig.parameters["eps"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["eps"].default == 0.0
    assert sig.parameters["s"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert pickle.loads(pickle.dumps(f)) is f
    W, A, B, m = dora_inputs()
    with pytest.raises(TypeError, match=r"dora_norm\(\) takes at most 5 positional arguments \(6 given\)"):
        f(W, A, B, m, 0.5, 1e-6)
    with pytest.raises(TypeError, match=r"dora_norm\(\) missing required argument 's'"):
        f(W, A, B, m, eps=1e-6)
    for name in set(kerf.ops.__all__) - {"Config"}:
        assert getattr(kerf.ops, name).__module__ == "kerf.ops", name


def test_a_declaration_that_does_not_match_its_binding_is_refused():
    core = kerf._kerf

    def lora_merge(W, A, B, t, *, stream=None, config=None):
        """declares t where the binding takes s"""

    with pytest.raises(ValueError, match=r"lora_merge declares 't', which lora_merge does not take"):
        core._with_signature(core.lora_merge, lora_merge)

    def short(W, A, B, s, *, stream=None):
        """leaves out config"""

    with pytest.raises(ValueError, match=r"short does not declare 'config', which lora_merge takes"):
        core._with_signature(core.lora_merge, short)

    def variadic(W, A, B, s, *args, stream=None, config=None):
        """*args has no binding parameter"""

    with pytest.raises(ValueError, match=r"parameter 'args' must be positional-or-keyword or keyword-only"):
        core._with_signature(core.lora_merge, variadic)
    with pytest.raises(TypeError, match=r"core must be a function of kerf._kerf"):
        core._with_signature(print, short)

    def reordered(B, A, W, s, *, config=None, stream=None):
        """the binding's parameters in another order"""

    merge = core._with_signature(core.lora_merge, reordered)
    assert merge.__name__ == "reordered" and merge.__doc__.endswith("the binding's parameters in another order")


@pytest.mark.parametrize("s", [float("inf"), float("-inf"), float("nan")])
def test_a_scale_that_is_not_finite_is_a_value_error_and_writes_nothing(kerf_cpu, s):
    W, A, B, m = dora_inputs()
    before = W.copy()
    with pytest.raises(ValueError, match="lora_merge: s must be finite"):
        kerf_cpu.ops.lora_merge(W, A, B, s)
    assert np.array_equal(W, before)
    with pytest.raises(ValueError, match="dora_norm: s must be finite"):
        kerf_cpu.ops.dora_norm(W, A, B, m, s)


def test_a_scale_beyond_float32_is_a_value_error_and_writes_nothing(kerf_cpu):
    # Finite as a double, inf as the float the kernels compute in: NaN everywhere before.
    W, A, B, m = dora_inputs()
    before = W.copy()
    for s in (1e39, -1e300):
        with pytest.raises(ValueError, match="lora_merge: s must be within float32's range"):
            kerf_cpu.ops.lora_merge(W, A, B, s)
    with pytest.raises(ValueError, match=r"lora_merge\(\): s is an int too large for a double"):
        kerf_cpu.ops.lora_merge(W, A, B, 10**400)
    assert np.array_equal(W, before)
    with pytest.raises(ValueError, match="dora_norm: eps must be within float32's range"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, eps=1e39)
    with pytest.raises(ValueError, match="dora_norm: eps must be >= 0, got -1e-30"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, eps=-1e-30)
    # Positive, yet 0 as a float32: a zero row would get scale = inf, not m / sqrt(eps).
    with pytest.raises(ValueError, match=r"dora_norm: eps 1e-50 is below float32's smallest positive value"):
        kerf_cpu.ops.dora_norm(W, A, B, m, 0.5, eps=1e-50)


def test_a_config_compares_copies_and_pickles_by_value():
    import copy
    import pickle
    c = kerf.Config(block_m=16, num_stages=2, meta={"EVICT": 1})
    assert c == kerf.Config(block_m=16, num_stages=2, meta={"EVICT": 1})
    assert c != kerf.Config(block_m=16, num_stages=2)
    assert c != "not a config"
    for twin in (copy.copy(c), copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert twin == c and twin is not c
        assert dict(twin.meta) == {"EVICT": 1}
    with pytest.raises(TypeError):
        hash(c)  # mutable and compared by value, as a dict


def test_config_fields_and_meta_are_checked_by_name():
    c = kerf.Config(block_m=np.int64(32), meta={"EVICT": np.int32(1)})  # NumPy ints are ints
    assert c.block_m == 32 and dict(c.meta) == {"EVICT": 1}
    with pytest.raises(ValueError, match="Config: block_m must fit in 64 bits"):
        kerf.Config(block_m=2**70)
    with pytest.raises(TypeError, match="Config: num_warps must be an int, got bool"):
        kerf.Config(num_warps=True)
    with pytest.raises(TypeError, match=r"Config: meta\['EVICT'\] must be an int, got str"):
        kerf.Config(meta={"EVICT": "a"})
    with pytest.raises(TypeError, match="Config: meta's names must be str, got int"):
        kerf.Config(meta={1: 2})
    with pytest.raises(TypeError, match="Config: meta must be a dict of str names to ints, got list"):
        kerf.Config(meta=[1])
    with pytest.raises(TypeError, match="Config: block_k must be an int, got str"):
        c.block_k = "x"
    with pytest.raises(TypeError, match="Config: meta's names must be str"):
        c.meta = {2: 1}
    c.num_stages = 2
    assert c == kerf.Config(block_m=32, num_stages=2, meta={"EVICT": 1})


def test_a_config_or_scale_of_the_wrong_kind_is_a_type_error_naming_the_op(kerf_cpu):
    W, A, B = np.ones((2, 4), np.float32), np.ones((1, 4), np.float32), np.ones((2, 1), np.float32)
    with pytest.raises(TypeError, match="lora_merge: config must be a kerf.Config or None, got dict"):
        kerf_cpu.ops.lora_merge(W, A, B, 0.5, config={"block_m": 64})
    with pytest.raises(TypeError, match=r"lora_merge\(\): s must be a float, got bool"):
        kerf_cpu.ops.lora_merge(W, A, B, True)
    assert (W == 1.0).all()


def test_a_config_deeper_than_any_kernel_is_refused_before_anything_runs(kerf_cpu):
    dW = np.random.rand(2, 5, 7).astype(np.float32)
    A, B = np.random.rand(2, 3, 7).astype(np.float32), np.random.rand(2, 5, 3).astype(np.float32)
    dA = np.full((2, 3, 7), 7.0, np.float32)
    with pytest.raises(ValueError, match="Config.num_stages must be at most 8"):
        kerf_cpu.ops.moe_lora_materialize_backward(dW, A, B, 0.5, dA=dA, config=kerf.Config(num_stages=9))
    assert (dA == 7.0).all()  # not zeroed by a first launch
