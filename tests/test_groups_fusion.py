"""Pure-Python planning of gradient sync: replica groups and fusion buckets."""

import itertools
import re

import pytest

from keras_smp.distribute.fusion import plan_buckets
from keras_smp.distribute.fusion import pieces_in_flight
from keras_smp.distribute.fusion import plan_pieces
from keras_smp.distribute.groups import ReplicaLayout
from keras_smp.distribute.groups import resolve_algorithm


@pytest.mark.parametrize("hosts,per_worker", [
    ((0, 0, 1, 1), 1), ((0, 1), 2), ((0, 0, 0, 1, 1, 1), 1), ((0, 1, 2), 2),
    ((0,), 4)])
def test_hierarchical_groups_cover_every_replica_once(hosts, per_worker):
    layout = ReplicaLayout.from_workers(hosts, per_worker)
    n = layout.size
    assert n == len(hosts) * per_worker
    intra = {layout.for_replica(r).intra_host_group for r in range(n)}
    cross = {layout.for_replica(r).cross_host_group for r in range(n)}
    # Host groups and cross-host groups each partition the replicas.
    for groups in (intra, cross):
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(n))
    # A cross-host group has one replica per host, all with the same index.
    for g in cross:
        assert len({layout.replica_hosts[r] for r in g}) == layout.num_hosts
        assert len({layout.for_replica(r).local_index for r in g}) == 1
    # Every replica uses only groups all workers enumerate, in one order.
    every = layout.all_groups()
    assert len(every) == len(set(every))
    for r in range(n):
        local = layout.for_replica(r)
        assert local.all_groups() == every
        assert {local.world_group, local.intra_host_group,
                local.cross_host_group} <= set(every)


def _all_groups_reference(layout):
    """`all_groups` as first written: every replica's groups, in order."""
    groups = [layout.world_group]
    groups += [layout.host_members(h) for h in sorted(set(layout.replica_hosts))]
    if layout.is_uniform:
        groups += [layout.for_replica(r).cross_host_group
                   for r in range(layout.size)]
    return list(dict.fromkeys(groups))


@pytest.mark.parametrize("hosts,per_worker", [
    ((0, 0, 1, 1), 1), ((0, 1), 2), ((0, 0, 0, 1, 1, 1), 1), ((0, 1, 2), 2),
    ((0,), 4), ((1, 0, 1, 0), 1), ((2, 0, 1, 2, 0, 1), 2), ((0, 0, 1), 1),
    ((3, 1, 1, 3, 2, 2), 1)])
def test_all_groups_order_is_unchanged(hosts, per_worker):
    # Group keys follow this order on every worker: it must not change.
    layout = ReplicaLayout.from_workers(hosts, per_worker)
    assert layout.all_groups() == _all_groups_reference(layout)


@pytest.mark.parametrize("hosts,per_worker,expected", [
    ((0, 0, 1, 1), 1, "hierarchical"),
    ((0, 1), 2, "hierarchical"),
    ((0, 1), 1, "ring"),        # one replica per host: nothing to gain
    ((0, 0), 1, "ring"),        # one host
    ((0, 0, 1), 1, "ring"),     # uneven hosts
])
def test_auto_algorithm(hosts, per_worker, expected):
    layout = ReplicaLayout.from_workers(hosts, per_worker)
    assert resolve_algorithm("auto", layout) == expected


def test_hierarchical_on_uneven_hosts_is_an_error():
    layout = ReplicaLayout.from_workers((0, 0, 1), 1)
    with pytest.raises(ValueError, match="same number of replicas"):
        resolve_algorithm("hierarchical", layout)


def test_unknown_algorithm_is_an_error():
    with pytest.raises(ValueError, match="'tree'"):
        resolve_algorithm("tree", ReplicaLayout((0,)))


def test_buckets_respect_threshold_and_dtype_and_order():
    shapes = [(10,), (300,), (5, 5), (2,), (1000,), (3,)]
    dtypes = ["float32", "float32", "float16", "float32", "float32", "float16"]
    sizes = [4 if d == "float32" else 2 for d in dtypes]
    buckets = plan_buckets(shapes, dtypes, sizes, threshold_bytes=1300)
    seen = sorted(i for b in buckets for i in b.indices)
    assert seen == list(range(len(shapes)))
    for b in buckets:
        assert {dtypes[i] for i in b.indices} == {b.dtype}
        assert list(b.indices) == sorted(b.indices)
        nbytes = sum(sizes[i] * b.sizes[k] for k, i in enumerate(b.indices))
        assert len(b.indices) == 1 or nbytes <= 1300
    # The 1000-element tensor (4000 bytes) is alone in its bucket.
    assert any(b.indices == (4,) for b in buckets)


