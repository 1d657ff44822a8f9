"""In-process pipeline executor: runs a `Schedule` with TensorFlow.

Stage `s` runs on `devices[s]`. For every action of the schedule, in an
order that respects its dependencies (the schedule's simulated timeline),
the executor builds graph ops:

- `F` (forward of microbatch m on stage s): copies the previous stage's
  outputs onto the stage's device (the in-process "receive") and calls the
  stage function;
- `B` (backward): `tf.gradients` of the stage's outputs with respect to its
  inputs and variables, seeded with the next stage's input gradients.
  `tf.gradients` places every gradient op with its forward op, so a stage's
  backward runs on the stage's device (`GradientTape` would not).

Every action on a device is made control-dependent on the previous action
of that device, so each device executes exactly the schedule's order. Ops
of an action are named `stage{s}/fwd_mb{m}/...` or `stage{s}/bwd_mb{m}/...`
(visible in TensorBoard's graph and profiler).
Variable gradients are summed over microbatches.

This module is the TensorFlow layer under the pure-Python schedule; the
Keras model integration (`DistributedModel`) builds on it.
"""

import tensorflow as tf

from keras_smp.pipeline.schedule import simulate


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _tf_variable(v):
    """The `tf.Variable` this replica computes with."""
    # Keras 3 variables wrap a tf.Variable in `.value` (tf.Variable's own
    # `value` is a method).
    value = getattr(v, "value", v)
    if callable(value):
        value = v
    if isinstance(value, tf.distribute.DistributedValues):
        # Inside a replica: this replica's component (on its own device).
        value = value._get_on_device_or_primary()
    return value


def _received(times, stage, kind, mb, start, copies):
    """Times the copy of a stage's inputs (the in-process receive)."""
    from keras_smp.pipeline.schedule import Action

    with tf.control_dependencies(copies):
        done = tf.timestamp()
    times.append((Action(stage, kind, mb), start, done))
    return done


