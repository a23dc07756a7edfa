"""python -m hypershard.testing.exit_stress [--world 2] [--launches 5] [--iterations 8]

Stress test for process-group teardown: every rank repeatedly creates meshes (new c10d groups),
runs DTensor ops with a backward whose data-parallel gradients are summed in buckets, issues
async collectives on the mesh's groups (some never waited for) while a Python saved-tensors hook
is active (so gloo's finished works hold Python references that need the GIL to drop), then
drops everything, in both orders (torch's groups destroyed before or after hypershard's last
reference), and finally exits with a mesh still alive (released at interpreter exit). A group
dropped while holding the GIL deadlocks here (its destructor joins a worker that waits for the
GIL); each launch has a timeout and names the stuck rank and where it was.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

_KEEP_UNTIL_EXIT = []  # meshes and tensors released only by interpreter exit


def _groups(mesh) -> list:
    return [mesh.group(axis) for axis in range(mesh.ndim) if mesh.size(axis) > 1]


def _iteration(i: int, shape: tuple, names: tuple) -> int:
    import torch
    import torch.distributed as dist

    import hypershard as hs

    mesh = hs.init_device_mesh("cpu", shape, names)
    collectives = 0
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.device("cpu"):
        # Data-parallel gradients: w is Replicate, x sharded on the batch, so w.grad arrives
        # Partial(sum) and is summed in a gradient bucket at the end of backward.
        torch.manual_seed(i)
        w = hs.distribute_tensor(torch.randn(6, 4), mesh, [hs.Replicate()] * len(shape)).requires_grad_()
        x = hs.distribute_tensor(
            torch.randn(4 * mesh.size(), 6), mesh, [hs.Shard(0)] + [hs.Replicate()] * (len(shape) - 1)
        )
        (x @ w).relu().sum().backward()
        assert w.grad is not None and w.grad.placements == w.placements
        for group in _groups(mesh):  # no Python reference to a group outlives this loop
            dist.all_reduce(torch.ones(16), group=group, async_op=True).wait()
            # Not waited for, handle dropped at once: gloo's worker holds the last reference and
            # destroys the work (and the Python hooks its saved state holds) when it finishes,
            # possibly while this thread is dropping the group.
            # The last rank joins late, so the others' workers are still busy with it when their
            # main threads drop the group.
            if dist.get_rank() == dist.get_world_size() - 1:
                time.sleep(0.02)
            dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
            collectives += 2
        del group
    if i % 3 == 2:
        _KEEP_UNTIL_EXIT.append((mesh, w))
        return collectives
    if i % 2:  # torch forgets its groups first: hypershard's mesh drops the last reference
        for group in _groups(mesh):
            dist.destroy_process_group(group)
        del mesh, w, x
    else:  # hypershard lets go first: torch's destroy drops the last reference
        groups = _groups(mesh)
        del mesh, w, x
        for group in groups:
            dist.destroy_process_group(group)
    gc.collect()
    return collectives


def stress_rank(rank: int, world: int, shape: tuple, names: tuple, iterations: int) -> dict:
    collectives = 0
    for i in range(iterations):
        collectives += _iteration(i, shape, names)
    return {"iterations": iterations, "collectives": collectives}


def run(world: int, launches: int, iterations: int, timeout: float = 120.0) -> dict:
    """Runs `launches` launches of `world` ranks; raises (RankTimeout naming the stuck rank) on
    a hang. Returns the counts."""
    from hypershard.launch import spawn_local_ranks

    shape, names = ((world,), ("dp",)) if world < 4 else ((2, world // 2), ("dp", "tp"))
    totals = {"launches": 0, "meshes": 0, "collectives": 0}
    for _ in range(launches):
        ranks = spawn_local_ranks(stress_rank, world, shape, names, iterations, timeout=timeout, pg_timeout=30)
        totals["launches"] += 1
        totals["meshes"] += ranks[0]["iterations"]
        totals["collectives"] += ranks[0]["collectives"]
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hypershard.testing.exit_stress", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    totals = run(args.world, args.launches, args.iterations, args.timeout)
    print(
        f"exit stress, {args.world} ranks: {totals['launches']} launches, {totals['meshes']} meshes created "
        f"and dropped per rank, {totals['collectives']} async collectives per rank, no hang "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
