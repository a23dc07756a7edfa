"""UT: every operator family's layout inference and error paths, without processes.

Each row runs the op's C++ rule on meta DTensors of a mesh that has no process groups
(hypershard.testing.planning) and checks the layouts the rule asks for: the input layouts
(where they differ from the given ones the per-op path redistributes first), the output
layouts, whether the op runs its own implementation (collectives inside the op: "expands"), or
the house-format error text. Multi-process behaviour (values, gradients, collectives) is the
Level0 tests' job; these rows pin the inference itself, one family per table.
"""

from __future__ import annotations

import pytest
import torch

import hypershard as hs
from hypershard.testing.planning import Arg as T
from hypershard.testing.planning import PlanningMesh, plan, realise
from hypershard.testing.planning import spec as S

aten = torch.ops.aten
i64, boolean = torch.int64, torch.bool

MESHES = {"tp4": {"tp": 4}, "dp2tp2": {"dp": 2, "tp": 2}}


R1, P1 = ["R"], ["P"]

# (id, mesh, op, args, kwargs, expected inputs (None: as given), expected outputs, expands)
ROWS = {
    "pointwise": [
        ("add_same", "dp2tp2", aten.add.Tensor, (T([4, 6], S(0, None)), T([4, 6], S(0, None))), {},
         None, [S(0, None)], False),
        ("add_broadcast", "dp2tp2", aten.add.Tensor, (T([4, 6], S(0, 1)), T([6], ["R", "S(0)"])), {},
         None, [S(0, 1)], False),
        ("add_partials", "tp4", aten.add.Tensor, (T([4, 6], P1), T([4, 6], P1)), {}, None, [P1], False),
        # a cost tie (reduce_scatter the Partial, or gather the shard and keep the Partial) goes to
        # fewer Partial output axes, whatever the operand order (sharding_search.h's one rule)
        ("add_partial_shard_tie", "tp4", aten.add.Tensor, (T([8, 8], P1), T([8, 8], S(0))), {},
         [S(0), S(0)], [S(0)], False),
        ("add_shard_partial_tie", "tp4", aten.add.Tensor, (T([8, 8], S(0)), T([8, 8], P1)), {},
         [S(0), S(0)], [S(0)], False),
        ("mul_partial_by_replicate", "tp4", aten.mul.Tensor, (T([4, 6], P1), T([4, 6], R1)), {},
         None, [P1], False),
        # two sum-Partials are never multiplied as such: one is reduced first
        ("mul_two_partials", "tp4", aten.mul.Tensor, (T([4, 6], P1), T([4, 6], P1)), {},
         [P1, R1], [P1], False),
        ("exp_keeps_max", "tp4", aten.exp.default, (T([4, 6], ["P(max)"]),), {}, None, [["P(max)"]], False),
        ("neg_flips_max", "tp4", aten.neg.default, (T([4, 6], ["P(max)"]),), {}, None, [["P(min)"]], False),
        ("float_cast_keeps_partial", "tp4", aten._to_copy.default, (T([4, 6], P1),), {"dtype": torch.float64},
         None, [P1], False),
        ("inplace_other_follows_self", "tp4", aten.add_.Tensor, (T([4, 8], S(0)), T([4, 8], S(1))), {},
         [S(0), S(0)], [S(0)], False),
        # rules from torch's pointwise tag (register_tagged_pointwise): the same engine, no Partial
        ("tagged_hypot_broadcast", "dp2tp2", aten.hypot.default, (T([4, 6], S(0, 1)), T([6], ["R", "S(0)"])), {},
         None, [S(0, 1)], False),
        ("tagged_frexp_two_outputs", "tp4", aten.frexp.Tensor, (T([8, 6], S(0)),), {}, None, [S(0), S(0)], False),
        ("tagged_inplace_other_follows_self", "tp4", aten.atan2_.default, (T([4, 8], S(0)), T([4, 8], S(1))), {},
         [S(0), S(0)], [S(0)], False),
    ],
    "matmul": [
        ("mm_row_sharded", "tp4", aten.mm.default, (T([8, 6], S(0)), T([6, 8], R1)), {}, None, [S(0)], False),
        ("mm_col_sharded", "tp4", aten.mm.default, (T([8, 6], R1), T([6, 8], S(1))), {}, None, [S(1)], False),
        ("mm_contraction_partial", "tp4", aten.mm.default, (T([8, 6], S(1)), T([6, 8], S(0))), {},
         None, [P1], False),
        ("mm_2d", "dp2tp2", aten.mm.default, (T([4, 6], S(0, None)), T([6, 8], S(None, 1))), {},
         None, [S(0, 1)], False),
        # row-parallel linear: the bias joins the Partial (added once, zeros elsewhere)
        ("addmm_bias_under_partial", "tp4", aten.addmm.default, (T([8], R1), T([4, 8], S(1)), T([8, 8], S(0))),
         {}, [P1, S(1), S(0)], [P1], False),
        ("bmm_batch", "tp4", aten.bmm.default, (T([4, 3, 5], S(0)), T([4, 5, 2], S(0))), {}, None, [S(0)], False),
        ("mm_partial_left", "tp4", aten.mm.default, (T([4, 6], P1), T([6, 8], R1)), {}, None, [P1], False),
        ("mm_two_partials", "tp4", aten.mm.default, (T([4, 6], P1), T([6, 8], P1)), {}, [R1, P1], [P1], False),
    ],
    "reductions": [
        ("sum_sharded_dim", "tp4", aten.sum.dim_IntList, (T([8, 6], S(0)), [0]), {}, None, [P1], False),
        ("sum_other_dim", "tp4", aten.sum.dim_IntList, (T([8, 6], S(0)), [1]), {}, None, [S(0)], False),
        ("mean_sharded_dim", "tp4", aten.mean.dim, (T([8, 6], S(0)), [0]), {}, None, [P1], True),
        ("amax_collective", "tp4", aten.amax.default, (T([8, 6], S(0)), [0]), {}, None, [R1], True),
        ("max_dim_global_indices", "tp4", aten.max.dim, (T([8, 6], S(0)), 0), {}, None, [R1, R1], True),
        ("argmax_global", "tp4", aten.argmax.default, (T([8, 6], S(0)), 0), {}, None, [R1], True),
        ("var_sharded", "tp4", aten.var.correction, (T([8, 6], S(0)), [0]), {}, None, [R1], True),
        ("norm_sharded", "tp4", aten.linalg_vector_norm.default, (T([8, 6], S(0)), 2.0), {}, None, [R1], True),
        ("any_sharded", "tp4", aten.any.dim, (T([8, 6], S(0), boolean), 0), {}, None, [R1], True),
        ("histc_counts_partial_data_range", "tp4", aten.histc.default, (T([8, 6], S(0)), 5, 0, 0), {}, None, [P1],
         True),
        ("histc_counts_partial_given_range", "dp2tp2", aten.histc.default, (T([8, 6], S(None, 1)), 5, -1, 1), {},
         None, [["R", "P"]], False),
        ("histc_replicate_local", "tp4", aten.histc.default, (T([8, 6], R1), 5, 0, 0), {}, None, [R1], False),
        ("sum_keeps_other_axis", "dp2tp2", aten.sum.dim_IntList, (T([4, 6], S(0, 1)), [1]), {},
         None, [["S(0)", "P"]], False),
    ],
    "views": [
        ("view_split_whole_blocks", "tp4", aten.view.default, (T([12, 8], S(0)), [4, 3, 8]), {}, None, [S(0)], False),
        ("view_flatten_outer", "tp4", aten.view.default, (T([4, 2, 8], S(0)), [8, 8]), {}, None, [S(0)], False),
        ("transpose", "dp2tp2", aten.transpose.int, (T([4, 6], S(0, 1)), 0, 1), {}, None, [S(1, 0)], False),
        ("permute", "dp2tp2", aten.permute.default, (T([4, 6, 2], S(0, 2)), [2, 0, 1]), {}, None, [S(1, 0)], False),
        ("unsqueeze", "tp4", aten.unsqueeze.default, (T([4, 6], S(1)), 0), {}, None, [S(2)], False),
        ("squeeze", "tp4", aten.squeeze.dim, (T([4, 1, 6], S(2)), 1), {}, None, [S(1)], False),
        # 5 over 4 ranks: shards 2, 2, 1, 0 -- the local squeeze() would drop rank 2's size-1 shard
        ("squeeze_all_shard_of_one", "tp4", aten.squeeze.default, (T([4, 1, 5], S(2)),), {}, None, [S(1)], True),
        ("expand", "tp4", aten.expand.default, (T([4, 1], S(0)), [4, 6]), {}, None, [S(0)], False),
        ("slice_other_dim", "tp4", aten.slice.Tensor, (T([8, 6], S(0)), 1, 0, 2), {}, None, [S(0)], False),
        # a slice of a dim sharded over one axis keeps it sharded (an exchange); over two it gathers
        ("slice_sharded_dim_exchanges", "tp4", aten.slice.Tensor, (T([8, 6], S(0)), 0, 0, 2), {}, None, [S(0)], True),
        ("slice_dim_over_two_axes_gathers", "dp2tp2", aten.slice.Tensor, (T([8, 6], S(0, 0)), 0, 0, 2), {},
         [["R", "R"]], [["R", "R"]], False),
        # [batch over dp, seq over tp] flattened into tokens: one row per dp rank keeps every
        # block contiguous, so the token dim is sharded over (dp, tp) (context parallelism's loss)
        ("view_flatten_two_sharded_dims", "dp2tp2", aten.view.default, (T([2, 8], S(0, 1)), [16]), {},
         None, [S(0, 0)], False),
        # and back: the token dim split into [batch, seq] gives dp to batch and tp to seq (an einsum
        # viewing a dim it flattened)
        ("view_split_dim_over_two_axes", "dp2tp2", aten.view.default, (T([16], S(0, 0)), [2, 8]), {},
         None, [S(0, 1)], False),
        ("view_split_dim_over_two_axes_one_dim", "dp2tp2", aten.view.default, (T([4, 3, 5], S(0, 0)),
         [2, 2, 3, 1, 5]), {}, None, [S(0, 1)], False),
        ("select_other_dim", "tp4", aten.select.int, (T([8, 6], S(0)), 1, 2), {}, None, [S(0)], False),
        ("select_sharded_dim_gathers", "tp4", aten.select.int, (T([8, 6], S(0)), 0, 2), {}, [R1], [R1], False),
        ("cat_other_dim", "tp4", aten.cat.default, ([T([8, 6], S(0)), T([8, 2], S(0))], 1), {}, None, [S(0)], False),
        ("cat_sharded_dim_gathers", "tp4", aten.cat.default, ([T([8, 6], S(0)), T([4, 6], S(0))], 0), {},
         [R1, R1], [R1], False),
        # a legacy empty operand (torch.cat skips it) leaves one operand: its sharded dim stays
        # (a KV cache's first update under context parallelism)
        ("cat_legacy_empty_keeps_sharded_dim", "tp4", aten.cat.default,
         ([T([0], R1), T([2, 4, 8, 8], S(2))], -2), {}, None, [S(2)], False),
        ("split_other_dim", "tp4", aten.split.Tensor, (T([8, 6], S(0)), 3, 1), {}, None, [S(0), S(0)], False),
        ("stack_shifts_dims", "tp4", aten.stack.default, ([T([8, 6], S(0)), T([8, 6], S(0))], 0), {},
         None, [S(1)], False),
    ],
    "softmax_norm_attention": [
        ("softmax_other_dim", "tp4", aten._softmax.default, (T([4, 6], S(0)), 1, False), {}, None, [S(0)], False),
        # the softmax dim sharded: the collective (vocab-parallel) variant, no gather
        ("softmax_sharded_dim", "tp4", aten._softmax.default, (T([4, 6], S(1)), 1, False), {}, None, [S(1)], True),
        ("log_softmax_sharded_dim", "tp4", aten._log_softmax.default, (T([4, 6], S(1)), 1, False), {},
         None, [S(1)], True),
        ("layer_norm_rows", "tp4", aten.native_layer_norm.default,
         (T([4, 6], S(0)), [6], T([6], R1), T([6], R1), 1e-5), {}, None, [S(0), S(0), S(0)], False),
        ("layer_norm_normalised_dim_gathers", "tp4", aten.native_layer_norm.default,
         (T([4, 6], S(1)), [6], T([6], R1), T([6], R1), 1e-5), {}, [R1, R1, R1], [R1, R1, R1], False),
        ("sdpa_heads", "tp4", aten._scaled_dot_product_flash_attention_for_cpu.default,
         (T([2, 4, 5, 8], S(1)), T([2, 4, 5, 8], S(1)), T([2, 4, 5, 8], S(1)), 0.0, True), {},
         None, [S(1), S(1)], False),
        # context parallelism: the query stays sharded on the sequence. An even split keeps key and
        # value sharded (the expand runs the mesh's algorithm; all-gather-KV gathers them there);
        # in the backward their gradients come back sharded (the expand)
        ("sdpa_sequence_even_keeps_kv_sharded", "tp4", aten._scaled_dot_product_flash_attention_for_cpu.default,
         (T([2, 4, 8, 8], S(2)), T([2, 4, 8, 8], S(2)), T([2, 4, 8, 8], S(2)), 0.0, True), {},
         None, [S(2), S(2)], True),
        ("sdpa_backward_sequence_even_keeps_kv_sharded", "tp4",
         aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
         (T([2, 4, 8, 8], S(2)), T([2, 4, 8, 8], S(2)), T([2, 4, 8, 8], S(2)), T([2, 4, 8, 8], S(2)),
          T([2, 4, 8, 8], S(2)), T([2, 4, 8], S(2)), 0.0, True), {},
         None, [S(2), S(2), S(2)], True),
        # uneven blocks (10 rows over 4): the plan gathers key and value (all-gather-KV), the
        # backward reduce-scatters their gradients back
        ("sdpa_sequence_uneven_gathers_kv", "tp4", aten._scaled_dot_product_flash_attention_for_cpu.default,
         (T([2, 4, 10, 8], S(2)), T([2, 4, 10, 8], S(2)), T([2, 4, 10, 8], S(2)), 0.0, True), {},
         [S(2), R1, R1], [S(2), S(2)], True),
        ("sdpa_backward_sequence_uneven_scatters_kv", "tp4",
         aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
         (T([2, 4, 10, 8], S(2)), T([2, 4, 10, 8], S(2)), T([2, 4, 10, 8], S(2)), T([2, 4, 10, 8], S(2)),
          T([2, 4, 10, 8], S(2)), T([2, 4, 10], S(2)), 0.0, True), {},
         [S(2), S(2), R1, R1, S(2), S(2)], [S(2), S(2), S(2)], True),
    ],
    "embedding_loss": [
        ("embedding_dim_sharded", "tp4", aten.embedding.default, (T([16, 8], S(1)), T([2, 3], R1, i64)), {},
         None, [S(2)], False),
        ("embedding_vocab_parallel", "tp4", aten.embedding.default, (T([16, 8], S(0)), T([2, 3], R1, i64)), {},
         None, [P1], True),
        ("embedding_vocab_parallel_2d", "dp2tp2", aten.embedding.default,
         (T([16, 8], S(None, 0)), T([4, 3], S(0, None), i64)), {}, None, [["S(0)", "P"]], True),
        ("nll_mean_global_count", "tp4", aten.nll_loss_forward.default,
         (T([8, 6], S(0)), T([8], S(0), i64), None, 1, -100), {}, None, [R1, R1], True),
        ("nll_none_stays_sharded", "tp4", aten.nll_loss_forward.default,
         (T([8, 6], S(0)), T([8], S(0), i64), None, 0, -100), {}, None, [S(0), R1], False),
        # per-sample losses: rows keep their sharding, classes whole; mean over the GLOBAL row count
        ("multi_margin_mean_rows", "tp4", aten.multi_margin_loss.default,
         (T([8, 6], S(0)), T([8], S(0), i64), 1, 1.0, None, 1), {}, [S(0), S(0)], [P1], True),
        ("multi_margin_none_classes_whole", "tp4", aten.multi_margin_loss.default,
         (T([8, 6], S(1)), T([8], R1, i64), 1, 1.0, None, 0), {}, [R1, R1], [R1], False),
        ("multilabel_margin_sum_rows", "tp4", aten.multilabel_margin_loss_forward.default,
         (T([8, 6], S(0)), T([8, 6], S(0), i64), 2), {}, [S(0), S(0)], [P1, S(0)], True),
        ("nll_vocab_parallel", "tp4", aten.nll_loss_forward.default,
         (T([8, 6], S(1)), T([8], R1, i64), None, 1, -100), {}, None, [R1, R1], True),
    ],
    "random_factories_optim": [
        ("dropout_sharded", "tp4", aten.native_dropout.default, (T([8, 6], S(0)), 0.1, True), {},
         None, [S(0), S(0)], True),
        ("bernoulli_sharded", "tp4", aten.bernoulli_.float, (T([8, 6], S(0)), 0.5), {}, None, [S(0)], True),
        ("cauchy_sharded", "tp4", aten.cauchy_.default, (T([8, 6], S(0)),), {}, None, [S(0)], True),
        # the probabilities are read whole; the rows keep their sharding, the categories become samples
        ("multinomial_rows_sharded", "tp4", aten.multinomial.default, (T([8, 6], S(0)), 3), {}, [R1], [S(0)], True),
        ("multinomial_categories_sharded", "tp4", aten.multinomial.default, (T([8, 6], S(1)), 3), {}, [R1], [R1],
         False),
        ("normal_mean_std", "tp4", aten.normal.Tensor_Tensor, (T([8, 6], S(0)), T([8, 6], S(0))), {}, [R1, R1],
         [S(0)], True),
        ("zeros_like", "tp4", aten.zeros_like.default, (T([8, 6], S(0)),), {}, None, [S(0)], False),
        ("linspace_partial_bounds", "tp4", aten.linspace.Tensor_Tensor, (T([], P1), T([], R1), 5), {}, [R1, R1], [R1],
         False),
        ("new_zeros_global_size", "tp4", aten.new_zeros.default, (T([8, 6], S(0)), [3, 5]), {}, None, [R1], False),
        # new_*: a dim of the source's rank and extent keeps its shard axes, the others are whole
        # (DeepSeek-V3.2's expand_kv: new_empty of the batch-sharded keys, then filled by slices)
        ("new_empty_keeps_equal_dims", "dp2tp2", aten.new_empty.default, (T([8, 6, 4], S(0, 1)), [8, 6, 5]), {},
         None, [S(0, 1)], False),
        ("new_ones_other_dim_whole", "dp2tp2", aten.new_ones.default, (T([8, 6, 4], S(0, 2)), [8, 6, 7]), {},
         None, [S(0, None)], False),
        ("new_full_partial_whole", "dp2tp2", aten.new_full.default, (T([8, 6], ["P", "S(1)"]), [8, 6], 2.0), {},
         None, [S(None, 1)], False),
        ("new_zeros_other_rank_whole", "dp2tp2", aten.new_zeros.default, (T([8, 6], S(0, 1)), [8]), {}, None,
         [S(None, None)], False),
        ("new_empty_strided_own_shape", "tp4", aten.new_empty_strided.default, (T([8, 6], S(1)), [8, 6], [6, 1]),
         {}, None, [S(1)], False),
        ("foreach_add_", "tp4", aten._foreach_add_.List,
         ([T([8, 6], S(0)), T([4], R1)], [T([8, 6], S(0)), T([4], R1)]), {}, None, [], False),
        ("foreach_scale_partial", "tp4", aten._foreach_mul.Scalar, ([T([8, 6], P1)], 2.0), {}, None, [P1], False),
        ("foreach_norm_global", "tp4", aten._foreach_norm.Scalar, ([T([8, 6], S(0)), T([4], R1)], 2.0), {},
         None, [R1, R1], True),
    ],
    "along_dims": [
        ("cumsum_whole_dim_local", "tp4", aten.cumsum.default, (T([8, 6], S(0)), 1), {}, None, [S(0)], False),
        ("cumsum_sharded_dim_exchanges", "tp4", aten.cumsum.default, (T([8, 6], S(0)), 0), {}, None, [S(0)], True),
        ("cumsum_keeps_partial", "tp4", aten.cumsum.default, (T([8, 6], P1), 0), {}, None, [P1], False),
        ("repeat_once_keeps_sharding", "tp4", aten.repeat.default, (T([8, 6], S(0)), [2, 1, 3]), {}, None,
         [["S(1)"]], False),
        ("repeat_sharded_dim_gathered", "tp4", aten.repeat.default, (T([8, 6], S(0)), [2, 1]), {}, [R1], [R1], False),
        ("unfold_other_dim_keeps", "tp4", aten.unfold.default, (T([8, 6], S(0)), 1, 3, 1), {}, None, [S(0)], False),
        ("cumsum_0d", "tp4", aten.cumsum.default, (T([], R1), 0), {}, None, [R1], False),
        # indexing: the index takes self's sharding where their sizes agree, a shorter dim is whole
        ("gather_index_follows_self", "tp4", aten.gather.default, (T([8, 6], S(0)), 1, T([8, 6], R1, i64)), {},
         [S(0), S(0)], [S(0)], False),
        ("gather_short_index_whole", "tp4", aten.gather.default, (T([8, 6], S(0)), 1, T([4, 6], S(0), i64)), {},
         [R1, R1], [R1], False),
        ("index_select_index_whole", "tp4", aten.index_select.default, (T([8, 6], S(0)), 1, T([3], S(0), i64)), {},
         [S(0), R1], [S(0)], False),
        ("index_keeps_other_dim", "tp4", aten.index.Tensor, (T([8, 6], S(1)), [T([3], R1, i64)]), {}, None, [S(1)],
         False),
        ("index_sharded_dim_gathered", "tp4", aten.index.Tensor, (T([8, 6], S(0)), [T([3], S(0), i64)]), {},
         [R1, R1], [R1], False),
        # self sharded along dim alone: indexed by ownership (no gather of self; index and src whole)
        ("scatter_add_dim_sharded", "tp4", aten.scatter_add.default,
         (T([8, 6], S(1)), 1, T([8, 6], S(1), i64), T([8, 6], S(1))), {}, [S(1), R1, R1], [S(1)], True),
        ("gather_dim_sharded_partial_result", "tp4", aten.gather.default,
         (T([8, 6], S(0)), 0, T([3, 6], R1, i64)), {}, None, [P1], True),
        # sharded along dim AND another dim: index and src follow self on the other dim
        ("scatter_add_dim_and_other_sharded", "dp2tp2", aten.scatter_add.default,
         (T([8, 6], S(1, 0)), 1, T([8, 6], R1 * 2, i64), T([8, 6], R1 * 2)), {},
         [S(1, 0), S(None, 0), S(None, 0)], [S(1, 0)], True),
        # summing writes with a sum-Partial operand: Partial kept, and the rows (dims but `dim`)
        # keep self's sharding where every operand has self's extent (gather's backward: zeros
        # row-sharded like the Partial gradient), whole where one is shorter
        ("scatter_add_partial_src_keeps_rows", "dp2tp2", aten.scatter_add.default,
         (T([8, 6], S(0, None)), 1, T([8, 3], S(0, None), i64), T([8, 3], ["S(0)", "P"])), {},
         [["S(0)", "P"], S(0, None), ["S(0)", "P"]], [["S(0)", "P"]], False),
        ("scatter_add_partial_short_index_rows_whole", "dp2tp2", aten.scatter_add.default,
         (T([8, 6], S(0, None)), 1, T([4, 3], S(None, None), i64), T([4, 3], ["R", "P"])), {},
         [["R", "P"], S(None, None), ["R", "P"]], [["R", "P"]], False),
        ("index_add_partial_source_keeps_rows", "dp2tp2", aten.index_add.default,
         (T([5, 6], S(1, None)), 0, T([7], S(None, None), i64), T([7, 6], ["S(1)", "P"])), {},
         [["S(1)", "P"], S(None, None), ["S(1)", "P"]], [["S(1)", "P"]], False),
        # an index shorter than self on a sharded other dim: the along-dims rule (dim made whole)
        ("gather_short_index_on_sharded_dim", "dp2tp2", aten.gather.default,
         (T([8, 6], S(1, 0)), 1, T([5, 6], R1 * 2, i64)), {}, [S(None, None), S(None, None)], [S(None, None)], False),
        ("topk_k_along_whole_dim", "dp2tp2", aten.topk.default, (T([8, 6], S(0, None)), 3, 1), {}, None,
         [S(0, None), S(0, None)], False),
        ("kthvalue_drops_dim", "dp2tp2", aten.kthvalue.default, (T([8, 6, 4], S(0, 2)), 2, 1), {}, None,
         [S(0, 1), S(0, 1)], False),
        ("logsumexp_sharded_dim", "dp2tp2", aten.logsumexp.default, (T([8, 6], S(0, 1)), [1]), {},
         [S(0, None)], [S(0, None)], False),
        ("flip_sharded_dim_exchanges", "dp2tp2", aten.flip.default, (T([8, 6], S(0, 1)), [1]), {}, None,
         [S(0, 1)], True),
        ("roll_flat_gathers_all", "tp4", aten.roll.default, (T([8, 6], S(0)), [3], []), {}, [R1], [R1], False),
        ("var_mean_all_dims", "tp4", aten.var_mean.correction, (T([8, 6], S(1)),), {}, [R1], [R1, R1], False),
        ("qr_batch_sharded", "tp4", aten.linalg_qr.default, (T([8, 4, 3], S(0)),), {}, None, [S(0), S(0)], False),
        ("qr_matrix_dim_gathered", "dp2tp2", aten.linalg_qr.default, (T([8, 4, 3], S(0, 1)),), {},
         [S(0, None)], [S(0, None), S(0, None)], False),
        ("det_drops_matrix", "tp4", aten._linalg_det.default, (T([8, 3, 3], S(0)),), {}, None, [S(0), S(0), S(0)],
         False),
        ("eigh_values_keep_batch", "tp4", aten._linalg_eigh.default, (T([8, 3, 3], S(0)),), {}, None,
         [S(0), S(0)], False),
    ],
    "convolution": [
        ("conv1d_batch_sharded", "tp4", aten.convolution.default,
         (T([8, 6, 9], S(0)), T([4, 6, 3], R1), T([4], R1), [1], [1], [1], False, [0], 1), {}, None, [S(0)], False),
        ("conv1d_channels_gathered", "tp4", aten.convolution.default,
         (T([8, 6, 9], S(1)), T([4, 6, 3], R1), None, [1], [0], [1], False, [0], 1), {}, [R1, R1], [R1], False),
        ("conv1d_backward_weight_partial", "tp4", aten.convolution_backward.default,
         (T([8, 4, 7], S(0)), T([8, 6, 9], S(0)), T([4, 6, 3], R1), [4], [1], [0], [1], False, [0], 1,
          [True, True, True]), {}, None, [S(0), P1, P1], False),
    ],
}

