"""Length-grouped training order (``data.group_by_length``), in process: the epoch's row set, global batches that
do not depend on the world size or the micro-batch/accumulation split, one length bucket per global batch, and an
exact mid-epoch resume. Real runs: the parity battery's GPT layouts (gpt-z2, gpt-1rank-*) train grouped against
the single-device reference, and test_train's BERT resume continues a grouped run bit-for-bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from finetune.config import DataConfig
from finetune.data.dataset import ResumableDistributedSampler, grouped_order, row_lengths, train_sampler

ROWS, GLOBAL_BATCH = 203, 8  # a remainder of 3 rows, 25 full global batches


@pytest.fixture(scope="module")
def dataset():
    import datasets

    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({"input_ids": [[1] * int(n) for n in rng.integers(2, 257, ROWS)]})


def rank_orders(dataset, world: int, seed: int, epoch: int, skip: int = 0, grouped: bool = True) -> list[list[int]]:
    cfg = DataConfig(group_by_length=grouped)
    out = []
    for r in range(world):
        sampler = train_sampler(dataset, cfg, GLOBAL_BATCH, world, r, seed)
        sampler.set_epoch(epoch, skip=skip)
        out.append(list(sampler))
    return out


def global_batches(orders: list[list[int]], micro: int, accum: int) -> list[list[int]]:
    """The rows of each optimizer step, as the loop draws them: ``accum`` micro-batches of ``micro`` per rank."""
    per_rank = micro * accum
    steps = len(orders[0]) // per_rank
    return [sorted(i for o in orders for i in o[s * per_rank:(s + 1) * per_rank]) for s in range(steps)]


def test_row_lengths_and_the_epoch_row_set(dataset):
    lengths = row_lengths(dataset)
    assert lengths.tolist() == [len(r) for r in dataset["input_ids"]]
    for epoch in (0, 1):
        order = grouped_order(lengths, GLOBAL_BATCH, seed=7, epoch=epoch)
        assert sorted(order) == list(range(ROWS)), "a permutation of the epoch's rows"
        assert order == grouped_order(lengths, GLOBAL_BATCH, seed=7, epoch=epoch), "deterministic per (seed, epoch)"
    assert grouped_order(lengths, GLOBAL_BATCH, 7, 0) != grouped_order(lengths, GLOBAL_BATCH, 7, 1)
    assert grouped_order(lengths, GLOBAL_BATCH, 7, 0) != grouped_order(lengths, GLOBAL_BATCH, 8, 0)
    # Every rank together trains the same rows per epoch with and without grouping (drop_last: all full steps).
    grouped = global_batches(rank_orders(dataset, 2, 7, 0), 4, 1)
    plain = global_batches(rank_orders(dataset, 2, 7, 0, grouped=False), 4, 1)
    assert len(grouped) == len(plain) == ROWS // GLOBAL_BATCH
    assert len({i for b in grouped for i in b}) == len({i for b in plain for i in b}) == 25 * GLOBAL_BATCH


def test_global_batches_do_not_depend_on_world_size_or_split(dataset):
    lengths = row_lengths(dataset)
    order = grouped_order(lengths, GLOBAL_BATCH, seed=3, epoch=1)
    want = [sorted(order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]) for s in range(ROWS // GLOBAL_BATCH)]
    for world, micro, accum in [(1, 8, 1), (1, 2, 4), (2, 4, 1), (2, 2, 2), (4, 1, 2), (8, 1, 1)]:
        assert global_batches(rank_orders(dataset, world, 3, 1), micro, accum) == want, (world, micro, accum)
    # One length bucket per global batch: the grouped batches are much tighter than random ones.
    spread = [np.ptp(lengths[b]) for b in want]
    plain = global_batches(rank_orders(dataset, 1, 3, 1, grouped=False), 8, 1)
    assert np.mean(spread) < 0.25 * np.mean([np.ptp(lengths[b]) for b in plain])
    # The longest row is in the first step (an out-of-memory shows at once); the steps are shuffled, not sorted.
    assert lengths[want[0]].max() == lengths.max()
    longest = [lengths[b].max() for b in want]
    assert longest != sorted(longest, reverse=True) and longest != sorted(longest)


def test_mid_epoch_resume_skips_exactly_the_trained_rows(dataset):
    """``set_epoch(epoch, skip=samples_in_epoch // world)`` continues where the run stopped, for any new split."""
    full = rank_orders(dataset, 2, 5, 2)
    for skip in (0, 4, 12):
        assert rank_orders(dataset, 2, 5, 2, skip=skip) == [o[skip:] for o in full]
    # resumed on 1 rank after 3 steps of 2 ranks x 4 rows: the same remaining global batches
    resumed = global_batches(rank_orders(dataset, 1, 5, 2, skip=3 * GLOBAL_BATCH), 8, 1)
    assert resumed == global_batches(full, 4, 1)[3:]


def test_plain_order_is_distributed_samplers_and_packed_rows_are_not_grouped(dataset):
    import datasets

    for r in range(2):
        plain = ResumableDistributedSampler(dataset, 2, r, seed=1)
        reference = DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=1, drop_last=True)
        plain.set_epoch(4)
        reference.set_epoch(4)
        assert list(plain) == list(reference)
        assert plain.global_order()[r:plain.total_size:2].tolist() == list(reference)
    packed = datasets.Dataset.from_dict({"input_ids": [[1] * 16] * 40})
    assert train_sampler(packed, DataConfig(), GLOBAL_BATCH, 2, 0, 1).lengths is None
    assert train_sampler(dataset, DataConfig(), GLOBAL_BATCH, 2, 0, 1).lengths is not None
    assert train_sampler(dataset, DataConfig(group_by_length=False), GLOBAL_BATCH, 2, 0, 1).lengths is None


def test_repeat_gives_each_steps_rows_that_many_times_in_a_row(dataset):
    """``repeat`` (grpo's ``num_iterations``): each rank's block of one step's rows (micro x accumulation) comes
    ``repeat`` times in a row, the epoch counts the repeats, and a skip into the middle of a block (a resume between
    two steps of one generation batch) continues there."""
    for r in range(2):
        once = train_sampler(dataset, DataConfig(), GLOBAL_BATCH, 2, r, 1)
        twice = train_sampler(dataset, DataConfig(), GLOBAL_BATCH, 2, r, 1, repeat=2)
        once.set_epoch(3)
        twice.set_epoch(3)
        rows, block = list(once), GLOBAL_BATCH // 2
        steps = len(rows) // block
        expected = [x for s in range(steps) for x in rows[s * block:(s + 1) * block] * 2] + rows[steps * block:]
        assert list(twice) == expected and twice.num_samples == len(expected) == once.num_samples + steps * block
        twice.set_epoch(3, skip=3 * block)  # after 3 steps: the second of step 2's repeats
        assert list(twice) == expected[3 * block:]
