// Autograd on DTensors for other libraries' ops whose own autograd never sees a DTensor: kernels
// at AutogradPrivateUse2 (a DTensor's autograd key) that record a backward made of ops with
// hypershard rules.
//
//   npu::npu_rms_norm(self, gamma, epsilon)          backward: npu::npu_rms_norm_backward(dy, self,
//                                                    gamma, rstd) -> (dx, dgamma)
//   npu::npu_rotary_mul(self, r1, r2[, rotary_mode]) backward: npu::npu_rotary_mul_backward(grad,
//                                                    self, r1, r2[, rotary_mode]) -> (dx, dr1, dr2)
//   npu::npu_rms_norm_backward, npu::npu_rotary_mul_backward
//                                                    run below autograd; a second derivative raises
//                                                    (forbid_second_derivative, as hypershard's own
//                                                    backward ops)
//   transformers::grouped_mm_fallback(input, weight, offs)
//                                                    backward: aten::_grouped_mm twice, per group
//                                                    dinput = grad @ weight[e]^T, dweight[e] =
//                                                    input^T @ grad (its rows of the group)
//
// Why: torch_npu registers its ops' autograd at its device's key (AutogradPrivateUse1), so a
// DTensor (AutogradPrivateUse2) reached no autograd kernel and no backward was recorded.
// transformers' fallback does have an Autograd kernel, but its backward writes each group's
// gradient with mm(out=) into zeros_like(weight)[e] / [start:end]: on an expert- or token-sharded
// DTensor those are slices across the sharded dim, which are not views of a shard ("does not alias
// its base"). The backwards here are the same maths as one op over all groups, each with a rule
// (csrc/ops/normalization.cpp, rotary.cpp, matmul.cpp).
//
// Registration before definition: these ops are defined only when torch_npu / transformers is
// imported, possibly after hypershard. The dispatcher accepts an impl for an op that has no schema
// yet and keeps it for the def, so the kernels are in place whatever the import order, also for
// the first call (a lazy hook on the registration listener would run only at the next
// sync_registrations, after a call could have missed it). They are boxed: a boxed kernel carries
// no inferred signature, so a torch_npu whose schema differs (npu_rotary_mul without rotary_mode in
// older releases) still defines its op; the kernels read their arguments by name.
#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Calls ns::name (overload "") with `args`, the schema's defaults filling the trailing arguments
// not given and an argument the schema lacks dropped (`optional_from`: the index from which args
// may be absent from the schema, e.g. rotary_mode). Returns the outputs.
std::vector<c10::IValue> call_op(const char* name, std::vector<c10::IValue> args, size_t optional_from = SIZE_MAX) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  const auto& params = op.schema().arguments();
  TORCH_CHECK(params.size() >= std::min(args.size(), optional_from), "hypershard: ", name, ": its schema ", op.schema(),
              " takes fewer arguments than hypershard's autograd kernel passes");
  if (args.size() > params.size()) args.resize(params.size());
  torch::jit::Stack stack(args.begin(), args.end());
  for (size_t i = stack.size(); i < params.size(); ++i) {
    TORCH_CHECK(params[i].default_value().has_value(), "hypershard: ", name, ": argument ", params[i].name(),
                " has no default in ", op.schema());
    stack.push_back(*params[i].default_value());
  }
  op.callBoxed(stack);
  return stack;
}

const c10::IValue& arg_named(const c10::OperatorHandle& op, const torch::jit::Stack& stack, const char* name) {
  const auto& params = op.schema().arguments();
  const auto index = op.schema().argumentIndexWithName(name);
  TORCH_CHECK(index.has_value(), "hypershard: ", op.schema().name(), ": no argument '", name,
              "' in its schema; allowed: hypershard's autograd kernel reads ", name);
  return stack[stack.size() - params.size() + *index];
}

// The gradient of forward input `input` from a backward op's output (None: no gradient).
at::Tensor grad_if(AutogradContext* ctx, size_t input, const c10::IValue& grad) {
  return ctx->needs_input_grad(input) && !grad.isNone() ? grad.toTensor() : at::Tensor();
}

// ------------------------------------------------------------------ npu::npu_rms_norm

class NpuRmsNorm : public torch::autograd::Function<NpuRmsNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gamma, double eps) {
    std::vector<c10::IValue> out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = call_op("npu::npu_rms_norm", {x, gamma, eps});
    }
    const at::Tensor y = out.at(0).toTensor(), rstd = out.at(1).toTensor();
    ctx->save_for_backward({x, gamma, rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto out = call_op("npu::npu_rms_norm_backward", {grads[0], saved[0], saved[1], saved[2]});
    return {grad_if(ctx, 0, out.at(0)), grad_if(ctx, 1, out.at(1)), at::Tensor()};
  }
};

void npu_rms_norm_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const at::Tensor x = arg_named(op, *stack, "self").toTensor(), gamma = arg_named(op, *stack, "gamma").toTensor();
  const double eps = arg_named(op, *stack, "epsilon").toDouble();
  torch::jit::drop(*stack, op.schema().arguments().size());
  auto out = NpuRmsNorm::apply(x, gamma, eps);
  torch::jit::push(*stack, out[0], out[1]);
}

