#!/usr/bin/env bash
# Does Qwen3.5-0.8B's training step fit in 80 GB per rank on 512 ranks (dp=64 x tp=8, fully_shard,
# 1024-token sequences)? The planner runs one real training step as ONE simulated rank of that mesh
# (meta tensors, no other process) and prints what the rank holds and sends (docs/planner.md).
# --layers 2 keeps the model's first two layers, for a quick look: leave it out for the whole model.
#
#   bash examples/planner.sh
set -euo pipefail
python -m hypershard.plan --model qwen3_5_0_8b --mesh dp=64,tp=8 --fully-shard --seq 1024 --layers 2 \
    --memory-per-rank 80