# (id, mesh, op, args, kwargs, text every rank must raise)
ERRORS = [
    ("relu_of_sum_partial", "tp4", aten.relu.default, (T([4, 6], P1),), {},
     "aten::relu: argument self (#0) [4, 6] (\"None\", \"None\") partial(sum: tp): Partial(sum) input is not "
     "supported by this op; allowed: Replicate or Shard"),
    ("partial_divisor", "tp4", aten.div.Tensor, (T([4, 6], R1), T([4, 6], P1)), {},
     "aten::div.Tensor: argument other (#1)"),
    ("integer_cast_of_partial", "tp4", aten._to_copy.default, (T([4, 6], P1),), {"dtype": i64},
     "aten::_to_copy: argument self (#0)"),
    ("inplace_broadcast_self", "tp4", aten.add_.Tensor, (T([1, 8], R1), T([4, 8], S(0))), {},
     "an in-place op cannot broadcast self to [4, 8]"),
    ("amax_of_sum_partial", "tp4", aten.amax.default, (T([8, 6], P1), [0]), {},
     "Partial(sum) input is not supported by this reduction; allowed: Replicate, Shard or Partial(max)"),
    ("view_cutting_shards", "tp4", aten.view.default, (T([12, 8], S(1)), [16, 6]), {},
     "viewing as [16, 6] would cut through a sharded dim"),
    ("view_flatten_inner_sharded", "tp4", aten.view.default, (T([2, 4, 8], S(1)), [8, 8]), {},
     "viewing as [8, 8] would cut through a sharded dim"),
    # two rows per dp rank and half of each row: not a contiguous block of the tokens
    ("view_flatten_two_sharded_dims_not_contiguous", "dp2tp2", aten.view.default, (T([4, 8], S(0, 1)), [32]), {},
     "viewing as [32] would cut through a sharded dim"),
    # 6 rows over (dp, tp) (2, 2, 1, 1 each) split as [2, 3]: rank 0's 2 rows are not the first
    # 3-row block that dp's half of the new dim 0 would hold
    ("view_split_dim_over_two_axes_uneven", "dp2tp2", aten.view.default, (T([6, 5], S(0, 0)), [2, 3, 5]), {},
     "viewing as [2, 3, 5] would cut through a sharded dim"),
    ("softmax_of_partial", "tp4", aten._softmax.default, (T([4, 6], P1), 1, False), {},
     "a softmax of a sum is not the sum of the parts' softmaxes"),
    ("attention_head_dim_sharded", "tp4", aten._scaled_dot_product_flash_attention_for_cpu.default,
     (T([2, 4, 5, 8], S(3)), T([2, 4, 5, 8], S(3)), T([2, 4, 5, 8], S(3))), {},
     "dim 3 (head_dim) is sharded"),
    ("sort_of_sum_partial", "tp4", aten.sort.default, (T([8, 6], P1), 1), {},
     "aten::sort: argument self (#0) [8, 6] (\"None\", \"None\") partial(sum: tp): Partial(sum) input is not "
     "supported by this op"),
    ("topk_dim_out_of_range", "tp4", aten.topk.default, (T([8, 6], S(0)), 2, 2), {},
     "dim 2 is out of range for a 2-d tensor"),
    ("histc_of_partial", "tp4", aten.histc.default, (T([8, 6], P1), 5, 0, 0), {},
     "a histogram of a Partial tensor counts its parts"),
    ("index_boolean_mask_not_covered", "tp4", aten.index.Tensor, (T([8, 6], S(0)), [T([6], R1, boolean)]), {},
     "Missing operator aten::index.Tensor for these arguments (a boolean mask index"),
    ("missing_operator", "tp4", aten.geqrf.default, (T([8, 6], S(0)),), {},
     "Missing operator aten::geqrf: no distributed rule for this op"),
]


