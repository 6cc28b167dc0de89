// kerf.ops in C++. Each op converts its tensors in the order it reads them
// (tensor_bridge.h), allocates the outputs it was not given in the caller's
// library, and runs the C++ op without the GIL. Binding a new op is one def_fast
// here (m.def's arguments; fast_call.h says why not m.def), its documented
// declaration in kerf/ops.py (decorated @_bound: kerf.ops' function is this
// binding under that signature) and its line in kerf/_kerf.pyi.
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kerf/error.h"
#include "kerf/ops/ops.h"
#include "fast_call.h"
#include "module.h"
#include "tensor_bridge.h"

namespace kerf::python {

namespace {

// Config.meta from Python: a mapping of str names to ints (TypeError / ValueError naming the
// entry otherwise).
std::map<std::string, int64_t> meta_of(py::handle meta) {
  if (!PyDict_Check(meta.ptr()) &&
      !py::isinstance(meta, py::module_::import("collections.abc").attr("Mapping")))
    throw TypeError("Config: meta must be a dict of str names to ints, got " + type_name(meta));
  std::map<std::string, int64_t> out;
  for (const py::handle key : meta) {
    if (!PyUnicode_Check(key.ptr()))
      throw TypeError("Config: meta's names must be str, got " + type_name(key));
    const std::string name = key.cast<std::string>();
    out[name] = fast_call::int_argument(meta[key].ptr(), "Config: meta['" + name + "']");
  }
  return out;
}

// The config= argument: None, or a kerf.Config. Taken as a handle so that the
// common None costs no lookup of the Config type (a typed argument does one per call).
ops::Config config_of(py::handle c, const char* op) {
  if (c.is_none()) return ops::Config{};
  if (!py::isinstance<ops::Config>(c))
    throw TypeError(std::string(op) + ": config must be a kerf.Config or None, got " +
                    type_name(c));
  return c.cast<ops::Config>();
}

std::string config_repr(const ops::Config& c) {
  std::string meta;
  for (const auto& [name, value] : c.meta)
    meta += (meta.empty() ? "" : ", ") + ("'" + name + "': ") + std::to_string(value);
  return "kerf.Config(block_m=" + std::to_string(c.block_m) +
         ", block_k=" + std::to_string(c.block_k) + ", split_k=" + std::to_string(c.split_k) +
         ", num_warps=" + std::to_string(c.num_warps) +
         ", num_stages=" + std::to_string(c.num_stages) + (meta.empty() ? "" : ", meta={" + meta + "}") + ")";
}

void bind_config(py::module_& m) {
  py::class_<ops::Config> config(m, "Config", R"doc(
Block sizes and launch shape of an op, and further meta-parameters by name. An
empty Config (or none) lets the autotuner choose on a GPU; a Config with any
field or meta entry set is the caller's choice for the call, which is then not
tuned, its zero fields taking the op's own values.
)doc");
  config.def(py::init([](py::handle block_m, py::handle block_k, py::handle split_k,
                         py::handle num_warps, py::handle num_stages, py::handle meta) {
               ops::Config c;
               c.block_m = fast_call::int_argument(block_m.ptr(), "Config: block_m");
               c.block_k = fast_call::int_argument(block_k.ptr(), "Config: block_k");
               c.split_k = fast_call::int_argument(split_k.ptr(), "Config: split_k");
               c.num_warps = fast_call::int_argument(num_warps.ptr(), "Config: num_warps");
               c.num_stages = fast_call::int_argument(num_stages.ptr(), "Config: num_stages");
               c.meta = meta_of(meta);
               return c;
             }),
             py::kw_only(), py::arg("block_m") = 0, py::arg("block_k") = 0, py::arg("split_k") = 0,
             py::arg("num_warps") = 0, py::arg("num_stages") = 0, py::arg("meta") = py::dict());
  // The int fields: read as ints, set through int_argument (TypeError or ValueError naming the
  // field).
  using Field = int64_t ops::Config::*;
  for (const auto& [name, field, doc] :
       {std::tuple<const char*, Field, const char*>{
            "block_m", &ops::Config::block_m,
            "Rows per program (BLOCK_N for MoE, tokens for the embedding)."},
        {"block_k", &ops::Config::block_k, "Columns per step."},
        {"split_k", &ops::Config::split_k,
         "Programs sharing one row block's columns (DoRA norm, merge, MoE, embedding)."},
        {"num_warps", &ops::Config::num_warps, "GPU threads per program / 32."},
        {"num_stages", &ops::Config::num_stages,
         "Software-pipelining depth of the GPU kernels' loads."}})
    config.def_property(
        name, [f = field](const ops::Config& c) { return c.*f; },
        [f = field, what = std::string("Config: ") + name](ops::Config& c, py::handle v) {
          c.*f = fast_call::int_argument(v.ptr(), what);
        },
        doc);
  config
      .def_property(
          "meta",
          [](const ops::Config& c) {
            return py::module_::import("types").attr("MappingProxyType")(py::cast(c.meta));
          },
          [](ops::Config& c, py::handle meta) { c.meta = meta_of(meta); },
          "Further meta-parameters by name, e.g. {'ROTATE': 1} (MoE and embedding backward), "
          "{'WARPS_N': 2}, {'L2_PREFETCH': 128} (docs/ops.md lists them per op); an op refuses "
          "names it does not take. Read-only as read (a mapping proxy); assign a whole dict: "
          "config.meta = {**config.meta, 'EVICT': 1}.")
      .def("__repr__", &config_repr)
      // Equal when every field and meta entry is; copies and pickles carry them all
      // (a Config inside a deepcopied or pickled training setup).
      .def("__eq__",
           [](const ops::Config& a, py::handle b) -> py::object {
             if (!py::isinstance<ops::Config>(b))
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             const ops::Config& c = b.cast<const ops::Config&>();
             return py::bool_(a.block_m == c.block_m && a.block_k == c.block_k &&
                              a.split_k == c.split_k && a.num_warps == c.num_warps &&
                              a.num_stages == c.num_stages && a.meta == c.meta);
           })
      .def("__copy__", [](const ops::Config& c) { return c; })
      .def(
          "__deepcopy__", [](const ops::Config& c, py::handle) { return c; }, py::arg("memo"))
      .def(py::pickle(
          [](const ops::Config& c) {
            return py::make_tuple(c.block_m, c.block_k, c.split_k, c.num_warps, c.num_stages, c.meta);
          },
          [](const py::tuple& t) {
            if (t.size() != 6)
              throw InvalidArgument("kerf.Config: a pickled state of 6 fields was expected");
            ops::Config c;
            c.block_m = t[0].cast<int64_t>();
            c.block_k = t[1].cast<int64_t>();
            c.split_k = t[2].cast<int64_t>();
            c.num_warps = t[3].cast<int64_t>();
            c.num_stages = t[4].cast<int64_t>();
            c.meta = t[5].cast<std::map<std::string, int64_t>>();
            return c;
          }));
  config.attr("__hash__") = py::none();  // mutable, compared by value: not hashable (as a dict)
}

// What a tensor looks like to kerf, for tests and debugging.
py::dict view_info(py::handle obj, py::handle stream) {
  const TensorView v = view_of(obj, stream);
  py::dict d;
  d["data_ptr"] = py::int_(reinterpret_cast<uintptr_t>(v.data));
  d["dtype"] = std::string(dtype_name(v.dtype));
  d["shape"] = std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.rank);
  d["strides"] = std::vector<int64_t>(v.strides.begin(), v.strides.begin() + v.rank);
  d["device"] = v.device.str();
  return d;
}

// A sharding layout from Python: None, or a dict
//   {"mesh": {"tp": 4} or [("tp", 4), ...], "specs": {"W": (None, "tp"), ...}, "coords": [c, ...]}
// (specs as jax.sharding.PartitionSpec entries: an axis name, a tuple of axis names
// (a dimension split over several axes, major to minor) or None per dimension;
// a spec of None is an unsplit operand). Anything else is a TypeError saying what was expected.
std::string layout_axis_name(py::handle h, const std::string& what) {
  if (!PyUnicode_Check(h.ptr()))
    throw TypeError("layout: " + what + " must be an axis name (str), got " + type_name(h));
  return h.cast<std::string>();
}

int64_t layout_int(py::handle h, const std::string& what) {
  return fast_call::int_argument(h.ptr(), "layout: " + what);
}

bool layout_sequence(py::handle h) {
  return PyList_Check(h.ptr()) || PyTuple_Check(h.ptr());
}

// A jax.sharding.PartitionSpec (newer JAX releases make it no tuple, and name its class
// P): an instance of the class where JAX is imported, else a class named so.
bool jax_partition_spec(py::handle h) {
  if (PyObject* sharding = PyDict_GetItemString(PyImport_GetModuleDict(), "jax.sharding")) {  // borrowed
    const py::object cls = py::getattr(py::handle(sharding), "PartitionSpec", py::none());
    if (!cls.is_none() && PyType_Check(cls.ptr())) {
      const int is = PyObject_IsInstance(h.ptr(), cls.ptr());
      if (is < 0) throw py::error_already_set();
      if (is) return true;
    }
  }
  return std::string(Py_TYPE(h.ptr())->tp_name).find("PartitionSpec") != std::string::npos;
}

// The axes a PartitionSpec leaves unreduced or reduced (newer JAX: partial sums): kerf's
// layouts have no such operands, so a spec naming any is refused rather than read as
// replicated.
void expect_no_reduced_axes(py::handle spec, const std::string& operand) {
  for (const char* attr : {"unreduced", "reduced"}) {
    if (!py::hasattr(spec, attr)) continue;
    const py::object axes = spec.attr(attr);
    if (!axes.is_none() && py::len(axes) > 0)
      throw InvalidArgument("layout: the spec of " + operand + " has " + attr + " axes " +
                            std::string(py::repr(axes)) + "; kerf's layouts take no " + attr +
                            " operands (an op's partial sums are its outputs, summed by the caller)");
  }
}

ops::Layout layout_of(py::handle obj) {
  ops::Layout layout;
  if (!obj || obj.is_none()) return layout;
  if (!py::isinstance<py::dict>(obj))
    throw TypeError("layout must be None or a dict with 'mesh', 'specs' and optionally 'coords', got " +
                    type_name(obj));
  const py::dict d = py::reinterpret_borrow<py::dict>(obj);
  for (const auto& [key, value] : d) {
    const std::string k = py::str(key);
    if (k == "mesh") {
      if (py::isinstance<py::dict>(value)) {
        for (const auto& [axis, size] : py::reinterpret_borrow<py::dict>(value))
          layout.mesh.push_back({layout_axis_name(axis, "a mesh axis"), layout_int(size, "a mesh axis size")});
      } else if (layout_sequence(value)) {
        for (const py::handle axis : value) {
          if (!layout_sequence(axis) || py::len(axis) != 2)
            throw TypeError("layout: mesh entries must be (axis name, size) pairs, got " + std::string(py::repr(axis)));
          const py::sequence pair = py::reinterpret_borrow<py::sequence>(axis);
          layout.mesh.push_back({layout_axis_name(pair[0], "a mesh axis"), layout_int(pair[1], "a mesh axis size")});
        }
      } else {
        throw TypeError("layout: mesh must be a dict {axis: size} or a list of (axis, size) pairs, got " +
                        type_name(value));
      }
    } else if (k == "specs") {
      if (!py::isinstance<py::dict>(value))
        throw TypeError("layout: specs must be a dict {operand: spec}, got " + type_name(value));
      for (const auto& [name, spec] : py::reinterpret_borrow<py::dict>(value)) {
        const std::string operand = layout_axis_name(name, "a specs key (an operand's name)");
        std::vector<ops::DimSplit> dims;
        if (!spec.is_none()) {
          const bool jax_spec = jax_partition_spec(spec);
          if (!layout_sequence(spec) && !jax_spec)
            throw TypeError("layout: the spec of " + operand +
                            " must be a jax.sharding.PartitionSpec or a tuple with an axis name, a tuple of axis "
                            "names or None per dimension, got " +
                            type_name(spec));
          if (jax_spec) expect_no_reduced_axes(spec, operand);
          for (const py::handle a : spec) {
            const std::string what = "an entry of " + operand + "'s spec";
            if (layout_sequence(a)) {  // several axes, major to minor, as JAX's P(("dp", "tp"))
              std::vector<std::string> axes;
              for (const py::handle one : a) axes.push_back(layout_axis_name(one, "each axis in " + what));
              dims.emplace_back(std::move(axes));
            } else if (a.is_none()) {
              dims.emplace_back();
            } else if (!PyUnicode_Check(a.ptr())) {
              const std::string got = py::repr(a);
              throw TypeError("layout: " + what + " must be an axis name (str), a tuple of axis names or None, got " +
                              got +
                              (got.find("UNCONSTRAINED") != std::string::npos
                                   ? " (kerf needs each dimension's split: name its axes, or None)"
                                   : ""));
            } else {
              dims.emplace_back(layout_axis_name(a, what));
            }
          }
        }
        layout.specs[operand] = ops::PartitionSpec(std::move(dims));
      }
    } else if (k == "coords") {
      if (!layout_sequence(value))
        throw TypeError("layout: coords must be a list with this device's coordinate per mesh axis, got " +
                        type_name(value));
      for (const py::handle c : value) layout.coords.push_back(layout_int(c, "a coordinate"));
    } else {
      throw InvalidArgument("layout: unknown key '" + k + "' (expected mesh, specs, coords)");
    }
  }
  return layout;
}

// id_check: None or "sync" (wait and raise at once), "deferred" (check_embedding_ids raises later).
ops::EmbeddingOptions embedding_options(const char* op, py::handle padding_idx, bool scale_grad_by_freq,
                                        py::handle id_check, py::handle vocab_start, py::handle vocab_size) {
  ops::EmbeddingOptions o;
  if (padding_idx && !padding_idx.is_none())
    o.padding_idx = fast_call::int_argument(padding_idx.ptr(), std::string(op) + "(): padding_idx");
  if (vocab_start && !vocab_start.is_none())
    o.vocab_start = fast_call::int_argument(vocab_start.ptr(), std::string(op) + "(): vocab_start");
  if (vocab_size && !vocab_size.is_none())
    o.vocab_size = fast_call::int_argument(vocab_size.ptr(), std::string(op) + "(): vocab_size");
  o.scale_grad_by_freq = scale_grad_by_freq;
  if (id_check && !id_check.is_none()) {
    if (!PyUnicode_Check(id_check.ptr()))
      throw TypeError(std::string(op) + "(): id_check must be \"sync\" or \"deferred\", got " + type_name(id_check));
    const std::string v = id_check.cast<std::string>();
    if (v == "deferred")
      o.id_check = ops::IdCheck::deferred;
    else if (v != "sync")
      throw InvalidArgument(std::string(op) + "(): id_check must be \"sync\" or \"deferred\", got \"" + v + "\"");
  }
  return o;
}

// The sum's dtype of an op mixing float dtypes: theirs when they agree, else f32.
DType common_float(std::initializer_list<DType> ts) {
  for (DType t : ts)
    if (t != *ts.begin()) return DType::f32;
  return *ts.begin();
}

std::vector<int64_t> dims(const TensorView& t) {
  return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.rank);
}

