"""All-reduces known tensors with SMPStrategy's gradient sync (tests).

Run with `keras-smp launch -n N [--host-map ...] -- python allreduce_sums.py
ALGORITHM FUSION_MB [FUSION_MB ...]` (with `allreduce_pieces=4`): one
all-reduce call per fusion
threshold, in one job (the gradient sync's `fusion_threshold_bytes` is set
before each call is traced). Every replica contributes, in each call,
float32 / float16 / bfloat16 tensors of several shapes (mixed dtypes in one
call exercise fusion's per-dtype buckets) holding small integers (exact in
every dtype), one of a shape unknown when traced, and float32 tensors
holding random values; rank 0 prints how
each result compares with the NumPy sum over all replicas.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

algorithm, fusions = sys.argv[1], [float(f) for f in sys.argv[2:]]
strategy = keras_smp.SMPStrategy(allreduce=algorithm,
                                 fusion_threshold_mb=fusions[0],
                                 allreduce_pieces=4)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SHAPES = [(3,), (4, 5), (1000,), (7, 3, 2)]
DTYPES = ["float32", "float16", "bfloat16"]
n = strategy.num_replicas_in_sync


def integers(replica, k, shape):
    rng = np.random.RandomState(1000 * replica + k)
    return rng.randint(-8, 9, size=shape).astype("float32")


def randoms(replica, k, shape):
    return np.random.RandomState(50_000 + 1000 * replica + k).randn(
        *shape).astype("float32")


# A 13 MB float32 tensor of an odd size: the hierarchical algorithm cuts
# buckets of this size into pipelined chunks (and pads shards).
BIG = (3_300_001,)


def values(replica):
    out = [tf.constant(integers(replica, 999, BIG))]
    for d, dtype in enumerate(DTYPES):
        for k, shape in enumerate(SHAPES):
            out.append(tf.cast(integers(replica, 10 * d + k, shape), dtype))
    for k, shape in enumerate(SHAPES):
        out.append(tf.constant(randoms(replica, 100 + k, shape)))
    # Of a shape unknown when traced (as a position embedding's rows of
    # unknown length): reduced alone, the others still fused.
    unknown = tf.constant(integers(replica, 500, (6,)))
    out.append(tf.boolean_mask(unknown, tf.ones([6], tf.bool)))
    return out


def run():
    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            # The replica's index among all replicas of the job.
            rid = ctx.replica_id_in_sync_group
            tensors = tf.switch_case(
                rid, [lambda r=r: values(r) for r in range(n)])
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensors)
        out = strategy.run(replica_fn)
        return [strategy.experimental_local_results(o)[0] for o in out]
    return step()


def check(fusion_mb):
    sync = strategy.gradient_sync
    sync.fusion_threshold_bytes = int(fusion_mb * 2**20)
    traced, pieces = sync.buckets_traced, sync.pieces_traced
    got = [t.numpy().astype("float64") for t in run()]
    report = {"algorithm": strategy.allreduce_algorithm, "replicas": n,
              "fusion_mb": fusion_mb,
              "buckets_traced": int(sync.buckets_traced - traced),
              "pieces_traced": int(sync.pieces_traced - pieces),
              "exact": [], "random_max_rel": 0.0}
    expected = sum(integers(r, 999, BIG).astype("float64") for r in range(n))
    report["exact"].append(["float32", list(BIG),
                            bool(np.array_equal(got[0], expected))])
    i = 1
    for d, dtype in enumerate(DTYPES):
        for k, shape in enumerate(SHAPES):
            expected = sum(integers(r, 10 * d + k, shape).astype("float64")
                           for r in range(n))
            report["exact"].append([dtype, list(shape),
                                    bool(np.array_equal(got[i], expected))])
            i += 1
    for k, shape in enumerate(SHAPES):
        expected = sum(randoms(r, 100 + k, shape).astype("float64")
                       for r in range(n))
        rel = float(np.max(np.abs(got[i] - expected)
                           / (np.abs(expected) + 1e-3)))
        report["random_max_rel"] = max(report["random_max_rel"], rel)
        i += 1
    expected = sum(integers(r, 500, (6,)).astype("float64") for r in range(n))
    report["exact"].append(["float32", [None],
                            bool(np.array_equal(got[i], expected))])
    if keras_smp.rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


for fusion_mb in fusions:
    check(fusion_mb)