def run_pipeline(stage_fns, stage_variables, loss_fn, schedule, devices,
                 microbatch_inputs, microbatch_targets, forward_only=False,
                 times=None):
    """Builds one pipelined forward+backward pass over all microbatches.

    Must be called inside a `tf.function` (it uses `tf.gradients`).

    Args:
        stage_fns: one callable per stage, `list[Tensor] -> list[Tensor]`.
            Stage s receives stage s-1's outputs (stage 0: the microbatch
            inputs).
        stage_variables: trainable variables of each stage (lists).
        loss_fn: `(last_stage_outputs, targets) -> scalar loss` of one
            microbatch. The returned per-microbatch losses are summed, so
            scale them (e.g. by `1 / num_microbatches`) as needed.
        schedule: a `keras_smp.pipeline.schedule.Schedule`.
        devices: one device name per stage.
        microbatch_inputs: list (per microbatch) of lists of input tensors.
        microbatch_targets: list (per microbatch) of targets for `loss_fn`.
        forward_only: run only the schedule's forward actions (evaluation
            and prediction); `loss_fn` may then be `None`.
        times: optional list; each action appends `(action, start, end)`,
            `tf.timestamp()` tensors taken when the action's inputs are
            ready and its device is free, and when its results exist (the
            executed timeline). The copy of a stage's inputs from the
            neighbouring stage is timed as a `RECV_F` / `RECV_B` action
            before its `F` / `B`.

    Returns:
        `(losses, outputs, grads)`: the list of per-microbatch losses, the
        list of per-microbatch last-stage outputs, and for each stage the
        list of variable gradients summed over microbatches (`None`s when
        `forward_only`).

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.executor import run_pipeline
    from keras_smp.pipeline.schedule import get_schedule

    w0, w1 = tf.Variable([[2.0]]), tf.Variable([[3.0]])

    @tf.function
    def step(x):
        return run_pipeline(
            [lambda t: [t[0] @ w0], lambda t: [t[0] @ w1]], [[w0], [w1]],
            lambda out, y: tf.reduce_sum(out[0]), get_schedule("1f1b", 2, 2),
            ["CPU:0", "CPU:0"], [[x[:1]], [x[1:]]], [None, None])

    losses, _, grads = step(tf.constant([[1.0], [1.0]]))
    assert float(grads[1][0][0, 0]) == 4.0  # d(sum x w0 w1)/dw1 = sum(x w0)
    ```
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    if len(stage_fns) != p or len(devices) != p or len(stage_variables) != p:
        raise ValueError(
            f"The schedule has {p} stages but received {len(stage_fns)} "
            f"stage functions, {len(stage_variables)} variable lists and "
            f"{len(devices)} devices; pass one of each per stage.")
    if len(microbatch_inputs) != m or len(microbatch_targets) != m:
        raise ValueError(
            f"The schedule has {m} microbatches but received "
            f"{len(microbatch_inputs)} inputs and {len(microbatch_targets)} "
            "targets.")
    timeline = simulate(schedule)
    order = sorted(
        (start, action.stage, action)
        for stage_entries in timeline.entries
        for start, _, action in stage_entries
        if not (forward_only and action.kind == "B"))
    tf_vars = [[_tf_variable(v) for v in vs] for vs in stage_variables]
    stage_in, stage_out, grad_out = {}, {}, {}
    losses, outputs = [None] * m, [None] * m
    grads = [[None] * len(vs) for vs in tf_vars]
    last = {}
    for _, s, action in order:
        mb = action.microbatch
        deps = [last[s]] if s in last else []
        scope = f"stage{s}/{'fwd' if action.kind == 'F' else 'bwd'}_mb{mb}"
        with tf.device(devices[s]), tf.control_dependencies(deps), \
                tf.name_scope(scope):
            start = None
            if times is not None:
                ready = (_as_list(microbatch_inputs[mb] if s == 0 else
                                  stage_out[(s - 1, mb)])
                         if action.kind == "F" else
                         ([] if s == p - 1 else grad_out[(s + 1, mb)]))
                with tf.control_dependencies(ready):
                    start = tf.timestamp()
            # The action starts after its start timestamp.
            with tf.control_dependencies([start] if start is not None else []):
                if action.kind == "F":
                    src = (microbatch_inputs[mb] if s == 0
                           else stage_out[(s - 1, mb)])
                    inputs = [tf.identity(t) for t in _as_list(src)]
                    if times is not None and s > 0:
                        start = _received(times, s, "RECV_F", mb, start,
                                          inputs)
                    # After the receive's timestamp, when timing.
                    with tf.control_dependencies(
                            [start] if start is not None else []):
                        out = _as_list(stage_fns[s](inputs))
                    stage_in[(s, mb)] = inputs
                    stage_out[(s, mb)] = out
                    if s == p - 1:
                        outputs[mb] = out
                        if loss_fn is not None:
                            losses[mb] = loss_fn(out, microbatch_targets[mb])
                    done = out + ([losses[mb]] if losses[mb] is not None
                                  and s == p - 1 else [])
                else:
                    if s == p - 1:
                        ys, seed = [losses[mb]], None
                    else:
                        ys = stage_out[(s, mb)]
                        seed = [tf.identity(g) for g in grad_out[(s + 1, mb)]]
                        if times is not None:
                            start = _received(times, s, "RECV_B", mb, start,
                                              seed)
                    ins = [] if s == 0 else stage_in[(s, mb)]
                    # Stop at the stage's inputs: a weight also used by an
                    # earlier stage (tied) would otherwise get that stage's part
                    # of its gradient here too, on top of the earlier stage's.
                    with tf.control_dependencies(
                            [start] if start is not None else []):
                        gs = tf.gradients(ys, ins + tf_vars[s], grad_ys=seed,
                                          stop_gradients=ins,
                                          unconnected_gradients="zero")
                    n_in = 0 if s == 0 else len(stage_in[(s, mb)])
                    grad_out[(s, mb)] = gs[:n_in]
                    for i, g in enumerate(gs[n_in:]):
                        grads[s][i] = g if grads[s][i] is None else grads[s][i] + g
                    done = gs
        last[s] = tf.group(*done) if done else tf.no_op()
        if times is not None:
            with tf.device(devices[s]), tf.control_dependencies([last[s]]):
                end = tf.timestamp()
            times.append((action, start, end))
    return losses, outputs, grads
