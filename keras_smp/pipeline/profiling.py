"""The executed timeline: when each stage really ran each action.

`executed_timeline(model, x, y)` runs one pipelined step with timing on
(`execute(..., times=...)` takes a `tf.timestamp()` on the stage's device
before and after every compute action and every chained receive) and
returns it as the schedule's own `Timeline`, so the planned and executed
pictures, grids and bubble fractions compare directly.

With one stage per process, every stage process of the replica runs the
step (every rank calls `executed_timeline`, as it calls `fit`); each times
its own actions and the ranks' timings are summed over the replica's
pipeline group (each rank fills its own row of a zero tensor), so every
rank returns the whole replica's timeline. With virtual stages a row is a
pipeline rank, holding the actions of all its model stages. Times are `tf.timestamp()`s,
wall-clock seconds: comparable between processes of one host, and between
hosts only as far as their clocks agree.
"""

import tensorflow as tf

from keras_smp.pipeline.schedule import Timeline
from keras_smp.pipeline.step import run_step


def executed_timeline(model, x, y=None, sample_weight=None, runs=3):
    """See `DistributedModel.executed_timeline`."""
    if y is not None and model.loss is None:
        raise ValueError(
            "executed_timeline(x, y) needs a compiled loss: call "
            "model.compile(optimizer, loss) first, or pass no y to time "
            "the forward pass only.")
    # Compiled without a loss (its layers add it): x alone trains, as in fit.
    training = y is not None or (model.compiled
                                 and model._smp_added_loss_only())
    recorded = []
    p = model.num_stages
    links = model._smp_links() if model._smp_multi_process() else None

    def replica(*data):
        times = []
        run = run_step(model, data, training=training, times=times)
        # TensorFlow prunes work whose results are unused, even with
        # control dependencies on it: fetch a checksum of everything.
        used = [tf.reduce_sum(tf.cast(tf.convert_to_tensor(t), "float64"))
                for t in tf.nest.flatten((run.y_pred, run.losses))
                + list(run.grads.values()) if t is not None]
        spans = tf.stack([tf.stack([s, e]) for _, s, e in times])
        if links is None:
            recorded[:] = [a for a, _, _ in times]
            return spans, tf.add_n(used)
        # One stage per process: every stage's spans, in the stages'
        # order, on every stage (see the module docstring).
        plan = [[a for a in model.schedule.compute_actions(r)
                 if training or a.kind == "F"] for r in range(p)]
        recorded[:] = [a for acts in plan for a in acts]
        n = max(len(acts) for acts in plan)
        mine = [a for a, _, _ in times]
        if mine != plan[links.rank]:
            raise AssertionError(
                f"executed_timeline: rank {links.rank} ran {mine}, its "
                f"schedule says {plan[links.rank]}")
        rows = [tf.zeros([n, 2], tf.float64)] * p
        rows[links.rank] = tf.pad(spans, [[0, n - len(mine)], [0, 0]])
        every = links.reduce(
            tf.stack(rows), links.keys.replica(links.replica), p,
            links.INSTANCE_TIMELINE + n)
        spans = tf.concat([every[s, :len(acts)]
                           for s, acts in enumerate(plan)], axis=0)
        return spans, tf.add_n(used)

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
    entries = [[] for _ in range(p)]
    for action, (start, end) in zip(recorded, spans):
        entries[model.schedule.rank_of(action.stage)].append(
            (1000.0 * (start - t0), 1000.0 * (end - t0), action))
    return Timeline(model.schedule, [sorted(e, key=lambda t: t[0])
                                     for e in entries], unit="ms")
