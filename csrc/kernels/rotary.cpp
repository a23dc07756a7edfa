// hypershard::rotary_position_embedding: y = rot_a(x) * cos + sign * rot_b(x) * sin, one fused
// pass over x with cos and sin broadcast to it, forward and backward, CPU, fp32/fp64/bf16/fp16.
//
//   rotary_position_embedding(Tensor x, Tensor cos, Tensor sin, int mode=0) -> Tensor
//   rotary_position_embedding_backward(Tensor grad, Tensor x, Tensor cos, Tensor sin, int mode,
//                                      bool[3] output_mask) -> (Tensor dx, Tensor dcos, Tensor dsin)
//
// The four modes of the Ascend operator (CANN's aclnnRotaryPositionEmbedding), D = x.size(-1):
//   0 half              rotate = cat(-x2, x1) of the two halves                 (GPT-NeoX)
//   1 interleave        rotate[2k] = -x[2k+1], rotate[2k+1] = x[2k]             (GPT-J)
//   2 quarter           rotate = cat(-x2, x1, -x4, x3) of the four quarters
//   3 interleave-half   e = x[..., ::2], o = x[..., 1::2]:
//                       y = cat(e, o) * cos + cat(-o, e) * sin
// Each is, per output position i of a row: y[i] = x[a(i)] * cos[i] + s(i) * x[b(i)] * sin[i],
// with a and b permutations of [0, D) and s(i) = +-1 (a is the identity except in mode 3). The
// backward follows: dx[a(i)] += g[i] cos[i], dx[b(i)] += s(i) g[i] sin[i], dcos[i] = g[i] x[a(i)],
// dsin[i] = s(i) g[i] x[b(i)], the last two summed over the dims cos / sin broadcast on.
//
// Arithmetic: every product and sum in float (double for double inputs), one rounding to the
// output dtype at the end; dcos / dsin are summed over the broadcast dims in float before that
// rounding. x, cos and sin have one rank; cos and sin each dim equal to x's or 1, the last dim D.
// Layouts BNSD, BSND, SBND are all this (the kernel reads no layout name).
//
// The autograd kernel (at the Autograd alias key, so DTensors get it too) saves x, cos, sin and
// calls the backward op; both ops below autograd reach hypershard's dispatch for DTensors, where
// one rule (csrc/ops/rotary.cpp) serves them and torch_npu's equivalents.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

// y[i] = x[a[i]] * cos[i] + sign[i] * x[b[i]] * sin[i] within one row of D elements.
struct RotaryMaps {
  std::vector<int64_t> a, b, a_inverse, b_inverse;
  std::vector<int8_t> sign;
};

RotaryMaps rotary_maps(int64_t d, int64_t mode) {
  RotaryMaps m;
  m.a.resize(d);
  m.b.resize(d);
  m.sign.resize(d);
  const int64_t half = d / 2, quarter = d / 4;
  for (int64_t i = 0; i < d; ++i) {
    switch (mode) {
      case 0:  // half
        m.a[i] = i;
        m.b[i] = i < half ? i + half : i - half;
        m.sign[i] = i < half ? -1 : 1;
        break;
      case 1:  // interleave
        m.a[i] = i;
        m.b[i] = i % 2 == 0 ? i + 1 : i - 1;
        m.sign[i] = i % 2 == 0 ? -1 : 1;
        break;
      case 2: {  // quarter
        const bool first = (i / quarter) % 2 == 0;
        m.a[i] = i;
        m.b[i] = first ? i + quarter : i - quarter;
        m.sign[i] = first ? -1 : 1;
        break;
      }
      default:  // 3: interleave-half
        m.a[i] = i < half ? 2 * i : 2 * (i - half) + 1;
        m.b[i] = i < half ? 2 * i + 1 : 2 * (i - half);
        m.sign[i] = i < half ? -1 : 1;
        break;
    }
  }
  m.a_inverse.resize(d);
  m.b_inverse.resize(d);
  for (int64_t i = 0; i < d; ++i) {
    m.a_inverse[m.a[i]] = i;
    m.b_inverse[m.b[i]] = i;
  }
  return m;
}

// Offsets of cos / sin rows for each row of x: cos expanded to x's shape (stride 0 on the
// broadcast dims), its last dim contiguous.
struct RowOffsets {
  std::vector<int64_t> sizes;  // x's dims but the last
  std::vector<int64_t> cos_strides, sin_strides;