// Binds an in-place LoRA merge-style op: op(W, A, B, s) updates W and returns it.
template <class Op>
void bind_in_place(py::module_& m, const char* name, Op* op, const char* w_name, const char* a_name,
                   const char* b_name) {
  def_fast(
      m, name,
      [name, op, w_name, a_name, b_name](py::handle W, py::handle A, py::handle B, double s,
                                         py::handle stream, py::handle config) {
        Call call(name, stream);
        const TensorView w = call.output(W, w_name), a = call.input(A, a_name),
                         b = call.input(B, b_name);
        const ops::Config cfg = config_of(config, call.op());
        call.run([&] { op(w, a, b, s, call.stream(), cfg); });
        return py::reinterpret_borrow<py::object>(W);
      },
      py::arg(w_name), py::arg(a_name), py::arg(b_name), py::arg("s"), py::arg("stream").none(true),
      py::arg("config").none(true));
}

}  // namespace

void bind_ops(py::module_& m) {
  bind_config(m);

  def_fast(
      m,
      "dora_norm",
      [](py::handle W, py::handle A, py::handle B, py::handle m, double s, py::handle norm,
         py::handle scale, double eps, py::handle stream, py::handle config,
         py::handle layout) {
        Call call("dora_norm", stream);
        const TensorView w = call.input(W, "W"), a = call.input(A, "A"), b = call.input(B, "B"),
                         mag = call.input(m, "m");
        const auto [n, sc] = call.output_pair_or_new(norm, "norm", scale, "scale", {w.shape[0]}, DType::f32);
        const ops::Config cfg = config_of(config, call.op());
        if (layout.is_none()) {
          call.run([&] {
            ops::dora_norm(w, a, b, mag, s, n.second, sc.second, eps, call.stream(), cfg);
          });
        } else {
          const ops::Layout lay = layout_of(layout);
          call.run([&] {
            ops::dora_norm(w, a, b, mag, s, n.second, sc.second, eps, call.stream(), cfg, lay);
          });
        }
        return py::make_tuple(n.first, sc.first);
      },
      py::arg("W"), py::arg("A"), py::arg("B"), py::arg("m"), py::arg("s"),
      py::arg("norm").none(true), py::arg("scale").none(true), py::arg("eps"),
      py::arg("stream").none(true), py::arg("config").none(true),
      py::arg("layout").none(true) = py::none(), "ops::dora_norm; see kerf.ops.dora_norm.");

  def_fast(
      m,
      "nf4_code", [] { return std::vector<float>(ops::nf4_code().begin(), ops::nf4_code().end()); },
      "The 16 values of QLoRA's NF4 codes (ops::nf4_code).");
  def_fast(
      m,
      "dora_norm_4bit",
      [](py::handle packed, py::handle absmax, py::handle code, int64_t blocksize, py::handle A, py::handle B,
         py::handle m, double s, py::handle norm, py::handle scale, double eps, py::handle stream,
         py::handle config) {
        Call call("dora_norm_4bit", stream);
        ops::Weight4bit w;
        w.packed = call.input(packed, "packed");
        w.absmax = call.input(absmax, "absmax");
        w.code = code.is_none() ? ops::nf4_code_tensor(w.packed.device) : call.input(code, "code");
        w.blocksize = blocksize;
        const TensorView a = call.input(A, "A"), b = call.input(B, "B"), mag = call.input(m, "m");
        const int64_t out = b.rank >= 1 ? b.shape[0] : 0;
        const auto [n, sc] = call.output_pair_or_new(norm, "norm", scale, "scale", {out}, DType::f32);
        const ops::Config cfg = config_of(config, call.op());
        call.run([&] { ops::dora_norm_4bit(w, a, b, mag, s, n.second, sc.second, eps, call.stream(), cfg); });
        return py::make_tuple(n.first, sc.first);
      },
      py::arg("packed"), py::arg("absmax"), py::arg("code").none(true), py::arg("blocksize"), py::arg("A"),
      py::arg("B"), py::arg("m"), py::arg("s"), py::arg("norm").none(true), py::arg("scale").none(true),
      py::arg("eps"), py::arg("stream").none(true), py::arg("config").none(true),
      "ops::dora_norm_4bit; see kerf.ops.dora_norm_4bit.");

  def_fast(
      m,
      "moe_lora_materialize",
      [](py::handle W, py::handle A, py::handle B, double s, py::handle out, py::handle stream,
         py::handle config, py::handle layout) {
        Call call("moe_lora_materialize", stream);
        const TensorView w = call.input(W, "W"), a = call.input(A, "A"), b = call.input(B, "B");
        const auto o =
            call.output_or_new(out, "W_eff", {w.shape[0], w.shape[1], w.shape[2]}, w.dtype);
        const ops::Config cfg = config_of(config, call.op());
        if (layout.is_none()) {
          call.run([&] { ops::moe_lora_materialize(w, a, b, s, o.second, call.stream(), cfg); });
        } else {
          const ops::Layout lay = layout_of(layout);
          call.run(
              [&] { ops::moe_lora_materialize(w, a, b, s, o.second, call.stream(), cfg, lay); });
        }
        return o.first;
      },
      py::arg("W"), py::arg("A"), py::arg("B"), py::arg("s"), py::arg("out").none(true),
      py::arg("stream").none(true), py::arg("config").none(true),
      py::arg("layout").none(true) = py::none(),
      "ops::moe_lora_materialize; see kerf.ops.moe_lora_materialize.");

  def_fast(
      m,
      "dora_norm_partial",
      [](py::handle W, py::handle A, py::handle B, double s, py::handle sumsq, py::handle stream,
         py::handle config, py::handle layout) {
        Call call("dora_norm_partial", stream);
        const TensorView w = call.input(W, "W"), a = call.input(A, "A"), b = call.input(B, "B");
        const auto o = call.output_or_new(sumsq, "sumsq", {w.shape[0]}, DType::f32);
        const ops::Config cfg = config_of(config, call.op());
        const ops::Layout lay = layout_of(layout);
        call.run([&] { ops::dora_norm_partial(w, a, b, s, o.second, call.stream(), cfg, lay); });
        return o.first;
      },
      py::arg("W"), py::arg("A"), py::arg("B"), py::arg("s"), py::arg("sumsq").none(true),
      py::arg("stream").none(true), py::arg("config").none(true), py::arg("layout").none(true));

  def_fast(
      m,
      "dora_norm_finish",
      [](py::handle sumsq, py::handle m, double eps, py::handle norm, py::handle scale,
         py::handle stream, py::handle layout) {
        Call call("dora_norm_finish", stream);
        const TensorView ss = call.input(sumsq, "sumsq"), mag = call.input(m, "m");
        const auto [n, sc] = call.output_pair_or_new(norm, "norm", scale, "scale", {ss.shape[0]}, DType::f32);
        const ops::Layout lay = layout_of(layout);
        call.run(
            [&] { ops::dora_norm_finish(ss, mag, eps, n.second, sc.second, call.stream(), lay); });
        return py::make_tuple(n.first, sc.first);
      },
      py::arg("sumsq"), py::arg("m"), py::arg("eps"), py::arg("norm").none(true),
      py::arg("scale").none(true), py::arg("stream").none(true), py::arg("layout").none(true));

  def_fast(
      m,
      "dora_norm_backward",
      [](py::handle norm, py::handle grad_scale, py::handle grad_m, py::handle stream,
         py::handle layout) {
        Call call("dora_norm_backward", stream);
        const TensorView n = call.input(norm, "norm"), g = call.input(grad_scale, "grad_scale");
        const auto o = call.output_or_new(grad_m, "grad_m", {n.shape[0]}, g.dtype);
        const ops::Layout lay = layout_of(layout);
        call.run([&] { ops::dora_norm_backward(n, g, o.second, call.stream(), lay); });
        return o.first;
      },
      py::arg("norm"), py::arg("grad_scale"), py::arg("grad_m").none(true),
      py::arg("stream").none(true), py::arg("layout").none(true));

  bind_in_place(m, "lora_merge", &ops::lora_merge, "W", "A", "B");
  bind_in_place(m, "lora_unmerge", &ops::lora_unmerge, "W", "A", "B");
  bind_in_place(m, "lora_merge_flax", &ops::lora_merge_flax, "kernel", "lora_a", "lora_b");
  bind_in_place(m, "lora_unmerge_flax", &ops::lora_unmerge_flax, "kernel", "lora_a", "lora_b");

  def_fast(
      m,
      "moe_lora_materialize_backward",
      [](py::handle dW, py::handle A, py::handle B, double s, py::handle dA, py::handle dB,
         py::handle stream, py::handle config, py::handle layout) {
        Call call("moe_lora_materialize_backward", stream);
        const TensorView g = call.input(dW, "dW_eff"), a = call.input(A, "A"),
                         b = call.input(B, "B");
        const auto da = call.output_or_new(dA, "dA", dims(a), a.dtype);
        const auto db = call.output_or_new(dB, "dB", dims(b), b.dtype);
        const ops::Config cfg = config_of(config, call.op());
        const ops::Layout lay = layout_of(layout);
        call.run([&] {
          ops::moe_lora_materialize_backward(g, a, b, s, da.second, db.second, call.stream(), cfg,
                                             lay);
        });
        return py::make_tuple(da.first, db.first);
      },
      py::arg("dW_eff"), py::arg("A"), py::arg("B"), py::arg("s"), py::arg("dA").none(true),
      py::arg("dB").none(true), py::arg("stream").none(true), py::arg("config").none(true),
      py::arg("layout").none(true));

  def_fast(
      m,
      "lora_embedding",
      [](py::handle x, py::handle weight, py::handle A, py::handle B, double s, py::handle out,
         py::handle padding_idx, bool scale_grad_by_freq, py::handle stream,
         py::handle config, py::handle layout, py::handle id_check, py::handle after_a, py::handle vocab_start,
         py::handle vocab_size) {
        Call call("lora_embedding", stream);
        const TensorView ids = call.input(x, "x"), w = call.input(weight, "weight"),
                         a = call.input(A, "A"), b = call.input(B, "B");
        std::vector<int64_t> shape = dims(ids);
        shape.push_back(w.shape[1]);
        const auto o =
            call.output_or_new(out, "out", shape, common_float({w.dtype, a.dtype, b.dtype}));
        ops::EmbeddingOptions opt =
            embedding_options("lora_embedding", padding_idx, scale_grad_by_freq, id_check, vocab_start, vocab_size);
        if (after_a && !after_a.is_none()) opt.after_a = call.output(after_a, "after_a");
        const ops::Config cfg = config_of(config, call.op());
        const ops::Layout lay = layout_of(layout);
        call.run(
            [&] { ops::lora_embedding(ids, w, a, b, s, o.second, opt, call.stream(), cfg, lay); });
        return o.first;
      },
      py::arg("x"), py::arg("weight"), py::arg("A"), py::arg("B"), py::arg("s"),
      py::arg("out").none(true), py::arg("padding_idx").none(true), py::arg("scale_grad_by_freq"),
      py::arg("stream").none(true), py::arg("config").none(true), py::arg("layout").none(true),
      py::arg("id_check").none(true) = py::none(), py::arg("after_a").none(true) = py::none(),
      py::arg("vocab_start").none(true) = py::none(), py::arg("vocab_size").none(true) = py::none());

  def_fast(
      m,
      "lora_embedding_backward",
      [](py::handle x, py::handle A, py::handle B, py::handle grad_out, double s, py::handle grad_A,
         py::handle grad_B, py::handle padding_idx, bool scale_grad_by_freq, py::handle stream,
         py::handle config, py::handle layout, py::handle id_check, py::handle after_a, py::handle vocab_start,
         py::handle vocab_size) {
        Call call("lora_embedding_backward", stream);
        const TensorView ids = call.input(x, "x"), a = call.input(A, "A"), b = call.input(B, "B"),
                         g = call.input(grad_out, "grad_out");
        std::optional<TensorView> act;
        if (after_a && !after_a.is_none()) act = call.input(after_a, "after_a");
        const auto ga = call.output_or_new(grad_A, "grad_A", dims(a), a.dtype);
        const auto gb = call.output_or_new(grad_B, "grad_B", dims(b), b.dtype);
        ops::EmbeddingOptions opt =
            embedding_options("lora_embedding_backward", padding_idx, scale_grad_by_freq, id_check, vocab_start,
                              vocab_size);
        opt.after_a = act;
        const ops::Config cfg = config_of(config, call.op());
        const ops::Layout lay = layout_of(layout);
        call.run([&] {
          ops::lora_embedding_backward(ids, a, b, g, s, ga.second, gb.second, opt, call.stream(),
                                       cfg, lay);
        });
        return py::make_tuple(ga.first, gb.first);
      },
      py::arg("x"), py::arg("A"), py::arg("B"), py::arg("grad_out"), py::arg("s"),
      py::arg("grad_A").none(true), py::arg("grad_B").none(true), py::arg("padding_idx").none(true),
      py::arg("scale_grad_by_freq"), py::arg("stream").none(true), py::arg("config").none(true),
      py::arg("layout").none(true), py::arg("id_check").none(true) = py::none(),
      py::arg("after_a").none(true) = py::none(), py::arg("vocab_start").none(true) = py::none(),
      py::arg("vocab_size").none(true) = py::none());

  def_fast(
      m,
      "check_embedding_ids",
      [](py::handle tensor, py::handle stream) {
        Call call("check_embedding_ids", stream);
        const TensorView t = call.input(tensor, "tensor");
        call.run([&] { ops::check_embedding_ids(t.device, call.stream()); });
        return py::none();
      },
      py::arg("tensor"), py::arg("stream").none(true) = py::none(),
      "ops::check_embedding_ids on the device of `tensor`; see kerf.ops.check_embedding_ids.");

  m.def(
      "_layout_text",
      [](py::handle layout) {
        const ops::Layout l = layout_of(layout);
        l.check();  // a text the ops (and kerf-cache warm --layout) can take
        return l.canonical();
      },
      py::arg("layout"), "ops::Layout::canonical() of a layout dict; see kerf.ops.layout_text.");

  // ---------------------------------------------------------------- introspection
  m.def("_torch_bridge_status", &torch_bridge_status,
        "How torch tensors are read: 'active (...)' when in C++ through kerf._torch_bridge, "
        "else why they are read through Python attributes.");
  m.def("_set_torch_bridge", &set_torch_bridge, py::arg("enabled"),
        "Turns the use of kerf._torch_bridge on or off; returns the previous setting (tests).");
  m.def("_view_info", &view_info, py::arg("tensor"), py::arg("stream").none(true) = py::none(),
        "How kerf sees a tensor (data_ptr, dtype, shape, strides in elements, device), without "
        "copying it.");
  m.def(
      "_convert",
      [](const py::tuple& tensors, py::handle stream) {
        Call call("kerf", stream);
        for (const py::handle t : tensors) call.input(t, "tensor");
      },
      py::arg("tensors"), py::arg("stream").none(true) = py::none(),
      "Converts tensors as an op would and does nothing else (to measure the binding's host "
      "overhead).");
}

}  // namespace kerf::python
