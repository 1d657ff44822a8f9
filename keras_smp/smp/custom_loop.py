"""SageMaker smp's custom-loop API: `init`, `@step`, `StepOutput`.

Scripts written for `smdistributed.modelparallel.tensorflow` run with
`import keras_smp as smp`:

```python
import keras, numpy as np, tensorflow as tf
import keras_smp as smp

smp.init({"partitions": 2, "microbatches": 4})

class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="relu")
        self.d2 = keras.layers.Dense(3)

    def call(self, x):
        return self.d2(self.d1(x))

model = Model()
optimizer = keras.optimizers.SGD(0.1)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

@smp.step
def get_grads(x, y):
    logits = model(x, training=True)
    loss = loss_fn(y, logits)
    return optimizer.get_gradients(loss, model.trainable_variables), loss

@tf.function
def train_step(x, y):
    grads, loss = get_grads(x, y)
    grads = [g.accumulate() for g in grads]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss.reduce_mean()

x = np.random.randn(32, 8).astype("float32")
y = np.random.randint(0, 3, 32)
print(float(train_step(x, y)))
```

Inside a step, `model(x)` runs the model stage by stage, each stage on its
device, and TensorFlow's executor overlaps the microbatches' stages.
"""

import contextlib
import functools
import inspect
import weakref

import tensorflow as tf

from keras_smp import state
from keras_smp import tensor
from keras_smp.config import SMPConfig
from keras_smp.distribute import compression
from keras_smp.pipeline import microbatch
from keras_smp.runtime import keras_private
from keras_smp.runtime import process
from keras_smp.runtime import sparse
from keras_smp.runtime import split_draws
from keras_smp.runtime import tf_private

_step_depth = [0]
# The trainable variables of the `DistributedModel`s called in the step
# being traced whose sparse gradients add up by position (a position
# embedding's: `StagedGraph.batch_free_sparse`).
_by_position = []


def in_step():
    """Whether code runs inside an `@smp.step` function."""
    return _step_depth[0] > 0


def across_processes():
    """Whether `smp.init` runs one pipeline stage per process (each
    process holds its stage's weights only, `keras_smp.smp.setup`)."""
    runtime = _initialised.get("runtime")
    return runtime is not None and runtime.mode == "multi_process"


# The DistributedModels called in steps with one stage per process, in
# the order of their first call (the same on every process).
_models_across = []


def note_model_across(model):
    """Notes a `DistributedModel` called in a step with one stage per
    process (`models_across`)."""
    if not any(ref() is model for ref in _models_across):
        _models_across.append(weakref.ref(model))


def models_across():
    """The `DistributedModel`s called in steps with one stage per
    process, in the order of their first call."""
    return [m for m in (ref() for ref in _models_across) if m is not None]


def check_gradient_sources(sources):
    """Refuses, inside `@smp.step` with one stage per process, a gradient
    call whose sources leave out every trainable weight of a stage that
    must build its backward (its neighbours would wait for its transfers
    until the collective timeout), for each `DistributedModel` called in
    the step being traced: the same sources on every process, so every
    process raises as the step is traced."""
    if not in_step():
        return
    ids = {id(v) for v in sources}
    graph = tf.compat.v1.get_default_graph()
    for model in models_across():
        if (graph, id(model)) in _calls:  # called in this step's trace
            model._smp_check_gradient_sources(ids)


# {(trace graph, id(model), call slot)}: backwards built in the step
_backwards = set()


def note_backward(model, slot):
    """Notes that the backward of `model`'s `slot`-th call is built; a
    second (a persistent tape asked twice, a gradient of a gradient) is
    refused: its transfers would take the first's collective keys."""
    key = (tf.compat.v1.get_default_graph(), id(model), slot)
    if key in _backwards:
        raise NotImplementedError(
            "@smp.step with one stage per process differentiates each "
            "model call once: the step took a second gradient through "
            f"call {slot} of {model.name!r} (a persistent tape asked twice, "
            "or a gradient of a gradient). Take all gradients from one "
            "`tape.gradient` / `optimizer.get_gradients` call, or leave "
            "local_devices unset.")
    _backwards.add(key)


# {(trace graph, id(model)): the model's calls so far in that trace}
_calls = {}


def call_slot(model):
    """The number of earlier calls of `model` in the step being traced
    (each microbatch's call its own slot: collective instance keys)."""
    key = (tf.compat.v1.get_default_graph(), id(model))
    slot = _calls.get(key, 0)
    if slot >= 299:
        raise ValueError(
            "keras-smp: a DistributedModel is called more than 299 times in "
            "one @smp.step trace (microbatches x calls per microbatch) with "
            "one stage per process; use fewer microbatches or calls.")
    _calls[key] = slot + 1
    return slot


