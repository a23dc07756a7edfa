"""hypershard.pipelining.shapes: which (torch stages, schedule) pair each batch shape gets. The pairs
here are stand-ins (the level1 test test_pipelining.py runs torch's own over 4 ranks)."""

import pytest

from hypershard.pipelining import PipelineError
from hypershard.pipelining.shapes import DEFAULT_MAX_SHAPES, SchedulesByShape, check_max_shapes


def _counting_builder():
    made = []

    def build():
        made.append(object())
        return made[-1]

    return build, made


def test_a_shape_seen_before_gets_its_own_pair_and_the_first_shape_the_pair_built_at_once():
    build, made = _counting_builder()
    schedules = SchedulesByShape(build)
    assert len(made) == 1 and schedules.unclaimed is made[0]  # Pipeline.stages / .schedule before a step
    first = schedules.get((8, 16))
    assert first is made[0] and schedules.unclaimed is None
    second = schedules.get((8, 24))
    assert second is made[1] and second is not first
    assert schedules.get((8, 16)) is first
    assert schedules.get((16, 16)) is made[2]  # another batch size is another shape
    assert (schedules.built, schedules.dropped) == (3, 0)
    assert schedules.shapes() == [(8, 24), (8, 16), (16, 16)]  # least recently used first


def test_beyond_max_shapes_the_least_recently_used_is_dropped_and_built_again_when_it_returns():
    build, made = _counting_builder()
    schedules = SchedulesByShape(build, max_shapes=2)
    a = schedules.get((8, 16))
    schedules.get((8, 24))
    assert schedules.get((8, 16)) is a  # now (8, 24) is the least recently used
    schedules.get((8, 32))
    assert schedules.shapes() == [(8, 16), (8, 32)] and schedules.dropped == 1
    again = schedules.get((8, 24))
    assert again is made[-1] and again not in made[:-1]
    assert schedules.shapes() == [(8, 32), (8, 24)]
    assert (schedules.built, schedules.dropped) == (4, 2)


def test_one_shape_kept_rebuilds_on_every_change():
    build, made = _counting_builder()
    schedules = SchedulesByShape(build, max_shapes=1)
    pairs = [schedules.get(shape) for shape in [(8, 16), (8, 16), (8, 24), (8, 16)]]
    assert pairs[0] is pairs[1] and len({id(p) for p in pairs}) == 3
    assert (schedules.built, schedules.dropped) == (3, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8", None])
def test_max_shapes_must_be_a_positive_int(bad):
    with pytest.raises(PipelineError) as error:
        check_max_shapes(bad)
    assert str(error.value) == (
        f"hypershard: pipeline: max_shapes={bad!r} is not a number of batch shapes; allowed: an int >= 1"
    )


def test_max_shapes_refused_before_the_split(monkeypatch):
    """hs.pipeline checks max_shapes first: the same line on every rank, before any collective (the
    split and parallelize come after)."""
    import hypershard as hs
    from hypershard.pipelining import api

    monkeypatch.setattr(api, "split_model", lambda *a, **k: pytest.fail("split before the check"))
    with pytest.raises(PipelineError, match="max_shapes=0 is not a number of batch shapes"):
        hs.pipeline(object(), None, n_microbatches=2, max_shapes=0)
    assert DEFAULT_MAX_SHAPES == check_max_shapes(DEFAULT_MAX_SHAPES)