  RowOffsets(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t n = x.dim() - 1;
    sizes.assign(x.sizes().begin(), x.sizes().begin() + n);
    const auto ce = cos.expand(x.sizes()), se = sin.expand(x.sizes());
    cos_strides.assign(ce.strides().begin(), ce.strides().begin() + n);
    sin_strides.assign(se.strides().begin(), se.strides().begin() + n);
  }
  void at(int64_t row, int64_t& cos_off, int64_t& sin_off) const {
    cos_off = sin_off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      const int64_t i = row % sizes[d];
      row /= sizes[d];
      cos_off += i * cos_strides[d];
      sin_off += i * sin_strides[d];
    }
  }
};

int64_t grain(int64_t d) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)); }

}  // namespace

void check_rotary_arguments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 3, "hypershard::rotary_position_embedding: mode ", mode,
              " is out of range; allowed: 0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half)");
  TORCH_CHECK(x.dim() >= 1, "hypershard::rotary_position_embedding: x must have at least one dim (D)");
  const int64_t d = x.size(-1);
  TORCH_CHECK(d % 2 == 0 && (mode != 2 || d % 4 == 0), "hypershard::rotary_position_embedding: the last dim D = ", d,
              " of x must be divisible by ", mode == 2 ? 4 : 2, " for mode ", mode);
  const std::array<std::pair<const char*, const at::Tensor*>, 2> tables{{{"cos", &cos}, {"sin", &sin}}};
  for (const auto& [name, t] : tables) {
    TORCH_CHECK(t->dim() == x.dim(), "hypershard::rotary_position_embedding: ", name, " has shape ", t->sizes(),
                " and x ", x.sizes(), "; allowed: the same rank as x");
    for (int64_t i = 0; i < x.dim(); ++i)
      TORCH_CHECK(t->size(i) == x.size(i) || (t->size(i) == 1 && i != x.dim() - 1),
                  "hypershard::rotary_position_embedding: ", name, " has shape ", t->sizes(), " and x ", x.sizes(),
                  "; allowed: each dim equal to x's or 1 (broadcast), the last dim equal to D");
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "hypershard::rotary_position_embedding: ", name, " is ",
                t->scalar_type(), " and x ", x.scalar_type(), "; allowed: one dtype for x, cos and sin");
  }
  TORCH_CHECK(x.is_floating_point(), "hypershard::rotary_position_embedding: x is ", x.scalar_type(),
              "; allowed: float32, float64, bfloat16, float16");
}

at::Tensor rotary_position_embedding_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                         int64_t mode) {
  check_rotary_arguments(x_in, cos_in, sin_in, mode);
  const auto x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  auto y = at::empty_like(x);
  const int64_t d = x.size(-1);
  if (x.numel() == 0) return y;
  const int64_t rows = x.numel() / d;
  const auto maps = rotary_maps(d, mode);
  const RowOffsets offsets(x, cos, sin);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_position_embedding", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int64_t co = 0, so = 0;
        offsets.at(r, co, so);
        const scalar_t* xr = xp + r * d;
        scalar_t* yr = yp + r * d;
        for (int64_t i = 0; i < d; ++i) {
          const acc_t rotated = static_cast<acc_t>(xr[maps.b[i]]) * static_cast<acc_t>(sp[so + i]);
          yr[i] = static_cast<scalar_t>(static_cast<acc_t>(xr[maps.a[i]]) * static_cast<acc_t>(cp[co + i]) +
                                        (maps.sign[i] < 0 ? -rotated : rotated));
        }
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
    int64_t mode, std::array<bool, 3> output_mask) {
  check_rotary_arguments(x_in, cos_in, sin_in, mode);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "hypershard::rotary_position_embedding_backward: grad has shape ",
              grad_in.sizes(), " and x ", x_in.sizes(), "; allowed: grad shaped like x");
  const auto x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto grad = grad_in.to(at::toOpMathType(x.scalar_type())).contiguous();  // no rounding of grad
  const int64_t d = x.size(-1);
  const auto acc_type = at::toOpMathType(x.scalar_type());
  at::Tensor dx = output_mask[0] ? at::empty_like(x) : at::Tensor();
  // Per-element products in float, summed over the broadcast dims below before rounding.
  at::Tensor dcos_full = output_mask[1] ? at::empty(x.sizes(), x.options().dtype(acc_type)) : at::Tensor();
  at::Tensor dsin_full = output_mask[2] ? at::empty(x.sizes(), x.options().dtype(acc_type)) : at::Tensor();
  if (x.numel() > 0) {
    const int64_t rows = x.numel() / d;
    const auto maps = rotary_maps(d, mode);
    const RowOffsets offsets(x, cos, sin);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_position_embedding_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const acc_t* gp = grad.const_data_ptr<acc_t>();
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* cp = cos.const_data_ptr<scalar_t>();
      const scalar_t* sp = sin.const_data_ptr<scalar_t>();
      scalar_t* dxp = dx.defined() ? dx.mutable_data_ptr<scalar_t>() : nullptr;
      acc_t* dcp = dcos_full.defined() ? dcos_full.mutable_data_ptr<acc_t>() : nullptr;
      acc_t* dsp = dsin_full.defined() ? dsin_full.mutable_data_ptr<acc_t>() : nullptr;
      at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          int64_t co = 0, so = 0;
          offsets.at(r, co, so);
          const acc_t* gr = gp + r * d;
          const scalar_t* xr = xp + r * d;
          if (dxp) {
            for (int64_t j = 0; j < d; ++j) {
              const int64_t i = maps.a_inverse[j], k = maps.b_inverse[j];
              const acc_t rotated = static_cast<acc_t>(gr[k]) * static_cast<acc_t>(sp[so + k]);
              dxp[r * d + j] = static_cast<scalar_t>(static_cast<acc_t>(gr[i]) * static_cast<acc_t>(cp[co + i]) +
                                                     (maps.sign[k] < 0 ? -rotated : rotated));
            }
          }
          for (int64_t i = 0; i < d; ++i) {
            const acc_t g = static_cast<acc_t>(gr[i]);
            if (dcp) dcp[r * d + i] = g * static_cast<acc_t>(xr[maps.a[i]]);
            if (dsp) {
              const acc_t v = g * static_cast<acc_t>(xr[maps.b[i]]);
              dsp[r * d + i] = maps.sign[i] < 0 ? -v : v;
            }
          }
        }
      });
    });
  } else {
    if (dcos_full.defined()) dcos_full.zero_();
    if (dsin_full.defined()) dsin_full.zero_();
  }
  auto reduce = [](const at::Tensor& full, const at::Tensor& like) {
    if (!full.defined()) return at::Tensor();
    return (full.sizes() == like.sizes() ? full : full.sum_to_size(like.sizes())).to(like.scalar_type());
  };
  return {dx, reduce(dcos_full, cos_in), reduce(dsin_full, sin_in)};
}

