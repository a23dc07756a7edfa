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
// Each is y = p(x) * cos + R(p(x)) * sin with R a signed rotation of pairs (blocks of D/2 or D/4,
// or adjacent pairs) and p the identity, or (mode 3) the deinterleave evens-then-odds. R is
// antisymmetric, so the backward is dx = p^T(g * cos - R(g * sin)), dcos = g * p(x),
// dsin = g * R(p(x)), the last two summed over the dims cos / sin broadcast on.
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

#include <algorithm>
#include <array>
#include <vector>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

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

namespace {

// The rotation R of one row as contiguous loops (no index tables in the hot path, so the
// compiler vectorizes them). Modes 0 and 2 rotate blocks pairwise: out = cat(-b2, b1) for each
// pair of `block`-long blocks (block D/2 or D/4); mode 1 rotates adjacent pairs; mode 3 is mode
// 0 on the row deinterleaved (evens, then odds). R is antisymmetric (R^T = -R), which the
// backward uses: dx = P^T (g*cos - R(g*sin)), with P the deinterleave of mode 3 (else identity).
template <typename T>
void rotate(const T* in, T* out, int64_t d, int64_t mode) {
  if (mode == 1) {
    for (int64_t k = 0; k < d; k += 2) {
      out[k] = -in[k + 1];
      out[k + 1] = in[k];
    }
    return;
  }
  const int64_t block = mode == 2 ? d / 4 : d / 2;
  for (int64_t start = 0; start < d; start += 2 * block) {
    const T* first = in + start;
    const T* second = first + block;
    for (int64_t i = 0; i < block; ++i) out[start + i] = -second[i];
    for (int64_t i = 0; i < block; ++i) out[start + block + i] = first[i];
  }
}

// Row of the storage -> row of the rotation's order (mode 3: evens then odds) and back.
template <typename From, typename T>
void load_row(const From* from, T* to, int64_t d, bool deinterleave) {
  if (!deinterleave) {
    for (int64_t i = 0; i < d; ++i) to[i] = static_cast<T>(from[i]);
    return;
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) to[i] = static_cast<T>(from[2 * i]);
  for (int64_t i = 0; i < half; ++i) to[half + i] = static_cast<T>(from[2 * i + 1]);
}

template <typename T, typename To>
void store_row(const T* from, To* to, int64_t d, bool interleave) {
  if (!interleave) {
    for (int64_t i = 0; i < d; ++i) to[i] = static_cast<To>(from[i]);
    return;
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) to[2 * i] = static_cast<To>(from[i]);
  for (int64_t i = 0; i < half; ++i) to[2 * i + 1] = static_cast<To>(from[half + i]);
}

// One thread's row scratch: x's row in the rotation's order, its rotation, and the cos/sin rows
// (reloaded only when the table row changes: consecutive x rows broadcast over the same one).
template <typename acc_t>
struct RowBuffers {
  std::vector<acc_t> x, cos, sin, rot, out;
  int64_t cos_at = -1, sin_at = -1;

