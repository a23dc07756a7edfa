// hypershard._C runtime bindings: DeviceMesh, DTensor construction and inspection,
// redistribution, dispatch statistics. Bindings only, no logic.
#include <torch/csrc/utils/pybind.h>
#include <ATen/InferSize.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>

#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "layout/error.h"
#include "layout/intern.h"
#include "ops/attention_sequence.h"
#include "ops/composites.h"
#include "ops/families.h"
#include "ops/op_call.h"
#include "ops/user_rules.h"
#include "ops/view_plan.h"
#include "runtime/dispatch.h"
#include "runtime/dispatch_internal.h"
#include "runtime/dtensor_impl.h"
#include "runtime/fast_path.h"
#include "runtime/fully_shard.h"
#include "runtime/grad_sync.h"
#include "runtime/redistribute.h"
#include "runtime/traced_collectives.h"

namespace py = pybind11;

namespace hypershard::python {
namespace {

using runtime::DeviceMesh;
using runtime::DeviceMeshPtr;

// __torch_dispatch__ hands a Tensor argument that was a Python number (`x * 2`) over as that
// number; the schema wants a tensor: the wrapped-number tensor the arg parser had made.
py::object wrapped_number(const c10::Argument& argument, const py::handle& value) {
  if (!argument.type()->isSubtypeOf(*c10::TensorType::get()) ||
      !(PyBool_Check(value.ptr()) || PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr()) ||
        PyComplex_Check(value.ptr())))
    return py::reinterpret_borrow<py::object>(value);
  at::Tensor t = c10::scalar_to_tensor(torch::jit::toIValue(value, c10::NumberType::get()).toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return py::cast(t);
}

// Runs `run` under a TracingScope when `traced` (collectives become functional collectives the
// tracer records), else for real with the GIL released (c10d: see "Collectives run without the
// GIL" below).
template <class Run>
auto traced_or_real(bool traced, Run&& run) {
  if (traced) {
    runtime::TracingScope tracing;
    return run();
  }
  py::gil_scoped_release no_gil;
  return run();
}

py::tuple with_wrapped_numbers(const c10::FunctionSchema& schema, const py::args& args) {
  py::tuple out(args.size());
  for (size_t i = 0; i < args.size(); ++i)
    out[i] = i < schema.arguments().size() ? wrapped_number(schema.arguments()[i], args[i])
                                           : py::reinterpret_borrow<py::object>(args[i]);
  return out;
}

py::dict with_wrapped_numbers(const c10::FunctionSchema& schema, const py::kwargs& kwargs) {
  py::dict out;
  for (const auto& [key, value] : kwargs) {
    const auto index = schema.argumentIndexWithName(py::cast<std::string>(key));
    out[key] = index ? wrapped_number(schema.arguments()[*index], value) : py::reinterpret_borrow<py::object>(value);
  }
  return out;
}

// DeviceMesh::SequenceAttention's values, in order, as parallelize's cp_algorithm names them.
constexpr const char* kSequenceAttentionNames[] = {"all_gather_kv", "ulysses", "ring"};

c10::DeviceType parse_device_type(const std::string& name) { return c10::Device(name).type(); }

}  // namespace

void bind_runtime(py::module_& m) {
  py::class_<DeviceMesh, DeviceMeshPtr>(m, "DeviceMesh", "A mesh with this rank's c10d process group for every axis.")
      .def(py::init([](std::shared_ptr<layout::Mesh> mesh, int64_t rank, const std::string& device_type,
                       std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups) {
             return std::make_shared<DeviceMesh>(std::const_pointer_cast<const layout::Mesh>(mesh), rank,
                                                 parse_device_type(device_type), std::move(groups));
           }),
           py::arg("mesh"), py::arg("rank"), py::arg("device_type"), py::arg("groups"))
      .def_static(
          "without_groups",
          [](std::shared_ptr<layout::Mesh> mesh, int64_t rank, const std::string& device_type) {
            std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups(mesh->ndim());
            return std::make_shared<DeviceMesh>(std::const_pointer_cast<const layout::Mesh>(mesh), rank,
                                                parse_device_type(device_type), std::move(groups),
                                                /*planning_only=*/true);
          },
          py::arg("mesh"), py::arg("rank") = 0, py::arg("device_type") = "cpu",
          "A mesh with no process groups: DTensors on it can be made (from_local) and planned for "
          "(infer_plan), but not redistributed.")
      .def_property_readonly("mesh",
                             [](const DeviceMesh& d) { return std::const_pointer_cast<layout::Mesh>(d.mesh()); })
      .def_property_readonly("rank", &DeviceMesh::rank)
      .def_property_readonly("position", &DeviceMesh::position)
      .def_property_readonly("device_type",
                             [](const DeviceMesh& d) { return c10::DeviceTypeName(d.device_type(), true); })
      .def("coordinate", &DeviceMesh::coordinate, py::arg("axis"))
      .def(
          "group",
          [](const DeviceMesh& d, int64_t axis) {
            return c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&d.group(axis));
          },
          py::arg("axis"), "This rank's c10d process group along `axis`.")
      .def("submesh", &DeviceMesh::submesh, py::arg("names"))
      .def_property("load_balanced_sequence_axis", &DeviceMesh::load_balanced_sequence_axis,
                    &DeviceMesh::set_load_balanced_sequence_axis,
                    "Mesh axis index whose sequences are stored in head-tail (zig-zag) order of 2 x its size "
                    "chunks (context parallelism, docs/context_parallel.md); -1: natural order.")
      .def_property(
          "cp_algorithm",
          [](const DeviceMesh& d) {
            return std::string(kSequenceAttentionNames[static_cast<int>(d.sequence_attention())]);
          },
          [](DeviceMesh& d, const std::string& name) {
            for (size_t i = 0; i < std::size(kSequenceAttentionNames); ++i)
              if (name == kSequenceAttentionNames[i])
                return d.set_sequence_attention(static_cast<DeviceMesh::SequenceAttention>(i));
            throw py::value_error("hypershard: device mesh: cp_algorithm '" + name +
                                  "' is not known; allowed: all_gather_kv, ulysses, ring");
          },
          "How attention runs on a sequence sharded over this mesh (docs/context_parallel.md): "
          "'all_gather_kv' (default), 'ulysses' or 'ring'.")
      .def("__str__", &DeviceMesh::to_string)
      .def("__repr__", [](const DeviceMesh& d) { return "DeviceMesh" + d.to_string(); });