namespace {

const c10::OperatorHandle& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hypershard::rotary_position_embedding", "");
  return op;
}
const c10::OperatorHandle& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hypershard::rotary_position_embedding_backward", "");
  return op;
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t mode) {
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["mode"] = mode;
    at::AutoDispatchBelowADInplaceOrView below;
    return forward_op().typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>().call(
        x, cos, sin, mode);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t mode = ctx->saved_data["mode"].toInt();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)};
    auto [dx, dcos, dsin] =
        backward_op()
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&, int64_t,
                                                                  std::array<bool, 3>)>()
            .call(grads[0], saved[0], saved[1], saved[2], mode, mask);
    return {dx, dcos, dsin, at::Tensor()};
  }
};

at::Tensor rotary_position_embedding_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                          int64_t mode) {
  check_rotary_arguments(x, cos, sin, mode);
  return at::empty_like(x);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_meta(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode,
    std::array<bool, 3> output_mask) {
  check_rotary_arguments(x, cos, sin, mode);
  return {output_mask[0] ? at::empty_like(x) : at::Tensor(), output_mask[1] ? at::empty_like(cos) : at::Tensor(),
          output_mask[2] ? at::empty_like(sin) : at::Tensor()};
}

at::Tensor rotary_position_embedding_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                              int64_t mode) {
  return RotaryFunction::apply(x, cos, sin, mode);
}

// The backward op has no derivative of its own: its outputs raise if a second derivative ever
// reaches them (first-order gradients with create_graph=True work). DTensors reach hypershard's
// dispatch below autograd.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_autograd(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode,
    std::array<bool, 3> output_mask) {
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = backward_op()
              .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&, int64_t,
                                                                    std::array<bool, 3>)>()
              .call(grad, x, cos, sin, mode, output_mask);
  }
  forbid_second_derivative({std::get<0>(out), std::get<1>(out), std::get<2>(out)}, {grad, x, cos, sin},
                           "hypershard::rotary_position_embedding_backward");
  return out;
}

}  // namespace

void register_rotary_kernels() {
  static auto* def = new torch::Library(torch::Library::FRAGMENT, "hypershard", std::nullopt, __FILE__, __LINE__);
  def->def("rotary_position_embedding(Tensor x, Tensor cos, Tensor sin, int mode=0) -> Tensor");
  def->def("rotary_position_embedding_backward(Tensor grad, Tensor x, Tensor cos, Tensor sin, int mode, "
           "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  static auto* cpu = new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_cpu));
  cpu->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_cpu));
  static auto* autograd =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  autograd->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_autograd));
  autograd->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_autograd));
  // Shapes only (fake tensors, torch.compile, and the meta shadows of hypershard's dispatch).
  static auto* meta = new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Meta, __FILE__, __LINE__);
  meta->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_meta));
  meta->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_meta));
}

}  // namespace hypershard::kernels