def _rows():
    for family, rows in ROWS.items():
        for row in rows:
            yield pytest.param(*row, id=f"{family}:{row[0]}")


@pytest.mark.parametrize("name,mesh_key,op,args,kwargs,inputs,outputs,expands", list(_rows()))
def test_rule_inference(name, mesh_key, op, args, kwargs, inputs, outputs, expands):
    mesh = PlanningMesh(MESHES[mesh_key])
    result = plan(op, *[realise(a, mesh) for a in args], **kwargs)
    given = [a.spec for arg in args for a in (arg if isinstance(arg, list) else [arg]) if isinstance(a, T)]
    assert result.input_specs == (inputs if inputs is not None else given)
    assert result.output_specs == outputs
    assert result.expands == expands


@pytest.mark.parametrize("name,mesh_key,op,args,kwargs,message", [pytest.param(*row, id=row[0]) for row in ERRORS])
def test_rule_errors(name, mesh_key, op, args, kwargs, message):
    mesh = PlanningMesh(MESHES[mesh_key])
    with pytest.raises((hs.LayoutError, RuntimeError)) as raised:
        plan(op, *[realise(a, mesh) for a in args], **kwargs)
    assert message in str(raised.value)
    assert str(raised.value).startswith("hypershard: ")


def test_operands_on_different_meshes():
    one, other = PlanningMesh(MESHES["tp4"]), PlanningMesh(MESHES["dp2tp2"])
    with pytest.raises(hs.LayoutError, match="operands live on different meshes"):
        plan(aten.add.Tensor, one.dtensor([8, 6], S(0)), other.dtensor([8, 6], S(0, None)))


