// The contract between the dispatch framework (runtime/dispatch.cpp) and the operator rules
// (one file per family in this folder).
//
// preprocess builds an OpCall: the schema-normalised arguments with, for every tensor
// argument, its layout (a plain tensor counts as Replicate on the call's mesh). A rule is a pure
// function OpCall -> OpPlan: the layout each tensor argument must have for the local call (the
// framework redistributes first where it differs), the layout of every returned tensor, and
// optionally a rewrite of non-tensor arguments into local terms or an expand implementation
// that replaces the plain ATen call. Plans are cached per op by a key of the input layouts,
// dtypes and the scalar arguments the rule declares relevant.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "layout/error.h"
#include "layout/intern.h"
#include "runtime/device_mesh.h"

namespace hypershard::ops {

using layout::Layout;
using layout::LayoutPtr;
using layout::ReduceOp;

struct TensorArg {
  int64_t arg = 0;    // schema argument index
  int64_t item = -1;  // position inside a Tensor[] / Tensor?[] argument; -1 for a single tensor
  LayoutPtr layout;   // a plain tensor: Replicate on the call's mesh with its own shape
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool is_dtensor = false;
};

struct OpCall {
  const c10::OperatorHandle* op = nullptr;
  const c10::IValue* args = nullptr;       // the schema's arguments, in order
  c10::SmallVector<TensorArg, 4> tensors;  // on the stack for the usual op
  runtime::DeviceMeshPtr mesh;
  // Set while autograd's engine runs a backward pass: the formulas there are torch's, not the
  // user's, so a rule may insert a redistribution it would refuse in forward code.
  bool in_backward = false;

  const c10::FunctionSchema& schema() const { return op->schema(); }
  std::string name() const;  // "aten::add.Tensor"
  const c10::IValue& arg(int64_t index) const { return args[index]; }
  int64_t num_args() const { return static_cast<int64_t>(schema().arguments().size()); }
  // Index of the named schema argument; raises when the schema has none.
  int64_t arg_index(const char* name) const;
  // Index into `tensors` of schema argument `arg` (item `item`), or -1 (None / absent).
  int64_t tensor_index(int64_t arg, int64_t item = -1) const;
  // Index into `tensors` of the first schema argument with one of these names, or -1: one rule
  // for ops whose schemas name the same operand differently (hypershard's `x`, torch_npu's `self`).
  int64_t tensor_named(std::initializer_list<const char*> names) const;
  const Layout& layout(int64_t tensor) const { return *tensors.at(tensor).layout; }
  std::string describe_inputs() const;  // "self [4, 6] ("dp", "None"), other [6] ("None",)"
};

using LocalizeFn = std::function<void(const OpCall&, c10::IValue* args)>;
using ExpandFn = std::function<void(const OpCall&, torch::jit::Stack&)>;
// A view's global geometry (strides, storage offset) from its input wrapper's, or nullopt when
// the rule cannot tell cheaply (the framework then runs the view on meta tensors).
using ViewGeometry = std::pair<std::vector<int64_t>, int64_t>;
using GeometryFn = std::function<std::optional<ViewGeometry>(const at::Tensor& input)>;

struct OpPlan {
  std::vector<LayoutPtr> inputs;   // per OpCall::tensors
  std::vector<LayoutPtr> outputs;  // per returned tensor, lists flattened
  LocalizeFn localize;             // optional
  ExpandFn expand;                 // optional: pops the arguments, pushes the returns
  GeometryFn geometry;             // optional, single-output views of a sharded input
  // The outputs' sizes depend on the data (nonzero, masked_select): the rule plans Replicate
  // outputs with placeholder shapes, and the framework takes each global shape from the local
  // result (the same on every rank, since the inputs are whole).
  bool data_shaped = false;
  // A view op whose outputs the expand step computes as new tensors (an exchange between ranks
  // built them): like a view of a redistributed input, they do not alias the base, so writes
  // through them are refused.
  bool copies = false;
  // An int-list argument (a view's `size`) that the framework rewrites to the first output's
  // local shape on this rank where that output is split; -1: none.
  int64_t local_shape_arg = -1;
  // An int argument whose GLOBAL value this rank shifts by a constant of its own (tril's diagonal:
  // its block's row minus column offset); -1: none. Set at plan time: plans are per process, so
  // per rank. Unlike `localize`, the typed fast path applies it too.
  int64_t shifted_int_arg = -1;
  int64_t int_shift = 0;
  // Non-empty when this plan redistributes an input beyond what strict mode allows: set by the
  // dispatch when the rule refused the caller's layouts and this plan is for redistributed ones
  // (default mode's implicit redistribution), or by a rule that accepts a layout only by cutting
  // it locally (a replicated operand sliced to match another's shards). Strict mode raises the
  // text; default mode counts the call as implicit.
  std::string refused;
};

using Rule = OpPlan (*)(const OpCall&);

// Which non-tensor arguments join the plan-cache key.
enum class KeyScalars : int8_t {
  kAll,   // every non-tensor argument (safe default: dims, sizes, flags)
  kNone,  // none: the plan depends on layouts and dtypes only (alpha, lr, eps, ...)
};

// Writes into a plain (non-DTensor) tensor argument from sharded DTensor inputs: by default the
// dispatch refuses them in strict mode and computes them on gathered inputs in default mode
// (the plain tensor would hold one rank's piece); kPlanned: the rule plans them itself, leaving
// every rank's plain tensor the same (GradScaler's found_inf, all-reduced).
enum class PlainWrites : int8_t { kRefused, kPlanned };

struct RuleEntry {
  Rule rule = nullptr;
  KeyScalars key = KeyScalars::kAll;
  const char* family = "";  // the family file that registered it ("pointwise", "rotary", ...)
  PlainWrites plain_writes = PlainWrites::kRefused;
};

// One registry for every family; filled by register_all (no static initialisers).
class Registry {
 public:
  void add(const std::string& op_name, Rule rule, KeyScalars key = KeyScalars::kAll,
           PlainWrites plain_writes = PlainWrites::kRefused);
  const RuleEntry* find(const std::string& op_name) const;
  std::vector<std::string> names() const;
  // register_all names the family whose register_<family> runs next (docs/operators.md lists
  // the ops per family file).
  void set_family(const char* family) { family_ = family; }
  // (op name, family) for every rule, sorted by name.
  std::vector<std::pair<std::string, std::string>> families() const;
  // A family's kernels (hypershard's own ops, or kernels at a key where torch's would be wrong on
  // a DTensor), registered next to the family's rules; install_dispatch installs them once, in
  // registration order, before the typed kernels (which skip an op that has a kernel already).
  void kernels(void (*install)()) { kernel_installers_.push_back(install); }
  void install_kernels() const {
    for (auto* install : kernel_installers_) install();
  }

