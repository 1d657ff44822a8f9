"""Every process-wide patch keras-smp makes to Keras, in one place.

`install()` (idempotent; run by `keras_smp.runtime.process.start`, i.e. by
`SMPStrategy(...)` and `smp.init(...)`) patches:

- `TensorFlowTrainer.make_train_function` / `make_test_function` /
  `make_predict_function`, once, for two things:
  - a plain Keras model under an `SMPStrategy` whose processes hold whole
    pipelines (`partitions > 1`, in process) fails at once, telling to wrap
    it in `keras_smp.DistributedModel` (it would train unpipelined);
  - under a multi-worker `SMPStrategy`, the step functions raise a
    `RuntimeError` naming a lost peer instead of TensorFlow's collective
    errors (`runtime.errors.guard`).
- `TensorFlowTrainer.fit` / `evaluate` / `predict` and Keras' epoch
  iterators (`keras_private.on_epoch_iterator`): under a multi-process
  `SMPStrategy`, before the first step of each call (and of a fit's
  validation), every rank checks that every rank runs the same call, with
  as many steps, the same arguments and batches of the same shapes and
  dtypes (`agreement.check_same_call`); a rank that differs, or whose
  script ended (`if rank == 0: model.evaluate(...)`), is named on every
  rank at once instead of a wait until `collective_timeout_seconds`.
- `keras.Model.save` / `save_weights`: atomic (temporary name, then rename)
  for models under `SMPStrategy` and pipelined models; non-chief workers of
  a multi-worker job write into a scratch directory removed right after, so
  the same (collective) work runs everywhere but only the chief writes.
  `keras.saving.save_model` / `save_weights` (and `keras.models.save_model`)
  of such a model call these methods.
- Keras' `.keras` writer (`saving_lib.save_model`, behind `Model.save`
  and `keras.saving.save_model`): a `DistributedModel` decides how to
  write itself (with one stage per process, streamed from its stages).
- `keras.callbacks.BackupAndRestore` (non-chief workers save into scratch
  and never delete the chief's backup), `keras.callbacks.TensorBoard` and
  `keras.callbacks.CSVLogger` (non-chief summaries and rows go to a
  scratch directory; `TensorBoard`'s weight histograms are of the whole
  model, gathered from the stage processes).
- `keras.layers.Layer.__init__`: every new layer is shown to
  `keras_smp.tensor` (`install_layer_hook`), which makes those created in
  `keras_smp.tensor_parallelism()` tensor-parallel.
- `keras.layers.Layer.get_weights` / `set_weights`: whole weights for
  layers and models holding tensor-parallel shards; the optimizer's slots
  of split weights are split alike and saved whole
  (`_patch_split_weights`).
- `TensorFlowTrainer.compute_loss` (Keras' `compile` loss, plus the
  losses layers add) of a plain Keras model trained by several data-parallel
  replicas under an `SMPStrategy`: each replica's mean losses count by its
  share of what one device would divide by (a masked loss's unmasked
  entries, a partial batch's rows), so the replicas' losses sum to the
  single-device loss (`_global_share_loss`; stock Keras averages the
  replicas' own means).
- `keras.optimizers.Optimizer.get_gradients(loss, params)`: SageMaker
  smp's (Keras 2's) method, for `@smp.step` functions.
- the optimizer step under an `SMPStrategy` acts on the gradient that
  single-device training sees (`_patch_optimizer`): with `clipnorm`,
  `global_clipnorm` or `clipvalue` the data-parallel replicas' gradients
  are summed first, then clipped (stock Keras clips each replica's part
  before the all-reduce); `global_clipnorm`'s norm covers every pipeline
  stage's gradients (`across_stages`); a `LossScaleOptimizer` takes one
  "finite" decision for all replicas and stages.

Being below the strategy and the models, the patches recognise them by
attributes, not classes: a strategy with `_smp_runtime` (an `SMPStrategy`,
see `keras_smp.runtime.of`), a model with `_smp_pipelined = True` (a
`DistributedModel`).

Readers (restore) read the chief's files, so multi-host restore needs a
shared filesystem.
"""

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import threading

import keras_smp.runtime as runtime_package
from keras_smp import tensor
from keras_smp.runtime import deferred
from keras_smp.runtime import errors
from keras_smp.runtime import placement
from keras_smp.runtime import split_draws
from keras_smp.runtime import tf_private
from keras_smp.runtime import xla

_lock = threading.Lock()
_installed = []


def _runtime_of(strategy):
    return getattr(strategy, "_smp_runtime", None)


def is_pipelined(model):
    """Whether `model` runs its steps as a pipeline (a `DistributedModel`)."""
    return bool(getattr(model, "_smp_pipelined", False))


# -- step functions --------------------------------------------------------


def check_pipelined(model):
    """Raises if `model` would train unpipelined under `partitions > 1`."""
    runtime = _runtime_of(model.distribute_strategy)
    if runtime is None or runtime.layout is None:
        return
    if runtime.layout.mode == "multi_process" and not is_pipelined(model):
        raise ValueError(
            f"Model '{model.name}' is a plain {type(model).__name__} under an "
            f"SMPStrategy running one pipeline stage per process "
            f"(partitions={runtime.config.partitions}); each process holds "
            "only its stage's layers' weights. Wrap it before compiling: "
            "`model = keras_smp.DistributedModel(model)` (or subclass "
            "keras_smp.DistributedModel).")
    stages = len(runtime.layout.local_stages)
    if stages > 1 and not is_pipelined(model):
        raise ValueError(
            f"Model '{model.name}' is a plain {type(model).__name__} under an "
            f"SMPStrategy with partitions={stages}; it would "
            "train without pipelining. Wrap it before compiling: "
            "`model = keras_smp.DistributedModel(model)` (or subclass "
            "keras_smp.DistributedModel).")


def check_not_eager(model):
    """Raises for `run_eagerly=True` on a `DistributedModel`: its steps are
    TensorFlow graphs (gradients per stage with `tf.gradients`, transfers
    between stage processes as collective ops ordered in one graph);
    eagerly, the first failed ("tf.gradients is not supported when eager
    execution is enabled") and the second waited until the timeout."""
    import tensorflow as tf

    if not is_pipelined(model):
        return
    if getattr(model, "run_eagerly", False):
        how = "compiled with run_eagerly=True"
        fix = "Compile without run_eagerly"
    elif tf.config.functions_run_eagerly():
        how = "trained under tf.config.run_functions_eagerly(True)"
        fix = "Call tf.config.run_functions_eagerly(False)"
    else:
        return
    raise ValueError(
        f"Model '{model.name}' is a DistributedModel {how}, which its "
        "pipelined steps do not support (they run as TensorFlow graphs). "
        f"{fix}; to debug a layer eagerly, run the plain Keras model on "
        "one device (`model.inner_model`, or the model before wrapping).")


def check_unsplit_states(model):
    """Raises for a `stateful=True` layer (Keras' RNNs) in a model whose
    batches this strategy splits into microbatches or replicas: the layer
    keeps one state row per batch row, and each part would start from the
    whole batch's states (Keras failed inside the first step: "the batch
    size of the input sequences must be the same as the batch size of the
    initial state"; with one stage per process, a graph error naming an
    `Add`)."""
    strategy = getattr(model, "_distribute_strategy", None)
    runtime = _runtime_of(strategy)
    if runtime is None:
        return
    from keras_smp.runtime import keras_private

    replicas = strategy.num_replicas_in_sync
    microbatches = (model.num_microbatches if is_pipelined(model) else 1)
    if replicas * microbatches < 2:
        return
    for layer in keras_private.flatten_layers(model):
        if layer is model or getattr(layer, "stateful", False) is not True:
            continue
        parts = " x ".join(
            f"{n} {what}" for n, what in ((microbatches, "microbatches"),
                                          (replicas, "replicas")) if n > 1)
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) of model "
            f"'{model.name}' is stateful=True: it keeps one state row per "
            f"batch row, and this SMPStrategy splits every batch into "
            f"{parts}, each of which would start from the whole batch's "
            "states. Use stateful=False (carry states yourself with "
            "`return_state=True` and `initial_state`), or run it with "
            "microbatches=1 and one replica (num_replicas_in_sync == 1).")


def _multi_worker_runtime(model):
    runtime = _runtime_of(getattr(model, "_distribute_strategy", None))
    if runtime is not None and runtime.cluster.world_size > 1:
        return runtime
    return None


def _patch_make_functions(trainer):
    for name, attr in (("make_train_function", "train_function"),
                       ("make_test_function", "test_function"),
                       ("make_predict_function", "predict_function")):
        original = getattr(trainer, name)
        if getattr(original, "_smp_patched", False):
            continue

        @functools.wraps(original)
        def make(self, *args, _original=original, _attr=attr, **kwargs):
            check_pipelined(self)
            check_not_eager(self)
            check_unsplit_states(self)
            tensor.check_model(self)
            before = getattr(self, _attr, None)
            smp = _runtime_of(getattr(self, "_distribute_strategy",
                                      None)) is not None
            compiles = smp and xla.wanted(self)
            if _attr == "predict_function" and smp:
                _share_predict_batches(self)
            with (xla.uncompiled_step(self) if compiles
                  else contextlib.nullcontext()):
                result = _original(self, *args, **kwargs)
            fn = getattr(self, _attr, None)
            if fn is None or fn is before:  # Keras returned the cached one
                return result
            if compiles and not is_pipelined(self):
                fn = xla.compiled_calls(
                    self, fn, differentiated=_attr == "train_function")
                setattr(self, _attr, fn)
            runtime = _multi_worker_runtime(self)
            if runtime is not None:
                fn = errors.guard(fn, runtime)
                setattr(self, _attr, fn)
            if (getattr(self, "steps_per_execution", 1) > 1
                    and _runtime_of(getattr(self, "_distribute_strategy",
                                            None)) is not None):
                setattr(self, _attr, tf_private.trace_time_instance_keys(fn))
            return result

        make._smp_patched = True
        setattr(trainer, name, make)


def _patch_compute_loss(trainer):
    original = trainer.compute_loss
    if getattr(original, "_smp_patched", False):
        return

    @functools.wraps(original)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        context = _shares_context(self)
        if context is None:
            return original(self, x, y, y_pred, sample_weight,
                            training=training)
        from keras_smp.runtime import loss_shares

        outputs = (loss_shares.weighted_or_masked(self, y, y_pred,
                                                  sample_weight)
                   if y is not None and y_pred is not None else {})
        with loss_shares.computing_parts(
                f"{context.num_replicas_in_sync} replicas", outputs), \
                _raised(_weighing_shares):
            return _global_share_loss(self, original, context, x, y, y_pred,
                                      sample_weight, training)

    compute_loss._smp_patched = True
    trainer.compute_loss = compute_loss


def _shares_context(model):
    """The replica context whose replicas split `model`'s batch, when the
    loss must count each replica's share (a plain Keras model under an
    `SMPStrategy` with several data-parallel replicas), else `None`."""
    from keras_smp.runtime import loss_shares

    if is_pipelined(model):
        return None  # its step weighs its microbatches and replicas
    strategy = getattr(model, "_distribute_strategy", None)
    if _runtime_of(strategy) is None:
        return None
    return loss_shares.replica_context(strategy)


def _global_share_loss(model, original, context, x, y, y_pred,
                       sample_weight, training):
    """Keras' `compute_loss` with each replica's mean losses scaled by
    its share (`runtime.loss_shares`): the compiled loss through its
    outputs' sample weights, the losses layers add in `call` (activity
    regularizers: means over the rows) by the share of the rows; weight
    regularizers are the same on every replica and stay as they are.

    Inside Keras' own `train_step` / `test_step` (also when an override
    calls them), which log the loss weighted by the replica's rows, the
    value (not the gradient) is rescaled so that the logged mean is the
    single-device loss; in a model's own step the replicas' values average
    to it (`_keeps_loss_value`), in a custom loop they sum to it."""
    import keras
    import tensorflow as tf

    from keras_smp.runtime import keras_private
    from keras_smp.runtime import loss_shares

    first = next((t for t in keras.tree.flatten(x) if t is not None), None)
    if y is not None and y_pred is not None:
        loss_shares.count_batch_values_per_row(model, y, y_pred)
    if first is None:
        return original(model, x, y, y_pred, sample_weight,
                        training=training)
    rows = tf.shape(first)[0]
    divisors = loss_shares.replica_divisors(model, y, y_pred,
                                            first.shape[0] is not None,
                                            sample_weight is not None)
    added = list(model.losses)
    if divisors is None or (keras_private.compiled_loss(model) is None
                            and not added):
        # Equal shares (or Keras' own "No loss" error).
        return original(model, x, y, y_pred, sample_weight,
                        training=training)
    loss, rows_share = loss_shares.shared_loss(
        model, context, divisors, y, y_pred, sample_weight, rows,
        keep_values=_keeps_loss_value())
    losses = [] if loss is None else [loss]
    weight_terms = keras_private.weight_regularization_count(model)
    unshared = []
    for i, term in enumerate(added):
        term = keras_private.aggregate_additional_loss(model, term)
        if i < len(added) - weight_terms:  # added in `call`
            term = term * tf.cast(rows_share, term.dtype)
        else:
            unshared.append(term)
        losses.append(term)
    total = losses[0] if len(losses) == 1 else keras.ops.sum(losses)
    if _in_keras_step.active:
        total = loss_shares.logged_value(
            total, rows_share,
            keras.ops.sum(unshared) if unshared else None)
    return total