  m.def(
      "cp_attention_calls",
      [] {
        const auto calls = ops::sequence_attention::calls_per_algorithm();
        py::dict d;
        for (size_t i = 0; i < calls.size(); ++i) d[kSequenceAttentionNames[i]] = calls[i];
        return d;
      },
      "Attention calls on an even sequence split (forward and backward) per context-parallel "
      "algorithm that ran them, since the last reset (a call the mesh's algorithm cannot run counts "
      "as all_gather_kv).");
  m.def("reset_cp_attention_calls", &ops::sequence_attention::reset_calls_per_algorithm);
  m.def("release_process_groups", &runtime::release_process_groups,
        "Drops the c10d process groups of every live DeviceMesh, with the GIL released (a gloo "
        "group's destructor joins a worker thread that may need the GIL); returns how many. Runs by "
        "itself at interpreter exit; call it earlier to free the groups of meshes still referenced "
        "somewhere. Collectives on those meshes raise afterwards.");
  m.def("install_dispatch", &runtime::install_dispatch);
  m.def("sync_registrations", &runtime::sync_registrations);
  m.def("is_dtensor", [](const at::Tensor& t) { return runtime::is_dtensor(t); }, py::arg("tensor"));
  m.def(
      "layout_of", [](const at::Tensor& t) { return *runtime::checked_dtensor(t, "layout_of").layout(); },
      py::arg("tensor"),
      "hypershard's Layout of a DTensor (mesh, global shape, sharded dims, Partial axes); the same "
      "as tensor.sharding. Raises for a plain tensor.");
  m.def(
      "device_mesh_of", [](const at::Tensor& t) { return runtime::checked_dtensor(t, "device_mesh_of").device_mesh(); },
      py::arg("tensor"));
  m.def(
      "local_of", [](const at::Tensor& t) { return runtime::checked_dtensor(t, "local_of").local(); },
      py::arg("tensor"), "This rank's local tensor, not differentiable (use to_local for autograd).");
  m.def(
      "from_local",
      [](const at::Tensor& local, const DeviceMeshPtr& mesh, const layout::Layout& layout) {
        runtime::sync_registrations();
        return runtime::from_local(local, mesh, layout::intern_layout(layout));
      },
      py::arg("local"), py::arg("device_mesh"), py::arg("layout"), py::call_guard<py::gil_scoped_release>());
  m.def("to_local", &runtime::to_local, py::arg("tensor"), py::call_guard<py::gil_scoped_release>());
  // Tracing (hypershard/tensor/traced.py): the traced program's DTensors are Python wrappers around
  // traced locals; these run hypershard's operator flow on them with collectives emitted as
  // functional collectives (runtime/traced_collectives.h). Under a tracer they hold the GIL: the
  // locals' ops call back into Python (the tracer's modes).
  m.def(
      "wrap_local",
      [](const at::Tensor& local, const DeviceMeshPtr& mesh, const layout::Layout& layout, std::vector<int64_t> strides,
         int64_t storage_offset) {
        const runtime::Geometry geometry{strides, storage_offset};
        return runtime::make_dtensor(local, layout::intern_layout(layout), mesh, &geometry);
      },
      py::arg("local"), py::arg("device_mesh"), py::arg("layout"), py::arg("strides"), py::arg("storage_offset"),
      "A DTensor around `local` itself (no alias, not differentiable) reporting the global `strides` "
      "and `storage_offset`.");
  m.def(
      "traced_call",
      [](const std::string& name, const std::string& overload, const py::args& args, const py::kwargs& kwargs) {
        const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
        auto stack = torch::jit::createStackForSchema(op.schema(), with_wrapped_numbers(op.schema(), args),
                                                      with_wrapped_numbers(op.schema(), kwargs), std::nullopt);
        traced_or_real(runtime::under_tracer(stack), [&] {
          runtime::detail::dtensor_fallback(op, c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), &stack);
        });
        return torch::jit::createPyObjectForStack(std::move(stack));
      },
      py::arg("name"), py::arg("overload"),
      "Op name.overload on DTensors whose locals are traced: hypershard's operator flow, each "
      "collective a functional collective the tracer records.");
  m.def(
      "view_source_layout",
      [](const layout::Layout& layout, const std::vector<int64_t>& shape) {
        return *ops::plan_view(layout, at::infer_size(shape, layout::numel(layout.global_shape()))).input;
      },
      py::arg("layout"), py::arg("shape"),
      "The layout `layout` must take so that viewing it as `shape` (one size may be -1) keeps every "
      "shard a whole block (itself when it already does): reshape's redistribution.");
  m.def("linear_keeps_sequence_shards", &ops::linear_keeps_sequence_shards, py::arg("input"), py::arg("weight_dim"),
        "Whether linear of an input laid out as `input` by a `weight_dim`-D weight takes the batched "
        "product that keeps its sequence shards (csrc/ops/composites.cpp), eagerly and traced.");
  m.def("linear_batched", &ops::linear_batched, py::arg("input"), py::arg("weight"), py::arg("bias") = std::nullopt,
        "linear as bmm(input, weight^T expanded over the batch) (+ bias): the batched product of "
        "linear_keeps_sequence_shards.");
  m.def(
      "traced_redistribute",
      [](const at::Tensor& t, const layout::Layout& layout) {
        const auto& impl = runtime::checked_dtensor(t, "traced_redistribute");
        const auto dst = layout::intern_layout(layout);
        return traced_or_real(runtime::under_tracer({c10::IValue(t)}), [&] {
          return runtime::make_dtensor(
              runtime::redistribute_local(impl.local(), impl.layout(), dst, *impl.device_mesh()), dst,
              impl.device_mesh());
        });
      },
      py::arg("tensor"), py::arg("layout"),
      "`tensor` (a DTensor with a traced local) in `layout`, not differentiable.");
  // Collectives run without the GIL: a finished gloo work is destroyed on gloo's thread, and
  // its saved thread-local state may drop Python references (which needs the GIL) -- holding
  // the GIL while waiting for that work deadlocks (seen as a random hang in full_tensor).
  m.def(
      "redistribute",
      [](const at::Tensor& t, const layout::Layout& layout) {
        return runtime::redistribute(t, layout::intern_layout(layout));
      },
      py::arg("tensor"), py::arg("layout"), py::call_guard<py::gil_scoped_release>());
  m.def("dispatch_stats", [] {
    const auto s = runtime::dispatch_stats();
    return py::dict(
        py::arg("calls") = s.calls, py::arg("cache_hits") = s.cache_hits, py::arg("cache_entries") = s.cache_entries,
        py::arg("fast_calls") = s.fast_calls, py::arg("fallback_calls") = s.fallback_calls,
        py::arg("fallback_bytes") = s.fallback_bytes, py::arg("implicit_calls") = s.implicit_calls,
        py::arg("interned_layouts") = layout::interned_count(), py::arg("cached_plans") = layout::cached_plan_count());
  });
  m.def("cached_op_plans", &runtime::cached_op_plans,
        "The number of cached op plans per op, as (name, count) pairs (ops without plans left out).");
  m.def("reset_dispatch_stats", &runtime::reset_dispatch_stats);
  m.def("traffic", [] {
    const auto t = runtime::traffic();
    return py::dict(py::arg("collectives") = t.collectives, py::arg("bytes_sent") = t.bytes_sent);
  });
  m.def("reset_traffic", &runtime::reset_traffic);
  m.def("rule_names", &runtime::rule_names);
  m.def("rule_families", &runtime::rule_families,
        "[(op name, family)] for every rule: the csrc/ops/<family>.cpp file that registers it");
  m.def(
      "rule_registrations",
      [] {
        // The pointwise tables alone, registered again into a scratch registry: the family's
        // other ops are those register_tagged_pointwise added for torch's `pointwise` tag.
        ops::Registry tables;
        ops::register_pointwise(tables);
        const ops::Registry& registry = ops::registry();
        std::vector<std::tuple<std::string, std::string, std::string, bool>> out;
        for (const auto& name : registry.names()) {
          const ops::RuleEntry& entry = *registry.find(name);
          const std::string family = entry.family;
          out.emplace_back(name, family, entry.key == ops::KeyScalars::kAll ? "all" : "none",
                           family == "pointwise" && tables.find(name) == nullptr);
        }
        return out;
      },
      "[(op name, family, key scalars, from tag)] for every rule, sorted by name: the csrc/ops/<family>.cpp "
      "file that registers it, which non-tensor arguments join its plan-cache key (\"all\" or \"none\"), and "
      "whether register_tagged_pointwise added it for torch's `pointwise` tag rather than a family table "
      "(docs/operators.md is generated from it).");
  m.def("set_rule_enabled", &runtime::set_rule_enabled, py::arg("op"), py::arg("enabled"),
        "Benchmarks and tests only: while disabled, calls of op (\"aten::add.Tensor\") ignore its rule, as if it had "
        "none (the fallback serves them; strict mode raises Missing operator).");
  m.def(
      "register_factor_rule",
      [](const std::string& op, const std::string& text, std::vector<std::string> inputs,
         std::vector<std::string> outputs, std::string whole, std::vector<bool> linear) {
        runtime::register_user_rule(
            op, ops::UserRule{text, std::move(inputs), std::move(outputs), std::move(whole), std::move(linear)});
      },
      py::arg("op"), py::arg("text"), py::arg("inputs"), py::arg("outputs"), py::arg("whole"), py::arg("linear"),
      "hypershard.register_rule's C++ side: op (\"mylib::op\") gets the factor rule `inputs` -> `outputs`.");
  m.def("fast_path_ops", &runtime::fast_path_ops,
        "The ops with a typed fast-path kernel on this torch (\"aten::add.Tensor\" style).");
  m.def("set_fast_path", &runtime::set_fast_path, py::arg("on"),
        "On by default; off, every op takes the boxed fallback (for tests and benchmarks).");
  m.def("fast_path_enabled", &runtime::fast_path_enabled);
  py::class_<runtime::FullyShardGroup, std::shared_ptr<runtime::FullyShardGroup>>(
      m, "FullyShardGroup",
      "The collectives and buffers of one fully_shard'ed module's parameters (see "
      "csrc/runtime/fully_shard.h); hypershard.fsdp.fully_shard drives it.")
      .def(py::init([](std::vector<at::Tensor> sharded, const std::vector<layout::Layout>& unsharded, int64_t axis,
                       std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype) {
             std::vector<layout::LayoutPtr> layouts;
             for (const auto& l : unsharded) layouts.push_back(layout::intern_layout(l));
             return std::make_shared<runtime::FullyShardGroup>(std::move(sharded), std::move(layouts), axis,
                                                               param_dtype, reduce_dtype);
           }),
           py::arg("sharded"), py::arg("unsharded_layouts"), py::arg("axis"), py::arg("param_dtype") = py::none(),
           py::arg("reduce_dtype") = py::none())
      .def("start_gather", &runtime::FullyShardGroup::start_gather, py::call_guard<py::gil_scoped_release>())
      .def("finish_gather", &runtime::FullyShardGroup::finish_gather, py::call_guard<py::gil_scoped_release>())
      .def("free_unsharded", &runtime::FullyShardGroup::free_unsharded, py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](runtime::FullyShardGroup& self, const std::vector<std::optional<at::Tensor>>& grads, bool sync) {
            std::vector<at::Tensor> in;
            for (const auto& g : grads) in.push_back(g.value_or(at::Tensor()));
            return self.reduce_scatter(in, sync);  // undefined -> None
          },
          py::arg("grads"), py::arg("sync"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("gathered", &runtime::FullyShardGroup::gathered)
      .def_property_readonly("gather_in_flight", &runtime::FullyShardGroup::gather_in_flight)
      .def_property_readonly("flat_numel", &runtime::FullyShardGroup::flat_numel)
      .def_property_readonly("unsharded_bytes", &runtime::FullyShardGroup::unsharded_bytes)
      .def("stats",
           [](const runtime::FullyShardGroup& g) {
             const auto& s = g.stats();
             return py::dict(py::arg("gathers") = s.gathers, py::arg("prefetched") = s.prefetched,
                             py::arg("reduce_scatters") = s.reduce_scatters, py::arg("bytes_sent") = s.bytes_sent,
                             py::arg("wait_seconds") = s.wait_seconds);
           })
      .def("reset_stats", &runtime::FullyShardGroup::reset_stats)
      .def("__len__", &runtime::FullyShardGroup::size);

  m.def(
      "install_grad_hook",
      [](const at::Tensor& leaf) {
        if (runtime::is_dtensor(leaf) && leaf.requires_grad() && leaf.is_leaf())
          runtime::detail::install_grad_hook(leaf);
      },
      py::arg("leaf"),
      "hypershard's gradient-layout hook on a DTensor leaf (normally installed when the leaf reaches an op): "
      "for parameters used only through local tensors (expert parallelism's local experts), so that their "
      "Partial gradients are still summed before .grad takes them.");
  m.def("set_grad_bucket_bytes", &runtime::set_grad_bucket_bytes, py::arg("bytes"),
        "The most bytes one data-parallel gradient bucket carries (default 25 MiB): gradients that "
        "differ from their parameter's layout only by Partial(sum) axes are reduced in buckets, one "
        "all-reduce per axis per bucket. 0 reduces each gradient when it arrives.");
  m.def("grad_bucket_bytes", &runtime::grad_bucket_bytes);
  m.def("set_grad_overlap", &runtime::set_grad_overlap, py::arg("overlap"),
        "Whether a full gradient bucket starts its all-reduce (over its first Partial axis) during the "
        "backward pass (default True) or every bucket waits for the end (False: no overlap).");
  m.def("grad_overlap", &runtime::grad_overlap);
  m.def("hold_grad_sync", &runtime::hold_grad_sync, py::arg("hold"), py::call_guard<py::gil_scoped_release>(),
        "True: the data-parallel gradient sums of the backward passes that follow are held (.grad stays "
        "Partial, later passes accumulate locally); False: they are all reduced now, in buckets.");
  m.def("grad_sync_held", &runtime::grad_sync_held);
  m.def("grad_sync_stats", [] {
    const auto s = runtime::grad_sync_stats();
    return py::dict(py::arg("reduced_on_arrival") = s.reduced_on_arrival, py::arg("bucketed") = s.bucketed,
                    py::arg("buckets") = s.buckets, py::arg("overlapped") = s.overlapped);
  });
  m.def("reset_grad_sync_stats", &runtime::reset_grad_sync_stats);
  m.def(
      "infer_plan",
      [](const std::string& name, const std::string& overload, const py::args& args, const py::kwargs& kwargs) {
        const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
        auto stack = torch::jit::createStackForSchema(op.schema(), args, kwargs, std::nullopt);
        const auto plan = runtime::infer_plan(op, stack);
        auto layouts = [](const std::vector<layout::LayoutPtr>& list) {
          py::list out;
          for (const auto& l : list) out.append(l ? py::cast(*l) : py::none());
          return out;
        };
        return py::dict(py::arg("inputs") = layouts(plan.inputs), py::arg("outputs") = layouts(plan.outputs),
                        py::arg("localizes") = plan.localizes, py::arg("expands") = plan.expands,
                        py::arg("refused") = plan.refused);
      },
      py::arg("name"), py::arg("overload"),
      "What the rule of op name.overload plans for these arguments (DTensors on any mesh, even "
      "one without process groups), without running it: {inputs, outputs, localizes, expands, refused}.");
  m.def(
      "plan_key",
      [](const std::string& name, const std::string& overload, const py::args& args, const py::kwargs& kwargs) {
        const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
        auto stack = torch::jit::createStackForSchema(op.schema(), args, kwargs, std::nullopt);
        return runtime::plan_key_words(op, stack);
      },
      py::arg("name"), py::arg("overload"),
      "The words of the plan-cache key that op name.overload gets for these arguments (DTensors on any mesh): "
      "two calls share a cached plan exactly when these are equal.");
  m.def("set_key_check", &runtime::set_key_check, py::arg("on"),
        "Tests: every fast-path call also computes the boxed flow's plan key and raises unless the two are equal.");
  m.def(
      "op_counts",
      [] {
        py::list out;
        for (const auto& c : runtime::op_counts()) out.append(py::make_tuple(c.name, c.calls, c.has_rule));
        return out;
      },
      "[(op name, calls since reset, has a rule)] for every op that reached hypershard");
  m.def("reset_op_counts", &runtime::reset_op_counts);
  m.def("set_strict", &runtime::set_strict, py::arg("on"));
  m.def("strict", &runtime::strict);
  m.def("set_check_replicas", &runtime::set_check_replicas, py::arg("on"));
  m.def("check_replicas", &runtime::check_replicas);
  m.def(
      "check_same_on_every_rank",
      [](const at::Tensor& tensor, const DeviceMeshPtr& mesh, const std::string& what) {
        runtime::check_same_on_every_rank(tensor, *mesh, what);
      },
      py::arg("tensor"), py::arg("device_mesh"), py::arg("what"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace hypershard::python