def test_inference_does_not_depend_on_the_rank():
    # Plans are made on every rank independently and must agree (a rank-dependent plan would
    # send the ranks into different collectives).
    specs = set()
    for rank in range(4):
        mesh = PlanningMesh(MESHES["dp2tp2"], rank=rank)
        result = plan(aten.mm.default, mesh.dtensor([5, 7], S(0, None)), mesh.dtensor([7, 3], S(None, 0)))
        specs.add(tuple(layout.to_string() for layout in result.inputs + result.outputs))
    assert len(specs) == 1, specs


def test_uneven_local_shapes_on_every_rank():
    # 5 rows over 4 ranks: 2, 2, 1, 0 -- the meta DTensors carry those local shapes.
    for rank, rows in enumerate((2, 2, 1, 0)):
        mesh = PlanningMesh(MESHES["tp4"], rank=rank)
        x = mesh.dtensor([5, 3], S(0))
        assert tuple(hs._C.local_of(x).shape) == (rows, 3)
        assert plan(aten.relu.default, x).output_specs == [S(0)]


def test_every_family_has_rows():
    families = {"pointwise", "matmul", "reductions", "views", "softmax_norm_attention", "embedding_loss",
                "random_factories_optim", "along_dims", "convolution"}
    assert families <= set(ROWS)
    assert sum(len(rows) for rows in ROWS.values()) + len(ERRORS) >= 60


