"""hs.compile: a tensor-parallel HuggingFace model's local program (its collectives included)
compiled into one forward and one backward graph, and a compiled function of DTensors.

    python -m hypershard.testing.fixtures --out fixtures --families qwen3
    torchrun --nproc-per-node 4 examples/compile_train.py --model fixtures/models/qwen3 [--backend aot_eager]

The default backend is inductor (a C++ compiler compiles its kernels: a minute or more on a small
CPU); `--backend aot_eager` traces the same graphs and runs them op by op. docs/compile.md.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hypershard as hs

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="fixtures/models/qwen3", help="a save_pretrained folder")
parser.add_argument("--backend", default="inductor", help="torch.compile's backend: inductor, aot_eager, ...")
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()

dist.init_process_group("gloo")
mesh = hs.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
model = hs.parallelize(model, mesh)
hs.compile(model, backend=args.backend, fullgraph=True)  # returns model, its forward replaced
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
labels = ids.clone()
model.train()
for step in range(1, args.steps + 1):
    loss = model(input_ids=ids, labels=labels).loss  # the first call traces and compiles
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f}")


def fn(x, w):
    return torch.relu(x @ w).sum(dim=-1)


f = hs.compile(fn, backend=args.backend, fullgraph=True)  # a function of DTensors
torch.manual_seed(0)  # the same global tensors on every rank
x = hs.distribute_tensor(torch.randn(8, 6), mesh, [hs.Shard(0), hs.Replicate()])
w = hs.distribute_tensor(torch.randn(6, 4), mesh, [hs.Replicate(), hs.Shard(1)])
out = f(x, w)
torch.testing.assert_close(out.full_tensor(), fn(x.full_tensor(), w.full_tensor()))
if dist.get_rank() == 0:
    print("compiled function:", out.placements)
dist.destroy_process_group()