// ------------------------------------------------------------------ npu::npu_rotary_mul

// rotary_mode: "half" where the schema has no such argument (torch_npu releases before it).
std::string rotary_mode(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (!op.schema().argumentIndexWithName("rotary_mode")) return "half";
  return std::string(arg_named(op, stack, "rotary_mode").toStringRef());
}

class NpuRotaryMul : public torch::autograd::Function<NpuRotaryMul> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                            const std::string& mode) {
    ctx->save_for_backward({x, r1, r2});
    ctx->saved_data["rotary_mode"] = mode;
    at::AutoDispatchBelowADInplaceOrView below;
    return call_op("npu::npu_rotary_mul", {x, r1, r2, mode}, 3).at(0).toTensor();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto out = call_op("npu::npu_rotary_mul_backward",
                             {grads[0], saved[0], saved[1], saved[2], ctx->saved_data["rotary_mode"]}, 4);
    return {grad_if(ctx, 0, out.at(0)), grad_if(ctx, 1, out.at(1)), grad_if(ctx, 2, out.at(2)), at::Tensor()};
  }
};

void npu_rotary_mul_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const at::Tensor x = arg_named(op, *stack, "self").toTensor();
  const at::Tensor r1 = arg_named(op, *stack, "r1").toTensor(), r2 = arg_named(op, *stack, "r2").toTensor();
  const std::string mode = rotary_mode(op, *stack);
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, NpuRotaryMul::apply(x, r1, r2, mode));
}

// ------------------------------------------------------------------ the backward ops

// Below autograd; with create_graph=True the outputs get a grad_fn that raises if reached.
void backward_op_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  std::vector<at::Tensor> inputs;
  for (size_t i = stack->size() - n; i < stack->size(); ++i)
    if ((*stack)[i].isTensor()) inputs.push_back((*stack)[i].toTensor());
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(*stack);
  }
  std::vector<at::Tensor> outputs;
  const size_t m = op.schema().returns().size();
  for (size_t i = stack->size() - m; i < stack->size(); ++i)
    if ((*stack)[i].isTensor()) outputs.push_back((*stack)[i].toTensor());
  forbid_second_derivative(outputs, inputs, op.schema().name().c_str());
}

// ------------------------------------------------------------------ transformers::grouped_mm_fallback

class GroupedMmFallback : public torch::autograd::Function<GroupedMmFallback> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& offs) {
    ctx->save_for_backward({input, weight, offs});
    at::AutoDispatchBelowADInplaceOrView below;
    return call_op("transformers::grouped_mm_fallback", {input, weight, offs}).at(0).toTensor();
  }

  // Group e holds rows [offs[e-1], offs[e]) of input and of the output: dinput's rows are
  // grad's rows times weight[e]^T ("mk,ekn->mn" with weight transposed), dweight[e] the product of
  // those rows of input^T and grad ("km,mn->ekn"); rows past offs[-1] get no gradient, as they
  // got zeros. With create_graph=True these _grouped_mm calls are recorded by torch's derivative
  // of _grouped_mm (no test compares second derivatives: transformers' own backward has none).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &offs = saved[2];
    const at::Tensor& grad = grads[0];
    at::Tensor dinput, dweight;
    if (ctx->needs_input_grad(0)) dinput = at::_grouped_mm(grad, weight.transpose(-2, -1), offs);
    if (ctx->needs_input_grad(1)) dweight = at::_grouped_mm(input.transpose(0, 1), grad, offs);
    return {dinput, dweight, at::Tensor()};
  }
};

void grouped_mm_fallback_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const at::Tensor input = arg_named(op, *stack, "input").toTensor();
  const at::Tensor weight = arg_named(op, *stack, "weight").toTensor(), offs = arg_named(op, *stack, "offs").toTensor();
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, GroupedMmFallback::apply(input, weight, offs));
}

}  // namespace

void register_external_autograd_kernels() {
  static auto* npu =
      new torch::Library(torch::Library::IMPL, "npu", c10::DispatchKey::AutogradPrivateUse2, __FILE__, __LINE__);
  npu->impl("npu_rms_norm", torch::CppFunction::makeFromBoxedFunction<&npu_rms_norm_autograd>());
  npu->impl("npu_rms_norm_backward", torch::CppFunction::makeFromBoxedFunction<&backward_op_autograd>());
  npu->impl("npu_rotary_mul", torch::CppFunction::makeFromBoxedFunction<&npu_rotary_mul_autograd>());
  npu->impl("npu_rotary_mul_backward", torch::CppFunction::makeFromBoxedFunction<&backward_op_autograd>());
  static auto* transformers = new torch::Library(torch::Library::IMPL, "transformers",
                                                 c10::DispatchKey::AutogradPrivateUse2, __FILE__, __LINE__);
  transformers->impl("grouped_mm_fallback", torch::CppFunction::makeFromBoxedFunction<&grouped_mm_fallback_autograd>());
}

}  // namespace hypershard::kernels
