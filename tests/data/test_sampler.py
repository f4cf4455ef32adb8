"""The global sample order: positions per iteration, DP independence, resume, epochs, seeds."""

import itertools
from collections import Counter

import numpy as np
import pytest

from swift_mcore.data.sampler import GlobalOrder, micro_batches

MBS, GBS = 2, 12


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def global_batches(consumed, n_iters, dp_size, mbs=MBS, gbs=GBS):
    """Positions each iteration reads, per DP rank, from independent iterators per rank."""
    per_rank = gbs // (mbs * dp_size)  # micro-batches per rank per iteration
    streams = [micro_batches(consumed, mbs, gbs, r, dp_size) for r in range(dp_size)]
    out = []
    for _ in range(n_iters):
        out.append([[p for mb in take(s, per_rank) for p in mb] for s in streams])
    return out


def test_iteration_i_reads_exactly_its_global_batch():
    for i, ranks in enumerate(global_batches(0, 5, dp_size=1)):
        assert ranks[0] == list(range(i * GBS, (i + 1) * GBS))
    mbs = take(micro_batches(0, MBS, GBS), GBS // MBS)
    assert mbs == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_dp_ranks_split_each_global_batch():
    one = global_batches(0, 6, dp_size=1)
    for dp in (2, 3, 6):
        many = global_batches(0, 6, dp_size=dp)
        for (single,), ranks in zip(one, many):
            assert sorted(itertools.chain(*ranks)) == single
            assert ranks[1][0] == GBS // dp + ranks[0][0]  # rank r reads the r-th slice
    order = GlobalOrder(37, seed=5)  # also as dataset indices, across an epoch boundary
    for (single,), ranks in zip(one, global_batches(0, 6, dp_size=2)):
        assert Counter(order[p] for p in single) == Counter(order[p] for p in sum(ranks, []))


def test_resume_is_the_tail_of_the_stream():
    full = take(micro_batches(0, MBS, GBS, 1, 2), 30)
    per_iter = GBS // (MBS * 2)
    for k in (1, 4, 7):
        resumed = take(micro_batches(k * GBS, MBS, GBS, 1, 2), 30 - k * per_iter)
        assert resumed == full[k * per_iter:]


def test_positioning_is_a_jump_not_a_replay():
    order = GlobalOrder(1000, seed=0)
    far = 10**12 + 17  # an absurd number of consumed samples must cost nothing
    first = next(micro_batches(10**12, MBS, 4, 0, 1))
    assert first == [10**12, 10**12 + 1]
    assert order[far] == order.permutation(far // 1000)[far % 1000]


@pytest.mark.parametrize("length", [1, 7, 64])
def test_each_epoch_covers_every_index_once(length):
    order = GlobalOrder(length, seed=3)
    for epoch in range(4):
        indices = [order[p] for p in range(epoch * length, (epoch + 1) * length)]
        assert sorted(indices) == list(range(length))
    if length > 1:  # and epochs are ordered differently
        epochs = [[order[p] for p in range(e * length, (e + 1) * length)] for e in range(4)]
        assert len({tuple(e) for e in epochs}) > 1


def test_seeds():
    a = [GlobalOrder(500, 1)[p] for p in range(1500)]
    assert a == [GlobalOrder(500, 1)[p] for p in range(1500)]
    assert a != [GlobalOrder(500, 2)[p] for p in range(1500)]
    # The order is a fixed function of (seed, epoch), not of numpy's global state or history.
    np.random.seed(0)
    late = GlobalOrder(500, 1)
    assert [late[p] for p in range(1499, -1, -1)] == a[::-1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of global_batch_size"):
        micro_batches(5, MBS, GBS)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        micro_batches(0, 5, GBS)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        micro_batches(0, 4, GBS, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        micro_batches(0, MBS, GBS, 2, 2)
    with pytest.raises(ValueError, match="empty dataset"):
        GlobalOrder(0, 1)
