"""The executed timeline: when each stage really ran each action.

`executed_timeline(model, x, y)` runs one pipelined step with timing on
(`execute(..., times=...)` takes a `tf.timestamp()` on the stage's device
before and after every compute action and every chained receive) and
returns it as the schedule's own `Timeline`, so the planned and executed
pictures, grids and bubble fractions compare directly.
"""

import tensorflow as tf

from keras_smp.pipeline.schedule import Timeline
from keras_smp.pipeline.step import run_step


def executed_timeline(model, x, y=None, sample_weight=None, runs=3):
    """See `DistributedModel.executed_timeline`."""
    if model._smp_multi_process():
        raise NotImplementedError(
            "executed_timeline() measures pipelines inside one process; "
            "with one stage per process, profile each worker with "
            "tf.profiler (see docs/pipeline.md).")
    if y is not None and model.loss is None:
        raise ValueError(
            "executed_timeline(x, y) needs a compiled loss: call "
            "model.compile(optimizer, loss) first, or pass no y to time "
            "the forward pass only.")
    training = y is not None
    recorded = []

    def replica(*data):
        times = []
        run = run_step(model, data, training=training, times=times)
        recorded[:] = [a for a, _, _ in times]
        # TensorFlow prunes work whose results are unused, even with
        # control dependencies on it: fetch a checksum of everything.
        used = [tf.reduce_sum(tf.cast(tf.convert_to_tensor(t), "float64"))
                for t in tf.nest.flatten((run.y_pred, run.losses))
                + list(run.grads.values()) if t is not None]
        return (tf.stack([tf.stack([s, e]) for _, s, e in times]),
                tf.add_n(used))

    strategy = model.distribute_strategy
    args = tuple(tf.convert_to_tensor(t) for t in (x, y, sample_weight)
                 if t is not None)

    @tf.function
    def timed(*data):
        out = strategy.run(replica, args=data)
        return tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0], out)

    for _ in range(max(1, runs)):
        spans = timed(*args)[0].numpy()
    t0 = spans[:, 0].min()
    p = model.num_stages
    entries = [[] for _ in range(p)]
    for action, (start, end) in zip(recorded, spans):
        entries[action.stage].append(
            (1000.0 * (start - t0), 1000.0 * (end - t0), action))
    return Timeline(model.schedule, [sorted(e, key=lambda t: t[0])
                                     for e in entries], unit="ms")