 private:
  std::unordered_map<std::string, RuleEntry> rules_;
  std::vector<void (*)()> kernel_installers_;
  const char* family_ = "";
};

const Registry& registry();

// ------------------------------------------------------------------ helpers for rules

// What a rule throws for arguments it does not cover (a boolean mask index: a data-dependent
// size): default mode computes such a call with the fallback; strict mode raises its text, a
// "Missing operator" for these arguments. Never retried with other layouts.
class NotCovered : public layout::LayoutError {
 public:
  using layout::LayoutError::LayoutError;
};
[[noreturn]] void not_covered(const OpCall& call, const std::string& why);

// The house error: "hypershard: <op>: argument <name> (#i) <layout>: <problem>; allowed: <set>".
// The same text without raising (a plan that strict mode refuses carries it in OpPlan::refused).
std::string argument_error(const OpCall& call, int64_t tensor, const std::string& problem, const std::string& allowed);
[[noreturn]] void fail_argument(const OpCall& call, int64_t tensor, const std::string& problem,
                                const std::string& allowed);
[[noreturn]] void fail_call(const OpCall& call, const std::string& problem);

inline bool is_sum_like(ReduceOp op) { return op == ReduceOp::Sum || op == ReduceOp::Avg; }
// Tensor `t` may not be a sum/avg Partial in forward code (the house error, with `allowed`);
// inside a backward pass the formula is torch's, so the caller reduces it instead. Returns
// whether `t` is Partial at all (the caller then drops the Partial: a redistribution reduces it).
bool refuse_sum_partial(const OpCall& call, int64_t t, const std::string& allowed);
// Tensor `t` (-1: absent) may not be Partial at all, in forward or backward code: "Partial(op)
// input is not supported: <why>; allowed: Replicate or Shard (...)".
void reject_partial(const OpCall& call, int64_t t, const std::string& why);
// `dim` in [-ndim, ndim) made non-negative (a 0-d tensor takes -1 and 0); out of range is the
// house error, raised on every rank alike before anything runs.
int64_t wrap_dim(const OpCall& call, int64_t dim, int64_t ndim);
// A concrete int / SymInt argument as int64_t, and an int[] / SymInt[] argument as a vector
// (the boxed stack carries either form, depending on the schema and the torch version).
int64_t int_arg(const c10::IValue& v);
std::vector<int64_t> int_list(const c10::IValue& v);

// Each returned tensor's GLOBAL shape: the op run on meta tensors of its tensor arguments' global
// shapes and dtypes, the other arguments as given (tensors and Tensor[] lists); an undefined
// return (a masked-out gradient) reports a 0-d shape.
std::vector<std::vector<int64_t>> meta_output_shapes(const OpCall& call);

// How many blocks `dim` of `l` is split into (the product of its axes' sizes): 1 when it is whole
// or sharded over axes of one rank only (nothing to exchange then).
inline int64_t dim_parts(const Layout& l, int64_t dim) {
  int64_t parts = 1;
  for (int64_t axis : l.dim_axes()[dim]) parts *= l.mesh()->shape()[axis];
  return parts;
}

// torch's pad, pooling, sampling and unfolding kernels refuse an empty non-batch dim, which an
// uneven shard gives some rank (3 channels over 4 ranks). Where some planned input has an empty
// block on some rank, the plan gets an expand (unless it has one) that makes the results of a
// rank holding an empty tensor argument itself: zeros of each output's block -- an empty block,
// or a zero part of a Partial(sum) (the caller's rule vouches for one of the two), no collective
// involved. Output o has dtype dtypes[o] (Undefined or absent: the empty argument's) and is
// undefined where the bool[] argument `mask_arg` (-1: none; a backward's output_mask) is false.
void skip_empty_blocks(OpPlan& plan, std::vector<c10::ScalarType> dtypes = {}, int64_t mask_arg = -1);

LayoutPtr make_layout(const Layout& like, std::vector<int64_t> shape, layout::DimAxes dims,
                      layout::PartialOps partial = {});
LayoutPtr replicate_like(const Layout& like, std::vector<int64_t> shape);
LayoutPtr intern(const Layout& layout);

}  // namespace hypershard::ops
