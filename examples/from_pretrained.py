import torch
import torch.distributed as dist

import hypershard as hs

dist.init_process_group("gloo")  # torchrun's environment
mesh = hs.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
path = "fixtures/models/qwen3"  # any save_pretrained folder: config.json + safetensors

model = hs.from_pretrained(path, mesh)  # the model's own TP/EP plans
model = hs.from_pretrained(path, mesh, fully_shard=True, dtype=torch.bfloat16)  # + fully_shard over dp
mlp_only = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
model = hs.from_pretrained(path, mesh, plan=mlp_only, seed=42, staging_bytes=64 << 20)
report = model.hs_load_report  # loaded / initialised names, unused file keys, bytes read, ...

ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
logits = model(input_ids=ids).logits  # the batch is split over dp inside
if dist.get_rank() == 0:
    print(f"{len(report.loaded)} tensors loaded, {report.bytes_read} bytes read by rank 0")
    print(logits.shape, logits.placements)
dist.destroy_process_group()