class _OwnStepShare(threading.local):
    """This replica's share of the batch's rows (a float32 scalar) while a
    model's own `train_step` is traced under an `SMPStrategy` with several
    data-parallel replicas (`own_step_share`)."""

    value = None

    @contextlib.contextmanager
    def set(self, share):
        before, self.value = self.value, share
        try:
            yield
        finally:
            self.value = before


_own_step_share = _OwnStepShare()


class _WeighingShares(threading.local):
    """Set while `compute_loss` weighs each replica's losses by its share
    (`_global_share_loss`) under an `SMPStrategy`."""

    active = False


_weighing_shares = _WeighingShares()


def _shares_weighed():
    return _weighing_shares.active


def own_step_share():
    """The weight of this replica's gradients in the replicas' sum inside a
    model's own `train_step` (outside Keras' steps it may call), or None.

    Such a step is written for one device (as Keras' guides and examples
    write it): a loss it computes by hand (`ops.mean` over the batch, a
    penalty on the weights) is its replica's part of the batch's loss,
    which Keras does not divide by the replicas (only its own losses: they
    go through `scale_loss_for_distribution`). Summed over the replicas,
    such gradients were the replicas' count times one device's (stock
    Keras under any `tf.distribute` strategy too: Keras' VAE example
    stepped twice as far with 2 replicas). Each replica's gradients are
    multiplied by its share of the batch's rows before the sum, so they
    add up to the batch's mean. Keras' losses keep their gradient: what
    `compute_loss` returns (weighed by the replicas' shares already) has
    its gradient divided by the share (`keras_private.kept_loss`); a
    loss object called in the step is left undivided, as a loss written
    by hand (`keras_private.on_loss_scaling`)."""
    if _in_keras_step.active or not _in_step_function.active:
        return None
    return _own_step_share.value


class _SharingGradients(threading.local):
    """Set while an optimizer's `apply` hands on gradients this thread
    already weighed by `own_step_share` (`_weighed_by_share`)."""

    active = False


_sharing_gradients = _SharingGradients()


@contextlib.contextmanager
def _weighed_by_share(optimizer, grads):
    """`grads` as `optimizer.apply` applies them in a model's own
    `train_step`: each multiplied by this replica's `own_step_share`, once
    (not again by the optimizers a `LossScaleOptimizer` or a
    `MultiOptimizer` hands them to inside this `apply`; a
    `LossScaleOptimizer` under a strategy applies its inner optimizer in
    other threads, where no share is set)."""
    share = own_step_share()
    if share is None or _sharing_gradients.active:
        yield grads
        return
    _sharing_gradients.active = True
    try:
        yield [None if g is None else _times_share(g, share) for g in grads]
    finally:
        _sharing_gradients.active = False


def _times_share(grad, share):
    """`grad` times `share` (a float32 scalar, float64 in a float64
    model), multiplied in float32 for 16-bit gradients (a share such as
    1/3 rounds in bfloat16)."""
    import tensorflow as tf

    if grad.dtype in (tf.float32, tf.float64):
        return _scaled(grad, share)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.cast(tf.cast(grad.values, tf.float32)
                    * tf.cast(share, tf.float32), grad.dtype),
            grad.indices, grad.dense_shape)
    return tf.cast(tf.cast(grad, tf.float32) * tf.cast(share, tf.float32),
                   grad.dtype)


def _replica_share(model, data):
    """`(share, part)` of this replica's part of the batch `data` under
    several data-parallel replicas: its share of the batch's rows (a
    float32 scalar) and `(offset, rows)` of its rows in the batch (for
    `split_draws.exactly`), from every replica's rows (one all-reduce);
    for a batch of a static size (every replica holds the same rows)
    `1 / replicas` and None (the strategy's part is exact). `(None,
    None)` with one replica or without a batch tensor."""
    import keras
    import tensorflow as tf

    from keras_smp.runtime import loss_shares

    strategy = model._distribute_strategy
    context = loss_shares.replica_context(strategy)
    if context is None:
        return None, None
    flat = [t for t in keras.tree.flatten(data)
            if isinstance(t, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor))
            and t.shape.rank]
    if not flat:
        return None, None
    first = flat[0]
    if first.shape[0] is not None:
        return tf.constant(1.0 / context.num_replicas_in_sync,
                           loss_shares.share_dtype()), None
    if isinstance(first, tf.SparseTensor):
        rows = first.dense_shape[0]
    elif isinstance(first, tf.RaggedTensor):
        rows = first.nrows()
    else:
        rows = tf.shape(first)[0]
    rows = tf.cast(rows, tf.int32)
    offset, total = strategy.extended._smp_share_bounds(rows)
    share = tf.math.divide_no_nan(tf.cast(rows, loss_shares.share_dtype()),
                                  tf.cast(total, loss_shares.share_dtype()))
    return share, (offset, rows)


class _KerasStep(threading.local):
    """Set while Keras' own `train_step` / `test_step` runs in this thread
    (a replica's): they log the loss weighted by the replica's rows."""

    active = False


_in_keras_step = _KerasStep()


class _StepFunction(threading.local):
    """Set while a plain Keras model's `train_step` / `test_step` (its own
    or Keras') runs in this thread (a replica's) under an `SMPStrategy`."""

    active = False


_in_step_function = _StepFunction()


@contextlib.contextmanager
def _raised(flag):
    """Sets a thread-local `flag.active` for the body."""
    before, flag.active = flag.active, True
    try:
        yield
    finally:
        flag.active = before


def _keeps_loss_value():
    """Whether Keras' losses keep their value (their gradient still divided
    by the replicas in sync, `keras_private.on_loss_scaling`): in a model's
    own `train_step` / `test_step` under an `SMPStrategy`, written for one
    device, which logs the losses it computes (`loss_tracker.update_state(
    loss)`, as Keras' guide does): with several replicas they logged the
    loss divided by the replicas (Keras' behaviour under any
    `tf.distribute` strategy) while training as one device does. Not in
    Keras' own steps (they undo the division themselves), nor in a
    custom loop's `strategy.run` (whose replicas' losses sum to the
    batch's, as TensorFlow's custom-loop guide reduces them)."""
    return _in_step_function.active and not _in_keras_step.active


def _custom_loop_loss():
    """Whether Keras' losses are computed in a custom loop with one stage
    per process (`smp.init` made its `SMPStrategy` current), outside
    `strategy.run`: Keras would divide them by the replicas in sync (as
    for replicas whose gradients sum), where `StepOutput.accumulate` and
    `reduce_mean` average over the replicas (SMP's semantics)."""
    import tensorflow as tf

    return _own_stage_only[0] and tf.distribute.in_cross_replica_context()


def _tensor_group_of(model):
    """The tensor-parallel group of processes whose ranks must compute on
    one batch in `model`'s steps, or `None` (none; or a `DistributedModel`
    with one stage per process, whose pipeline steps share it)."""
    if is_pipelined(model) and model._smp_multi_process():
        return None
    group = getattr(getattr(model, "_distribute_strategy", None),
                    "tensor_group", None)
    return group if group is not None and group.size > 1 else None


def _share_predict_batches(model):
    """Gives `model`'s `predict_step` (whatever it is overridden with) its
    tensor-parallel group's rank 0's batch: Keras' predict function looks
    `predict_step` up when it traces, so an instance attribute wraps it."""
    group = _tensor_group_of(model)
    step = model.predict_step
    if group is None or getattr(step, "_smp_from_first", False):
        return

    def predict_step(data, *args, **kwargs):
        return step(group.from_first(data), *args, **kwargs)

    predict_step._smp_from_first = True
    object.__setattr__(model, "predict_step", predict_step)


def _patch_keras_steps(trainer):
    """Marks Keras' train and test steps (`_in_keras_step`), and gives
    the ranks of a tensor-parallel group of processes their rank 0's
    batch (`TensorGroup.from_first`) in every step: through
    `_make_function` for training and evaluation (whatever `train_step` or
    `test_step` a model overrides them with); `predict_step` in
    `_patch_make_functions` (`_share_predict_batches`)."""
    original_make = trainer._make_function
    if not getattr(original_make, "_smp_patched", False):
        @functools.wraps(original_make)
        def _make_function(self, step_function):
            from keras_smp.runtime import keras_private

            group = _tensor_group_of(self)
            # Position embeddings (data-parallel replicas, training; not
            # with tensor-parallel layers, whose collectives a trace would
            # issue).
            positions = (group is None and getattr(
                step_function, "__name__", None) == "train_step")
            # A model's own `train_step` (not Keras', which it may call):
            # its gradients count by the replica's share of the rows.
            own_train_step = (
                getattr(step_function, "__name__", None) == "train_step"
                and type(self).train_step is not trainer.train_step)
            # Random layers in training and evaluation steps: each
            # replica draws its rows of the batch's draws, from its
            # share's first row (shares of unequal rows: see
            # `_replica_share`).
            draws = getattr(step_function, "__name__", None) in (
                "train_step", "test_step") and bool(
                    keras_private.seed_generator_states([self]))
            if group is not None:
                inner = step_function

                def step_function(data, *args, **kwargs):
                    return inner(group.from_first(data), *args, **kwargs)
            if (_runtime_of(getattr(self, "_distribute_strategy", None))
                    is not None and not is_pipelined(self)):
                user = step_function

                def step_function(*args, **kwargs):
                    from keras_smp.runtime import sparse

                    free = (_position_summed(self, args[0])
                            if positions and args else [])
                    share, part = (_replica_share(self, args[0])
                                   if (own_train_step or draws) and args
                                   else (None, None))
                    with _raised(_in_step_function), \
                            sparse.summed_by_position(free), \
                            _own_step_share.set(
                                share if own_train_step else None), \
                            (split_draws.exactly(part) if draws and part
                             else contextlib.nullcontext()):
                        return user(*args, **kwargs)
            return original_make(self, step_function)

        _make_function._smp_patched = True
        trainer._make_function = _make_function
    for name in ("train_step", "test_step"):
        original = getattr(trainer, name)
        if getattr(original, "_smp_patched", False):
            continue

        @functools.wraps(original)
        def step(self, *args, _original=original, **kwargs):
            with _raised(_in_keras_step):
                return _original(self, *args, **kwargs)

        step._smp_patched = True
        setattr(trainer, name, step)