# {(trace graph, id(model), call in its microbatch): the model's seed
# generator states before that call in the step's first microbatch}
_seed_starts = {}
# {id(model): its calls so far in the microbatch being traced}
_microbatch_calls = {}


def seeds_as_in_first_microbatch(model, layers):
    """Inside an `@smp.step` function: gives the seed generators of
    `layers` (those `model`'s call runs here) the states they held before
    the same call of the step's first microbatch, so that every
    microbatch draws from the seeds one call on the whole batch draws
    from (its rows of them: `runtime.split_draws`), and the generators
    advance once per step (`keras_private.once_per_step_states`: and a
    `SpectralNormalization` normalises its kernel once)."""
    if not in_step() or split_draws.current() is None:
        return  # (no part: each microbatch draws for its own shape)
    slot = _microbatch_calls.get(id(model), 0)
    _microbatch_calls[id(model)] = slot + 1
    # (Also none: a layer built by the first microbatch's call and
    # holding such state then is a clear error in the next.)
    split_draws.remembered_seeds(
        keras_private.once_per_step_states(layers), _seed_starts,
        (tf.compat.v1.get_default_graph(), id(model), slot))


def note_step_variables(variables):
    """Notes, inside an `@smp.step` function, variables whose sparse
    gradients `StepOutput.accumulate` adds up position by position over
    the microbatches and the replicas (a position embedding's)."""
    if in_step():
        _by_position.extend(variables)


def init(config=None, *, start=None):
    """`smp.init`'s set-up (see `keras_smp.smp.setup.init`, which calls it:
    `keras_smp.init` is that one).

    Args:
        config: `None`, a dict of SMP's keys, or an `SMPConfig`.
        start: `config -> Runtime`, the process set-up (default: every
            process runs whole model replicas, `process.start(...,
            custom_loop=True)`).

    Returns:
        The validated `SMPConfig`.
    """
    previous = _initialised.get("runtime")
    if previous is not None and state.runtime() is previous:
        # Again (a notebook cell run twice): the same config is a no-op;
        # another cannot apply to what is already set up and traced.
        old, new = previous.config.to_dict(), SMPConfig.build(
            config).to_dict()
        changed = {k: (old.get(k), new.get(k)) for k in sorted(
            set(old) | set(new)) if old.get(k) != new.get(k)}
        if not changed:
            return previous.config
        raise ValueError(
            "smp.init was already called in this process, with another "
            "config: " + ", ".join(f"{k}: {a!r} -> {b!r}"
                                   for k, (a, b) in changed.items())
            + ". Models, steps and the distributed runtime keep the first "
            "config; start a new process (or restart the notebook's "
            "kernel) to change it.")
    # One runtime set-up for strategies and custom loops; here every
    # process runs whole model replicas (as SMPStrategy in process), or
    # (`start`: `keras_smp.smp.setup`'s) one pipeline stage.
    runtime = (start or functools.partial(process.start, custom_loop=True))(
        config)
    _initialised.clear()
    _initialised["runtime"] = runtime
    topology = runtime.topology
    if runtime.collectives:
        # The group of `accumulate`'s replica average (the same keys on
        # every process: every process calls init in the same order): the
        # replicas of one pipeline stage's tensor-parallel rank.
        _initialised["group_key"] = runtime.keys.allocate(
            "smp.StepOutput.accumulate replica average",
            topology.pp_size * topology.tp_size).key(
                topology.pp_rank * topology.tp_size + topology.tp_rank)
    tensor.set_process_group(_tensor_group(runtime) if runtime.collectives
                             and topology.tp_size > 1 else None)
    if runtime.config.horovod:
        _init_horovod(runtime.topology)
    if runtime.mode == "multi_process":
        from keras_smp.pipeline.transport import StageLinks

        sparse.check_gradient_sources(check_gradient_sources)

        # The first stage's batch to every stage process of its pipeline.
        replica = topology.dp_rank * topology.tp_size + topology.tp_rank
        group = runtime.keys.allocate(
            "smp.step arguments from the first stage",
            topology.dp_size * topology.tp_size).key(replica)
        _initialised["first_stage_links"] = (
            StageLinks(topology.pp_size, topology.pp_rank, replica, None,
                       runtime.config.collective_timeout_seconds),
            group, topology.pp_size)
    return runtime.config


# What `init` started: its Runtime, the replica-average group key, Horovod.
_initialised = {}


