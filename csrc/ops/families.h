// One register function per operator family; register_all calls each explicitly.
#pragma once

#include <torch/library.h>

#include "ops/op_call.h"

namespace hypershard::ops {

// The library of hypershard's kernels at aten's AutogradPrivateUse2 key: ops whose composite
// kernel would be wrong on DTensors. Each family's register_*_kernel(s) adds its own with impl().
torch::Library& aten_autograd_kernels();

void register_all(Registry& r);
void register_pointwise(Registry& r);  // pointwise.cpp
// pointwise.cpp: every op torch tags pointwise that no family has a rule for (registered last).
void register_tagged_pointwise(Registry& r);
void register_tensor_ops(Registry& r);  // tensor_ops.cpp: identity views, factories, scalars
void register_views(Registry& r);       // views.cpp: views and shape ops
// views.cpp: hypershard's own reshape kernel on AutogradPrivateUse2 (installed through the registry).
void register_reshape_kernel();
// tensor_ops.cpp: one_hot on AutogradPrivateUse2 (its composite kernel would escape the DTensor).
void register_one_hot_kernel();
void register_matmul(Registry& r);      // matmul.cpp: mm, bmm, addmm, baddbmm, mv, addmv, dot
void register_masked(Registry& r);      // masked.cpp: masked_scatter (and boolean-mask indexing) in GLOBAL order
void register_along_dims(Registry& r);  // along_dims.cpp: sorts, dim-wise reductions, indexing, linalg
// along_sharded.cpp: scans (exchange of shard totals), flip and roll (span exchange) along a sharded dim
void register_along_sharded(Registry& r);
// along_sharded.cpp: cummaxmin_backward on AutogradPrivateUse2 (its composite writes into a plain tensor).
void register_along_sharded_kernels();
// assembly.cpp: select/slice/diagonal_scatter (a base with a view replaced), block_diag, _chunk_cat
void register_assembly(Registry& r);
void register_lookups(Registry& r);  // lookups.cpp: searchsorted, bucketize, take (the query keeps its sharding)
// resampling.cpp: reflect/replicate pads (a sharded padded dim stays sharded: span exchange),
// upsampling and 3-d area (the spatial dims whole)
void register_resampling(Registry& r);
// spatial.cpp: 3-d and fractional pools, max_unpool, grid sampling, im2col/col2im (batch and
// channels keep their sharding)
void register_spatial(Registry& r);
// pairwise.cpp: cdist, pdist, _trilinear (bilinear)
void register_pairwise(Registry& r);
void register_convolution(Registry& r);  // convolution.cpp: convolution and its backward, batch-parallel
void register_reductions(Registry& r);   // reductions.cpp: sum, mean, amax, max, var, norms, any/all, ...
// reductions.cpp: max.dim/min.dim backward on AutogradPrivateUse2 (its composite kernel would
// scatter into a plain tensor).
void register_reduction_kernels();
void register_loss(Registry& r);  // loss.cpp: softmax, log_softmax, nll_loss(2d), backwards
// elementwise_loss.cpp: mse, smooth_l1, huber, soft_margin, binary_cross_entropy(_with_logits),
// their backward ops: mean over the GLOBAL element count.
void register_elementwise_loss(Registry& r);
// loss.cpp: cross_entropy_loss on AutogradPrivateUse2 (label smoothing on class-sharded logits).
void register_cross_entropy_kernel();
// foreach.cpp: _foreach_* list ops, _fused_adam(w)_/_fused_sgd_, GradScaler's _amp_* ops
void register_foreach(Registry& r);
void register_embedding(Registry& r);  // embedding.cpp: embedding (vocab-parallel too) and its backward
// embedding.cpp: aten::embedding on AutogradPrivateUse2 and hypershard::embedding_vocab_backward
// (a row-sharded table's gradient stays on its rows).
void register_embedding_kernels();
void register_normalization(Registry& r);  // normalization.cpp: layer/group norm, softmax
// attention.cpp: scaled dot-product attention (the CPU, CUDA and PrivateUse1 kernels) and torch_npu's
// fusion attention
void register_attention(Registry& r);
void register_random(Registry& r);  // random.cpp: random fills, *_like draws, dropout
// rotary.cpp: hypershard::rotary_position_embedding (and its backward) and torch_npu's rotary ops.
void register_rotary(Registry& r);
// composites.cpp: max_pool1d, tensor_split(tensor), ctc_loss(tensor lengths) on AutogradPrivateUse2
// (their composite kernels read argument data, which a DTensor does not have).
void register_composite_kernels();

}  // namespace hypershard::ops
