"""Level0: process-group teardown never hangs. Ranks create meshes, run bucketed backward passes
and async collectives under a Python saved-tensors hook, drop everything in both orders and exit
with meshes still alive, many times, on 2 and 4 ranks (hypershard.testing.exit_stress); every
launch has a timeout that names the stuck rank. Before the fix about one launch in four hung in
~ProcessGroupGloo (its worker thread waiting for the GIL the dropping thread held)."""

import pytest

from hypershard.testing import exit_stress


@pytest.mark.parametrize("world, launches", [(2, 4), (4, 2)])
def test_meshes_created_and_dropped_never_hang(world, launches):
    totals = exit_stress.run(world, launches=launches, iterations=8, timeout=120)
    assert totals["launches"] == launches and totals["meshes"] == 8 * launches


def _stall_on_last_rank(rank, world):
    import time

    if rank == world - 1:
        while True:  # a rank that never returns: the launch must name it and where it is
            time.sleep(0.1)
    return {"rank": rank}


def test_launcher_names_the_stuck_rank_and_where_it_is():
    from hypershard.launch import RankTimeout, spawn_local_ranks

    with pytest.raises(RankTimeout) as info:
        spawn_local_ranks(_stall_on_last_rank, 2, timeout=20)
    text = str(info.value)
    assert "ranks [0, 1] of 2 still running after 20 s" in text, text
    assert "rank 0: finished; waiting for the other ranks (barrier)" in text, text
    assert "rank 1: running" in text and "_stall_on_last_rank" in text, text
