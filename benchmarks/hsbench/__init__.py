"""The sections of `make bench` (benchmarks/run.py is the entry point and CLI).

common        small helpers: medians, ratios, error text, the op-argument specs
timing        calibrated, interleaved timing shared by the per-op sections
collectives   counts torch DTensor's collectives and bytes at torch's dispatcher
dispatch      section "dispatch": per-op overhead vs plain eager and torch DTensor
fallback      section "fallback": an op through hypershard's fallback vs its native rule
rotary        section "rotary": the fused rotary position embedding op vs its composed form
trainers      the training step of each implementation (hypershard, torch DTensor, one device)
training      section "step" (with bytes and rule cache): the step launches
memory        section "memory": peak RSS and state bytes, measured inside the step launches
context_parallel  section "context_parallel": a long sequence sharded over cp, per cp algorithm
report        RESULTS.md (markdown tables) and the targets summary
chart         results.png
"""