def _tensor_group(runtime):
    """The tensor-parallel group of this process (`tensor_parallel_degree
    > 1`): consecutive processes, one collective group per pipeline
    device (the stages of a step run on their own devices) and one for
    what runs outside the stages (optimizer sums, weight gathers)."""
    from keras_smp.tensor.ops import TensorGroup

    topology, config = runtime.topology, runtime.config
    p = config.partitions
    slots = p + 1
    keys = runtime.keys.allocate(
        "smp.init tensor-parallel groups",
        topology.world_size // topology.tp_size * slots)
    base = topology.rank // topology.tp_size * slots
    devices = [d or "" for d in runtime.layout.stage_devices(0)]
    return TensorGroup(
        topology.tp_size, topology.tp_rank, keys.key(base),
        timeout=config.collective_timeout_seconds,
        stage_keys=[keys.key(base + 1 + s) for s in range(p)],
        stage_devices=devices if len(devices) == p else None)


def _init_horovod(topology):
    from keras_smp.distribute import horovod

    hvd, _ = horovod.init(topology, what="smp.init: horovod=True")
    _initialised["horovod"] = hvd


def _replica_sync():
    """(group size, timeout) when `accumulate` must average over replicas."""
    config = state.config()
    size = state.topology().dp_size
    if size == 1 or config.horovod or "group_key" not in _initialised:
        return None
    return size, config.collective_timeout_seconds


# Instance keys of `accumulate`'s replica average: one per traced call
# (every replica traces the same calls in order); instance keys are scoped
# by their group. Eager calls draw from their own range: an eager call
# made on some replicas only (`if smp.rank() == 0: loss.reduce_mean()`)
# still waits for the others until the timeout (a collective), but it does
# not shift the keys of the steps traced afterwards.
_instance_keys = iter(range(300_000, 10**9))
_eager_instance_keys = iter(range(1_100_000_000, 2_100_000_000))


def _over_replicas(t, final_op="Div", gradient=False):
    """The replicas' sum of `t` (`final_op="Id"`) or their mean; a
    `gradient` travels as `allreduce_compression` says (summed in that
    dtype, divided after it is cast back)."""
    size, timeout = _replica_sync()
    wire = state.config().allreduce_compression if gradient else None
    if compression.compresses(t, wire):
        graph = tf.compat.v1.get_default_graph()
        (out,) = compression.summed(
            [t], wire, lambda values: [_over_replicas(values[0], "Id")])
        if not tf.executing_eagerly():
            # (a float16 sum summed again in float32 happens in a branch
            # of its own graph: later collectives wait for the branch)
            graph._smp_last_collective = out
        return out / tf.cast(size, t.dtype) if final_op == "Div" else out
    if tf.executing_eagerly():
        return tf.raw_ops.CollectiveReduceV2(
            input=t, group_size=size, group_key=_initialised["group_key"],
            instance_key=next(_eager_instance_keys), ordering_token=[],
            merge_op="Add", final_op=final_op, timeout_seconds=timeout)
    graph = tf.compat.v1.get_default_graph()
    # Chain the collectives of one graph so every replica runs them in the
    # same order (the last one kept on the graph, freed with it).
    previous = getattr(graph, "_smp_last_collective", None)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = tf.raw_ops.CollectiveReduceV2(
            input=t, group_size=size, group_key=_initialised["group_key"],
            instance_key=next(_instance_keys), ordering_token=[],
            merge_op="Add", final_op=final_op, timeout_seconds=timeout)
    graph._smp_last_collective = out
    return out


def after_first_call(model):
    """Runs once a `DistributedModel`'s weights exist inside a step.

    Restores a checkpoint whose `CheckpointManager.restore()` came before
    the model was built, then copies rank 0's weights to every replica
    (SMP scripts call restore before the first step).
    """
    with tf.init_scope():
        from keras_smp.smp.checkpoint import restore_pending

        restore_pending(model)
        if state.topology().world_size > 1 and not across_processes():
            from keras_smp.runtime import patches
            from keras_smp.smp import comms

            # Whole values (a tensor-parallel shard gathered over its
            # group: every rank takes part), rank 0's sent to all, each
            # keeping its own shard.
            whole = [patches.whole_value(v) for v in model.variables]
            values = comms.share(
                whole if state.topology().rank == 0 else None)
            for v, value in zip(model.variables, values):
                patches.assign_whole(v, value)


class StepOutput:
    """One value returned by an `@smp.step` function, per microbatch (a
    weight's gradient: the microbatches' sum, see `step`'s
    `sum_gradients`).

    Args:
        outputs: the value of each microbatch, in microbatch order.
        axis: the axis the step's inputs were split along (for `merge`).

    Example:

    ```python
    import tensorflow as tf
    from keras_smp import StepOutput
    out = StepOutput([tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])])
    assert out.merge().numpy().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert out.reduce_mean().numpy().tolist() == [2.0, 3.0]
    ```
    """

    def __init__(self, outputs, axis=0, by_position=False):
        self.outputs = list(outputs)
        self.axis = axis
        # Sparse gradients of a position embedding (ids from shapes, the
        # same in every microbatch): `accumulate` adds their rows.
        self._by_position = by_position

    def __repr__(self):
        return f"StepOutput({len(self.outputs)} microbatches)"

    def _tensors(self):
        if any(o is None for o in self.outputs):
            return None
        return [tf.convert_to_tensor(o) for o in self.outputs]

    def reduce_sum(self):
        """Elementwise sum over microbatches (and, as `accumulate`, over
        the replicas: the global batch's sum)."""
        ts = self._tensors()
        if ts is None:
            return None
        total = tf.add_n(ts)
        return _over_replicas(total, "Id") if _replica_sync() else total

    def reduce_mean(self):
        """Elementwise mean over microbatches (e.g. of per-microbatch
        losses; and, as `accumulate`, over the replicas: the global
        batch's mean loss, the same on every replica)."""
        ts = self._tensors()
        if ts is None:
            return None
        mean = tf.add_n(ts) / len(ts)
        return _over_replicas(mean) if _replica_sync() else mean

    def concat(self, axis=0):
        """The microbatches' values concatenated along `axis`."""
        ts = self._tensors()
        return None if ts is None else tf.concat(ts, axis=axis)

    def stack(self, axis=0):
        """The microbatches' values stacked along a new `axis`."""
        ts = self._tensors()
        return None if ts is None else tf.stack(ts, axis=axis)

    def merge(self, axis=None):
        """Per-sample values in the original order of the batch.

        keras-smp splits a batch into contiguous microbatches, so merging
        concatenates them: along the axis every split argument of the
        step was split along (`input_split_axes`), or axis 0 when the
        arguments were split along different axes (a time-major input
        split on axis 1 beside batch-major labels: the model's outputs
        and the labels are batch-major). Pass `axis` for other outputs.
        """
        return self.concat(self.axis if axis is None else axis)

    def accumulate(self, method="variable", var=None):
        """The mean over microbatches, for gradients.

        A sparse gradient (`tf.IndexedSlices`, an `Embedding`'s) stays
        sparse, as one device's gradient for the whole batch holds it
        (see `_accumulate_sparse`); `tf.convert_to_tensor` makes it dense.

        With several data-parallel replicas (processes) and `horovod=False`
        it is also averaged over the replicas (a collective all-reduce),
        as `reduce_mean` and `reduce_sum` are (every replica must call
        them, in the same order); with `horovod=True` all three are this
        replica's own: average with `hvd.allreduce` as in SMP.

        Args:
            method: "variable" (a running sum, one microbatch's value alive
                at a time), "add_n" or "accumulate_n" (one sum of all).
            var: accepted for SMP compatibility; unused.
        """
        if method not in ("variable", "add_n", "accumulate_n"):
            raise ValueError(
                f"StepOutput.accumulate: unknown method={method!r}; use "
                "'variable', 'add_n' or 'accumulate_n'.")
        if self.outputs and all(isinstance(o, tf.IndexedSlices)
                                for o in self.outputs):
            return self._accumulate_sparse()
        ts = self._tensors()
        if ts is None:
            return None
        if method == "variable":
            total = ts[0]
            for t in ts[1:]:
                total = total + t
        else:
            total = tf.add_n(ts)
        mean = total / len(ts)
        return (_over_replicas(mean, gradient=True) if _replica_sync()
                else mean)

    def _accumulate_sparse(self):
        """`accumulate` of sparse gradients (`tf.IndexedSlices`), kept
        sparse as one device's gradient for the whole batch holds them:
        Keras optimizers other than SGD apply each row as it comes (Adam
        squares it), so summing them densely (merging a repeated id's
        rows) would step otherwise. The microbatches' (and replicas')
        rows are put one after another (a lookup with a row per sample:
        token ids), or added position by position for a position
        embedding's gradient (ids the same in every microbatch) from
        `optimizer.get_gradients` or a `tf.GradientTape` in the step, or
        summed by id for a lookup of distinct ids (a sparse input's,
        `sparse.from_unique`)."""
        parts = self.outputs
        m = len(parts)
        distinct = not self._by_position and all(
            sparse.from_unique(p.indices) for p in parts)
        if distinct and _replica_sync():
            raise ValueError(
                "StepOutput.accumulate: a gradient whose ids are a lookup's "
                "distinct ids (a layer on a sparse input, "
                "`keras.Input(sparse=True)`) with several data-parallel "
                "replicas: each replica holds its own number of ids, which "
                "the replicas' gradients cannot be gathered by. Train the "
                "model with `model.fit` under an `SMPStrategy` (supported), "
                "or make this gradient dense (`tf.convert_to_tensor`; "
                "optimizers other than SGD then step the ids absent from "
                "the batch too).")
        lookups = max(sparse.distinct_lookups(p.indices) for p in parts)
        if lookups > 1 and (m > 1 or _replica_sync()):
            sparse.warn_split_lookups(None, lookups, f"{m} microbatches")
        if self._by_position:
            total = parts[0]
            for part in parts[1:]:
                total = sparse.add_rows(total, part, "a position embedding")
            values, indices = total.values, total.indices
        else:
            values = tf.concat([p.values for p in parts], 0)
            indices = tf.concat([p.indices for p in parts], 0)
        values = values / tf.cast(m, values.dtype)
        if _replica_sync():
            size, _ = _replica_sync()
            with tf.control_dependencies(_same_count(values)):
                values = tf.identity(values)
            if self._by_position:
                values = _over_replicas(values)
            else:
                values = _gather_over_replicas(values) / tf.cast(
                    size, values.dtype)
                indices = _gather_over_replicas(indices)
        total = tf.IndexedSlices(values, indices, parts[0].dense_shape)
        if distinct:
            # A lookup of distinct ids (a sparse input's): one device's
            # gradient holds each id of the batch once.
            total = sparse.summed_by_id(total)
        return total


class _NoMicrobatchValues(ValueError, AttributeError):
    """What `outputs`, `merge()`, `concat()` and `stack()` of a gradient
    `@smp.step` summed raise (an `AttributeError` too, so `hasattr(g,
    "outputs")` is `False`)."""


class _GradientSum(StepOutput):
    """The `StepOutput` of a gradient `@smp.step` added up over the
    microbatches (`sum_gradients`): the sum, without each microbatch's."""

    def __init__(self, total, count, name, axis=0):
        self._total, self._count, self.axis = total, count, axis
        self._name = name
        self._by_position = False

    def __repr__(self):
        return (f"StepOutput(the sum of {self._count} microbatches' "
                f"gradients of {self._name})")

    @property
    def outputs(self):
        return self._tensors()

    def _tensors(self):
        raise _NoMicrobatchValues(
            f"StepOutput: this value is the gradient of {self._name}, which "
            f"@smp.step added up over the {self._count} microbatch"
            f"{'es' if self._count != 1 else ''} as they were computed "
            "(one microbatch's gradient in memory at a time, not one per "
            "microbatch): it has no per-microbatch values. "
            "Use accumulate(), reduce_mean() or reduce_sum(); for each "
            "microbatch's gradient, decorate the step with "
            "@smp.step(sum_gradients=False).")

    def reduce_sum(self):
        total = self._total
        return _over_replicas(total, "Id") if _replica_sync() else total

    def reduce_mean(self):
        mean = self._total / self._count
        return _over_replicas(mean) if _replica_sync() else mean

    def accumulate(self, method="variable", var=None):
        if method not in ("variable", "add_n", "accumulate_n"):
            raise ValueError(
                f"StepOutput.accumulate: unknown method={method!r}; use "
                "'variable', 'add_n' or 'accumulate_n'.")
        mean = self._total / self._count
        return (_over_replicas(mean, gradient=True) if _replica_sync()
                else mean)


def _same_count(values):
    """Checks (when not known when traced) that every replica holds as
    many rows of a sparse gradient as this one: `[assertion]` or `[]`."""
    if values.shape[:1].num_elements() is not None:
        return []
    size, _ = _replica_sync()
    same, mean = sparse.same_counts(
        [tf.shape(values)[0]], lambda t: _over_replicas(t, "Id"), size)
    return [tf.debugging.Assert(same[0], [
        "keras-smp: StepOutput.accumulate: the data-parallel replicas "
        "hold different numbers of rows in a sparse gradient (an "
        "embedding looked up on batches of different lengths or sizes). "
        "Give every replica batches of the same shape "
        "(`drop_remainder=True`; pad sequences to one length).",
        "Rows on this replica:", tf.shape(values)[0],
        "mean over the replicas:", mean[0]])]


def _gather_over_replicas(t):
    """The replicas' `t`s (as many rows each) one after another, in
    replica order (chained as `_over_replicas`' collectives are)."""
    size, timeout = _replica_sync()

    def gather(keys):
        return tf.raw_ops.CollectiveGatherV2(
            input=t, group_size=size, group_key=_initialised["group_key"],
            instance_key=next(keys), ordering_token=[],
            timeout_seconds=timeout)

    if tf.executing_eagerly():
        return gather(_eager_instance_keys)
    graph = tf.compat.v1.get_default_graph()
    previous = getattr(graph, "_smp_last_collective", None)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = gather(_instance_keys)
    graph._smp_last_collective = out
    return out


_step_indices = iter(range(10**6))
# Instance keys of a step's argument broadcast (`_from_first_stage`): per
# step, tensor argument and dtype (a retrace with another dtype takes
# other keys), a header's key and one per size bucket.
_ARGS_BASE, _MAX_ARGS, _DTYPES = 1_000_000, 64, 32
_ARGS_PER_STEP = _MAX_ARGS * _DTYPES * 128
_MAX_STEPS = (2**31 - 1 - _ARGS_BASE) // _ARGS_PER_STEP


def _from_first_stage(bound, index):
    """With one stage per process: every tensor argument of the step as
    the pipeline's first stage process has it (broadcast over the
    replica's stage processes, with its shape), in place in `bound`.

    Every process of a pipeline runs the step's own code (the loss on the
    model's outputs, metrics), which must see the batch the first stage
    computed on; another process's data may differ (a dataset shuffled
    with `seed=smp.rank()`, a generator of its own), and would train the
    first stage's inputs' outputs on its own labels. As `fit`, the first
    stage's batch is used. Returns the receives (or sends), which the
    step's results wait for: one whose value this stage does not use
    would otherwise be pruned, and its sender wait for it forever."""
    from keras_smp.pipeline.transport import Dynamic

    links, group, size = _initialised["first_stage_links"]
    first = links.rank == 0
    position = 0
    done = []
    for name, value in bound.arguments.items():
        flat = tf.nest.flatten(value)
        out = []
        for v in flat:
            if v is None or isinstance(v, (int, float, bool, str)):
                out.append(v)
                continue
            t = tf.convert_to_tensor(v)
            if position >= _MAX_ARGS:
                raise ValueError(
                    f"@smp.step with one stage per process broadcasts at "
                    f"most {_MAX_ARGS} tensor arguments from the first "
                    "stage; pass fewer (a tuple of tensors counts each).")
            if index >= _MAX_STEPS:
                raise ValueError(
                    f"keras-smp: this program decorated {index + 1} "
                    f"@smp.step functions; with one stage per process at "
                    f"most {_MAX_STEPS} can broadcast their arguments. "
                    "Decorate each step function once (at module level), "
                    "not inside a loop.")
            base = _ARGS_BASE + index * _ARGS_PER_STEP + (
                position * _DTYPES
                + t.dtype.as_datatype_enum % _DTYPES) * 128
            keys = (lambda b: lambda i: b + i)(base)
            position += 1
            if first:
                done += links.send_dynamic(t, group, size, keys)
                out.append(t)
                continue
            # (after this process's own batch: see `CollectiveTransport`)
            with tf.control_dependencies([t]):
                out.append(links.recv_dynamic(Dynamic(t.shape), t.dtype,
                                              group, size, keys))
            done.append(out[-1])
        bound.arguments[name] = tf.nest.pack_sequence_as(value, out)
    return done


def _after(done, results):
    """`results` (nested; `None`s, tensors, `tf.IndexedSlices`) waiting
    for the ops `done`."""
    if not done:
        return results

    def wait(r):
        if isinstance(r, tf.IndexedSlices):
            return tf.IndexedSlices(wait(r.values), r.indices, r.dense_shape)
        if isinstance(r, (tf.Tensor, tf.Variable)):
            with tf.control_dependencies(done):
                return tf.identity(r)
        return r

    return tf.nest.map_structure(wait, results, expand_composites=False)


def _sum_gradients(results, source, made):
    """`results` (one per microbatch) with each dense gradient summed.

    A returned leaf that is, in every microbatch, the gradient
    (`source`) of one same variable becomes the microbatches' sum, held
    by the first microbatch's results (`None` in the others'): the step
    returns one tensor, not one per microbatch. Microbatch i's gradient
    is computed only after the sum of the earlier ones (a control input
    on the operation that makes it, among the operations `made[i]` its
    call built), so a weight's gradients alive at once are the sum so
    far, one microbatch's gradient and the next sum. The sum adds in
    microbatch order, as `accumulate()` did, on the gradient's device.

    No cycle: the operations of microbatch i's call are built after
    every operation the sum of the earlier microbatches depends on (the
    earlier calls' operations, through the earlier added inputs too),
    and TensorFlow only adds edges from an operation to one built later,
    so none of them is an ancestor of that sum.

    Returns (results, summed): `summed[j]` is the name of the variable
    of leaf `j` where it was summed, else `None`.
    """
    flat = [tf.nest.flatten(r) for r in results]
    summed = []
    for j, leaves in enumerate(zip(*flat)):
        variables = [source(g) if isinstance(g, tf.Tensor) else None
                     for g in leaves]
        if (variables[0] is None or isinstance(variables[0], tf.Tensor)
                or any(v is not variables[0] for v in variables)
                or len({id(g) for g in leaves}) < len(leaves)):
            # (not a weight's gradient: a tensor's, one `tape.watch`ed)
            summed.append(None)
            continue
        total = leaves[0]
        for i in range(1, len(leaves)):
            maker = _maker(leaves[i], made[i])
            if maker is not None:
                tf_private.add_control_input(maker, total.op)
            device = leaves[i].device
            with tf.device(device) if device else contextlib.nullcontext():
                total = total + leaves[i]
        flat[0][j] = total
        for f in flat[1:]:
            f[j] = None
        summed.append(getattr(variables[0], "path", None)
                      or getattr(variables[0], "name", "?"))
    return ([tf.nest.pack_sequence_as(r, f) for r, f in zip(results, flat)],
            summed)


def _maker(tensor, ops):
    """The operation among `ops` that computes `tensor` (through
    `Identity`s), or `None`."""
    op = tensor.op
    while (op.type == "Identity" and op.inputs
           and op.inputs[0].op in ops):
        op = op.inputs[0].op
    return op if op in ops else None


def _split(value, m, axis, name):
    if value is None or isinstance(value, (int, float, bool, str)):
        return [value] * m
    composite = isinstance(value, (tf.SparseTensor, tf.RaggedTensor))
    t = value if composite else tf.convert_to_tensor(value)
    rank = t.shape.rank
    if composite and axis != 0:
        raise ValueError(
            f"@smp.step: argument '{name}' is a {type(value).__name__}, "
            f"which splits into microbatches along axis 0 only, not "
            f"input_split_axes={{'{name}': {axis}}}. Batch it along axis 0, "
            f"or list it in non_split_inputs=['{name}'].")
    if rank is not None and not -rank <= axis < rank:
        raise ValueError(
            f"@smp.step: argument '{name}' is a tensor of shape "
            f"{tuple(t.shape)}, with no axis {axis} to split into "
            f"microbatches. List it in non_split_inputs=['{name}'] (passed "
            "whole to every microbatch), or give its batch axis in "
            f"input_split_axes={{'{name}': ...}}.")
    checks = microbatch.check_divisible(
        t, m, what=f"@smp.step: argument '{name}' (axis {axis})", axis=axis,
        advice=(f"Use a batch size divisible by {m} (e.g. dataset.batch(..., "
                "drop_remainder=True)), or list the argument in "
                "non_split_inputs."))
    with tf.control_dependencies(checks):
        if composite:  # (a sparse or ragged tensor's rows)
            return microbatch.split_rows(t, m)
        return tf.split(t, m, axis=axis)


def step(func=None, *, input_signature=None, non_split_inputs=None,
         input_split_axes=None, sum_gradients=True):
    """Runs a forward/backward function once per microbatch (SMP's `smp.step`).

    Tensor arguments are split along their batch axis into the config's
    `microbatches`; every value the function returns becomes a
    `StepOutput` holding one value per microbatch (a weight's gradient:
    their sum, see `sum_gradients`). The function is a
    `tf.function`; inside it `model(x)` of a `DistributedModel` runs stage
    by stage on the stages' devices, and gradients come from
    `optimizer.get_gradients(loss, params)` or a `tf.GradientTape`.

    Args:
        func: the function (also usable as `@step(...)`).
        input_signature: passed to `tf.function`.
        non_split_inputs: names of arguments passed whole to every
            microbatch.
        input_split_axes: `{argument name: batch axis}` (default 0).
        sum_gradients: whether a returned gradient (a weight's dense
            gradient, as `optimizer.get_gradients` or a `tf.GradientTape`
            gave it) is added up over the microbatches inside the step,
            each microbatch's gradient of a weight computed after the sum
            of the earlier ones: one microbatch's gradient is then alive
            at a time beside the sum, not `microbatches` of them, however
            many microbatches. Its `StepOutput` then has the sum only:
            `accumulate()`, `reduce_mean()` and `reduce_sum()` work;
            `outputs`, `merge()`, `concat()` and `stack()` raise (with 1
            microbatch too). `False` keeps every microbatch's gradient,
            as SMP did.

    Example: see `keras_smp.smp.custom_loop`.
    """
    if func is None:
        return functools.partial(
            step, input_signature=input_signature,
            non_split_inputs=non_split_inputs,
            input_split_axes=input_split_axes, sum_gradients=sum_gradients)
    whole = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    signature = inspect.signature(func)
    # Its place among the program's steps (decorated in the same order on
    # every process): the keys of its arguments' broadcast.
    index = next(_step_indices)
    unknown = (whole | set(axes)) - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"@smp.step: {sorted(unknown)} in non_split_inputs / "
            f"input_split_axes are not arguments of {func.__name__}"
            f"{signature}.")

    def run(*args, **kwargs):
        m = state.config().microbatches
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        received = (_from_first_stage(bound, index) if across_processes()
                    else [])
        per_arg = {}
        for name, value in bound.arguments.items():
            if name in whole:
                per_arg[name] = [value] * m
            else:
                axis = axes.get(name, 0)
                flat = tf.nest.flatten(value)
                parts = [_split(v, m, axis, name) for v in flat]
                per_arg[name] = [
                    tf.nest.pack_sequence_as(value, [p[i] for p in parts])
                    for i in range(m)]
        results = []
        if not _step_depth[0]:
            _calls.clear()
            _backwards.clear()
            _seed_starts.clear()
        # Each microbatch draws its rows of the global batch's random
        # numbers (`runtime.split_draws`: data-parallel replica `d` holds
        # its rows `[d * b, (d + 1) * b)`; models reset their seed
        # generators per microbatch, `seeds_as_in_first_microbatch`), when
        # every tensor is split along its first axis.
        split = [t for name in bound.arguments if name not in whole
                 for t in tf.nest.flatten(per_arg[name][0])
                 if tf.is_tensor(t)]
        rows = (microbatch.rows(split[0]) if split and not any(
            axes.get(name, 0) for name in bound.arguments
            if name not in whole) else None)
        _step_depth[0] += 1
        before = list(_by_position)
        graph = tf.compat.v1.get_default_graph()
        made = []  # the operations each microbatch's call built
        try:
            with sparse.noting_sources() as source:
                for i in range(m):
                    start = len(graph.get_operations())
                    _microbatch_calls.clear()
                    part = (contextlib.nullcontext() if rows is None
                            else split_draws.exactly((
                                (state.topology().dp_rank * m + i) * rows,
                                rows)))
                    with tf.name_scope(f"microbatch{i}"), part:
                        call = bound.signature.bind_partial()
                        call.arguments.update(
                            {n: per_arg[n][i] for n in bound.arguments})
                        results.append(func(*call.args, **call.kwargs))
                    made.append(set(graph.get_operations()[start:]))
                # Which returned values are sparse gradients (from
                # `optimizer.get_gradients` or a tape) of position
                # embeddings.
                free = {id(v) for v in _by_position}
                marks = [all(isinstance(r, tf.IndexedSlices)
                             and id(source(r)) in free for r in leaves)
                         for leaves in zip(*[tf.nest.flatten(r)
                                             for r in results])]
                if sum_gradients:
                    results, summed = _sum_gradients(results, source, made)
                else:
                    summed = [None] * len(marks)
        finally:
            _step_depth[0] -= 1
            _by_position[:] = before
            if not _step_depth[0]:
                _seed_starts.clear()  # (tensors of this trace's graph)
        # (Beside the outputs, for this trace: a tf.function turns Python
        # values into tensors.)
        traced[graph] = (marks, summed)
        return _after(received, results)

    # {trace's graph: (marks, summed)}
    traced = weakref.WeakKeyDictionary()
    compiled = tf.function(run, input_signature=input_signature)

    def merge_axis(args, kwargs):
        """The axis every split argument was split along (`merge`'s
        default), or 0 (the batch axis of Keras outputs) when they differ."""
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        split = {axes.get(name, 0) for name, value in bound.arguments.items()
                 if name not in whole and any(
                     v is not None and not isinstance(
                         v, (int, float, bool, str))
                     for v in tf.nest.flatten(value))}
        return split.pop() if len(split) == 1 else 0

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        # A tf.function returns tensors only: wrap them afterwards.
        results = compiled(*args, **kwargs)
        axis = merge_axis(args, kwargs)
        flat = [tf.nest.flatten(r) for r in results]
        graph = compiled.get_concrete_function(*args, **kwargs).graph
        if graph not in traced:
            raise RuntimeError(
                f"@smp.step {func.__name__}: its trace left no record of "
                "which values are gradients (keras-smp bug: please report "
                "it); decorate it with @smp.step(sum_gradients=False) "
                "meanwhile.")
        marks, summed = traced[graph]
        return tf.nest.pack_sequence_as(results[0], [
            _GradientSum(flat[0][j], len(flat), summed[j], axis=axis)
            if summed[j] is not None else
            StepOutput([f[j] for f in flat], axis=axis,
                       by_position=marks[j])
            for j in range(len(flat[0]))])

    wrapper.python_function = func
    return wrapper