def test_fusion_disabled_gives_one_bucket_per_tensor():
    buckets = plan_buckets([(2,), (3,)], ["float32"] * 2, [4, 4], 0)
    assert [b.indices for b in buckets] == [(0,), (1,)]


@pytest.mark.parametrize("rows,dense_rows,replicas,dense", [
    (512, 1000, 2, True),      # gathered 1024 rows >= a 1000-row table
    (512, 1025, 2, False),
    (64, 32, 2, True),         # small vocabulary (the zoo's LM)
    (512, 50_000, 8, False),   # large vocabulary: stay sparse
    (None, 1000, 2, False),    # unknown batch: stay sparse
    (512, 100, 1, False),      # one replica: nothing to sum
])
def test_sparse_gradient_summed_dense_when_smaller(rows, dense_rows, replicas,
                                                   dense):
    from keras_smp.distribute.fusion import sum_sparse_as_dense

    assert sum_sparse_as_dense(rows, dense_rows, replicas) is dense


@pytest.mark.parametrize("elements,itemsize,max_pieces,expected", [
    (8 * 2**20, 4, 4, [2**21] * 4),         # 32 MB: 4 pieces of 8 MB
    (3_301_066, 4, 4, [825_267] * 2 + [825_266] * 2),  # uneven: sizes differ by 1
    (2**19 + 1, 4, 4, [2**18 + 1, 2**18]),  # 2 MB: 2 pieces of >= 1 MB
    (2**18, 4, 4, [2**18]),                 # exactly 1 MB: whole
    (1000, 4, 4, [1000]),                   # small: whole
    (8 * 2**20, 4, 1, [8 * 2**20]),         # allreduce_pieces=1: whole
    (2**21, 2, 8, [2**19] * 4),             # 4 MB of float16: 4 x 1 MB
])
def test_pieces_cut_large_buckets_only(elements, itemsize, max_pieces,
                                       expected):
    sizes = plan_pieces(elements, itemsize, max_pieces)
    assert sizes == expected
    assert sum(sizes) == elements
    assert all(s * itemsize >= 2**20 for s in sizes) or len(sizes) == 1


def test_pieces_bad_count_is_an_error():
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_pieces must be an int >= 1"):
            plan_pieces(100, 4, bad)
    # Never more pieces than elements, whatever the smallest piece.
    assert plan_pieces(2, 4, 4, min_piece_bytes=0) == [1, 1]


def test_fusion_docstring_examples():
    import doctest

    from keras_smp.distribute import fusion

    failed, attempted = doctest.testmod(fusion, verbose=False)
    assert attempted >= 5 and failed == 0


CPU0 = "/job:worker/replica:0/task:0/device:CPU:0"
CPU1 = "/job:worker/replica:0/task:0/device:CPU:1"
GPU0 = "/job:worker/replica:0/task:0/device:GPU:0"


@pytest.mark.parametrize("algorithm,devices,expected", [
    ("ring", [CPU0], 4),
    ("ring", [CPU0, CPU1], 4),        # logical CPUs: pipeline stages
    ("ring", [GPU0], 1),              # NCCL: one launch order
    ("ring", [CPU0, GPU0], 1),        # any GPU keeps buckets whole
    ("hierarchical", [CPU0], 1),      # pipelines its own chunks
    ("horovod", [CPU0], 1),
])
def test_pieces_in_flight_only_for_the_ring_on_cpus(algorithm, devices,
                                                    expected):
    assert pieces_in_flight(4, algorithm, devices) == expected
    assert pieces_in_flight(1, algorithm, devices) == 1


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_pieces_in_flight_bad_value_is_an_error(bad):
    with pytest.raises(ValueError,
                       match=r"allreduce_pieces must be an int >= 1; "
                       r"received " + re.escape(repr(bad))):
        pieces_in_flight(bad, "ring", [CPU0])