  explicit RowBuffers(int64_t d) : x(d), cos(d), sin(d), rot(d), out(d) {}
  void tables(const acc_t* cp, int64_t co, const acc_t* sp, int64_t so, int64_t d) {
    if (co != cos_at) load_row(cp + co, cos.data(), d, false), cos_at = co;
    if (so != sin_at) load_row(sp + so, sin.data(), d, false), sin_at = so;
  }
};

// The row loops, compiled for AVX2 too where the CPU has it (chosen once at load time; the
// default clone serves every other x86-64 CPU and other architectures build it alone).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HS_VECTOR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define HS_VECTOR_CLONES
#endif

// Rows [begin, end) of x (GLOBAL row indices: they address cos / sin through `offsets`); the
// x, grad, y and dx pointers hold rows from `base` on. Everything here is in the opmath type T.
template <typename T>
HS_VECTOR_CLONES void forward_rows(int64_t begin, int64_t end, int64_t base, int64_t d, int64_t mode,
                                   const RowOffsets& offsets, const T* xp, const T* cp, const T* sp, T* yp) {
  RowBuffers<T> buf(d);
  T *xf = buf.x.data(), *rot = buf.rot.data();
  const T *cf = buf.cos.data(), *sf = buf.sin.data();
  for (int64_t r = begin; r < end; ++r) {
    int64_t co = 0, so = 0;
    offsets.at(r, co, so);
    buf.tables(cp, co, sp, so, d);
    load_row(xp + (r - base) * d, xf, d, mode == 3);
    rotate(xf, rot, d, mode);
    T* yr = yp + (r - base) * d;  // y is in the rotation's order (mode 3 too)
    for (int64_t i = 0; i < d; ++i) yr[i] = xf[i] * cf[i] + rot[i] * sf[i];
  }
}

template <typename T>
HS_VECTOR_CLONES void backward_rows(int64_t begin, int64_t end, int64_t base, int64_t d, int64_t mode,
                                    const RowOffsets& offsets, const T* gp, const T* xp, const T* cp, const T* sp,
                                    T* dxp, T* dcp, T* dsp) {
  RowBuffers<T> buf(d);
  T *xf = buf.x.data(), *rot = buf.rot.data(), *out = buf.out.data();
  const T *cf = buf.cos.data(), *sf = buf.sin.data();
  const bool permuted = mode == 3;
  for (int64_t r = begin; r < end; ++r) {
    int64_t co = 0, so = 0;
    offsets.at(r, co, so);
    buf.tables(cp, co, sp, so, d);
    const T* gf = gp + (r - base) * d;
    if (dxp) {
      for (int64_t i = 0; i < d; ++i) out[i] = gf[i] * sf[i];
      rotate(out, rot, d, mode);
      for (int64_t i = 0; i < d; ++i) out[i] = gf[i] * cf[i] - rot[i];
      store_row(out, dxp + (r - base) * d, d, permuted);
    }
    if (dcp || dsp) {
      load_row(xp + (r - base) * d, xf, d, permuted);
      if (dcp)
        for (int64_t i = 0; i < d; ++i) dcp[r * d + i] = gf[i] * xf[i];
      if (dsp) {
        rotate(xf, rot, d, mode);
        for (int64_t i = 0; i < d; ++i) dsp[r * d + i] = gf[i] * rot[i];
      }
    }
  }
}

// bfloat16 / float16 rows are widened and narrowed by ATen's own (vectorized) conversions, a
// block of rows at a time, so the row loops always run in float: one rounding per result, and
// transient float memory of one block only.
constexpr int64_t kBlockElements = int64_t{1} << 18;

// Calls fn(first_row, row_count) per block of rows: blocks of ~kBlockElements when the rows are
// widened (transient float copies), else one block of every row.
template <typename Fn>
void for_each_block(int64_t rows, int64_t d, bool widen, Fn fn) {
  const int64_t block = widen ? std::max<int64_t>(1, kBlockElements / std::max<int64_t>(d, 1)) : rows;
  for (int64_t first = 0; first < rows; first += block) fn(first, std::min(block, rows - first));
}

}  // namespace

