"""Tensor parallelism + fully_shard training of a HuggingFace model on 4 CPU ranks (dp=2 x tp=2),
with selective activation recomputation, bf16 mixed precision, a sharded checkpoint saved and
loaded back, and a HuggingFace export.

    python -m hypershard.testing.fixtures --out fixtures --families qwen3
    torchrun --nproc-per-node 4 examples/train_tp_fully_shard.py --model fixtures/models/qwen3

Any save_pretrained folder of a causal LM with a HuggingFace TP plan works as --model (Qwen3,
Qwen3.5, ...). docs/fully_shard.md, docs/mixed_precision.md, docs/recompute.md and
docs/checkpoint.md explain each step.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import hypershard as hs
from hypershard import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="fixtures/models/qwen3", help="a save_pretrained folder with its tokenizer")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--output", default="out", help="checkpoints go to OUTPUT/ckpts, the export to OUTPUT/hf")
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...
rank = dist.get_rank()
mesh = hs.init_device_mesh("cpu", (2, 2), ("dp", "tp"))

# Every rank loads the whole model here; hs.from_pretrained (examples/from_pretrained.py) reads
# only each rank's shards instead.
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
model = hs.parallelize(model, mesh)  # the model's TP plan on tp; inputs split over dp
for layer in model.model.layers:
    hs.fully_shard(layer, mesh)  # one group per decoder layer: 1/dp of its parameters per rank
hs.fully_shard(model, mesh)  # the root: embeddings, final norm, lm_head
hs.recompute(model, mode="selective")  # recompute each layer in backward, keeping the matmuls
model = hs.mixed_precision(model)  # bf16 compute, fp32 master weights and gradient sums
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # steps on the shards only

# The same global batch on every rank (parallelize's input hook gives each dp rank its half).
tokenizer = AutoTokenizer.from_pretrained(args.model)
text = "hypershard runs every ATen op of a HuggingFace model on DTensors. " * 8
ids = torch.tensor(tokenizer(text)["input_ids"][: 4 * 16]).reshape(4, 16)  # 4 sequences of 16 tokens
labels = ids.clone()  # the model shifts them

model.train()
for step in range(1, args.steps + 1):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}")

# Sharded checkpoint: each rank writes its own shards (torch DCP), then loads them back in place.
path = checkpoint.save(f"{args.output}/ckpts", model, optimizer, step=args.steps, extra={"step": args.steps})
assert str(checkpoint.latest(f"{args.output}/ckpts")) == str(path)
extra = checkpoint.load(f"{args.output}/ckpts", model, optimizer)
checkpoint.export_hf(model, f"{args.output}/hf")  # a save_pretrained folder, from the shards
if rank == 0:
    print(f"checkpoint {path} (extra {extra}); HuggingFace export in {args.output}/hf")
dist.destroy_process_group()
