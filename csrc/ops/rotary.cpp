// Rotary position embedding: y = rot_a(x) * cos + rot_b(x) * sin along the last dim D of x, cos
// and sin broadcast to x (csrc/kernels/rotary.cpp has the maths of the four modes). One rule
// serves the fused op, its backward and torch_npu's equivalents:
//
//   hypershard::rotary_position_embedding(x, cos, sin, mode)              -> y
//   hypershard::rotary_position_embedding_backward(grad, x, cos, sin, mode, output_mask)
//                                                                         -> dx, dcos, dsin
//   npu::npu_rotary_position_embedding(x, cos, sin, mode)                 (Ascend, when loaded)
//   npu::npu_rotary_position_embedding_backward(grad, cos, sin, x?, mode)
//   npu::npu_rotary_mul(self, r1, r2[, rotary_mode])                      (modes half/interleave)
//   npu::npu_rotary_mul_backward(grad, self, r1, r2[, rotary_mode])
//
// Sharding: every row of x is rotated by itself, so every dim of x but D keeps its sharding and
// y is laid out like x. D is never sharded (the rotation pairs positions across D). cos and sin
// follow x on each dim they share with it (the same mesh axes, so each rank holds the rows its
// x rows need); a size-1 dim of cos/sin (broadcast) is whole. A full-size cos/sin that is whole
// on a dim x shards is cut locally to this rank's rows (no communication) in default mode and is
// an error in strict mode (it costs every rank the whole table; Hyper-Parallel accepts it
// silently and computes with the wrong rows). cos/sin sharded on an axis x does not use there is
// an error (default mode gathers it). The mode never changes a layout.
//
// Partial: y is bilinear in x and (cos, sin), so no input may be Partial in forward (default
// mode reduces it first). The backward is linear in grad: a Partial grad is reduced first. dx is
// laid out like x; dcos / dsin like cos / sin, and Partial(sum) on every axis that shards x on a
// dim where cos / sin broadcast (each rank summed its own rows of that dim).
#include "kernels/kernels.h"
#include "ops/families.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

struct RotaryOperands {
  int64_t grad = -1, x = -1, cos = -1, sin = -1;
};

std::string axis_names(const Layout& l, const std::vector<int64_t>& axes) {
  std::string out;
  for (int64_t axis : axes) out += (out.empty() ? "'" : ", '") + l.mesh()->axis_names().at(axis) + "'";
  return out.empty() ? "no mesh axis" : "mesh axis " + out;
}

const char* kAllowedLayouts =
    "x, cos and sin Replicate or Shard on dims other than the last (D); cos/sin sharded like x on the "
    "dims they share with it, whole on their size-1 (broadcast) dims";

// The mode argument: an int 0..3 (rotary_position_embedding) or "half"/"interleave" (rotary_mul).
void check_mode(const OpCall& call) {
  if (const auto index = call.schema().argumentIndexWithName("mode")) {
    const int64_t mode = call.arg(*index).toInt();
    if (mode < 0 || mode > 3)
      fail_call(call, layout::str_cat("mode ", mode,
                                      " is out of range; allowed: 0 (half), 1 (interleave), 2 (quarter), "
                                      "3 (interleave-half)"));
  } else if (const auto text = call.schema().argumentIndexWithName("rotary_mode")) {
    const auto mode = call.arg(*text).toStringRef();
    if (mode != "half" && mode != "interleave")
      fail_call(call, "rotary_mode '" + mode + "' is not supported; allowed: 'half', 'interleave'");
  }
}

int64_t mode_divisor(const OpCall& call) {
  const auto index = call.schema().argumentIndexWithName("mode");
  return index && call.arg(*index).toInt() == 2 ? 4 : 2;
}