VIEW_CHAINS = {
    "transpose": lambda t: t.transpose(0, 2),
    "permute": lambda t: t.permute(2, 0, 1),
    "view": lambda t: t.view(8, 24),
    "transpose_twice": lambda t: t.transpose(1, 2).transpose(0, 1),
    "permute_view_slice_permute": lambda t: t.permute(1, 0, 2).view(6, 8, 4)[1:].permute(2, 1, 0),
    "transpose_slice_permute": lambda t: t.transpose(0, 1)[1:3].permute(1, 0, 2),
    "t_of_view": lambda t: t.view(8, 24).t(),
}


@pytest.mark.parametrize("chain", list(VIEW_CHAINS))
def test_view_geometry_equals_torch(chain):
    # The wrapper of a view of a sharded DTensor reports the global strides and offset torch
    # gives the same view of the global tensor (computed by the rule, or by a meta shadow).
    for rank in (0, 3):
        x = PlanningMesh(MESHES["tp4"], rank=rank).dtensor([8, 6, 4], S(0))
        got, want = VIEW_CHAINS[chain](x), VIEW_CHAINS[chain](torch.empty(8, 6, 4, device="meta"))
        assert (tuple(got.shape), got.stride(), got.storage_offset()) == \
            (tuple(want.shape), want.stride(), want.storage_offset())
        assert got.is_contiguous() == want.is_contiguous()


def test_every_pointwise_tagged_op_has_a_rule():
    """register_tagged_pointwise: every ATen op torch tags pointwise has a rule, except seeded random
    ops (random.cpp's family) and ops that return something other than tensors (equal's bool)."""
    rules = set(hs._C.rule_names())
    missing = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        packet = getattr(aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or torch.Tag.pointwise not in op.tags or torch.Tag.nondeterministic_seeded in op.tags:
            continue
        returns = op._schema.returns
        if returns and all(isinstance(r.type, torch.TensorType) for r in returns) and name not in rules:
            missing.append(name)
    assert not missing, f"pointwise-tagged ops without a rule: {missing}"