at::Tensor rotary_position_embedding_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                         int64_t mode) {
  check_rotary_arguments(x_in, cos_in, sin_in, mode);
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  const bool widen = acc_type != x_in.scalar_type();
  const auto x = x_in.contiguous(), cos = cos_in.to(acc_type).contiguous(), sin = sin_in.to(acc_type).contiguous();
  auto y = at::empty_like(x);
  const int64_t d = x.size(-1);
  if (x.numel() == 0) return y;
  const int64_t rows = x.numel() / d;
  const RowOffsets offsets(x, cos, sin);
  const auto x_rows = x.view({rows, d});
  auto y_rows = y.view({rows, d});
  AT_DISPATCH_FLOATING_TYPES(acc_type, "rotary_position_embedding", [&] {
    for_each_block(rows, d, widen, [&](int64_t first, int64_t count) {
      const auto xb = x_rows.narrow(0, first, count).to(acc_type);
      auto yb = widen ? at::empty({count, d}, xb.options()) : y_rows.narrow(0, first, count);
      const scalar_t* xp = xb.const_data_ptr<scalar_t>();
      scalar_t* yp = yb.mutable_data_ptr<scalar_t>();
      const scalar_t *cp = cos.const_data_ptr<scalar_t>(), *sp = sin.const_data_ptr<scalar_t>();
      at::parallel_for(first, first + count, row_grain(d), [&](int64_t begin, int64_t end) {
        forward_rows<scalar_t>(begin, end, first, d, mode, offsets, xp, cp, sp, yp);
      });
      if (widen) y_rows.narrow(0, first, count).copy_(yb);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t mode,
    std::array<bool, 3> output_mask) {
  check_rotary_arguments(x_in, cos_in, sin_in, mode);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "hypershard::rotary_position_embedding_backward: grad has shape ",
              grad_in.sizes(), " and x ", x_in.sizes(), "; allowed: grad shaped like x");
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  const bool widen = acc_type != x_in.scalar_type() || grad_in.scalar_type() != acc_type;
  const auto x = x_in.contiguous(), grad = grad_in.contiguous();
  const auto cos = cos_in.to(acc_type).contiguous(), sin = sin_in.to(acc_type).contiguous();
  const int64_t d = x.size(-1);
  at::Tensor dx = output_mask[0] ? at::empty_like(x) : at::Tensor();
  // Per-element products in float, summed over the broadcast dims below before rounding.
  at::Tensor dcos_full = output_mask[1] ? at::empty(x.sizes(), x.options().dtype(acc_type)) : at::Tensor();
  at::Tensor dsin_full = output_mask[2] ? at::empty(x.sizes(), x.options().dtype(acc_type)) : at::Tensor();
  if (x.numel() > 0) {
    const int64_t rows = x.numel() / d;
    const RowOffsets offsets(x, cos, sin);
    const auto x_rows = x.view({rows, d}), grad_rows = grad.view({rows, d});
    auto dx_rows = dx.defined() ? dx.view({rows, d}) : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES(acc_type, "rotary_position_embedding_backward", [&] {
      scalar_t* dcp = dcos_full.defined() ? dcos_full.mutable_data_ptr<scalar_t>() : nullptr;
      scalar_t* dsp = dsin_full.defined() ? dsin_full.mutable_data_ptr<scalar_t>() : nullptr;
      const scalar_t *cp = cos.const_data_ptr<scalar_t>(), *sp = sin.const_data_ptr<scalar_t>();
      for_each_block(rows, d, widen, [&](int64_t first, int64_t count) {
        // grad in any floating dtype is widened, never rounded
        const auto gb = grad_rows.narrow(0, first, count).to(acc_type);
        const auto xb = (dcp || dsp) ? x_rows.narrow(0, first, count).to(acc_type) : at::Tensor();
        at::Tensor dxb;
        if (dx.defined())
          dxb = x_in.scalar_type() == acc_type ? dx_rows.narrow(0, first, count) : at::empty({count, d}, gb.options());
        const scalar_t* gp = gb.const_data_ptr<scalar_t>();
        const scalar_t* xp = xb.defined() ? xb.const_data_ptr<scalar_t>() : nullptr;
        scalar_t* dxp = dxb.defined() ? dxb.mutable_data_ptr<scalar_t>() : nullptr;
        at::parallel_for(first, first + count, row_grain(d), [&](int64_t begin, int64_t end) {
          backward_rows<scalar_t>(begin, end, first, d, mode, offsets, gp, xp, cp, sp, dxp, dcp, dsp);
        });
        if (dxb.defined() && x_in.scalar_type() != acc_type) dx_rows.narrow(0, first, count).copy_(dxb);
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
    auto [dx, dcos, dsin] = backward_op()
                                .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
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
  def->def(
      "rotary_position_embedding_backward(Tensor grad, Tensor x, Tensor cos, Tensor sin, int mode, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  static auto* cpu = new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_cpu));
  cpu->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_cpu));
  static auto* autograd =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  autograd->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_autograd));
  autograd->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_autograd));
  // Shapes only (fake tensors, torch.compile, and the meta shadows of hypershard's dispatch).
  static auto* meta =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Meta, __FILE__, __LINE__);
  meta->impl("rotary_position_embedding", TORCH_FN(rotary_position_embedding_meta));
  meta->impl("rotary_position_embedding_backward", TORCH_FN(rotary_position_embedding_backward_meta));
  register_rotary_composite();
}

}  // namespace hypershard::kernels