def _position_summed(model, data):
    """The trainable weights of `model` whose sparse gradients are
    summed across data-parallel replicas position by position
    (`sparse.summed_by_position`): those of its `Embedding`s looked up at
    ids that neither come from the data nor change with the batch (a
    position embedding). Found by tracing `model(x, training=True)` (into
    graphs never run) for `data`'s inputs at batch sizes 2 and 3 (other
    unknown dimensions 8), once per input shapes and trainable weights;
    none when the model has no trainable `Embedding` or a single replica,
    or when the trace fails (with a warning, unless the model has its own
    `train_step`, which may not call the model on `x`: a GAN's)."""
    import keras
    import tensorflow as tf

    from keras_smp.runtime import keras_private
    from keras_smp.runtime import sparse

    layers = keras_private.flatten_layers(model)
    if (model.distribute_strategy.num_replicas_in_sync <= 1
            or not any(isinstance(layer, keras.layers.Embedding)
                       and layer.trainable_weights for layer in layers)):
        return []
    try:  # (a model's own `train_step` may take other data)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    except ValueError:
        return []
    flat = tf.nest.flatten(x)
    if not flat or not all(tf.is_tensor(t) and t.shape.rank
                           for t in flat):
        return []
    key = (tuple((tuple(t.shape), t.dtype) for t in flat),
           tuple(id(w) for w in model.trainable_weights))
    cached = model.__dict__.get("_smp_position_summed")
    if cached is not None and cached[0] == key:
        return cached[1]
    traces = []
    try:
        def tracer(free, scope):
            def trace(*tensors):
                with variable_reads(stateless=True) as seen:
                    out = model(tf.nest.pack_sequence_as(x, list(tensors)),
                                training=True)
                sparse.note_reads({}, seen, [out, scope.losses], True, free)
                return []
            return trace

        for rows in (2, 3):
            free = {}
            scope = keras.StatelessScope(collect_losses=True)
            trace = tracer(free, scope)
            specs = [tf.TensorSpec((rows,) + tuple(
                8 if d is None else d for d in t.shape[1:]), t.dtype)
                for t in flat]
            # (the model's own call: with XLA the step calls a compiled
            # one, whose reads are inside its function's graph)
            with tf.init_scope(), scope, xla.plain_calls(model):
                tf.function(trace, autograph=False).get_concrete_function(
                    *specs)
            traces.append(free)
    except Exception as e:  # pylint: disable=broad-except
        found = []
        # (the same on every rank: the same model, traced alike). A model
        # with its own `train_step` may not call itself on `x` (a GAN).
        if getattr(type(model).train_step, "_smp_patched", False):
            import warnings
            warnings.warn(
                f"keras-smp traced model '{model.name}' at batch sizes 2 "
                "and 3 (unknown lengths as 8) to find embedding lookups "
                "whose ids do not depend on the batch (a position "
                "embedding's), and the trace failed "
                f"({type(e).__name__}: {e}). Each such lookup's gradient "
                "is gathered over the data-parallel replicas, which "
                "Adam-like optimizers apply otherwise than one device "
                "(token lookups are exact either way).", stacklevel=2)
    else:
        ids = sparse.batch_free(*traces)
        found = [w for w in model.trainable_weights if id(w) in ids]
    finally:
        keras_private.clear_added_losses(layers)
    object.__setattr__(model, "_smp_position_summed", (key, found))
    return found


def _symbolic_batch(epoch_iterator):
    """Shape-and-dtype stand-ins (`tf.TensorSpec`s) for a batch of the
    dataset behind `epoch_iterator`, one replica's part, or `None` where
    its spec does not give them (unknown rank, no dataset)."""
    import tensorflow as tf

    from keras_smp.runtime import keras_private

    spec = keras_private.epoch_dataset_spec(epoch_iterator)
    if spec is None:
        return None
    parts = tf.nest.map_structure(tf_private.first_replica_spec, spec)
    for part in tf.nest.flatten(parts):
        shape = getattr(part, "shape", None)
        # (Keras builds from a sparse or ragged input's shape and dtype.)
        if (part is not None and not isinstance(part, (
                tf.TensorSpec, tf.SparseTensorSpec, tf.RaggedTensorSpec))) or (
                shape is not None and shape.rank is None):
            return None
    return parts


# The arguments of each call, beyond its data's steps and batch shapes,
# that decide how many steps it runs (compared across ranks). Not
# `batch_size`: the steps and shapes show its effect, and `None` and 32
# run the same batches of arrays.
_CALL_ARGUMENTS = {
    "fit": ("epochs", "initial_epoch", "validation_split", "validation_freq"),
    "evaluate": (),
    "predict": (),
}


class _CallsInProgress(threading.local):
    """This thread's `fit` / `evaluate` / `predict` calls in progress."""

    def __init__(self):
        self.stack = []


_in_progress = _CallsInProgress()


class _Reads(threading.local):
    recording = None
    stateless = False  # also inside Keras' stateless scopes


_reads = _Reads()


@contextlib.contextmanager
def variable_reads(stateless=False):
    """Records the Keras variables read in the body outside Keras'
    symbolic tracing (a model's `call` traced on symbolic inputs reads a
    weight only when it uses its value eagerly: `keras.ops.transpose(
    layer.kernel)` outside any layer): yields the list they go into.
    `stateless=True` records the reads inside stateless scopes too (a
    layer's call traced under `keras.StatelessScope`: the weights it
    uses), as `(variable, value read)` pairs. A layer building itself
    reads no weight here."""
    before = _reads.recording, _reads.stateless
    _reads.recording, _reads.stateless = [], stateless
    try:
        yield _reads.recording
    finally:
        _reads.recording, _reads.stateless = before


