#include "ops/op_call.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/kernels.h"
#include "ops/families.h"
#include "ops/user_rules.h"
#include "ops/partial.h"

namespace hypershard::ops {

std::string OpCall::name() const {
  const auto& n = schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

int64_t OpCall::tensor_named(std::initializer_list<const char*> names) const {
  for (const char* name : names)
    if (const auto index = schema().argumentIndexWithName(name)) return tensor_index(static_cast<int64_t>(*index));
  return -1;
}

int64_t OpCall::arg_index(const char* name) const {
  const auto index = schema().argumentIndexWithName(name);
  if (!index) fail_call(*this, std::string("internal error: no argument named '") + name + "'");
  return static_cast<int64_t>(*index);
}

int64_t OpCall::tensor_index(int64_t arg, int64_t item) const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].arg == arg && tensors[i].item == item) return static_cast<int64_t>(i);
  return -1;
}

std::string OpCall::describe_inputs() const {
  std::string out;
  for (const auto& t : tensors) {
    const auto& arg_name = schema().arguments()[t.arg].name();
    out += (out.empty() ? "" : ", ") + arg_name;
    if (t.item >= 0) out += "[" + std::to_string(t.item) + "]";
    if (t.layout) {
      out += " " + t.layout->to_string();
    } else {  // a plain tensor before its Replicate layout is made
      const auto& v = args[t.arg];
      const at::Tensor tensor =
          t.item < 0 ? v.toTensor()
                     : (v.isTensorList() ? v.toTensorList().get(t.item) : v.toList().get(t.item).toTensor());
      out += " " + layout::shape_string(tensor.sizes().vec());
    }
    if (!t.is_dtensor) out += " (plain tensor)";
  }
  return out.empty() ? "no tensor arguments" : out;
}

std::string argument_error(const OpCall& call, int64_t tensor, const std::string& problem, const std::string& allowed) {
  const auto& t = call.tensors[tensor];
  std::string arg = call.schema().arguments()[t.arg].name();
  if (t.item >= 0) arg += "[" + std::to_string(t.item) + "]";
  return "hypershard: " + call.name() + ": argument " + arg + " (#" + std::to_string(t.arg) + ") " +
         t.layout->to_string() + ": " + problem + "; allowed: " + allowed;
}

void fail_argument(const OpCall& call, int64_t tensor, const std::string& problem, const std::string& allowed) {
  throw layout::LayoutError(argument_error(call, tensor, problem, allowed));
}

void not_covered(const OpCall& call, const std::string& why) {
  throw NotCovered("hypershard: Missing operator " + call.name() + " for these arguments (" + why +
                   "): no distributed rule covers them; inputs: " + call.describe_inputs());
}

bool refuse_sum_partial(const OpCall& call, int64_t t, const std::string& allowed) {
  const auto op = call.layout(t).partial_op();
  if (op && is_sum_like(*op) && !call.in_backward)
    fail_argument(call, t, partial_name(*op) + " input is not supported by this op", allowed);
  return op.has_value();
}

void reject_partial(const OpCall& call, int64_t t, const std::string& why) {
  if (t >= 0 && call.layout(t).has_partial())
    fail_argument(call, t, partial_name(call.layout(t)) + " input is not supported: " + why,
                  redistribute_partial_first());
}

void fail_call(const OpCall& call, const std::string& problem) {
  layout::fail(call.name(), problem + " (inputs: " + call.describe_inputs() + ")");
}

int64_t int_arg(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().expect_int(); }

std::vector<int64_t> int_list(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  std::vector<int64_t> out;
  for (const auto& s : v.toSymIntVector()) out.push_back(s.expect_int());
  return out;
}

int64_t wrap_dim(const OpCall& call, int64_t dim, int64_t ndim) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  if (dim < -n || dim >= n) fail_call(call, layout::str_cat("dim ", dim, " is out of range for a ", ndim, "-d tensor"));
  return dim < 0 ? dim + n : dim;
}

torch::Library& aten_autograd_kernels() {
  static auto* library =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse2, __FILE__, __LINE__);
  return *library;
}

LayoutPtr intern(const Layout& layout) { return layout::intern_layout(layout); }

std::vector<std::vector<int64_t>> meta_output_shapes(const OpCall& call) {
  torch::jit::Stack meta;
  for (int64_t a = 0; a < call.num_args(); ++a) {
    const c10::IValue& v = call.arg(a);
    meta.push_back(v.isTensorList() ? c10::IValue(v.toTensorList().copy()) : v);  // its items replaced below
  }
  for (const auto& t : call.tensors) {
    at::Tensor shadow = at::empty(t.layout->global_shape(), at::TensorOptions().dtype(t.dtype).device(c10::kMeta));
    if (t.item < 0) {
      meta[t.arg] = std::move(shadow);
    } else {
      if (!meta[t.arg].isTensorList())
        fail_call(call, "internal error: meta_output_shapes takes tensors and Tensor[] lists only");
      meta[t.arg].toTensorList().set(t.item, std::move(shadow));
    }
  }
  call.op->callBoxed(&meta);
  std::vector<std::vector<int64_t>> out;
  for (const auto& r : meta)
    if (r.isTensor()) out.push_back(r.toTensor().defined() ? r.toTensor().sizes().vec() : std::vector<int64_t>{});
  return out;
}

