"""Every process ends the data together, with model parallelism.

With pipeline stages or tensor-parallel ranks in different processes, every
process of the job takes each step together: a rank whose data ends early
leaves the step (and starts the next epoch, or ends its `fit`) while its
peers wait in a transfer for it. Before this module such a rank silently
took the next epoch's first step in place of the peers' current one (the
stages paired batches of different steps), then the job waited until
`collective_timeout_seconds` and failed naming no cause.

For data whose length is known, `fit`, `evaluate` and `predict` check
before their first step that every rank runs as many steps
(`runtime.calls`). Data of unknown length (a generator without
`__len__`, a dataset of unknown cardinality), or a `steps_per_epoch` that
some rank's data cannot fill, escapes that check: this module makes the
ranks agree at every step on whether there is a next batch: TensorFlow's
distributed iterator already counts the replicas holding one
(`tf_private.route_replicas_with_values`), summed over the data-parallel
group; here every process of the job sums a vector of each rank's count
instead (one small all-reduce per step, for any data but infinite data:
a step function traced for data of known length serves data of unknown
length with the same element spec). All ranks with a batch: the step
runs. None: the data has ended everywhere, at the same step. Some: every
rank fails at once with the same `ValueError` naming the ranks whose data
ended (`calls.data_end_message`), instead of a hang.

Data-parallel processes alone keep TensorFlow's behaviour: a replica whose
data ended gets empty batches until every replica's has. For them too, a
step function traced on infinite data is traced again for finite data
(`tf_private.trace_by_length_class`): TensorFlow reused it, without its
end handling, and a replica whose data ended first left the others
waiting in the gradient all-reduce until the timeout.
"""

import itertools
import threading

from keras_smp.runtime import calls

_lock = threading.Lock()
_installed = []


def install():
    """Routes distributed iterators' end-of-data count here (idempotent)."""
    with _lock:
        if _installed:
            return
        from keras_smp.runtime import tf_private

        tf_private.route_replicas_with_values(_agree)
        _installed.append(True)


def group_of(extended):
    """`(group key, instance keys)` of `extended`'s (an `SMPStrategy`'s)
    agreement, or `None` when it needs none (one process, or processes
    that each hold a whole model replica)."""
    return getattr(extended, "_smp_data_end", None)


def allocate(extended, runtime):
    """Gives a strategy's extended its agreement's collective group (every
    process of the job), where model parallelism spans processes. Called
    at the same point on every rank (the strategy's construction)."""
    from keras_smp.runtime import tf_private

    topology = runtime.topology
    if topology.world_size > 1:
        # Several processes, data parallel too: a step traced on infinite
        # data must not serve finite data (TensorFlow's end handling).
        tf_private.trace_by_length_class()
    if topology.world_size > 1 and topology.mp_size > 1:
        key = runtime.keys.allocate("end-of-data agreement", 1).key(0)
        extended._smp_data_end = (key, itertools.count(1))
        install()


def _agree(strategy, cardinality, count, replicas, device):
    import tensorflow as tf

    # Whatever the data's length: a step function traced for data of
    # known length is reused for data of unknown length with the same
    # element spec (TensorFlow's iterator spec ignores the cardinality).
    # (Infinite data, `repeat()`, never asks: TensorFlow takes its next
    # batch as there.)
    del cardinality
    found = group_of(getattr(strategy, "extended", None))
    if found is None:
        return None
    key, instances = found
    runtime = strategy.runtime
    world, rank = runtime.topology.world_size, runtime.topology.rank
    with tf.device(device):
        mine = tf.one_hot(rank, world, dtype=tf.int64)
        both = tf.raw_ops.CollectiveReduceV2(
            input=tf.concat([mine * count, mine * replicas], 0),
            group_size=world, group_key=key, instance_key=next(instances),
            ordering_token=[], merge_op="Add", final_op="Id",
            communication_hint="auto",
            timeout_seconds=float(runtime.config.collective_timeout_seconds))
        counts, expected = both[:world], both[world:]
        agree = tf.logical_or(tf.reduce_all(tf.equal(counts, expected)),
                              tf.reduce_all(tf.equal(counts, 0)))
        if tf.executing_eagerly():  # Keras' predict draws batches eagerly
            if not bool(agree):
                raise ValueError(calls.data_end_message(
                    counts.numpy().tolist(), expected.numpy().tolist()))
            return tf.reduce_sum(counts)
        check = tf.debugging.Assert(
            agree, [calls.DATA_END_MARKER + " (batches per rank, then "
                    "replicas per rank):", counts, expected],
            summarize=world)
        with tf.control_dependencies([check]):
            return tf.reduce_sum(counts)
