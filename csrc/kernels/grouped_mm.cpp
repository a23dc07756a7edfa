// hypershard::grouped_mm_local: the local program of the grouped matrix products
// (aten::_grouped_mm, transformers::grouped_mm_fallback; their rule is in csrc/ops/matmul.cpp)
// as ONE op, so that a traced program can hold it.
//
//   grouped_mm_local(self, mat2, offs, first_group=0, out_dtype=None)
//     2d x 3d  "mk,ekn->mn"  mat2 holds groups first_group .. first_group + mat2.size(0) - 1 of
//                            the GLOBAL cumulative row ends `offs`; each group's rows of self times
//                            its matrix, the rows of groups not held here zeros
//     2d x 2d  "km,mn->ekn"  one [k, n] product per group over its span of m (the weight
//                            gradient); a group with no rows is zeros
//
// Why an op: the group sizes are values (offs), read here on real tensors. While torch.compile
// traces hypershard's local program the locals are FakeTensors without values; the Meta kernel
// gives the shape, the graph records the op and the compiled program runs this kernel. (aten's
// _grouped_mm has a meta but refuses float32 on CPU, and torch's CPU kernel asks 16-byte aligned
// strides, which a shard of an aligned weight need not have: hence a loop of mm.)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

std::vector<int64_t> group_ends(const at::Tensor& offs) {
  const at::Tensor longs = offs.to(at::kCPU, at::kLong).contiguous();
  return {longs.const_data_ptr<int64_t>(), longs.const_data_ptr<int64_t>() + longs.numel()};
}

void check_grouped_mm_arguments(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& offs,
                                int64_t first_group) {
  const bool rows = self.dim() == 2 && mat2.dim() == 3, contraction = self.dim() == 2 && mat2.dim() == 2;
  TORCH_CHECK(rows || contraction, "hypershard::grouped_mm_local: takes a 2-d by 3-d or a 2-d by 2-d product, got ",
              self.dim(), "-d by ", mat2.dim(), "-d");
  TORCH_CHECK(offs.dim() == 1, "hypershard::grouped_mm_local: offs must be 1-d, got ", offs.dim(), "-d");
  if (rows)
    TORCH_CHECK(first_group >= 0 && first_group + mat2.size(0) <= offs.size(0), "hypershard::grouped_mm_local: groups ",
                first_group, "..", first_group + mat2.size(0) - 1, " are not among offs' ", offs.size(0));
}

// The result, uninitialized, after the argument checks.
at::Tensor grouped_mm_local_meta(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& offs,
                                 int64_t first_group, std::optional<at::ScalarType> out_dtype) {
  check_grouped_mm_arguments(self, mat2, offs, first_group);
  const auto options = self.options().dtype(out_dtype.value_or(self.scalar_type()));
  if (mat2.dim() == 3) return at::empty({self.size(0), mat2.size(2)}, options);
  return at::empty({offs.size(0), self.size(0), mat2.size(1)}, options);
}

at::Tensor grouped_mm_local(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& offs, int64_t first_group,
                            std::optional<at::ScalarType> out_dtype) {
  at::Tensor out = grouped_mm_local_meta(self, mat2, offs, first_group, out_dtype);
  // out_dtype (bfloat16 operands, a float32 result): the operands widened, so that products and
  // sums are in the result's dtype, rounded once, as _grouped_mm's out_dtype promises
  const at::Tensor x = self.to(out.scalar_type()), w = mat2.to(out.scalar_type());  // no copy when equal
  const auto ends = group_ends(offs);
  const auto begin_of = [&ends](int64_t e) { return e == 0 ? int64_t{0} : ends.at(e - 1); };
  // Each group's product is written into its block of the result (mm_out: no temporary); only what
  // no group computes is zeroed.
  if (mat2.dim() == 3) {
    const int64_t local_groups = mat2.size(0);
    const int64_t rows_begin = begin_of(first_group);
    const int64_t rows_end = local_groups == 0 ? rows_begin : ends.at(first_group + local_groups - 1);
    if (rows_begin > 0) out.narrow(0, 0, rows_begin).zero_();
    if (rows_end < self.size(0)) out.narrow(0, rows_end, self.size(0) - rows_end).zero_();
    for (int64_t g = 0; g < local_groups; ++g) {
      const int64_t begin = begin_of(first_group + g), end = ends.at(first_group + g);
      if (end > begin) {
        at::Tensor block = out.narrow(0, begin, end - begin);
        at::mm_out(block, x.narrow(0, begin, end - begin), w[g]);
      }
    }
    return out;
  }
  for (int64_t g = 0; g < static_cast<int64_t>(ends.size()); ++g) {
    const int64_t begin = begin_of(g), end = ends[g];
    at::Tensor block = out[g];
    if (end > begin)
      at::mm_out(block, x.narrow(1, begin, end - begin), w.narrow(0, begin, end - begin));
    else
      block.zero_();
  }
  return out;
}

}  // namespace

void register_grouped_mm_kernels() {
  static auto* def = new torch::Library(torch::Library::FRAGMENT, "hypershard", std::nullopt, __FILE__, __LINE__);
  def->def(
      "grouped_mm_local(Tensor self, Tensor mat2, Tensor offs, int first_group=0, ScalarType? out_dtype=None) -> "
      "Tensor");
  static auto* any = new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::CompositeExplicitAutograd,
                                        __FILE__, __LINE__);
  any->impl("grouped_mm_local", TORCH_FN(grouped_mm_local));
  static auto* meta =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Meta, __FILE__, __LINE__);
  meta->impl("grouped_mm_local", TORCH_FN(grouped_mm_local_meta));
}

}  // namespace hypershard::kernels