// Global shapes: x of rank >= 1 with D divisible by 2 (4 for quarter mode), cos/sin of x's rank,
// each dim x's or 1, the last D.
void check_shapes(const OpCall& call, const RotaryOperands& o) {
  const Layout& x = call.layout(o.x);
  if (x.ndim() < 1) fail_argument(call, o.x, "a 0-d x has no dim to rotate", "x of rank >= 1 (its last dim D)");
  const int64_t n = x.ndim(), d = x.global_shape().back(), divisor = mode_divisor(call);
  if (d % divisor != 0)
    fail_argument(call, o.x, layout::str_cat("the last dim D = ", d, " is not divisible by ", divisor),
                  divisor == 4 ? "D divisible by 4 in mode 2 (quarter)" : "an even D");
  for (int64_t t : {o.cos, o.sin}) {
    const Layout& table = call.layout(t);
    bool fits = table.ndim() == n;
    for (int64_t i = 0; fits && i < n; ++i) {
      const int64_t size = table.global_shape()[i];
      fits = size == x.global_shape()[i] || (size == 1 && i != n - 1);
    }
    if (!fits)
      fail_argument(call, t,
                    "shape " + layout::shape_string(table.global_shape()) + " does not broadcast to x " +
                        layout::shape_string(x.global_shape()),
                    "the rank of x, each dim equal to x's or 1, the last dim D");
  }
  if (o.grad >= 0 && call.layout(o.grad).global_shape() != x.global_shape())
    fail_argument(call, o.grad, "shape differs from x " + layout::shape_string(x.global_shape()), "grad shaped like x");
}

struct TablePlan {
  LayoutPtr input;     // the layout cos/sin must have for the local call
  LayoutPtr gradient;  // the layout of its gradient (Partial over x's broadcast axes)
};

// What cos or sin (tensor `t`) must be given x's layout; `refused` collects the text strict mode
// raises for a full-size replicated table that the plan cuts locally.
TablePlan plan_table(const OpCall& call, const Layout& x, int64_t t, std::string& refused) {
  const Layout& table = call.layout(t);
  const int64_t n = x.ndim();
  layout::DimAxes dims(static_cast<size_t>(n));
  layout::PartialOps summed(static_cast<size_t>(x.mesh()->ndim()));
  for (int64_t i = 0; i < n; ++i) {
    const auto& x_axes = x.dim_axes()[i];
    const auto& t_axes = table.dim_axes()[i];
    // A size-1 dim is a broadcast dim even where x has size 1 too (whole, a Partial gradient).
    const bool broadcast = table.global_shape()[i] == 1;
    if (i == n - 1) {
      if (!t_axes.empty())
        fail_argument(
            call, t,
            "the last dim (D) is sharded on " + axis_names(table, t_axes) + "; the rotation pairs positions across D",
            kAllowedLayouts);
    } else if (broadcast) {
      if (!t_axes.empty())
        fail_argument(call, t,
                      layout::str_cat("its size-1 (broadcast) dim ", i, " is sharded on ", axis_names(table, t_axes)),
                      kAllowedLayouts);
      for (int64_t axis : x_axes) summed[axis] = ReduceOp::Sum;
    } else if (!t_axes.empty() && t_axes != x_axes) {
      fail_argument(call, t,
                    layout::str_cat("dim ", i, " is sharded on ", axis_names(table, t_axes), " but x's dim ", i, " on ",
                                    axis_names(x, x_axes)),
                    kAllowedLayouts);
    } else {
      if (t_axes.empty() && !x_axes.empty() && refused.empty())
        refused = argument_error(
            call, t,
            layout::str_cat("full-size dim ", i, " is whole where x is sharded on ", axis_names(x, x_axes),
                            " (every rank would hold the whole table; default mode cuts "
                            "this rank's rows locally)"),
            "the table sharded like x on that dim, or of size 1 there (broadcast)");
      dims[i] = x_axes;
    }
  }
  TablePlan plan;
  plan.input = make_layout(table, table.global_shape(), dims);
  plan.gradient = make_layout(table, table.global_shape(), std::move(dims), std::move(summed));
  return plan;
}

