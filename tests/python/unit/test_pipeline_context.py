"""UT: context parallelism inside pipeline stages (hypershard.pipelining.context): which sequences a cp
axis can split (one line, hypershard's format), each rank's block of the shifted targets, and
hypershard.sft's pp checks with a cp axis. The training itself: level1 test_pipelining.py (pp2 x cp2)."""

import argparse

import pytest
import torch

from hypershard.parallel.context import head_tail_order
from hypershard.pipelining import PipelineError
from hypershard.pipelining.context import check_sequence, local_targets, sequence_parts


class _Mesh:
    """The two things the helpers read of a mesh: its shape and this rank's coordinates."""

    def __init__(self, shape, coordinates):
        self.shape, self._coordinates = tuple(shape), tuple(coordinates)

    def coordinate(self, axis):
        return self._coordinates[axis]


def test_sequence_parts():
    mesh = _Mesh((2, 4), (0, 0))
    assert sequence_parts(mesh, 1, True) == 8 and sequence_parts(mesh, 1, False) == 4
    assert sequence_parts(mesh, None, True) == 1 and sequence_parts(None, 1, True) == 1


@pytest.mark.parametrize(
    "length, head_tail, message",
    [
        (
            14,
            True,
            "hypershard: pipeline: a sequence of 14 tokens cannot be split over cp=2 in head-tail order of 4 "
            "chunks (2 x cp); allowed: sequences padded to a multiple of 4",
        ),
        (
            15,
            False,
            "hypershard: pipeline: a sequence of 15 tokens cannot be split over cp=2 in 2 equal shards "
            "(natural order); allowed: sequences padded to a multiple of 2",
        ),
    ],
)
def test_a_sequence_cp_cannot_split(length, head_tail, message):
    with pytest.raises(PipelineError) as error:
        check_sequence(length, _Mesh((2,), (0,)), 0, head_tail)
    assert str(error.value) == message


def test_a_sequence_cp_splits():
    check_sequence(16, _Mesh((2,), (1,)), 0, True)
    check_sequence(14, _Mesh((2,), (1,)), 0, False)
    check_sequence(13, None, None, True)  # no cp axis: any length


@pytest.mark.parametrize("head_tail", [True, False])
def test_local_targets_are_the_whole_sequences_shifted_targets(head_tail):
    """dp2 x cp2: the four ranks' blocks put together are the labels shifted over the WHOLE natural
    sequence, then permuted -- so the target of a block's last row is the next natural token, held by
    another rank (what shifting each block on its own gets wrong)."""
    labels = torch.arange(4 * 8).reshape(4, 8)
    labels[0, 3] = -100
    shifted = torch.cat([labels[:, 1:], torch.full((4, 1), -100)], dim=1)
    if head_tail:
        shifted = shifted[:, head_tail_order(8, 4)]
    for dp in range(2):
        row = []
        for cp in range(2):
            block = local_targets(labels, _Mesh((2, 2), (dp, cp)), [0], 1, head_tail)
            assert block.shape == (2, 4) and block.is_contiguous()
            row.append(block)
        torch.testing.assert_close(torch.cat(row, 1), shifted[2 * dp : 2 * dp + 2], rtol=0, atol=0)
    # rank (0, 0)'s first stored row: natural positions 0, 1 then (head-tail) 6, 7, or 0..3 (natural)
    first = local_targets(labels, _Mesh((2, 2), (0, 0)), [0], 1, head_tail)[0]
    assert first.tolist() == ([1, 2, 7, -100] if head_tail else [1, 2, -100, 4])


def _sft_args(mesh, fully_shard=False):
    sizes, names = zip(*((int(v), k) for k, v in (a.split("=") for a in mesh.split(","))))
    return argparse.Namespace(
        mesh=(sizes, names),
        fully_shard=fully_shard,
        export_hf=False,
        microbatches=2,
        batch_size=4,
        micro_batch_size=4,
        pp_schedule="1f1b",
    )


def test_sft_takes_pp_with_cp():
    from hypershard.sft.train import check_pipeline

    check_pipeline(_sft_args("pp=2,cp=2"))


def test_sft_refuses_fully_shard_with_pp_and_cp():
    from hypershard.sft.data import SFTError
    from hypershard.sft.train import check_pipeline

    with pytest.raises(SFTError, match=r"^hypershard: sft: a pp axis with --fully-shard with a cp axis; allowed: "):
        check_pipeline(_sft_args("pp=2,dp=2,cp=2", fully_shard=True))