def _plain(value):
    """`value` as JSON keeps it (numbers, strings, lists of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # a NumPy scalar
    if callable(item):
        try:
            return _plain(item())
        except (TypeError, ValueError):
            pass
    return repr(value)


def _patch_calls(trainer):
    """`fit`, `evaluate` and `predict` note their arguments while they run,
    for `_check_call` (which Keras' epoch iterators trigger)."""
    import inspect

    for name, kept in _CALL_ARGUMENTS.items():
        original = getattr(trainer, name)
        if getattr(original, "_smp_patched", False):
            continue
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(self, *args, _original=original, _name=name, _kept=kept,
                 _signature=signature, **kwargs):
            try:
                bound = _signature.bind(self, *args, **kwargs)
                bound.apply_defaults()
                given = bound.arguments
            except TypeError:  # Keras itself will say what is wrong
                given = {}
            arguments = {k: _plain(given.get(k)) for k in _kept}
            if _name == "fit":
                arguments["validation data"] = (
                    given.get("validation_data") is not None
                    or bool(given.get("validation_split")))
                histograms = _gathering_callbacks(self,
                                                  given.get("callbacks"))
                if histograms:
                    arguments["TensorBoard histogram_freq"] = histograms
            _in_progress.stack.append({
                "call": _name, "arguments": arguments, "iterators": 0,
                "index": None, "orders": {}, "model": self,
                "validation_data": given.get("validation_data"),
                # Keras' (the model's, else the scope's).
                "strategy": getattr(self, "distribute_strategy", None)})
            try:
                return _original(self, *args, **kwargs)
            finally:
                _in_progress.stack.pop()

        call._smp_patched = True
        setattr(trainer, name, call)


def _gathering_callbacks(model, callbacks):
    """The `histogram_freq` of each `TensorBoard` among `callbacks` that
    gathers `model` (one stage per process: `_log_whole_weights`), for the
    fit's record: a rank without it (`callbacks=[board] if rank == 0 else
    []`) would leave the others waiting in the gather."""
    import keras

    if not getattr(model, "_smp_multi_process", lambda: False)():
        return []
    return [board.histogram_freq for board in (callbacks or [])
            if isinstance(board, keras.callbacks.TensorBoard)
            and board.histogram_freq]


def _array_shuffle(shuffle):
    """The permutation of a `fit`'s shuffled arrays under a strategy whose
    data-parallel replicas span processes (`data_order.shuffle_for`),
    noted in the call's record so that ranks shuffling differently fail
    before the first step."""
    from keras_smp.runtime import data_order

    if not _in_progress.stack:
        return None
    frame = _in_progress.stack[-1]
    replacement, order = data_order.shuffle_for(frame["strategy"], shuffle)
    if order is not None and frame["iterators"] == 0:
        # (the call's own data: not a fit's validation arrays, made after
        # its record)
        frame["orders"][data_order.ORDER] = order
    return replacement


def _data_orders(epoch_iterator, runtime, validation_data=None):
    """The orders of a call's data (`runtime.data_order`) for its record
    (and of a fit's `validation_data`, given); an order this rank cannot
    tell is recorded as such, not raised here alone (the other ranks
    would wait in the agreement)."""
    from keras_smp.runtime import data_order
    from keras_smp.runtime import keras_private

    strategy = keras_private.epoch_iterator_strategy(epoch_iterator)
    orders = {}
    try:
        order = data_order.dataset_order(
            strategy, keras_private.epoch_iterator_dataset(epoch_iterator),
            runtime.topology.rank)
        if order is not None:
            orders[data_order.DATASET_ORDER] = order
        if validation_data is not None:
            # A fit's validation dataset, checked before its first step
            # (not after an epoch's training, at its first validation).
            order = data_order.dataset_order(
                strategy, validation_data, runtime.topology.rank)
            if order is not None:
                orders[data_order.VALIDATION_ORDER] = order
        if keras_private.epoch_iterator_shuffles_py_dataset(epoch_iterator):
            order = data_order.py_dataset_order(strategy)
            if order is not None:
                orders[data_order.PY_DATASET_ORDER] = order
    except Exception as e:  # noqa: BLE001 - reported through the record
        orders["order of the data"] = (
            f"unknown on rank {runtime.topology.rank} "
            f"({type(e).__name__}: {str(e)[:160]})")
    return orders


def _check_call(epoch_iterator):
    """Before the first step of a `fit` / `evaluate` / `predict` call (and
    of a fit's validation) under a multi-process `SMPStrategy`: every rank
    runs the same (`agreement.check_same_call`)."""
    import tensorflow as tf

    from keras_smp.runtime import agreement
    from keras_smp.runtime import keras_private
    from keras_smp.runtime.calls import call_record

    if not _in_progress.stack:
        return  # an epoch iterator made outside these calls
    runtime = _runtime_of(keras_private.epoch_iterator_strategy(
        epoch_iterator))
    if runtime is None or not runtime.collectives:
        return
    frame = _in_progress.stack[-1]
    frame["iterators"] += 1
    validation = None
    if frame["iterators"] == 1:
        call, arguments = frame["call"], frame["arguments"]
        orders = dict(frame["orders"])
        validation = frame.get("validation_data")
    elif frame["call"] == "fit" and frame["iterators"] == 2:
        call, arguments, orders = "validation of fit", {}, {}
    else:
        return
    orders.update(_data_orders(epoch_iterator, runtime, validation))
    arguments = dict(arguments, data=_length_class(epoch_iterator))
    spec = _symbolic_batch(epoch_iterator)
    inputs = None if spec is None else [
        (s.dtype.name, s.shape.as_list()) for s in tf.nest.flatten(spec)]
    index = agreement.check_same_call(runtime, call_record(
        call, steps=keras_private.epoch_iterator_steps(epoch_iterator),
        arguments=arguments, inputs=inputs, orders=orders),
        of_call=frame["index"])
    if frame["index"] is None:
        frame["index"] = index


def _length_class(epoch_iterator):
    """Whether a call's data is infinite, for its record (several
    processes): a step over infinite data (`repeat()`) takes its next
    batch as it is, a step over other data first asks every process
    whether each has one (TensorFlow's all-reduce of the replicas holding
    a batch, `runtime.data_end`'s with model parallelism across
    processes). So with `steps_per_epoch` given to both, a rank reading
    infinite data beside one reading finite data left the latter waiting
    until `collective_timeout_seconds` (one stage per process), or failed
    both in TensorFlow's "Graph execution error ... CollectiveReduceV2"
    (data parallel)."""
    import tensorflow as tf

    from keras_smp.runtime import keras_private

    dataset = keras_private.epoch_iterator_dataset(epoch_iterator)
    try:
        if isinstance(dataset, tf.data.Dataset):
            cardinality = int(dataset.cardinality())
        else:  # a distributed dataset: an int attribute, maybe absent
            cardinality = getattr(dataset, "cardinality", None)
    except Exception as e:  # noqa: BLE001 - reported through the record
        # (not raised here alone: the other ranks would wait)
        return f"unknown on this rank ({type(e).__name__}: {str(e)[:80]})"
    if cardinality == tf_private.INFINITE_CARDINALITY:
        return "infinite (repeat())"
    return "finite (or of unknown length)"


def _build_across_replicas(optimizer, trainable_variables):
    """Builds an optimizer first applied in a traced step's replica (a
    custom `train_step`'s own optimizers, such as a GAN's two) once, for
    every replica, in the strategy's cross-replica context and outside
    the step's graph, as Keras builds a compiled optimizer before fit's
    first step. Keras built it in each replica's graph: with several
    replicas in one process the step failed ("You must feed a value for
    placeholder tensor ..."), with one per process it worked."""
    import keras
    import tensorflow as tf

    if not tf.distribute.has_strategy() or (
            tf.distribute.in_cross_replica_context()) or _runtime_of(
            tf.distribute.get_strategy()) is None:
        return
    if tf_private.replicas_update_without_merge_call():
        # Keras' own updates make no merge_call here (each replica updates
        # its copies): one could fail inside a `tf.cond`; Keras' build.
        return

    def build(strategy):
        del strategy
        with tf.init_scope():
            if not optimizer.built:
                with keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(trainable_variables)
                optimizer.built = True

    tf.distribute.get_replica_context().merge_call(build)


def _build_for_predict(model, data_batch):
    """A `DistributedModel` not built yet, built from `data_batch`'s
    shapes and dtypes before `predict` / `predict_on_batch` (Keras'
    `fit`, `evaluate`, `*_on_batch` build a model first; its `predict`
    builds it inside the predict function's trace, where a pipeline's
    stages cannot be made)."""
    if getattr(model, "_smp_pipelined", False) and data_batch is not None:
        model._smp_build_from_data(data_batch)


def _on_epoch_iterator(epoch_iterator):
    """Right after Keras makes a call's epoch iterator: the ranks' check
    that they make the same call, then `predict`'s build."""
    _check_call(epoch_iterator)
    if _in_progress.stack and _in_progress.stack[-1]["call"] == "predict":
        _build_for_predict(_in_progress.stack[-1]["model"],
                           _symbolic_batch(epoch_iterator))


def _raise_if_optimizer_outside_scope(model, error):
    """TensorFlow's "Mixing different tf.distribute.Strategy objects", when
    the optimizer was created outside the model's strategy scope (Keras
    creates its slots where the optimizer was created), as an error that
    says so and how to fix it."""
    from keras_smp.runtime import keras_private

    outside = [o for o in (getattr(model, "optimizer", None), getattr(
        getattr(model, "optimizer", None), "inner_optimizer", None))
        if o is not None and keras_private.optimizer_strategy(o)
        is not model.distribute_strategy]
    if "Mixing different tf.distribute.Strategy" not in str(error) or (
            not outside):
        return
    optimizer = outside[-1]  # a LossScaleOptimizer's inner one, if that
    name = type(optimizer).__name__
    raise ValueError(
        f"The optimizer {name} of model '{model.name}' was created outside "
        "the SMPStrategy's scope, so its slot variables cannot be placed "
        "with the model's weights. Create it inside the scope: `with "
        f"strategy.scope(): model.compile(optimizer=keras.optimizers."
        f"{name}(...), ...)`.") from error


def _patch_symbolic_build(trainer):
    """Under an `SMPStrategy`, `fit`/`evaluate` build the model from the
    dataset's spec instead of drawing a batch from a new iterator.

    Keras (3.15, any `tf.distribute` strategy) takes `next()` of a fresh
    iterator over the dataset to build the model symbolically, and drops
    it. A Python generator or `PyDataset` loses that batch and what the
    iterator prefetched (3 of 8 batches, measured), and a dataset
    reshuffling each iteration (`shuffle()`, `PyDataset` with
    `shuffle=True`) starts its first epoch on its second order: training
    differs from the same model without the strategy. Building needs
    only shapes and dtypes, which the spec holds.
    """
    original = trainer._maybe_symbolic_build
    if getattr(original, "_smp_patched", False):
        return

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if _runtime_of(getattr(self, "_distribute_strategy", None)) is None:
            if getattr(self, "_smp_pipelined", False) and getattr(
                    self, "_distribute_strategy", None) is None:
                # A DistributedModel without a strategy (`smp.init`,
                # `SMP_CONFIG`, or none): Keras builds a model without a
                # strategy as its train function is traced, where a
                # pipeline's stages cannot be made ("has not been built
                # yet"): built from the data's shapes first, as
                # `predict` builds one.
                _build_for_predict(self, data_batch if data_batch
                                   is not None or iterator is None
                                   else _symbolic_batch(iterator))
            return original(self, iterator=iterator, data_batch=data_batch)
        from keras_smp.runtime import keras_private

        # (before Keras builds the optimizer on weights without a stage)
        check_pipelined(self)
        check_unsplit_states(self)
        if not keras_private.implements_call(self):
            # A model whose own steps call its parts (a GAN's generator
            # and discriminator), not itself: built as its steps are
            # traced, as Keras builds it without a strategy (with one,
            # Keras' build called it: "Unable to automatically build").
            return None
        if iterator is not None and data_batch is None:
            spec = _symbolic_batch(iterator)
            if spec is not None:
                iterator, data_batch = None, spec
        try:
            return original(self, iterator=iterator, data_batch=data_batch)
        except RuntimeError as e:
            _raise_if_optimizer_outside_scope(self, e)
            raise

    _maybe_symbolic_build._smp_patched = True
    trainer._maybe_symbolic_build = _maybe_symbolic_build


def _patch_epoch_logs(trainer):
    """Under an `SMPStrategy`, the logs of an epoch (and of `evaluate`)
    whose step returns the model's metrics nested as `self.metrics` gives
    them (`{m.name: m.result() for m in self.metrics}`, as Keras' guide
    writes a custom step: the compiled metrics as one dict) are the
    metrics' results over every replica's state, as for Keras' own steps.

    Keras takes the metrics' results only when the step's logs have their
    flat names; otherwise the last step's logs, each the mean of the
    replicas' own results: not the batch's value where the replicas'
    shares differ (a masked accuracy over 14/13 rows)."""
    original = trainer._get_metrics_result_or_logs
    if getattr(original, "_smp_patched", False):
        return

    @functools.wraps(original)
    def _get_metrics_result_or_logs(self, logs):
        if (_runtime_of(getattr(self, "_distribute_strategy", None))
                is not None and isinstance(logs, dict)
                and any(isinstance(v, dict) for v in logs.values())):
            flat = {}
            for name, value in logs.items():
                flat.update(value if isinstance(value, dict)
                            else {name: value})
            results = self.get_metrics_result()
            if set(flat) == set(results):
                return results
        return original(self, logs)

    _get_metrics_result_or_logs._smp_patched = True
    trainer._get_metrics_result_or_logs = _get_metrics_result_or_logs


def _patch_predict_on_batch(trainer):
    """Under an `SMPStrategy` with several replicas, `predict_on_batch(x)`
    splits `x` among them as `predict` does.

    Keras hands the whole batch to every replica and concatenates their
    outputs (gathered across processes): a model under it returned each
    row once per replica.
    """
    original = trainer.predict_on_batch
    if getattr(original, "_smp_patched", False):
        return

    @functools.wraps(original)
    def predict_on_batch(self, x):
        _build_for_predict(self, (x,))
        strategy = _batch_splitting_strategy(self)
        if strategy is None:
            return original(self, x)
        from keras_smp.runtime import keras_private

        self.make_predict_function()
        batch = _distributed_batch(strategy, (x,))
        return keras_private.outputs_to_numpy(self.predict_function([batch]))

    predict_on_batch._smp_patched = True
    trainer.predict_on_batch = predict_on_batch


def _patch_train_and_test_on_batch(trainer):
    """Under an `SMPStrategy` with several replicas, `train_on_batch` and
    `test_on_batch` split their batch among the replicas as `fit` and
    `evaluate` do (each process giving the same global batch).

    Keras hands the whole batch to every replica: each computed the
    whole batch (data-parallel processes each drew a random layer's numbers
    for their share of a batch twice the size: other masks than on one
    device).
    """
    for name, attr in (("train_on_batch", "train_function"),
                       ("test_on_batch", "test_function")):
        original = getattr(trainer, name)
        if getattr(original, "_smp_patched", False):
            continue

        @functools.wraps(original)
        def on_batch(self, *args, _original=original, _attr=attr, **kwargs):
            strategy = _batch_splitting_strategy(self)
            if strategy is None:
                return _original(self, *args, **kwargs)
            made = [getattr(self, _attr, None)]

            def split(iterator):
                # Keras' generator of the one (x, y, sample_weight) batch
                # (class weights already sample weights), after its checks
                # and build: the step function made as Keras makes it.
                setattr(self, _attr, made[0])
                getattr(self, "make_" + _attr)()
                made[0] = getattr(self, _attr)
                return made[0](iter([_distributed_batch(strategy, data)
                                     for data in iterator]))

            # Keras' method calls `self.<attr>` once, with its batch (a
            # `DistributedModel` may wrap it first: put back what was made).
            setattr(self, _attr, split)
            try:
                return _original(self, *args, **kwargs)
            finally:
                setattr(self, _attr, made[0])

        on_batch._smp_patched = True
        setattr(trainer, name, on_batch)


def _batch_splitting_strategy(model):
    """`model`'s `SMPStrategy` when a batch given to one of its `*_on_batch`
    calls must be split among replicas or devices, else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if _runtime_of(strategy) is None or (
            strategy.num_replicas_in_sync < 2
            and len(strategy.extended.worker_devices) < 2):
        return None
    return strategy


def _distributed_batch(strategy, batch):
    """`batch`, a tuple making one global batch (`(x, y, sample_weight)`,
    `None` where absent), split among `strategy`'s replicas as a
    distributed dataset splits it."""
    import keras
    import tensorflow as tf

    present = [i for i, part in enumerate(batch) if part is not None]
    # tf.data reads a list as one tensor: inputs given as a list (a
    # multi-input model) become a tuple, as in `predict`.
    dataset = tf.data.Dataset.from_tensors(keras.tree.lists_to_tuples(
        tuple(batch[i] for i in present)))
    parts = iter(next(iter(strategy.experimental_distribute_dataset(
        dataset))))
    return tuple(next(parts) if part is not None else None
                 for part in batch)


# -- files -----------------------------------------------------------------


def _non_chief_runtime(model):
    """The runtime of `model`'s strategy on a non-chief worker, else None."""
    runtime = _runtime_of(getattr(model, "_distribute_strategy", None))
    if runtime is None:
        return None
    if runtime.cluster.world_size > 1 and runtime.topology.rank != 0:
        return runtime
    return None


def _smp_model(model):
    return (_runtime_of(getattr(model, "_distribute_strategy", None))
            is not None or is_pipelined(model))


def _redirect_save(method):
    @functools.wraps(method)
    def wrapper(self, filepath, *args, **kwargs):
        if _non_chief_runtime(self) is not None:
            scratch = tempfile.mkdtemp(prefix="keras_smp_scratch_")
            try:
                target = os.path.join(scratch, os.path.basename(str(filepath)))
                return method(self, target, *args, **kwargs)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        if not (_smp_model(self) and isinstance(filepath, (str, os.PathLike))):
            return method(self, filepath, *args, **kwargs)
        return _atomic(method, self, os.fspath(filepath), *args, **kwargs)

    wrapper._smp_patched = True
    return wrapper


def _redirect_save_function(function, method_name):
    """`keras.saving.save_model(model, path)` / `save_weights(model, path)`
    (also `keras.models.save_model`) of a model under an `SMPStrategy` or
    pipelined: the model's own `save` / `save_weights`, which write on the
    chief only, atomically (every process of a data-parallel job wrote
    the same file at once: a `.keras` zip with a bad CRC)."""
    import inspect

    @functools.wraps(function)
    def wrapper(model, filepath, *args, **kwargs):
        if not _smp_model(model):
            return function(model, filepath, *args, **kwargs)
        method = getattr(model, method_name)
        try:
            inspect.signature(method).bind(filepath, *args, **kwargs)
        except TypeError:
            if is_pipelined(model):
                raise TypeError(
                    f"keras.saving.{function.__name__}(model, ...) of a "
                    f"DistributedModel takes the arguments of "
                    f"model.{method_name}{inspect.signature(method)}; "
                    f"received {sorted(kwargs)}.") from None
            # Keras' own keywords (objects_to_skip): the function itself,
            # written by the chief only, atomically.
            return _redirect_save(function)(model, filepath, *args,
                                            **kwargs)
        return method(filepath, *args, **kwargs)

    wrapper._smp_patched = True
    return wrapper


def _redirect_export(method):
    """`Model.export` on a non-chief worker writes into scratch (every
    process of a data-parallel job may call it; rank 0's is the file)."""
    @functools.wraps(method)
    def wrapper(self, filepath, *args, **kwargs):
        if _non_chief_runtime(self) is None:
            return method(self, filepath, *args, **kwargs)
        scratch = tempfile.mkdtemp(prefix="keras_smp_scratch_")
        try:
            target = os.path.join(scratch, os.path.basename(
                os.path.normpath(str(filepath))))
            return method(self, target, *args, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    wrapper._smp_patched = True
    return wrapper


def _atomic(method, model, filepath, *args, **kwargs):
    """Saves to a temporary name in the same folder, then renames.

    A process killed during the save leaves the previous file intact (and
    a stray `.tmp-<pid>-<name>` behind); the rename is atomic on POSIX.
    """
    overwrite = kwargs.get("overwrite", args[0] if args else True)
    if not overwrite and os.path.exists(filepath):
        return method(model, filepath, *args, **kwargs)  # Keras asks first
    folder, name = os.path.split(os.path.abspath(filepath))
    os.makedirs(folder, exist_ok=True)
    # Keras checks the suffix (.keras, .weights.h5): keep the name's end.
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
    try:
        result = method(model, tmp, *args, **kwargs)
        os.replace(tmp, filepath)
        return result
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _keras_file_writer(original, model, filepath, *args, **kwargs):
    """Keras' `.keras` writer: a `DistributedModel` decides how (with one
    stage per process it streams the file from its stages)."""
    hook = getattr(model, "_smp_save_model", None)
    if hook is None:
        return original(model, filepath, *args, **kwargs)
    return hook(original, filepath, *args, **kwargs)


def _swap_own_averages(original, callback, tf_fn, backend_fn):
    """`SwapEMAWeights` on the weights this process holds: with one stage
    per process the optimizer's lists also name the other stages' weights
    (no storage here), which the callback would swap too (it failed with
    an `AssertionError` in TensorFlow's `_update`)."""
    scope = getattr(callback.model, "_smp_ema_scope", None)
    with scope() if scope is not None else contextlib.nullcontext():
        return original(callback, tf_fn, backend_fn)


def _log_whole_weights(original, callback, epoch):
    """`TensorBoard`'s weight histograms of the whole model: with one stage
    per process each process holds only its stage's weights, and the
    others' were written as zeros. The model is gathered for them (as
    `get_weights()` gathers it): every process runs the callback (the
    chief's writes its log, the others' go to scratch), so each takes part
    in the gather at the same epochs."""
    gathered = getattr(callback.model, "_smp_gathered", None)
    with gathered() if gathered is not None else contextlib.nullcontext():
        return original(callback, epoch)


def _patch_files(keras):
    keras.Model.save = _redirect_save(keras.Model.save)
    keras.Model.save_weights = _redirect_save(keras.Model.save_weights)
    keras.Model.export = _redirect_export(keras.Model.export)
    for module in (keras.saving, keras.models):
        for name, method_name in (("save_model", "save"),
                                  ("save_weights", "save_weights")):
            function = getattr(module, name, None)
            if function is not None and not getattr(
                    function, "_smp_patched", False):
                setattr(module, name,
                        _redirect_save_function(function, method_name))
    from keras_smp.runtime import keras_private

    keras_private.wrap_save_model(_keras_file_writer)
    keras_private.wrap_ema_swaps(_swap_own_averages)
    keras_private.wrap_tensorboard_weights(_log_whole_weights)

    backup = keras.callbacks.BackupAndRestore
    save_model = backup._save_model
    on_train_end = backup.on_train_end

    on_train_begin = backup.on_train_begin

    @functools.wraps(save_model)
    def _save_model(self):
        if _non_chief_runtime(self.model) is not None:
            # Same save (and collectives) as the chief, into scratch.
            self.model.save_weights(filepath=self._weights_path,
                                    overwrite=True)
            return None
        keep = getattr(self.model, "_smp_keep_backup", None)
        kept = (self.double_checkpoint and keep is not None
                and keep(self._weights_path, self._prev_weights_path))
        if not kept:
            return save_model(self)
        # The weights' backup is kept (a sharded checkpoint: Keras' copy
        # of its `.weights.h5` would name the next save's index); Keras'
        # copy of the training metadata (not over a kept backup's, when
        # the last one was damaged), then its save.
        if kept == "kept" and os.path.exists(self._training_metadata_path):
            _copy_atomic(self._training_metadata_path,
                         self._prev_training_metadata_path)
        self.double_checkpoint = False
        try:
            return save_model(self)
        finally:
            self.double_checkpoint = True

    @functools.wraps(on_train_begin)
    def _on_train_begin(self, logs=None):
        if _multi_worker_runtime(self.model) is None or (
                keras_private.is_remote_path(str(self.backup_dir))):
            return on_train_begin(self, logs)
        try:
            self._load_model()
        except OSError:
            if not os.path.exists(self._prev_weights_path):
                raise
            # Keras' fallback copies the previous backup over the last one
            # and loads that: every process at once, on the same files.
            # Each loads the previous backup where it is; the chief then
            # makes it the last one (Keras' copies) for the next save.
            paths = self._weights_path, self._training_metadata_path
            scratch = None
            as_is = getattr(self.model, "_smp_loads_as_is", None)
            if as_is is not None and as_is(self._prev_weights_path):
                # (a DistributedModel loads a sharded `.bkp` as it is)
                self._weights_path = self._prev_weights_path
            else:  # Keras reads a `.weights.h5` only by that name
                scratch = tempfile.mkdtemp(prefix="keras_smp_backup_")
                self._weights_path = os.path.join(
                    scratch, os.path.basename(paths[0]))
                shutil.copyfile(self._prev_weights_path, self._weights_path)
            self._training_metadata_path = self._prev_training_metadata_path
            try:
                self._load_model()
            finally:
                self._weights_path, self._training_metadata_path = paths
                if scratch is not None:
                    shutil.rmtree(scratch, ignore_errors=True)
            if _non_chief_runtime(self.model) is None:
                # Each file replaced at once (a rank still reading the
                # last backup sees one or the other), the metadata first:
                # the backup's weights never pair with the last epoch.
                if os.path.exists(self._prev_training_metadata_path):
                    _copy_atomic(self._prev_training_metadata_path,
                                 self._training_metadata_path)
                elif os.path.exists(self._training_metadata_path):
                    os.remove(self._training_metadata_path)
                _copy_atomic(self._prev_weights_path, self._weights_path)
        return None

    @functools.wraps(on_train_end)
    def _on_train_end(self, logs=None):
        if _non_chief_runtime(self.model) is None:
            return on_train_end(self, logs)

    backup._save_model = _save_model
    backup.on_train_begin = _on_train_begin
    backup.on_train_end = _on_train_end

    board = keras.callbacks.TensorBoard
    set_model = board.set_model

    @functools.wraps(set_model)
    def _set_model(self, model):
        if _non_chief_runtime(model) is not None:
            # Summaries of non-chief workers duplicate the chief's.
            self.log_dir = _scratch_of(self, "keras_smp_tb_")
        return set_model(self, model)

    board.set_model = _set_model

    logger = keras.callbacks.CSVLogger
    csv_begin = logger.on_train_begin

    @functools.wraps(csv_begin)
    def _csv_on_train_begin(self, logs=None):
        if _non_chief_runtime(self.model) is not None:
            # The chief's rows: a non-chief's went into the same file too
            # (twice each with `append=True`).
            self.filename = os.path.join(
                _scratch_of(self, "keras_smp_csv_"),
                os.path.basename(self.filename) or "log.csv")
        return csv_begin(self, logs)

    logger.on_train_begin = _csv_on_train_begin


def _copy_atomic(source, target):
    """Copies `source` over `target` through a temporary file beside it
    and a rename: a reader sees the old file or the new one."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)),
                       f".tmp-{os.getpid()}-{os.path.basename(target)}")
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _scratch_of(callback, prefix):
    """A non-chief worker's scratch directory for `callback`'s files: one
    per callback, removed when the process exits (a later fit or evaluate
    reuses it)."""
    scratch = getattr(callback, "_keras_smp_scratch", None)
    if scratch is None or not os.path.isdir(scratch):
        scratch = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        callback._keras_smp_scratch = scratch
    return scratch


# -- optimizers ------------------------------------------------------------


# Set by `smp.init` with one stage per process (`keras_smp.smp.setup`):
# `[on, stage_reducer]`.
_own_stage_only = [False, None]


def apply_own_stage_only(stage_sync):
    """From now on, optimizers given gradients for other stages' weights
    (`apply_gradients(zip(grads, model.trainable_variables))` in a custom
    loop with one stage per process, their gradients `None`) skip them, so
    they are neither built for nor applied to them here; and
    `global_clipnorm`'s norm and a `LossScaleOptimizer`'s finite check
    count every stage's gradients (`across_stages`); the gradients of
    weights several stage processes use (tied) are first summed over them.
    `stage_sync(variables)` gives, for the pipeline whose weights
    `variables` are, `(reduce_sum, sum_tied)` (or `None`): the sum over
    its stage processes, and `sum_tied(grads, variables) -> (grads,
    counted_elsewhere)`."""
    _own_stage_only[:] = [True, stage_sync]


def applies_own_stage_only():
    """Whether `smp.init` runs one stage per process in this program."""
    return _own_stage_only[0]


def _patch_apply_own_stage(keras):
    for cls in (keras.optimizers.Optimizer,
                keras.optimizers.LossScaleOptimizer):
        _wrap_apply_own_stage(cls, keras)


def _wrap_apply_own_stage(base, keras):
    original = base.apply
    if getattr(original, "_smp_own_stage", False):
        return

    import tensorflow as tf

    from keras_smp.runtime import keras_private

    def own_stage_apply(self, grads, trainable_variables):
        if (isinstance(self, keras.optimizers.LossScaleOptimizer)
                and tf.distribute.in_cross_replica_context()):
            # Keras' TensorFlow path applies it in a replica context only;
            # every stage process takes the same finite decision
            # (`check_finite` sums over the stages) and skips together.
            return keras_private.loss_scale_apply_in_cross_replica_context(
                self, grads, trainable_variables)
        return original(self, grads, trainable_variables)

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if _own_stage_only[0] and trainable_variables is not None:
            grads, trainable_variables = list(grads), list(
                trainable_variables)
            given = [(g, v) for g, v in zip(grads, trainable_variables)
                     if deferred.holds_no_copy(v) and g is not None]
            if given:
                raise ValueError(
                    f"optimizer.apply_gradients was given a gradient for "
                    f"{given[0][1].path!r}, a weight of another pipeline "
                    "stage (one stage per process: it has no storage in "
                    "this process). Give the step's gradients as they come "
                    "(`None` for other stages' weights).")
            sync = _own_stage_only[1](trainable_variables)
            keep = [i for i, v in enumerate(trainable_variables)
                    if not deferred.holds_no_copy(v)]
            grads = [grads[i] for i in keep]
            trainable_variables = [trainable_variables[i] for i in keep]
            if sync is not None and _step(self, "stage_state") is None:
                # A MultiOptimizer's sub-optimizer applied by it takes its
                # step state: the tied weights' parts are summed already
                # (by an outer optimizer's `apply`, or `fit`'s step).
                state = _applying_parent_state(self)
                if state is None:
                    reduce_sum, sum_tied = sync
                    grads, elsewhere = sum_tied(grads, trainable_variables)
                    state = (reduce_sum, elsewhere)
                with across_stages(self, *state):
                    if all(g is None for g in grads):
                        # Nothing to train here (a frozen stage): its part
                        # of the stages' sums, and the step counted, as
                        # in `fit`.
                        return step_without_gradients(self)
                    return own_stage_apply(self, grads, trainable_variables)
            return own_stage_apply(self, grads, trainable_variables)
        return original(self, grads, trainable_variables)

    apply._smp_own_stage = True
    base.apply = apply


def _patch_get_gradients(keras):
    """Adds `get_gradients(loss, params)` to Keras optimizers.

    Keras 3 optimizers lack this Keras 2 method, which SMP scripts call
    inside their step. Inside `@smp.step` (a graph) it returns
    `tf.gradients(loss, params)`; called eagerly it raises an error
    naming the alternatives.
    """
    import tensorflow as tf

    base = keras.optimizers.Optimizer
    if getattr(base, "get_gradients", None) is not None:
        return

    def get_gradients(self, loss, params):
        if tf.executing_eagerly():
            raise RuntimeError(
                "optimizer.get_gradients(loss, params) only works inside an "
                "@smp.step function (or another tf.function). In eager code "
                "use tf.GradientTape: `with tf.GradientTape() as tape: ...; "
                "grads = tape.gradient(loss, params)`.")
        from keras_smp.runtime import sparse

        # Another stage's weight (one stage per process) has no gradient
        # here: `None`, which `apply_gradients` skips.
        grads = sparse.held_gradients(
            params, lambda held: tf.gradients(
                loss, [sparse.local_copy(p, of_value=True) for p in held],
                unconnected_gradients="zero"))
        for p, g in zip(params, grads):
            sparse.note_source(g, p)  # (for `StepOutput.accumulate`)
        return grads

    base.get_gradients = get_gradients


# -- optimizer step on the synced gradient -----------------------------------

# {id(optimizer): optimizer} of the MultiOptimizers inside `across_stages`
# now (registered by the first entry, e.g. of a process's one replica with
# one stage per process): their sub-optimizers' `apply` takes their step
# state (`_applying_parent_state`), read for the replica running it. Not a
# thread-local: TensorFlow runs the sub-optimizers' `apply` in another
# thread than the step that entered it (measured in `fit`).
_applying_multis = {}


def _applying_parent_state(optimizer):
    """The step state (`across_stages`) of a MultiOptimizer applying
    `optimizer` as one of its sub-optimizers now, or `None`."""
    for multi in list(_applying_multis.values()):
        if any(sub is optimizer for sub in multi.optimizers):
            state = _step(multi, "stage_state")
            if state is not None:
                return state
    return None


@contextlib.contextmanager
def across_stages(optimizer, reduce_sum, counted_elsewhere=()):
    """Within: `optimizer`'s steps see the gradients of every stage.

    `reduce_sum(tensor)` sums a float32 tensor over the stage processes of
    this model replica (one stage per process: each process applies its
    own stage's gradients, so the global norm and the loss-scale finite
    check need the other stages' parts). `counted_elsewhere`: ids of
    variables (tied weights) whose gradient another stage process also
    holds and counts in the norm. `DistributedModel` sets it around its
    optimizer step. Kept on the optimizer (and the one it wraps), not in a
    thread-local: TensorFlow may run the replica function in a thread.
    """
    optimizers = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        optimizers.append(inner)
    state = (reduce_sum, frozenset(counted_elsewhere))
    key = _replica_key()
    previous = [opt.__dict__.get("_smp_step_state", {}).get(
        ("stage_state", key)) for opt in optimizers]
    from keras_smp.runtime import keras_private

    multis = [opt for opt in optimizers
              if keras_private.is_multi_optimizer(opt)
              and id(opt) not in _applying_multis]
    for opt in optimizers:
        _set_step(opt, "stage_state", state)
    for opt in multis:
        _applying_multis[id(opt)] = opt
    try:
        yield
    finally:
        for opt in multis:
            _applying_multis.pop(id(opt), None)
        for opt, before in zip(optimizers, previous):
            _set_step(opt, "stage_state", before)


def _set(optimizer, name, value):
    """Sets a keras-smp attribute past Keras' attribute tracking (which
    would add the variables of a list to the optimizer's own)."""
    object.__setattr__(optimizer, name, value)


def _replica_key():
    """The replica whose step runs now (`None` outside a strategy's
    replica function): the local replicas of one process (tensor-parallel
    ranks on local devices) trace their steps in turns, switching at each
    merge_call, so the optimizer's step state is kept per replica."""
    from keras_smp.runtime import tf_private

    if not tf_private.in_strategy_replica():
        return None
    return tf_private.replica_id()


def _set_step(optimizer, name, value):
    """Sets `optimizer`'s step state `name` for the replica running now."""
    table = optimizer.__dict__.setdefault("_smp_step_state", {})
    table[(name, _replica_key())] = value


def _step(optimizer, name, default=None):
    """`optimizer`'s step state `name` for the replica running now (or as
    set outside the replicas)."""
    table = optimizer.__dict__.get("_smp_step_state", {})
    key = _replica_key()
    if (name, key) in table and table[(name, key)] is not None:
        return table[(name, key)]
    return table.get((name, None), default)


def _stage_state(optimizer):
    return _step(optimizer, "stage_state") or (None, frozenset())


def _stage_sum(optimizer, tensor):
    reduce_sum = _stage_state(optimizer)[0]
    return tensor if reduce_sum is None else reduce_sum(tensor)


def sub_optimizers_with_weights(optimizer):
    """`{index: sub-optimizer}` of a built `MultiOptimizer`'s
    sub-optimizers that train some weight (on any stage), in order; `{}`
    for other optimizers. With one stage per process, one whose update
    acts on all its weights together (`global_clipnorm`, `use_ema`,
    `gradient_accumulation_steps`: reductions across the stages not made
    yet) is refused, on every stage."""
    from keras_smp.runtime import keras_private

    if not keras_private.is_multi_optimizer(optimizer) or (
            not optimizer.built):
        return {}
    used = sorted(set(keras_private.sub_optimizer_indices(optimizer)[0]
                      .values()))
    subs = {i: optimizer.optimizers[i] for i in used}
    for sub in subs.values():
        unsupported = [name for name in (
            "global_clipnorm", "use_ema", "gradient_accumulation_steps")
            if getattr(sub, name, None)]
        if unsupported:
            raise NotImplementedError(
                f"MultiOptimizer with one pipeline stage per process: its "
                f"sub-optimizer {sub.name!r} sets {', '.join(unsupported)}, "
                "which act on all its weights together, across the stages; "
                "not supported yet. Set them on a single optimizer, or use "
                "clipnorm/clipvalue (per weight).")
    return subs


def step_without_gradients(optimizer):
    """The optimizer step of a stage process with nothing to train.

    A frozen stage (fine-tuning) still takes part in the other stages'
    `across_stages` reductions, in the same order and under the same
    conditions: it contributes zero to the norm and "finite" to the
    loss-scale check, keeps its loss scale in step with theirs (the last
    stage scales the loss with it) and counts the step in `iterations`.
    """
    import keras
    import tensorflow as tf

    from keras_smp.runtime import keras_private

    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    inner = optimizer.inner_optimizer if scaled else optimizer
    counter = keras_private.step_counter(inner)
    accumulate = getattr(inner, "gradient_accumulation_steps", None)

    def clip_sum():
        if not getattr(inner, "global_clipnorm", None):
            return
        if not accumulate:
            _stage_sum(inner, tf.zeros([]))
            return
        # The training stages clip (and sum the norm) on update steps only.
        def norm_share():
            _stage_sum(inner, tf.zeros([]))
            return tf.constant(True)

        tf.cond(tf.equal((counter + 1) % accumulate, 0), norm_share,
                lambda: tf.constant(False))

    subs = sub_optimizers_with_weights(inner)
    if subs and (scaled or getattr(inner, "global_clipnorm", None)
                 or accumulate):
        raise NotImplementedError(
            "A stage process with nothing to train and a MultiOptimizer "
            "inside a LossScaleOptimizer (mixed precision), or with "
            "global_clipnorm or gradient_accumulation_steps of its own, is "
            "not supported yet. Give the frozen stage a trainable weight, "
            "or use one optimizer.")
    if not scaled:
        clip_sum()
        for sub in subs.values():  # each counts the step, as on 1 device
            sub.iterations.assign_add(1)
        counter.assign_add(1)
        return
    if not optimizer.built:
        optimizer.build([])
    finite = tf.equal(_stage_sum(optimizer, tf.zeros([])), 0.0)

    def on_finite():
        clip_sum()
        keras_private.loss_scale_after_finite_step(optimizer)
        return tf.constant(True)

    def on_non_finite():
        keras_private.loss_scale_after_non_finite_step(optimizer)
        return tf.constant(False)

    tf.cond(finite, on_finite, on_non_finite)
    # After the cond (the clip reads the count before this step), outside
    # it: the counter (aggregated "only first replica") cannot be assigned
    # in a replica context inside control flow.
    counter.assign_add(tf.cast(finite, counter.dtype))



def _tensor_group(optimizer):
    """The tensor-parallel group of the optimizer's strategy (an
    `SMPStrategy` with `tensor_parallel_degree > 1`), or `None`."""
    from keras_smp.runtime import keras_private

    strategy = keras_private.optimizer_strategy(optimizer)
    group = getattr(strategy, "_smp_tensor_group", None)
    if group is None and _runtime_of(strategy) is None:
        # A custom loop (smp.init): the group of the split weights the
        # optimizer was built for (marked by its `build`).
        for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            group = group or getattr(opt, "_smp_tp_group", None)
    return group if group is not None and group.size > 1 else None


def rows_sum_linearly(optimizer):
    """Whether `optimizer` applies a sparse gradient (`tf.IndexedSlices`)
    as it applies the dense sum of its rows, so that the replicas' rows
    may be summed densely: Keras' `SGD` (momentum and Nesterov included:
    its update is linear in the gradient). Adam, Adagrad, RMSprop and
    the others square (or take the sign of) each row as it comes, so a
    repeated id's rows summed first step otherwise."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    return (getattr(type(inner), "update_step", None)
            is keras.optimizers.SGD.update_step)


def _smp_optimizer(optimizer):
    from keras_smp.runtime import keras_private

    return (_runtime_of(keras_private.optimizer_strategy(optimizer))
            is not None or _tensor_group(optimizer) is not None)


def _patch_optimizer(keras):
    import tensorflow as tf

    from keras_smp.runtime import keras_private
    from keras_smp.runtime import sparse

    if keras_private.optimizer_step_wrapped():
        return

    def conditional_updates(optimizer):
        # Keras updates inside `tf.cond`: a `merge_call` there fails under
        # any tf.distribute strategy ("`merge_call` called while defining
        # a new graph"); keras-smp sums the gradients first and updates
        # each replica's copies in its own context.
        return bool(getattr(optimizer, "gradient_accumulation_steps", None)
                    or (getattr(optimizer, "use_ema", False) and getattr(
                        optimizer, "ema_overwrite_frequency", None)))

    def clips(optimizer):
        return any(getattr(optimizer, a, None)
                   for a in ("clipnorm", "global_clipnorm", "clipvalue"))

    def wrap_apply(apply_gradients):
        inner = wrap_apply_summed(apply_gradients)

        def backend_apply_gradients(self, grads, trainable_variables):
            # Lookups of distinct ids (a sparse input's matmul): one
            # device's gradient holds each id of the batch once; the
            # microbatches' (concatenated) and, after the all-reduce, the
            # replicas' are summed by id.
            if not _smp_optimizer(self):
                return inner(self, grads, trainable_variables)
            grads, variables = list(grads), list(trainable_variables)
            distinct = [i for i, g in enumerate(grads)
                        if isinstance(g, tf.IndexedSlices)
                        and sparse.from_unique(g.indices)]
            context = tf.distribute.get_replica_context()
            if (context is not None and context.num_replicas_in_sync > 1
                    and not rows_sum_linearly(self)):
                for g, v in zip(grads, variables):
                    lookups = (sparse.distinct_lookups(g.indices)
                               if isinstance(g, tf.IndexedSlices) else 0)
                    if lookups > 1:
                        sparse.warn_split_lookups(
                            v, lookups,
                            f"{context.num_replicas_in_sync} replicas")
            if not distinct:
                return inner(self, grads, variables)
            before = _step(self, "distinct", None)
            ids = set(before or ())
            for i in distinct:
                grads[i] = sparse.summed_by_id(grads[i])
                ids.update((id(variables[i]), id(
                    keras_private.backing_variable(variables[i]))))
            _set_step(self, "distinct", frozenset(ids))
            try:
                return inner(self, grads, variables)
            finally:
                _set_step(self, "distinct", before)

        return backend_apply_gradients

    def by_id(optimizer, grads, variables):
        # (the replicas' rows of `_step(optimizer, "distinct")`'s
        # variables, gathered by the all-reduce, summed by id)
        distinct = _step(optimizer, "distinct", None)
        if not distinct:
            return list(grads)
        return [sparse.summed_by_id(g) if isinstance(g, tf.IndexedSlices)
                and id(v) in distinct else g
                for g, v in zip(grads, variables)]

    def wrap_apply_summed(apply_gradients):
        def backend_apply_gradients(self, grads, trainable_variables):
            group = _tensor_group(self)
            if group is not None and not _step(self, "tp_summed", False):
                # Tensor parallelism: each rank holds shards, so the global
                # norm and the finite check sum over the group (then over
                # the pipeline's stages, if any); a replicated weight's
                # gradient counts once (on tensor-parallel rank 0).
                stage_sum, stage_elsewhere = _stage_state(self)
                elsewhere = set(stage_elsewhere)
                if group.rank > 0:
                    elsewhere.update(
                        id(v) for v in trainable_variables
                        if getattr(v, "_smp_tp_axis", None) is None)
                if stage_sum is None:
                    reduce_sum = group.sum
                else:
                    def reduce_sum(t):
                        return stage_sum(group.sum(t))
                grads = _average_replicated(group, list(grads),
                                            list(trainable_variables))
                # Once (a LossScaleOptimizer's inner optimizer steps inside).
                optimizers = [self, getattr(self, "inner_optimizer", None)]
                optimizers = [o for o in optimizers if o is not None]
                for o in optimizers:
                    _set_step(o, "tp_summed", True)
                try:
                    with across_stages(self, reduce_sum, elsewhere):
                        return backend_apply_gradients(
                            self, grads, trainable_variables)
                finally:
                    for o in optimizers:
                        _set_step(o, "tp_summed", False)
            conditional = _smp_optimizer(self) and conditional_updates(self)
            if not (_smp_optimizer(self) and (clips(self) or conditional)):
                return apply_gradients(self, grads, trainable_variables)
            context = tf.distribute.get_replica_context()
            grads = list(grads)
            if context is not None and context.num_replicas_in_sync > 1:
                # Sum the replicas' gradients first, clip the sum (as one
                # device would), and skip the all-reduce of the update.
                present = [i for i, g in enumerate(grads) if g is not None]
                with runtime_package.sparse_gradients_as_is(), \
                        runtime_package.summing_gradients():
                    variables = list(trainable_variables)
                    summed = sparse.all_reduce(
                        functools.partial(context.all_reduce,
                                          tf.distribute.ReduceOp.SUM),
                        [grads[i] for i in present],
                        [variables[i] for i in present], context)
                summed = by_id(self, summed, [variables[i] for i in present])
                for i, g in zip(present, summed):
                    grads[i] = g
                _set_step(self, "synced", True)
            _set_step(self, "clip_ids",
                 tuple(id(v) for v in trainable_variables))
            _set_step(self, "clip_split", tuple(
                getattr(v, "_smp_tp_axis", None) is not None
                for v in trainable_variables))
            try:
                with (placement.replica_updates() if conditional
                      else contextlib.nullcontext()):
                    return apply_gradients(self, grads, trainable_variables)
            finally:
                _set_step(self, "synced", False)
                _set_step(self, "clip_ids", None)
                _set_step(self, "clip_split", None)

        return backend_apply_gradients

    def wrap_all_reduce(all_reduce):
        def all_reduce_sum_gradients(self, grads_and_vars):
            if _step(self, "synced", False):
                return list(grads_and_vars)  # summed before clipping
            # A sparse gradient summed densely merges its repeated ids'
            # rows, which only an optimizer linear in the gradient (SGD)
            # applies as it applies them one by one.
            with (contextlib.nullcontext() if rows_sum_linearly(self)
                  else runtime_package.sparse_gradients_as_is()), \
                    runtime_package.summing_gradients():
                context = tf.distribute.get_replica_context()
                if context is None or not sparse.active():
                    pairs = list(all_reduce(self, grads_and_vars))
                    variables = [v for _, v in pairs]
                    return list(zip(by_id(self, [g for g, _ in pairs],
                                          variables), variables))
                # Position embeddings' rows added position by position.
                pairs = list(grads_and_vars)
                variables = [v for _, v in pairs]
                grads = sparse.all_reduce(
                    lambda gs: [g for g, _ in all_reduce(
                        self, list(zip(gs, variables)))],
                    [g for g, _ in pairs], variables, context)
                return list(zip(by_id(self, grads, variables), variables))

        return all_reduce_sum_gradients

    def wrap_clip(clip):
        def clip_gradients(self, grads):
            group = _tensor_group(self)
            if group is not None and self.clipnorm:
                # Each weight's own norm: a tensor-parallel shard's counts
                # every rank's shard (Keras' clip_by_norm, whole weight).
                split = _step(self, "clip_split", None)
                if split is None or len(split) != len(grads):
                    raise RuntimeError(
                        "keras-smp: clipnorm with tensor parallelism lost "
                        "track of the optimizer's variables (internal error).")
                grads = [g if g is None else _clip_by_norm(
                    g, self.clipnorm, group.sum if s else None)
                    for g, s in zip(grads, split)]
                clipnorm = self.clipnorm
                try:
                    self.clipnorm = None
                    return clip_gradients(self, grads)
                finally:
                    self.clipnorm = clipnorm
            reduce_sum, skip = _stage_state(self)
            if not (_smp_optimizer(self) and self.global_clipnorm
                    and reduce_sum is not None):
                return clip(self, grads)
            # keras' clip_by_global_norm, with the norm over every stage.
            ids = _step(self, "clip_ids", None)
            if ids is None or len(ids) != len(grads):
                raise RuntimeError(
                    "keras-smp: global_clipnorm across pipeline stages lost "
                    "track of the optimizer's variables (internal error).")
            squares = [_squared_norm(g) for g, i in zip(grads, ids)
                       if g is not None and i not in skip]
            norm = tf.sqrt(reduce_sum(tf.add_n(squares) if squares
                                      else tf.zeros([], _share_dtype())))
            clip_norm = self.global_clipnorm
            scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm)
            scale = scale + (norm - norm)
            # Dense, as Keras' `v * scale` makes a sparse gradient (Adam's
            # sparse update of an id repeated in the batch is not its dense
            # one: the step differed from plain Keras).
            return [None if g is None else _scaled(tf.convert_to_tensor(g),
                                                   scale) for g in grads]

        return clip_gradients

    def wrap_check_finite(check_finite):
        def finite(self, grads):
            result = check_finite(self, grads)
            if not _smp_optimizer(self):
                return result
            # One decision everywhere: count the replicas and stages whose
            # gradients are not finite.
            bad = 1.0 - tf.cast(result, tf.float32)
            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                bad = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)
            group = _tensor_group(self)
            if group is not None and not _step(self, "tp_summed", False):
                # A LossScaleOptimizer checks before its inner optimizer's
                # step (where the tensor-parallel sums are set): a shard's
                # overflow on one rank skips the step on every rank.
                bad = group.sum(bad)
            return tf.equal(_stage_sum(self, bad), 0.0)

        return finite

    keras_private.wrap_optimizer_step(
        apply_gradients=wrap_apply, all_reduce=wrap_all_reduce,
        clip=wrap_clip, check_finite=wrap_check_finite)


def _average_replicated(group, grads, variables):
    """The gradients of replicated weights (every tensor-parallel rank
    holds the whole weight: LayerNorm, biases added after a sum, layers
    left whole) averaged over the group, in one fused all-reduce.

    Every rank computes them from the same values, but CPU kernels may
    round differently in different processes (memory alignment changes
    the summation order): unsynced, the copies would drift apart by a few
    ULPs a step. Sparse gradients are made dense first. The cost is the
    size of the layers left whole (a few KB for a transformer's
    LayerNorms and row biases).
    """
    import numpy as np
    import tensorflow as tf

    index = [i for i, (g, v) in enumerate(zip(grads, variables))
             if g is not None and getattr(v, "_smp_tp_axis", None) is None]
    if not index:
        return grads
    dense = [tf.convert_to_tensor(grads[i]) for i in index]
    flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1])
                      for g in dense], axis=0)
    flat = group.sum(flat) / group.size
    shapes = [tuple(variables[i].shape) for i in index]
    sizes = [int(np.prod(shape)) for shape in shapes]
    for i, g, shape, part in zip(index, dense, shapes,
                                 tf.split(flat, sizes)):
        grads[i] = tf.cast(tf.reshape(part, shape), g.dtype)
    return grads


def _squared_norm(grad):
    """Sum of squares of a gradient, as Keras' clip_by_global_norm takes
    it: a sparse gradient's rows as they come (an id repeated in the batch
    counts once per occurrence; the pipeline's microbatch sum and the
    sparse all-reduce keep the single-device rows)."""
    import tensorflow as tf

    if isinstance(grad, tf.IndexedSlices):
        grad = grad.values
    return tf.reduce_sum(tf.square(tf.cast(grad, _share_dtype())))


def _share_dtype():
    from keras_smp.runtime import loss_shares

    return loss_shares.share_dtype()


def _clip_by_norm(grad, clip_norm, reduce_sum=None):
    """Keras' `clip_by_norm` of one gradient, its norm summed over
    `reduce_sum` (a tensor-parallel shard's group) when given."""
    import tensorflow as tf

    squares = _squared_norm(grad)
    if reduce_sum is not None:
        squares = reduce_sum(squares)
    safe = tf.where(squares > 0, squares, tf.ones_like(squares))
    norm = tf.where(squares > 0, tf.sqrt(safe), squares)
    return _scaled(grad, clip_norm / tf.maximum(norm, clip_norm))


def _scaled(grad, scale):
    import tensorflow as tf

    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)


# -- layer weights ---------------------------------------------------------


def defers_layer_weights():
    """Whether layer weights created now are deferred: inside the scope of
    an `SMPStrategy` running one pipeline stage per process, or several
    stages on the devices of one process (each weight is then created on
    its stage's device, never first on another)."""
    import tensorflow as tf

    if placement.creating_local() or not tf.distribute.has_strategy():
        return False
    runtime = _runtime_of(tf.distribute.get_strategy())
    if runtime is None:
        return False
    if runtime.mode == "multi_process":
        return True
    return (runtime.mode == "in_process" and runtime.layout is not None
            and runtime.layout.num_stages > 1)


def _patch_add_weight(keras):
    """Under a one-stage-per-process strategy, `Layer.add_weight` creates
    deferred weights (`keras_smp.runtime.deferred`): the stage owning a
    layer materialises them, the other stages never hold them."""
    import tensorflow as tf

    from keras_smp.runtime import keras_private

    original = keras.layers.Layer.add_weight
    if getattr(original, "_smp_patched", False):
        return

    @functools.wraps(original)
    def add_weight(self, *args, **kwargs):
        if not defers_layer_weights():
            return original(self, *args, **kwargs)
        with tf.variable_creator_scope(deferred.creator):
            return original(self, *args, **kwargs)

    add_weight._smp_patched = True
    keras.layers.Layer.add_weight = add_weight

    def wrap_value(value):
        def read(self):
            if _reads.recording is None:
                return unrecorded(self)
            if _reads.stateless:
                # A value of the graph traced, whatever the variable holds
                # (a placeholder, or its storage read), so its gradient
                # can be taken there.
                out = tf.identity(unrecorded(self))
                _reads.recording.append((self, out))
                return out
            if not keras_private.in_stateless_scope():
                _reads.recording.append(self)
            return unrecorded(self)

        def unrecorded(self):
            initial = deferred.initial_value(self)
            if initial is None:
                return value(self)
            if keras_private.in_stateless_scope():
                mapped = keras_private.stateless_value(self)
                if mapped is not None:  # stateless_call's given state
                    return keras_private.autocast_value(self, mapped)
                # Keras traces shapes: a placeholder, as for its own
                # uninitialised variables (a graph op, no storage).
                return keras_private.autocast_value(
                    self, initial() if callable(initial) else initial)
            if not getattr(self, "_smp_local", False):
                # A weight no DistributedModel has claimed (a plain
                # model built in the scope, read for its values): it
                # gets its values here, in this process only.
                with placement.local_variables():
                    deferred.materialize(self)
            return value(self)

        return read

    keras_private.wrap_variable_value(wrap_value)

    def wrap_build(maybe_build):
        def build(self, *args, **kwargs):
            # A layer building itself may read its own weights (adapted
            # preprocessing layers, seeded initializers): not a use.
            saved, _reads.recording = _reads.recording, None
            try:
                return maybe_build(self, *args, **kwargs)
            finally:
                _reads.recording = saved

        return build

    keras_private.wrap_layer_build(wrap_build)

    def wrap_assign(direct_assign):
        def assign(self, value):
            if deferred.is_pending(self):
                if getattr(self, "_smp_local", False):
                    return None  # another stage's weight: not held here
                # Not partitioned yet (weights loaded into a model built in
                # the scope): values here; the owning stage re-creates it
                # under the strategy with them when the plan is set.
                with placement.local_variables():
                    deferred.materialize(self)
            return direct_assign(self, value)

        return assign

    keras_private.wrap_variable_direct_assign(wrap_assign)


def _unpartitioned(variable):
    """Whether `variable` is a weight of a model built in a pipeline
    strategy's scope that no `DistributedModel` has placed yet: deferred
    (shapes only), or given values in this process only (read, assigned,
    loaded) before any plan. Other stages' weights are not."""
    import tensorflow as tf

    own = vars(variable) if hasattr(variable, "__dict__") else {}
    if own.get("_smp_local") is True:
        return False
    if deferred.is_pending(variable):
        return True
    storage = own.get("_value")
    return (own.get("_smp_local") is False and storage is not None
            and not isinstance(storage, tf.distribute.DistributedValues))


def _patch_loading(keras):
    """`keras.models.load_model` of a compiled plain model inside the scope
    of a pipeline `SMPStrategy`, then `DistributedModel(model)`: Keras
    builds the loaded model's optimizer on its weights to load the saved
    optimizer state, but they have no stage yet (TensorFlow failed:
    "`colocate_vars_with` must only be passed a variable created in this
    tf.distribute.Strategy.scope()"). The build waits for the pipeline,
    and the optimizer keeps the state it is given (`load_own_variables`)
    until it is built there. Building an optimizer on such weights
    otherwise (`fit` on a model never wrapped) is a clear error."""
    import numpy as np

    optimizer_class = keras.optimizers.Optimizer
    if getattr(optimizer_class.build, "_smp_patched", False):
        return
    original_build = optimizer_class.build
    original_load = optimizer_class.load_own_variables
    original_compile_from_config = keras.Model.compile_from_config

    @functools.wraps(original_build)
    def build(self, var_list):
        if not self.built and defers_layer_weights():
            waiting = [v for v in var_list if _unpartitioned(v)]
            if waiting:
                raise ValueError(
                    f"The optimizer {self.name!r} is being built for "
                    f"{len(waiting)} weight(s) of a model that no "
                    f"DistributedModel has partitioned (first: "
                    f"{waiting[0].path!r}), inside the scope of an "
                    "SMPStrategy with several pipeline stages. A plain "
                    "Keras model is not pipelined: wrap it inside the "
                    "scope, `model = keras_smp.DistributedModel(model)`, "
                    "before fit (or building its optimizer).")
        return original_build(self, var_list)

    @functools.wraps(original_load)
    def load_own_variables(self, store):
        if self.built or not defers_layer_weights():
            return original_load(self, store)
        # Saved state for an optimizer of weights without a stage yet:
        # kept until the pipeline builds it, then loaded as Keras would.
        saved = {k: np.array(store[k]) for k in store.keys()}
        build_first = self.build

        def build_then_load(var_list):
            build_first(var_list)
            state = vars(self).pop("_smp_saved_state", None)
            if state is not None:
                original_load(self, state)

        object.__setattr__(self, "_smp_saved_state", saved)
        object.__setattr__(self, "build", build_then_load)

    @functools.wraps(original_compile_from_config)
    def compile_from_config(self, config):
        if (type(self).compile is not keras.Model.compile
                or not defers_layer_weights()
                or not any(_unpartitioned(v)
                           for v in self.trainable_variables)):
            return original_compile_from_config(self, config)
        # Keras' compile_from_config, less the optimizer's build (the
        # saved state waits for it: `load_own_variables` above).
        self.compile(**keras.saving.deserialize_keras_object(config))

    for f in (build, load_own_variables, compile_from_config):
        f._smp_patched = True
    optimizer_class.build = build
    optimizer_class.load_own_variables = load_own_variables
    keras.Model.compile_from_config = compile_from_config


def _patch_unheld_reads(keras):
    """Reading a weight this process holds no copy of (another pipeline
    stage's, with one stage per process: `pipeline.residency` marks it
    `_smp_unheld`) raises an error naming it, instead of giving an empty
    array: `numpy()` (a layer's `get_weights()`) and NumPy conversion."""
    cls = keras.Variable
    numpy, array = cls.numpy, cls.__array__

    def check(variable):
        if getattr(variable, "_smp_unheld", False):
            raise ValueError(
                f"Weight {variable.path!r} belongs to another pipeline "
                "stage: with one stage per process this process holds no "
                "copy of it (reading it would give an empty array, e.g. "
                "from its layer's `get_weights()`). Read whole weights with "
                "`model.get_weights()` (a collective: every process calls "
                "it; it gathers every stage's), or read it in the process "
                "that runs its stage (`model.partition_summary()` names the "
                "stages' layers).")

    @functools.wraps(numpy)
    def _numpy(self):
        check(self)
        return numpy(self)

    @functools.wraps(array)
    def _array(self, *args, **kwargs):
        check(self)
        return array(self, *args, **kwargs)

    cls.numpy, cls.__array__ = _numpy, _array


def install():
    """Installs every patch (idempotent, thread-safe)."""
    with _lock:
        if _installed:
            return
        import keras

        from keras_smp.runtime import keras_private
        from keras_smp.runtime.keras_private import TensorFlowTrainer

        _patch_make_functions(TensorFlowTrainer)
        _patch_compute_loss(TensorFlowTrainer)
        _patch_keras_steps(TensorFlowTrainer)
        _patch_symbolic_build(TensorFlowTrainer)
        _patch_predict_on_batch(TensorFlowTrainer)
        _patch_train_and_test_on_batch(TensorFlowTrainer)
        _patch_epoch_logs(TensorFlowTrainer)
        _patch_calls(TensorFlowTrainer)
        keras_private.on_epoch_iterator(_on_epoch_iterator)
        keras_private.on_array_dataset(_array_shuffle)
        keras_private.on_loss_scaling(_keeps_loss_value, _custom_loop_loss,
                                      own_step_share, _shares_weighed)
        keras_private.before_unbuilt_optimizer_applies(
            _build_across_replicas)
        keras_private.on_optimizer_apply(_weighed_by_share)
        keras_private.loss_scale_read_when_applied()
        keras_private.python_scalars_of_distributed_variables()
        _patch_files(keras)
        _patch_get_gradients(keras)
        _patch_apply_own_stage(keras)
        _patch_optimizer(keras)
        _patch_add_weight(keras)
        install_layer_hook()
        _patch_split_weights(keras)
        _patch_unheld_reads(keras)
        _patch_loading(keras)
        split_draws.install()
        _installed.append(True)


def split_of(variable):
    """`(axis, group)` of a tensor-parallel shard (a weight of a split
    layer, or an optimizer slot of one), or `None`."""
    axis = getattr(variable, "_smp_tp_axis", None)
    group = getattr(variable, "_smp_tp_group", None)
    if axis is None or group is None or group.size == 1:
        return None
    return axis, group


def whole_value(variable):
    """A variable's value as a NumPy array, whole: a tensor-parallel
    shard is gathered over its group (a collective: every rank of the
    group calls it for the same variables, in the same order)."""
    import keras
    import numpy as np
    import tensorflow as tf

    split = split_of(variable)
    if split is not None and split[1].local:
        # Ranks of local devices: the shards are the components of the
        # distributed variable, one per local replica.
        return np.concatenate(
            [keras.ops.convert_to_numpy(c)
             for c in _rank_components(variable)], axis=split[0])
    value = tf.convert_to_tensor(variable)
    if split is not None:
        value = split[1].all_gather(value, split[0])
    return keras.ops.convert_to_numpy(value)


def _rank_components(variable):
    """A local tensor-parallel group's shards of `variable`, in rank
    order (the components of its distributed variable)."""
    from keras_smp.runtime import keras_private

    backing = keras_private.backing_variable(variable)
    components = tuple(getattr(backing, "values", (backing,)))
    group = split_of(variable)[1]
    if len(components) != group.size:
        raise RuntimeError(
            f"keras-smp: tensor-parallel weight "
            f"{getattr(variable, 'path', variable)} has {len(components)} "
            f"copies for {group.size} local ranks (internal error).")
    return components


def assign_whole(variable, value, what="weight"):
    """Assigns a whole `value` to `variable`: to a tensor-parallel shard,
    its rank's part (every rank's, for ranks that are local devices)."""
    part = rank_part(value, variable, what)  # checks the shape
    split = split_of(variable)
    if split is None or not split[1].local:
        variable.assign(part)
        return
    import numpy as np

    axis, group = split
    for rank, component in enumerate(_rank_components(variable)):
        component.assign(np.split(np.asarray(value), group.size,
                                  axis=axis)[rank])


def rank_part(value, variable, what="weight"):
    """This rank's part of a whole `value` for `variable` (itself when the
    variable is not a shard); raises when the shapes do not fit."""
    import numpy as np

    value = np.asarray(value)
    split = split_of(variable)
    whole = list(variable.shape)
    if split is not None:
        whole[split[0]] *= split[1].size
    if tuple(whole) != value.shape:
        raise ValueError(
            f"{what} {getattr(variable, 'path', variable)} has shape "
            f"{tuple(whole)} (whole"
            + (f", split in {split[1].size} on axis {split[0]} across "
               "tensor-parallel ranks" if split else "")
            + f"), not compatible with provided shape {value.shape}.")
    if split is None:
        return value
    axis, group = split
    step = value.shape[axis] // group.size
    index = [slice(None)] * value.ndim
    index[axis] = slice(group.rank * step, (group.rank + 1) * step)
    return value[tuple(index)]


def _patch_split_weights(keras):
    """`get_weights` / `set_weights` of a layer or model holding
    tensor-parallel shards use whole weights, as single-device Keras: each
    shard is gathered over its group (every rank of the group calls it, as
    for `save_weights`), and a whole weight is cut to this rank's shard."""
    import numpy as np
    import tensorflow as tf

    layer = keras.layers.Layer
    if getattr(layer.get_weights, "_smp_patched", False):
        return
    get_weights, set_weights = layer.get_weights, layer.set_weights

    @functools.wraps(get_weights)
    def get_whole_weights(self):
        variables = self.weights
        if not any(split_of(v) for v in variables):
            return get_weights(self)
        return [whole_value(v) for v in variables]

    @functools.wraps(set_weights)
    def set_whole_weights(self, weights):
        variables = self.weights
        # Another pipeline stage's weight (one stage per process), unless
        # its assignment is dropped on purpose (`model.set_weights` sets
        # every weight; each process keeps its stage's).
        unheld = [v for v in variables
                  if (getattr(v, "_smp_unheld", False)
                      or getattr(v, "_smp_local", False))
                  and "assign" not in vars(v)]
        if unheld:
            raise ValueError(
                f"Layer '{self.name}' holds weights of another pipeline "
                f"stage (e.g. {unheld[0].path!r}): with one stage per "
                "process this process holds no copy of them, so "
                "`set_weights` here would set nothing. Set whole weights "
                "with `model.set_weights(...)` (a collective: every process "
                "calls it, each keeping its stage's), or call the layer's "
                "`set_weights` in the process that runs its stage "
                "(`model.partition_summary()` names the stages' layers).")
        if not any(split_of(v) for v in variables):
            return set_weights(self, weights)
        if len(variables) != len(weights):
            raise ValueError(
                f"You called `set_weights(weights)` on layer '{self.name}' "
                f"with a weight list of length {len(weights)}, but the layer "
                f"was expecting {len(variables)} weights.")
        for v, w in zip(variables, weights):  # check all, then assign
            rank_part(w, v, f"Layer {self.name} weight")
        for v, w in zip(variables, weights):
            assign_whole(v, w, f"Layer {self.name} weight")

    # Optimizer slots of split weights are split alike (marked when made),
    # and saved whole like the weights.
    from keras_smp.runtime.keras_private import BaseOptimizer as base

    make_slot = base.add_variable_from_reference

    @functools.wraps(make_slot)
    def add_variable_from_reference(self, reference_variable, *args,
                                    **kwargs):
        slot = make_slot(self, reference_variable, *args, **kwargs)
        split = split_of(reference_variable)
        if split is not None and tuple(slot.shape) == tuple(
                reference_variable.shape):
            object.__setattr__(slot, "_smp_tp_axis", split[0])
            object.__setattr__(slot, "_smp_tp_group", split[1])
        return slot

    build = base.build

    @functools.wraps(build)
    def build_marked(self, variables):
        build(self, variables)
        # The group of the split weights it steps (a custom loop's
        # optimizer has no strategy to tell it).
        splits = [split_of(v) for v in variables]
        object.__setattr__(self, "_smp_tp_group", next(
            (s[1] for s in splits if s is not None), None))

    base.build = build_marked

    save_slots, load_slots = base.save_own_variables, base.load_own_variables

    @functools.wraps(save_slots)
    def save_own_variables(self, store):
        if not any(split_of(v) for v in self.variables):
            return save_slots(self, store)
        for i, variable in enumerate(self.variables):
            store[str(i)] = whole_value(variable)

    @functools.wraps(load_slots)
    def load_own_variables(self, store):
        variables = self.variables
        if not any(split_of(v) for v in variables) or (
                len(store.keys()) != len(variables)):
            return load_slots(self, store)  # Keras' checks and warning
        for i, variable in enumerate(variables):
            assign_whole(variable, store[str(i)],
                         f"Optimizer {self.name} variable")

    base.add_variable_from_reference = add_variable_from_reference
    base.save_own_variables = save_own_variables
    base.load_own_variables = load_own_variables
    get_whole_weights._smp_patched = True
    layer.get_weights = get_whole_weights
    layer.set_weights = set_whole_weights


def install_layer_hook():
    """`keras.layers.Layer.__init__` tells `keras_smp.tensor` of every new
    layer (tensor parallelism converts those created in its scope).
    Idempotent; `keras_smp.tensor.layers` installs it on import."""
    import keras

    original = keras.layers.Layer.__init__
    if getattr(original, "_smp_patched", False):
        return

    # Keras' Layer.__init__ takes keywords only; Keras reads this
    # function's argspec (`(self, **kwargs)`, as the original's shape).
    @functools.wraps(original)
    def __init__(self, **kwargs):
        original(self, **kwargs)
        tensor.on_layer_created(self)

    __init__._smp_patched = True
    keras.layers.Layer.__init__ = __init__
