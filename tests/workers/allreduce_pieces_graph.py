"""How the ring all-reduce's pieces are ordered in the traced step (tests).

Usage: allreduce_pieces_graph.py PIECES. One process, 2 logical CPUs (2
replicas), `SMPStrategy(allreduce_pieces=PIECES)`. Traces one all-reduce of
a 16 MB float32 tensor and a 4 KB one (2 buckets, fusion off), runs it,
and prints one JSON line: the CollectiveReduceV2 ops per device, how many
distinct ordering tokens they use, how many pairs of one device's
collectives depend on each other (a data or control path in the graph:
those cannot be in flight together), and whether the last bucket went
first.
"""

import itertools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(local_devices=2, fusion_threshold_mb=0,
                                 allreduce_pieces=int(sys.argv[1]))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BIG, SMALL = 4 * 2**20, 1000


@tf.function
def step():
    def replica_fn():
        rid = tf.cast(tf.distribute.get_replica_context()
                      .replica_id_in_sync_group, tf.float32)
        big = tf.range(BIG, dtype=tf.float32) % 7 + rid
        small = tf.ones([SMALL]) * (rid + 1)
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, [big, small])
    return [strategy.experimental_local_results(o)[0]
            for o in strategy.run(replica_fn)]


big, small = step()
expected = 2 * (np.arange(BIG, dtype=np.float64) % 7) + 1
graph = step.get_concrete_function().graph
ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]


def ancestors(op, seen=None):
    seen = set() if seen is None else seen
    stack = [op]
    while stack:
        o = stack.pop()
        for parent in [t.op for t in o.inputs] + list(o.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


by_device = {}
for op in ops:
    by_device.setdefault(op.device, []).append(op)
report = {"exact": bool(np.array_equal(big.numpy(), expected))
          and bool(np.all(small.numpy() == 3.0)),
          "pieces_traced": strategy.gradient_sync.pieces_traced,
          "devices": []}
for device, group in sorted(by_device.items()):
    up = {op.name: ancestors(op) for op in group}
    tokens = {op.inputs[-1].op.name for op in group}  # ordering_token
    dependent = sum(1 for a, b in itertools.permutations(group, 2)
                    if a.name in up[b.name])
    small = [op for op in group if op.inputs[0].shape[0] == SMALL]
    report["devices"].append({
        "collectives": len(group), "tokens": len(tokens),
        "dependent_pairs": dependent,
        # The small bucket (the last tensor, so the last bucket) is issued
        # first: a big piece on its stream depends on it.
        "small_first": any(small[0].name in up[op.name] for op in group),
        "sizes": sorted(int(op.inputs[0].shape[0]) for op in group)})
print("RESULT " + json.dumps(report), flush=True)