LayoutPtr make_layout(const Layout& like, std::vector<int64_t> shape, layout::DimAxes dims,
                      layout::PartialOps partial) {
  return intern(Layout::create(like.mesh(), std::move(shape), std::move(dims), std::move(partial)));
}

LayoutPtr replicate_like(const Layout& like, std::vector<int64_t> shape) {
  return intern(Layout::replicate(like.mesh(), std::move(shape)));
}

namespace {
// Does sharding leave some rank an empty block of a non-empty dim (3 channels over 4 ranks)?
bool sharding_leaves_a_block_empty(const Layout& l) {
  if (!l.is_sharded_anywhere()) return false;
  for (int64_t p = 0; p < l.mesh()->size(); ++p) {
    const auto local = l.local_shape_at(p);
    for (int64_t d = 0; d < l.ndim(); ++d)
      if (local[d] == 0 && l.global_shape()[d] > 0) return true;
  }
  return false;
}
}  // namespace

void skip_empty_blocks(OpPlan& plan, std::vector<c10::ScalarType> dtypes, int64_t mask_arg) {
  bool empty = false;
  for (const LayoutPtr& l : plan.inputs) empty = empty || sharding_leaves_a_block_empty(*l);
  if (plan.expand || !empty) return;
  dtypes.resize(plan.outputs.size(), c10::ScalarType::Undefined);
  plan.expand = [outputs = plan.outputs, dtypes, mask_arg](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    const c10::IValue* args = stack.data() + (stack.size() - num);
    at::Tensor empty;
    for (size_t i = 0; i < num && !empty.defined(); ++i)
      if (args[i].isTensor() && args[i].toTensor().defined() && args[i].toTensor().numel() == 0)
        empty = args[i].toTensor();
    if (!empty.defined()) {
      c.op->callBoxed(stack);
      return;
    }
    std::vector<bool> mask(outputs.size(), true);
    if (mask_arg >= 0) {
      const auto list = args[mask_arg].toBoolList();
      for (size_t o = 0; o < outputs.size() && o < list.size(); ++o) mask[o] = list.get(o);
    }
    torch::jit::drop(stack, num);
    for (size_t o = 0; o < outputs.size(); ++o) {
      if (!mask[o]) {
        stack.emplace_back(at::Tensor());
        continue;
      }
      auto options = empty.options();
      if (dtypes[o] != c10::ScalarType::Undefined) options = options.dtype(dtypes[o]);
      stack.emplace_back(at::zeros(outputs[o]->local_shape_at(c.mesh->position()), options));
    }
  };
}

void Registry::add(const std::string& op_name, Rule rule, KeyScalars key, PlainWrites plain_writes) {
  HS_CHECK(rules_.emplace(op_name, RuleEntry{rule, key, family_, plain_writes}).second, "registry", "two rules for ",
           op_name);
}

std::vector<std::pair<std::string, std::string>> Registry::families() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [name, entry] : rules_) out.emplace_back(name, entry.family);
  std::sort(out.begin(), out.end());
  return out;
}

const RuleEntry* Registry::find(const std::string& op_name) const {
  auto it = rules_.find(op_name);
  return it == rules_.end() ? nullptr : &it->second;
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : rules_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

const Registry& registry() {
  static const Registry* instance = [] {
    auto* r = new Registry();
    register_all(*r);
    return r;
  }();
  return *instance;
}

void add_late_rule(const char* family, const std::string& op_name, Rule rule) {
  // The instance registry() made is not const itself: only its users see it so.
  auto& r = const_cast<Registry&>(registry());
  r.set_family(family);
  r.add(op_name, rule);
}

void register_all(Registry& r) {
  r.set_family("pointwise");
  register_pointwise(r);
  r.set_family("tensor_ops");
  register_tensor_ops(r);
  r.set_family("views");
  register_views(r);
  r.set_family("matmul");
  register_matmul(r);
  r.set_family("reductions");
  register_reductions(r);
  r.set_family("loss");
  register_loss(r);
  r.set_family("elementwise_loss");
  register_elementwise_loss(r);
  r.set_family("foreach");
  register_foreach(r);
  r.set_family("embedding");
  register_embedding(r);
  r.set_family("normalization");
  register_normalization(r);
  r.set_family("attention");
  register_attention(r);
  r.set_family("random");
  register_random(r);
  r.set_family("along_dims");
  register_along_dims(r);
  r.set_family("along_sharded");
  register_along_sharded(r);
  r.set_family("masked");
  register_masked(r);
  r.set_family("assembly");
  register_assembly(r);
  r.set_family("lookups");
  register_lookups(r);
  r.set_family("convolution");
  register_convolution(r);
  r.set_family("rotary");
  register_rotary(r);
  r.set_family("resampling");
  register_resampling(r);
  r.set_family("spatial");
  register_spatial(r);
  r.set_family("pairwise");
  register_pairwise(r);
  r.set_family("pointwise");
  register_tagged_pointwise(r);
  // Kernels without rules of their own: composites.cpp's (ops whose composite kernels read
  // argument data) and other libraries' ops' autograd (whose backward ops have rules in the
  // normalization, rotary and matmul families).
  r.kernels(&register_composite_kernels);
  r.kernels(&kernels::register_external_autograd_kernels);
}

}  // namespace hypershard::ops