RotaryOperands operands(const OpCall& call) {
  RotaryOperands o;
  o.grad = call.tensor_named({"grad", "dy", "grad_output"});
  o.x = call.tensor_named({"x", "self", "input"});
  o.cos = call.tensor_named({"cos", "r1"});
  o.sin = call.tensor_named({"sin", "r2"});
  if (o.cos < 0 || o.sin < 0 || (o.x < 0 && o.grad < 0))
    fail_call(call, "internal error: the schema has no x/self, cos/r1 or sin/r2 argument");
  return o;
}

// x's layout after the checks every rotary call shares: no Partial on x, cos or sin; D whole.
const Layout& checked_x(const OpCall& call, const RotaryOperands& o, int64_t reference) {
  for (int64_t t : {o.x, o.cos, o.sin}) {
    if (t < 0) continue;
    if (const auto op = call.layout(t).partial_op())
      fail_argument(call, t, partial_name(*op) + " input: the rotation is not linear in x and cos/sin together",
                    redistribute_partial_first({}, kAllowedLayouts));
  }
  const Layout& x = call.layout(reference);
  const auto& d_axes = x.dim_axes().back();
  if (!d_axes.empty() && reference == o.x)
    fail_argument(call, o.x,
                  "the last dim (D) is sharded on " + axis_names(x, d_axes) + "; the rotation pairs positions across D",
                  kAllowedLayouts);
  return x;
}

OpPlan rotary_rule(const OpCall& call) {
  const auto o = operands(call);
  check_mode(call);
  check_shapes(call, o);
  const Layout& x = checked_x(call, o, o.x);
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  plan.inputs[o.x] = intern(x);
  plan.inputs[o.cos] = plan_table(call, x, o.cos, plan.refused).input;
  plan.inputs[o.sin] = plan_table(call, x, o.sin, plan.refused).input;
  plan.outputs = {plan.inputs[o.x]};
  return plan;
}

OpPlan rotary_backward_rule(const OpCall& call) {
  const auto o = operands(call);
  check_mode(call);
  const int64_t reference = o.x >= 0 ? o.x : o.grad;
  RotaryOperands shapes = o;
  shapes.x = reference;
  check_shapes(call, shapes);
  // Without x (npu's optional x) grad stands for it; a grad sharded on D is gathered there.
  const Layout& given = checked_x(call, o, reference);
  layout::DimAxes dims = given.dim_axes();
  dims.back().clear();
  const auto x = make_layout(given, given.global_shape(), std::move(dims));
  std::string unused;  // forward raised it already; a backward may cut its tables
  const auto cos = plan_table(call, *x, o.cos, unused), sin = plan_table(call, *x, o.sin, unused);
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  plan.inputs[o.grad] = x;  // a Partial grad is reduced (the backward is linear in it)
  if (o.x >= 0) plan.inputs[o.x] = x;
  plan.inputs[o.cos] = cos.input;
  plan.inputs[o.sin] = sin.input;
  plan.outputs = {x, cos.gradient, sin.gradient};
  return plan;
}

}  // namespace

void register_rotary(Registry& r) {
  r.kernels(&kernels::register_rotary_kernels);
  // The mode changes no layout, but it is keyed: the rule checks it (and D against it).
  r.add("hypershard::rotary_position_embedding", &rotary_rule, KeyScalars::kAll);
  r.add("hypershard::rotary_position_embedding_backward", &rotary_backward_rule, KeyScalars::kAll);
  r.add("npu::npu_rotary_mul", &rotary_rule, KeyScalars::kAll);
  r.add("npu::npu_rotary_mul_backward", &rotary_backward_rule, KeyScalars::kAll);
  r.add("npu::npu_rotary_position_embedding", &rotary_rule, KeyScalars::kAll);
  r.add("npu::npu_rotary_position_embedding_backward", &rotary_backward_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
