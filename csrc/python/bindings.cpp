// hypershard._C: Python bindings of the layout core (csrc/layout). Bindings only, no logic:
// every name maps one-to-one to the C++ API declared in csrc/layout/*.h.
//
// Meshes are immutable and shared (MeshPtr = shared_ptr<const Mesh>); pybind11 holds them as
// shared_ptr<Mesh>, so the adapters below only add or drop the const.
// hypershard::layout::LayoutError becomes hypershard.LayoutError, a ValueError subclass carrying
// the same message.
#include <pybind11/pybind11.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/layout.h"
#include "layout/mesh.h"
#include "layout/placements.h"
#include "layout/redistribute_plan.h"

namespace py = pybind11;

namespace hypershard::python {
namespace {

using namespace hypershard::layout;
using PyMeshPtr = std::shared_ptr<Mesh>;

PyMeshPtr to_py(const MeshPtr& mesh) { return std::const_pointer_cast<Mesh>(mesh); }

void bind_errors(py::module_& m) { py::register_exception<LayoutError>(m, "LayoutError", PyExc_ValueError); }

void bind_mesh(py::module_& m) {
  py::class_<Mesh, PyMeshPtr>(m, "Mesh", "An N-dimensional arrangement of ranks with named axes (immutable).")
      .def_static(
          "create",
          [](std::vector<int64_t> shape, std::vector<std::string> axis_names, std::vector<int64_t> ranks) {
            return to_py(Mesh::create(std::move(shape), std::move(axis_names), std::move(ranks)));
          },
          py::arg("shape"), py::arg("axis_names"), py::arg("ranks") = std::vector<int64_t>{},
          "Validated mesh; empty `ranks` means 0..size-1 (row-major over `shape`).")
      .def_property_readonly("shape", &Mesh::shape)
      .def_property_readonly("axis_names", &Mesh::axis_names)
      .def_property_readonly("ranks", &Mesh::ranks)
      .def_property_readonly("ndim", &Mesh::ndim)
      .def_property_readonly("size", &Mesh::size)
      .def("axis_size", &Mesh::axis_size, py::arg("axis"))
      .def("axis_index", &Mesh::axis_index, py::arg("name"))
      .def("contains", &Mesh::contains, py::arg("rank"))
      .def("__contains__", &Mesh::contains, py::arg("rank"))
      .def("position_of", &Mesh::position_of, py::arg("rank"))
      .def("coordinate_at", &Mesh::coordinate_at, py::arg("position"))
      .def("coordinate", &Mesh::coordinate, py::arg("rank"))
      .def("position_at", &Mesh::position_at, py::arg("coordinate"))
      .def("axis_group", &Mesh::axis_group, py::arg("axis"), py::arg("rank"))
      .def("axis_groups", &Mesh::axis_groups, py::arg("axis"))
      .def(
          "submesh",
          [](const Mesh& self, const std::vector<std::string>& names, int64_t rank) {
            return to_py(self.submesh(names, rank));
          },
          py::arg("names"), py::arg("rank"))
      .def(
          "__eq__", [](const Mesh& a, const Mesh& b) { return a == b; }, py::is_operator())
      .def(
          "__ne__", [](const Mesh& a, const Mesh& b) { return a != b; }, py::is_operator())
      // Equal meshes print the same, so the text's hash is consistent with ==.
      .def("__hash__", [](const Mesh& self) { return std::hash<std::string>()(self.to_string()); })
      .def("to_string", &Mesh::to_string)
      .def("__str__", &Mesh::to_string)
      .def("__repr__", [](const Mesh& self) { return "Mesh" + self.to_string(); });
}

void bind_layout(py::module_& m) {
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("Sum", ReduceOp::Sum)
      .value("Avg", ReduceOp::Avg)
      .value("Max", ReduceOp::Max)
      .value("Min", ReduceOp::Min)
      .value("Prod", ReduceOp::Prod);
  m.def("reduce_op_name", &reduce_op_name, py::arg("op"));
  m.def("parse_reduce_op", &parse_reduce_op, py::arg("name"));

  py::class_<Span>(m, "Span")
      .def_readonly("begin", &Span::begin)
      .def_readonly("length", &Span::length)
      .def("__repr__", [](const Span& s) { return str_cat("Span(begin=", s.begin, ", length=", s.length, ")"); });
  m.def("chunk_span", &chunk_span, py::arg("size"), py::arg("parts"), py::arg("index"));
  m.def("numel", &numel, py::arg("shape"));
  m.def("shape_string", &shape_string, py::arg("shape"));

  py::class_<Layout>(m, "Layout", "How one global tensor is spread over a mesh (canonical form).")
      .def_static(
          "create",
          [](const PyMeshPtr& mesh, std::vector<int64_t> global_shape, DimAxes dim_axes, PartialOps partial) {
            return Layout::create(mesh, std::move(global_shape), std::move(dim_axes), std::move(partial));
          },
          py::arg("mesh"), py::arg("global_shape"), py::arg("dim_axes"), py::arg("partial") = PartialOps{})
      .def_static(
          "replicate",
          [](const PyMeshPtr& mesh, std::vector<int64_t> global_shape) {
            return Layout::replicate(mesh, std::move(global_shape));
          },
          py::arg("mesh"), py::arg("global_shape"))
      .def_property_readonly("mesh", [](const Layout& self) { return to_py(self.mesh()); })
      .def_property_readonly("global_shape", &Layout::global_shape)
      .def_property_readonly("dim_axes", &Layout::dim_axes)
      .def_property_readonly("partial", &Layout::partial)
      .def_property_readonly("ndim", &Layout::ndim)
      .def("sharded_dim", &Layout::sharded_dim, py::arg("axis"))
      .def("is_sharded", &Layout::is_sharded, py::arg("axis"))
      .def("is_partial", &Layout::is_partial, py::arg("axis"))
      .def("is_replicate", &Layout::is_replicate, py::arg("axis"))
      .def("has_partial", &Layout::has_partial)
      .def("partial_op", &Layout::partial_op)
      .def("local_shape_at", &Layout::local_shape_at, py::arg("position"))
      .def("global_offset_at", &Layout::global_offset_at, py::arg("position"))
      .def("local_shape", &Layout::local_shape, py::arg("rank"))
      .def_property_readonly("has_empty_shard", &Layout::has_empty_shard)
      .def("global_offset", &Layout::global_offset, py::arg("rank"))
      .def("with_partial", &Layout::with_partial, py::arg("axis"), py::arg("op"))
      .def("with_global_shape", &Layout::with_global_shape, py::arg("global_shape"))
      .def("without_axis", &Layout::without_axis, py::arg("axis"))
      .def("with_minor_shard", &Layout::with_minor_shard, py::arg("axis"), py::arg("dim"))
      .def(py::self == py::self)
      .def(py::self != py::self)
      // Equal layouts print the same (shape, alias notation, Partial axes), so the text's hash is
      // consistent with == (meshes that differ only in rank order share a hash, which is allowed).
      .def("__hash__", [](const Layout& self) { return std::hash<std::string>()(self.to_string()); })
      .def("to_string", &Layout::to_string)
      .def("sharding_string", &Layout::sharding_string)
      .def("__str__", &Layout::to_string)
      .def("__repr__", [](const Layout& self) { return "Layout(" + self.to_string() + ")"; });
}

void bind_placements(py::module_& m) {
  py::class_<Placement> placement(m, "Placement", "One mesh axis of a torch-style placement list.");
  py::enum_<Placement::Kind>(placement, "Kind")
      .value("Replicate", Placement::Kind::Replicate)
      .value("Shard", Placement::Kind::Shard)
      .value("Partial", Placement::Kind::Partial);
  placement.def_static("replicate", &Placement::replicate)
      .def_static("shard", &Placement::shard, py::arg("dim"))
      .def_static("partial", &Placement::partial, py::arg("op") = ReduceOp::Sum)
      .def_readonly("kind", &Placement::kind)
      .def_readonly("dim", &Placement::dim)
      .def_readonly("op", &Placement::op)
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("to_string", &Placement::to_string)
      .def("__str__", &Placement::to_string)
      .def("__repr__", &Placement::to_string);

  py::class_<Placements>(m, "Placements",
                         "One Placement per mesh axis, plus the shard order of multi-axis dims "
                         "whose order is not ascending mesh-axis order.")
      .def(py::init([](std::vector<Placement> per_axis, ShardOrder shard_order) {
             return Placements{std::move(per_axis), std::move(shard_order)};
           }),
           py::arg("per_axis"), py::arg("shard_order") = ShardOrder{})
      .def_readonly("per_axis", &Placements::per_axis)
      .def_readonly("shard_order", &Placements::shard_order)
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("to_string", &Placements::to_string)
      .def("__str__", &Placements::to_string)
      .def("__repr__", [](const Placements& p) { return "Placements" + p.to_string(); });

  m.def(
      "from_placements",
      [](const PyMeshPtr& mesh, std::vector<int64_t> global_shape, const Placements& placements) {
        return from_placements(mesh, std::move(global_shape), placements);
      },
      py::arg("mesh"), py::arg("global_shape"), py::arg("placements"));
  m.def("to_placements", &to_placements, py::arg("layout"));

  py::class_<AliasLayout>(m, "AliasLayout",
                          "Hyper-Parallel alias notation: per tensor dim the axis names "
                          "(major -> minor; empty = \"None\"), and the Partial axes by name.")
      .def(py::init([](std::vector<std::vector<std::string>> dims, std::map<std::string, ReduceOp> partial) {
             return AliasLayout{std::move(dims), std::move(partial)};
           }),
           py::arg("dims"), py::arg("partial") = std::map<std::string, ReduceOp>{})
      .def_readonly("dims", &AliasLayout::dims)
      .def_readonly("partial", &AliasLayout::partial)
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("to_string", &AliasLayout::to_string)
      .def("__str__", &AliasLayout::to_string)
      .def("__repr__", [](const AliasLayout& a) { return "AliasLayout(" + a.to_string() + ")"; });
  m.def("parse_alias", &parse_alias, py::arg("text"));
  m.def(
      "from_alias",
      [](const PyMeshPtr& mesh, std::vector<int64_t> global_shape, const AliasLayout& alias) {
        return from_alias(mesh, std::move(global_shape), alias);
      },
      py::arg("mesh"), py::arg("global_shape"), py::arg("alias"));
  m.def("to_alias", &to_alias, py::arg("layout"));

  m.def(
      "from_tensor_map",
      [](const PyMeshPtr& mesh, std::vector<int64_t> global_shape, const TensorMap& map, const PartialOps& partial) {
        return from_tensor_map(mesh, std::move(global_shape), map, partial);
      },
      py::arg("mesh"), py::arg("global_shape"), py::arg("tensor_map"), py::arg("partial") = PartialOps{});
  m.def("to_tensor_map", &to_tensor_map, py::arg("layout"));
}

void bind_redistribute_plan(py::module_& m) {
  py::enum_<StepKind>(m, "StepKind")
      .value("LocalChunk", StepKind::LocalChunk)
      .value("PartialFill", StepKind::PartialFill)
      .value("AllGather", StepKind::AllGather)
      .value("AllToAll", StepKind::AllToAll)
      .value("AllReduce", StepKind::AllReduce)
      .value("ReduceScatter", StepKind::ReduceScatter);
  m.def("step_kind_name", &step_kind_name, py::arg("kind"));

  // `from` is a Python keyword: the layouts around a step are `from_` and `to`.
  py::class_<RedistributeStep>(m, "RedistributeStep")
      .def_readonly("kind", &RedistributeStep::kind)
      .def_readonly("axis", &RedistributeStep::axis)
      .def_readonly("src_dim", &RedistributeStep::src_dim)
      .def_readonly("dst_dim", &RedistributeStep::dst_dim)
      .def_readonly("op", &RedistributeStep::op)
      .def_readonly("from_", &RedistributeStep::from)
      .def_readonly("to", &RedistributeStep::to)
      .def_readonly("elements_sent", &RedistributeStep::elements_sent)
      .def("total_elements", &RedistributeStep::total_elements)
      .def("to_string", &RedistributeStep::to_string)
      .def("__str__", &RedistributeStep::to_string)
      .def("__repr__", &RedistributeStep::to_string);

  py::class_<RedistributePlan>(m, "RedistributePlan")
      .def_readonly("steps", &RedistributePlan::steps)
      .def("total_elements", &RedistributePlan::total_elements)
      .def("elements_sent_at", &RedistributePlan::elements_sent_at, py::arg("position"))
      .def("to_string", &RedistributePlan::to_string, py::arg("element_size") = 0)
      .def("__str__", [](const RedistributePlan& p) { return p.to_string(); })
      .def("__repr__", [](const RedistributePlan& p) { return p.to_string(); });

  m.def("step_elements_sent", &step_elements_sent, py::arg("kind"), py::arg("axis"), py::arg("src_dim"),
        py::arg("dst_dim"), py::arg("from_"));
  m.def("plan_redistribute", &plan_redistribute, py::arg("src"), py::arg("dst"));
}

}  // namespace

void bind_runtime(py::module_& m);    // runtime_bindings.cpp
void bind_in_flight(py::module_& m);  // in_flight_bindings.cpp

}  // namespace hypershard::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "hypershard C++ core: the layout model and the redistribution planner";
  // The torch this module was compiled against; hypershard/__init__.py compares it with the
  // torch that is imported.
  m.attr("_torch_version") = HS_TORCH_VERSION;
  hypershard::python::bind_errors(m);
  hypershard::python::bind_mesh(m);
  hypershard::python::bind_layout(m);
  hypershard::python::bind_placements(m);
  hypershard::python::bind_redistribute_plan(m);
  hypershard::python::bind_runtime(m);
  hypershard::python::bind_in_flight(m);
}
