"""Collective group keys: one allocator, disjoint ranges, the same on every rank.

Pure Python (keras_smp.runtime.keys, distribute.groups): no TensorFlow.
"""

import pytest

from keras_smp.distribute.groups import ReplicaLayout
from keras_smp.distribute.groups import group_key_counts
from keras_smp.distribute.groups import stage_replica_layout
from keras_smp.runtime import keys as keys_lib
from keras_smp.runtime.keys import TF_RESERVED
from keras_smp.runtime.keys import KeyAllocator
from keras_smp.runtime.keys import KeyRange
from keras_smp.topology import Topology

MAX = 2**31 - 1


def _disjoint(ranges):
    spans = sorted((r.start, r.stop) for r in ranges if r.size)
    return all(a_stop <= b_start
               for (_, a_stop), (b_start, _) in zip(spans, spans[1:]))


def test_ranges_are_disjoint_consecutive_and_in_call_order():
    keys = KeyAllocator()
    a = keys.allocate("a", 5)
    b = keys.allocate("b", 1)
    empty = keys.allocate("nothing", 0)
    c = keys.allocate("c", 1000)
    assert (a.start, b.start, empty.start, c.start) == (
        1_000_000, 1_000_005, 1_000_006, 1_000_006)
    assert keys.ranges == [a, b, empty, c]
    assert _disjoint(keys.ranges)
    assert a.start > TF_RESERVED[-1] and c.stop - 1 <= MAX
    assert [a.key(i) for i in range(5)] == list(a) == list(range(1_000_000, 1_000_005))
    assert 1_000_004 in a and 1_000_005 not in a and len(c) == 1000


def test_same_calls_give_the_same_keys_on_every_rank():
    def program(keys):
        return [keys.allocate(n, s) for n, s in (("x", 3), ("y", 40), ("z", 7))]

    assert program(KeyAllocator()) == program(KeyAllocator())


def test_key_index_out_of_range_names_the_range():
    r = KeyRange("pipeline links", 1_000_006, 4)
    for bad in (-1, 4, 1.0, True, "0"):
        with pytest.raises(ValueError, match=r"'pipeline links' of size 4 "
                                             r"\(keys 1000006\.\.1000009\)"):
            r.key(bad)
    assert r.key(3) == 1_000_009


def test_parts_stay_inside_their_range():
    r = KeyRange("grads", 100, 10)
    p = r.part(4, 6, "stage 1")
    assert (p.name, p.start, p.size) == ("stage 1", 104, 6)
    assert r.part(0, 4).name == "grads[0:4]"
    with pytest.raises(ValueError, match=r"part\(offset=5, size=6\).*'grads'"):
        r.part(5, 6)
    with pytest.raises(ValueError, match="does not fit"):
        r.part(-1, 2)


def test_allocation_past_the_limit_is_an_error_naming_the_ranges():
    keys = KeyAllocator(start=10, limit=19)
    keys.allocate("a", 4)
    keys.allocate("b", 6)   # exactly up to the limit
    assert keys.ranges[-1].stop - 1 == 19
    with pytest.raises(ValueError, match=r"cannot allocate 1 collective "
                       r"key\(s\) for 'c': keys 10\.\.19 are exhausted "
                       r"\(10 used by 2 ranges: 'a' 4, 'b' 6\)"):
        keys.allocate("c", 1)
    with pytest.raises(ValueError, match="exhausted"):
        KeyAllocator(start=MAX - 1).allocate("big", 3)
    assert KeyAllocator(start=MAX - 1).allocate("fits", 2).key(1) == MAX


@pytest.mark.parametrize("size", [-1, 1.5, None, True])
def test_bad_sizes_are_rejected(size):
    with pytest.raises(ValueError, match="size must be an int >= 0"):
        KeyAllocator().allocate("x", size)


@pytest.mark.parametrize("start, limit", [(-1, 10), (20, 10), (0, 2**31),
                                          (1.0, 10)])
def test_bad_bounds_are_rejected(start, limit):
    with pytest.raises(ValueError, match="KeyAllocator"):
        KeyAllocator(start=start, limit=limit)


def test_process_allocator_is_shared_until_reset():
    keys_lib.reset_process_keys()
    try:
        a = keys_lib.process_keys()
        assert keys_lib.process_keys() is a
        first = a.allocate("t", 2)
        assert first.start == 1_000_000
        keys_lib.reset_process_keys()
        assert keys_lib.process_keys() is not a
        assert keys_lib.process_keys().allocate("t", 2) == first
    finally:
        keys_lib.reset_process_keys()


def _strategy_keys(keys, topology, tf_keys_per_stage=1000):
    """What SMPStrategy allocates with one stage per process; returns the
    parts this rank uses: its stage's gradient block and TF key block."""
    blocks = group_key_counts(topology, 1, 1, multi_process=True)
    grads = keys.allocate("SMPStrategy gradient all-reduce", sum(blocks))
    mine = grads.part(sum(blocks[:topology.pp_rank]), blocks[topology.pp_rank])
    tf_keys = keys.allocate("SMPStrategy CollectiveKeys per stage",
                            topology.pp_size * tf_keys_per_stage)
    tf_mine = tf_keys.part(topology.pp_rank * tf_keys_per_stage,
                           tf_keys_per_stage)
    return blocks, [mine, tf_mine]


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_thousands_of_ranks_two_strategies_keys_disjoint_and_agreeing(
        placement):
    # 4096 ranks = 16 pipeline stages x 256 replicas, 8 ranks per host, and
    # two strategies in one process. Every rank allocates the same ranges;
    # the parts the 16 stages use never overlap, across both strategies.
    pp, dp, per_host = 16, 256, 8
    world = pp * dp
    hosts = tuple(f"h{r // per_host}" for r in range(world))
    used = {}
    allocations = None
    samples = sorted({0, 1, 9, 10, 15, 255, 2047, world - 1} | {
        Topology(world, 0, hosts, pp, placement).rank_of(s, 7)
        for s in range(pp)})
    for rank in samples:
        topo = Topology(world, rank, hosts, pp, placement)
        keys = KeyAllocator()
        parts = []
        for strategy in range(2):
            blocks, mine = _strategy_keys(keys, topo)
            # The stage's block holds exactly its groups' keys.
            layout = stage_replica_layout(topo, 1, multi_process=True)
            assert blocks[topo.pp_rank] == len(layout.all_groups())
            parts += [(strategy, kind, topo.pp_rank, r)
                      for kind, r in zip(("grads", "tf"), mine)]
        if allocations is None:
            allocations = keys.ranges
        assert keys.ranges == allocations, f"rank {rank} disagrees"
        for strategy, kind, stage, r in parts:
            assert used.setdefault((strategy, kind, stage), r) == r
    assert _disjoint(allocations)
    assert allocations[0].start > TF_RESERVED[-1]
    assert allocations[-1].stop - 1 <= MAX
    every_part = list(used.values())
    assert len({(k[0], k[1]) for k in used}) == 4
    assert _disjoint(every_part)
    assert all(TF_RESERVED[-1] < r.start and r.stop - 1 <= MAX
               for r in every_part)


def test_group_key_counts_cover_every_stage_layout():
    # Stages whose data-parallel groups sit on different hosts need
    # different numbers of groups; every rank still allocates the sum.
    topo = Topology(6, 4, tuple("aaabcc"), 2, "spread")
    assert group_key_counts(topo, 1, 1, multi_process=True) == [4, 3]
    assert group_key_counts(topo, 2, 3, multi_process=False) == [
        3 * len(stage_replica_layout(topo, 2, False).all_groups())]
    layout = ReplicaLayout.from_workers((0, 0, 1, 1), 2)
    assert len(layout.all_groups()) == 1 + 2 + 4
