"""Every private Keras API (`keras.src...`) keras-smp uses, in one place.

A flat module of re-exported names: keras-smp code imports Keras
internals only from here, so a Keras upgrade that moves one breaks (and is
fixed in) this file. Add new names here rather than importing `keras.src`
elsewhere.

Checked against Keras 3.15.
"""

# pylint: disable=unused-import
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: F401

# --- used by keras_smp.pipeline (DistributedModel, StagedGraph) ------------
import contextlib  # noqa: E402
import functools  # noqa: E402
import threading  # noqa: E402
import weakref  # noqa: E402

from keras.src.backend.common import global_state  # noqa: E402
from keras.src.losses.loss import unscale_loss_for_distribution  # noqa: E402,F401
from keras.src.models import functional as functional_lib  # noqa: E402
from keras.src.models.model import functional_init_arguments  # noqa: E402,F401
from keras.src.ops import function as function_lib  # noqa: E402,F401
from keras.src.ops import node as node_lib  # noqa: E402,F401
from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: E402,F401

#: Calls a layer of a functional graph as the functional model would.
operation_fn = functional_lib.operation_fn
#: `(inputs, outputs) -> (nodes, ...)`: a functional graph's nodes in order.
build_graph_map = function_lib._build_map
#: `Function(inputs, outputs)`: runs the operations between symbolic
#: tensors on real ones (the outputs' Keras masks from the model inputs).
operations_function = function_lib.Function
#: Keras' graph node class (`keras_smp.pipeline.graph` records partitions).
Node = node_lib.Node


def functional_of(model):
    """The functional graph behind a Sequential/functional model, or None."""
    functional = getattr(model, "_functional", None) or model
    return functional if hasattr(functional, "_outputs_struct") else None


def is_subclassed_model(model):
    """Whether `model` is a subclassed `keras.Model` (its own `call`),
    rather than a Sequential or functional model (Keras' graph classes)."""
    from keras.src.models.sequential import Sequential

    return not isinstance(model, (functional_lib.Functional, Sequential))


def plain_functional(layer):
    """The functional graph behind `layer` when it is a built Sequential or
    functional model running Keras' own `call` (no subclass overriding
    it): what its call computes node by node. Otherwise None."""
    from keras.src.models.sequential import Sequential

    if type(layer).call not in (functional_lib.Functional.call,
                                Sequential.call):
        return None
    if not getattr(layer, "built", False):
        return None
    functional = functional_of(layer)
    if functional is None or (
            type(functional).call is not functional_lib.Functional.call):
        return None
    return functional


def call_context_arguments(layer):
    """The call-context arguments (`training`, ...) a functional model
    passes on to `layer` when it calls it (Keras' `operation_fn`)."""
    return set(getattr(layer, "_call_context_args", ()) or ())


def functional_structs(functional):
    """`(inputs, outputs)` structures of a functional graph."""
    return functional._inputs_struct, functional._outputs_struct


def standardize_inputs(functional, x):
    """`x` flattened in the functional model's input order."""
    return list(functional._standardize_inputs(x))


@contextlib.contextmanager
def outside_symbolic_scopes():
    """Lifts Keras' stateless/symbolic scopes for the `with` body.

    Keras may build a model inside `compute_output_spec` (a scratch graph);
    weights created there must be real ones.
    """
    names = ("stateless_scope", "symbolic_scope")
    saved = {n: global_state.get_global_attribute(n) for n in names}
    try:
        for n in names:
            global_state.set_global_attribute(n, None)
        yield
    finally:
        for n in names:
            global_state.set_global_attribute(n, saved[n])


def compiled_loss(model):
    """The callable `(y, y_pred, sample_weight) -> loss` of `compile`."""
    return getattr(model, "_compile_loss", None)


def compiled_loss_objects(model):
    """The compiled loss objects, flat (their reductions matter): once
    the compiled loss is built (Keras builds it before the first step),
    the `Loss` of each of its `(path, loss, loss_weights, name)` entries;
    before, what was given to `compile` (strings and functions: Keras'
    default `sum_over_batch_size` losses)."""
    flat = getattr(compiled_loss(model), "_flat_losses", None)
    if flat:
        return [getattr(entry, "loss", entry) for entry in flat]
    return compiled_loss_specs(model)


def compiled_loss_entries(model, y_true=None, y_pred=None):
    """`[(path, Loss)]`: each compiled loss and its output's path in the
    outputs as the compiled loss was built. Under a strategy Keras builds
    it before the first step (`_symbolic_build`); otherwise it is built
    here from `y_true` and `y_pred` (symbolic outputs do), as its first
    call would."""
    loss = compiled_loss(model)
    if loss is None:
        return []
    if getattr(loss, "_flat_losses", None) is None:
        loss.build(y_true, y_pred)
    return [(tuple(entry.path), entry.loss) for entry in loss._flat_losses]


def rewrap_compiled_losses(model, wrap):
    """Replaces, in place, the `Loss` of each entry of `model`'s built
    compiled loss by `wrap(loss, path)` (which returns `loss` to keep
    it; `path` as `compiled_loss_entries` gives it): Keras' own steps
    then call the replacements too."""
    loss = compiled_loss(model)
    flat = getattr(loss, "_flat_losses", None)
    if flat:
        loss._flat_losses = [
            entry._replace(loss=wrap(entry.loss, tuple(entry.path)))
            for entry in flat]


def loss_with_call(loss, call):
    """A shallow copy of the Keras `Loss` `loss` whose `call(y_true,
    y_pred)` is `call(loss.call, y_true, y_pred)`; `Loss.__call__` (the
    reduction, weights and masks) stays Keras'. (`copy.copy` would
    serialise the loss, which a function not registered with Keras
    cannot be.) A copy: later changes to `loss`'s own attributes (its
    `reduction`, `name`) do not reach it."""
    own = loss.call
    out = object.__new__(type(loss))
    out.__dict__.update(loss.__dict__)
    out.call = functools.partial(call, own)
    return out


def compiled_loss_replacing(model, wrap, which):
    """A copy of `model`'s compiled loss (the same per-output loss
    trackers) whose entries whose `Loss` passes `which(loss)` call
    `wrap(loss, path)` instead (`path`: as `compiled_loss_entries`
    gives it); `model` is unchanged. Keras' `CompileLoss` calls each
    entry as `loss(y, y_pred, sample_weight)` after resolving the
    output's target and weights."""
    loss = compiled_loss(model)
    out = object.__new__(type(loss))  # (Keras' copy needs its get_config)
    out.__dict__.update(loss.__dict__)
    out.__dict__["_flat_losses"] = [
        entry._replace(loss=wrap(entry.loss, tuple(entry.path)))
        if which(entry.loss) else entry for entry in loss._flat_losses]
    return out


def merged_loss_weights(loss, sample_weight, mask):
    """The sample weights Keras' `Loss.__call__` reduces with, given an
    output's `sample_weight` and Keras `mask` (either may be None; None
    when both are): the mask merged in as `apply_mask` does for
    `loss.reduction` (with `"mean_with_sample_weight"`, their product)."""
    from keras.src.losses import loss as loss_lib
    from keras import ops

    dtype = loss.dtype
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    return loss_lib.apply_mask(sample_weight, mask, dtype=dtype,
                               reduction=loss.reduction)


def loss_weights_and_mask(loss, values, y_pred, sample_weight):
    """`(values, sample weight)` as Keras' `Loss.__call__` reduces them
    (`values`: what `loss.call` returned, `y_pred` as given to the loss):
    the output's and the values' Keras masks merged into the sample
    weights (`apply_mask`, for `loss.reduction`), both brought to the
    same rank; the weights are None without weights or masks."""
    from keras.src.losses import loss as loss_lib
    from keras import ops

    in_mask = keras_mask(y_pred)
    out_mask = keras_mask(values)
    if in_mask is not None and out_mask is not None:
        mask = in_mask & out_mask
    else:
        mask = in_mask if in_mask is not None else out_mask
    values = ops.convert_to_tensor(values, dtype=loss.dtype)
    weights = merged_loss_weights(loss, sample_weight, mask)
    if weights is None:
        return values, None
    weights = ops.cast(weights, values.dtype)
    return loss_lib.squeeze_or_expand_to_same_rank(values, weights)


def label_mask(loss, y_true):
    """The Keras mask that `loss` (a compiled Keras `Loss`) attaches to
    its values and that its targets `y_true` alone decide, as a bool
    tensor of the targets' entries (its count is what Keras' mean
    reduction divides by, with the output's own mask and'ed in), or None
    for a loss that attaches none this way.

    Keras' `sparse_categorical_crossentropy` with `ignore_class` (the
    `SparseCategoricalCrossentropy(ignore_class=...)` loss) masks out the
    targets equal to it, compared in the loss's dtype as Keras compares
    them.

    Example:

    ```python
    import keras
    from keras_smp.runtime.keras_private import label_mask

    loss = keras.losses.SparseCategoricalCrossentropy(ignore_class=0)
    mask = label_mask(loss, [[3, 0, 1], [0, 0, 2]])
    assert int(keras.ops.sum(keras.ops.cast(mask, "int32"))) == 3
    assert label_mask(keras.losses.MeanSquaredError(), [[1.0]]) is None
    ```
    """
    from keras import ops
    from keras.src.losses import losses as losses_lib

    kwargs = getattr(loss, "_fn_kwargs", None) or {}
    if (getattr(loss, "fn", None)
            is not losses_lib.sparse_categorical_crossentropy
            or kwargs.get("ignore_class") is None):
        return None
    dtype = getattr(loss, "dtype", None) or "float32"
    y_true = ops.convert_to_tensor(y_true)
    if len(y_true.shape) >= 2 and y_true.shape[-1] == 1:
        # Keras squeezes class ids of shape (..., 1) against predictions
        # of shape (..., classes).
        y_true = ops.squeeze(y_true, axis=-1)
    return ops.not_equal(ops.cast(y_true, dtype),
                         ops.cast(kwargs["ignore_class"], dtype))


def masks_by_labels(loss):
    """Whether `label_mask` gives `loss` (a compiled Keras `Loss`) a mask."""
    from keras.src.losses import losses as losses_lib

    kwargs = getattr(loss, "_fn_kwargs", None) or {}
    return (getattr(loss, "fn", None)
            is losses_lib.sparse_categorical_crossentropy
            and kwargs.get("ignore_class") is not None)


def compiled_loss_targets(model, y_true, y_pred):
    """`{path: target}`: the targets Keras' compiled loss of `model` gives
    the loss at each path of `compiled_loss_entries`, for the step's
    `y_true` and outputs `y_pred` (any leaves in the outputs' structure:
    only their layout is read). Resolved by Keras' own `CompileLoss.call`
    on a copy whose losses only record their targets: nothing computed,
    no loss tracker updated."""
    from keras import ops

    loss = compiled_loss(model)
    if loss is None:
        return {}
    compiled_loss_entries(model, y_true, y_pred)  # built
    seen = {}

    def recorder(path):
        def record(y_t, y_p, sample_weight=None):
            seen[path] = y_t
            return ops.zeros((), dtype=loss.dtype)
        return record

    out = object.__new__(type(loss))
    out.__dict__.update(loss.__dict__)
    out.__dict__["_flat_losses"] = [
        entry._replace(loss=recorder(tuple(entry.path)))
        for entry in loss._flat_losses]
    # (one tracker per loss: Keras zips the losses with its trackers)
    out.__dict__["_metrics"] = [_NoTracker()] * len(loss._flat_losses)
    out.call(y_true, y_pred)
    return seen


class _NoTracker:
    """Stands in for a compiled loss's per-output loss tracker."""

    def update_state(self, *args, **kwargs):
        pass


def merged_masks(mask, labels):
    """The mask Keras' `Loss.__call__` reduces with, from the output's
    Keras `mask` and the loss's `label_mask` `labels` (either may be
    None): their conjunction, the labels laid out as the mask (Keras
    reshapes them to the values' shape); None when both are."""
    import tensorflow as tf

    if mask is None or labels is None:
        return mask if labels is None else tf.cast(labels, tf.bool)
    mask = tf.cast(mask, tf.bool)
    return mask & tf.reshape(tf.cast(labels, tf.bool), tf.shape(mask))


def counted_entries(mask, labels):
    """The number (float32) of entries a mean loss divides by under the
    output's Keras `mask` and its `label_mask` `labels` (either may be
    None, not both): `merged_masks`' unmasked entries."""
    import tensorflow as tf

    return tf.reduce_sum(tf.cast(merged_masks(mask, labels), tf.float32))


def compiled_loss_layout(model, outputs):
    """The structure the compiled loss looks each output up in (by the
    paths of `compiled_loss_entries`): the outputs' (`outputs`, any
    leaves) or, when they differ, the one it was built with (a list of
    outputs with losses keyed by name: a dict)."""
    import keras

    built = getattr(compiled_loss(model), "_y_pred_build_structure", None)
    if built is None:
        return outputs
    try:
        keras.tree.assert_same_structure(built, outputs)
        return outputs
    except ValueError:
        return built


def compiled_loss_output_index(model, outputs, n):
    """`{path: flat output index}` of `compiled_loss_entries`' paths, as
    the compiled loss repacks the model's outputs (`outputs`: their
    structure, `n` leaves)."""
    import keras

    ours = keras.tree.pack_sequence_as(outputs, list(range(n)))
    layout = compiled_loss_layout(model, ours)
    if layout is not ours:
        ours = keras.tree.pack_sequence_as(layout, keras.tree.flatten(ours))
    return {path: resolve_path(path, ours)
            for path, _ in compiled_loss_entries(model)}


def resolve_path(path, structure):
    """`structure[path[0]][path[1]]...`, as the compiled loss finds an
    output's target and sample weights."""
    for key in path:
        structure = structure[key]
    return structure


def compiled_loss_specs(model):
    """The losses given to `compile`, flattened over outputs (strings,
    functions or `Loss` objects; known before the first step builds
    them)."""
    import keras

    given = getattr(compiled_loss(model), "_user_loss", None)
    return [x for x in keras.tree.flatten(given) if x is not None] \
        if given is not None else []


def outputs_with_loss(model, outputs):
    """Per flattened model output (`outputs`: the outputs' structure),
    whether the compiled loss uses it: `False` for an output that a dict
    of losses leaves out or maps to `None` (or a list of losses maps to
    `None`), all `False` without a compiled loss, all `True` for other
    structures (Keras resolves those at the first step)."""
    import keras

    flat = keras.tree.flatten(outputs)
    loss = compiled_loss(model)
    if loss is None:
        return [False] * len(flat)
    given = getattr(loss, "_user_loss", None)
    if isinstance(given, dict) and isinstance(outputs, dict) and not any(
            keras.tree.is_nested(v) for v in outputs.values()):
        keys = keras.tree.flatten({k: k for k in outputs})  # flat order
        return [given.get(k) is not None for k in keys]
    names = list(getattr(getattr(model, "inner_model", None) or model,
                         "output_names", None) or [])
    if (isinstance(given, dict) and isinstance(outputs, (list, tuple))
            and len(names) == len(flat) == len(outputs)
            and set(names) == set(given)):
        # A list of outputs, the losses keyed by output layer name.
        return [given[n] is not None for n in names]
    if (isinstance(given, (list, tuple)) and isinstance(outputs, (list, tuple))
            and len(given) == len(flat) == len(outputs)
            and not any(keras.tree.is_nested(g) for g in given)):
        return [g is not None for g in given]
    return [True] * len(flat)


def loss_output_trackers(model):
    """The per-output loss `Mean` metrics the compiled loss updates when it
    runs ("cls_loss", ...: models with several outputs), or []."""
    loss = compiled_loss(model)
    return list(getattr(loss, "metrics", None) or []) if loss else []


def compile_arguments(model):
    """Keyword arguments of `compile` that compile another model as `model`
    is compiled: its own optimizer object (a `LossScaleOptimizer` if
    Keras wrapped it, so `auto_scale_loss=False`), or `None` when it is
    not compiled."""
    config = getattr(model, "_compile_config", None)
    if not getattr(model, "compiled", False) or config is None:
        return None
    return dict(config.config, optimizer=model.optimizer,
                auto_scale_loss=False)


def hand_over_compile(model):
    """Leaves `model` uncompiled after another model took its compile
    (`compile_arguments`, a `DistributedModel` wrapping it): the optimizer
    then belongs to one model only. Keras saves an object two models hold
    once, at the first path it walks (sorted attribute names:
    `inner_model/optimizer` before `optimizer`), so the wrapper's own
    `optimizer` path held nothing and `keras.models.load_model` dropped
    the optimizer state ("Skipping variable loading for optimizer")."""
    model.optimizer = None
    model.compiled = False


def compiled_metrics(model):
    """The compiled metrics container, or None."""
    return getattr(model, "_compile_metrics", None)


def compiled_metric_specs(model):
    """The metrics given to `compile` (`metrics` and `weighted_metrics`),
    flattened over outputs: strings, functions or `Metric` objects."""
    import keras

    container = compiled_metrics(model)
    specs = []
    for attr in ("_user_metrics", "_user_weighted_metrics"):
        given = getattr(container, attr, None)
        if given is not None:
            specs.extend(keras.tree.flatten(given))
    return [m for m in specs if m is not None]


def loss_tracker(model):
    """The `Mean` metric Keras reports as "loss"."""
    return model._loss_tracker


def regularization_losses(model):
    """Weight-regularization losses of every layer."""
    return model._get_regularization_losses()


def flatten_layers(model):
    """`model` and every layer inside it (Keras' own walk)."""
    return list(model._flatten_layers())


def effective_training(training):
    """`training` as a layer called now takes it: the value given, else
    the enclosing Keras call context's (`None`: neither sets it)."""
    if training is not None:
        return training
    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.training


@contextlib.contextmanager
def call_context(entry, training=None):
    """Layers called in the body run as inside `entry`'s own call: in one
    Keras call context, so their `add_loss()` losses accumulate (a layer
    called alone is its call's entry and clears its previous losses) and
    they inherit `training`, as inside a functional model's `call`. An
    enclosing call context is kept as it is."""
    from keras.src.layers.layer import CallContext

    if global_state.get_global_attribute("current_call_ctx") is not None:
        yield
        return
    context = CallContext(entry_layer=entry)
    if training is not None:
        context.set_value("training", training)
    with _current_call_context(context):
        yield


@contextlib.contextmanager
def training_context(training):
    """Layers called in the body get `training` from a fresh Keras call
    context (as inside a model's `call` run with that `training`), unless
    given one; the enclosing context is restored after."""
    from keras.src.layers.layer import CallContext

    context = CallContext(entry_layer=None)
    context.set_value("training", training)
    with _current_call_context(context):
        yield


@contextlib.contextmanager
def _current_call_context(context):
    """Keras' current call context is `context` for the body."""
    before = global_state.get_global_attribute("current_call_ctx")
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", before)


@contextlib.contextmanager
def graph_nodes_kept(layers):
    """Symbolic calls of `layers` in the body leave no graph nodes on them
    (their inbound and outbound node lists are cut back after): traces
    made only to be compared."""
    kept = [(layer, len(layer._inbound_nodes), len(layer._outbound_nodes))
            for layer in layers]
    try:
        yield
    finally:
        for layer, inbound, outbound in kept:
            del layer._inbound_nodes[inbound:]
            del layer._outbound_nodes[outbound:]


def clear_added_losses(layers):
    """Forgets the `add_loss()` losses of `layers` (their last call's);
    operations that are not layers (`keras.ops` nodes) have none."""
    for layer in layers:
        if hasattr(layer, "_clear_losses"):
            layer._clear_losses()


def added_losses(layers):
    """Losses `layers` added with `add_loss()` (activity regularizers
    included) since `clear_added_losses`, each once; inside a Keras
    `StatelessScope(collect_losses=True)`, those of its calls."""
    out, seen = [], set()
    for layer in layers:
        if not hasattr(layer, "_get_own_losses"):
            continue
        for loss in layer._get_own_losses():
            if id(loss) not in seen:
                seen.add(id(loss))
                out.append(loss)
    return out


def may_add_losses(layers):
    """Whether any of `layers` may add a loss when called: an activity
    regularizer, or a class outside Keras whose methods call `add_loss`
    (read from their code, not run). The same answer on every stage
    process, which all hold every layer."""
    for layer in layers:
        if getattr(layer, "activity_regularizer", None) is not None:
            return True
        if calls_add_loss(type(layer)):
            return True
    return False


def calls_add_loss(cls):
    """Whether a method of `cls` or of a base class outside Keras and
    TensorFlow calls `add_loss` (a name in its code)."""
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in (
                "keras", "tensorflow", "keras_smp", "builtins"):
            continue
        for attr in vars(base).values():
            fn = getattr(attr, "__func__", attr)
            # Through decorators (functools.wraps, tf.function).
            for _ in range(8):
                inner = (getattr(fn, "__wrapped__", None)
                         or getattr(fn, "python_function", None))
                if inner is None:
                    break
                fn = inner
            code = getattr(fn, "__code__", None)
            if code is not None and _names_add_loss(code):
                return True
    return False


def _names_add_loss(code):
    if "add_loss" in code.co_names:
        return True
    return any(_names_add_loss(c) for c in code.co_consts
               if hasattr(c, "co_names"))


def weight_regularization_count(model):
    """How many of `model.losses` are weight regularizers' (Keras lists
    them last, one per regularized trainable weight)."""
    if getattr(model, "_losses_override", None):
        return 0
    return sum(1 for v in model.trainable_weights
               if getattr(v, "regularizer", None) is not None)


def aggregate_additional_loss(model, loss):
    """An additional loss summed and cast as Keras does."""
    return model._aggregate_additional_loss(loss)


def loss_scale_after_finite_step(optimizer):
    """A `LossScaleOptimizer`'s update of its scale after a finite step,
    without gradients to apply (a pipeline stage with nothing to train)."""
    optimizer._stateful_handle_finite_grads([], [])


def loss_scale_after_non_finite_step(optimizer):
    """A `LossScaleOptimizer`'s update of its scale after a skipped step."""
    optimizer._stateful_handle_non_finite_grads()


def python_scalars_of_distributed_variables():
    """Makes `float(v)` and `int(v)` of a scalar Keras variable that a
    `tf.distribute` strategy holds (its `value` a `MirroredVariable`:
    an optimizer's `learning_rate` and `iterations` under an
    `SMPStrategy`) return its value, as they do on one device (idempotent;
    checked against `keras.src.backend.common.variables.Variable`'s
    `__float__` and `__int__`).

    Keras converts `float(self.value)`, which TensorFlow's distributed
    variables do not support ("float() argument must be a string or a
    real number, not 'MirroredVariable'"): a callback logging
    `float(self.model.optimizer.learning_rate)` failed under any
    strategy. Read eagerly, as `v.numpy()` reads it (a graph being traced
    keeps Keras' own behaviour, as does a variable of more dimensions).
    """
    import tensorflow as tf
    from keras.src.backend.common import variables

    cls = variables.Variable
    for name, convert in (("__float__", float), ("__int__", int)):
        original = getattr(cls, name)
        if getattr(original, "_smp_patched", False):
            continue

        def scalar(self, original=original, convert=convert):
            if (self.ndim == 0 and tf.executing_eagerly()
                    and isinstance(self.value,
                                   tf.distribute.DistributedValues)):
                return convert(self.numpy())
            return original(self)

        scalar = functools.wraps(original)(scalar)
        scalar._smp_patched = True
        setattr(cls, name, scalar)


def loss_scale_read_when_applied():
    """Makes a `LossScaleOptimizer` not built yet scale losses by its scale
    variable, not by the number `initial_scale` (idempotent; checked
    against `LossScaleOptimizer.scale_loss` and `build`).

    Keras builds the optimizer at its first `apply`. Its `scale_loss`
    before that multiplies by `initial_scale`, a constant: in a step
    traced once (`@tf.function`, `@smp.step`) before the optimizer is
    built, as an SMP custom loop's first step is (the model's weights
    are made in it), every later step would scale by that constant while
    `apply` unscales by the current scale, which halves at each skipped
    step. Here the first `scale_loss` makes the two variables Keras'
    `build` would make (`step_counter`, `dynamic_scale`, the same
    specification, outside any graph being traced), and `build` then
    takes them instead of making them again, so the optimizer's variables
    and their order are Keras' own. Not in a replica function
    (`strategy.run`), where Keras' own `scale_loss` runs.
    """
    import tensorflow as tf
    from keras.src import initializers
    from keras.src import ops
    from keras.src.optimizers import loss_scale_optimizer

    cls = loss_scale_optimizer.LossScaleOptimizer
    if getattr(cls.scale_loss, "_smp_patched", False):
        return
    original_scale, original_build = cls.scale_loss, cls.build

    def scale_variables(self):
        early = self.__dict__.get("_smp_early_scale")
        if early is None:
            with tf.init_scope():
                early = {
                    "step_counter": self.add_variable(
                        shape=(), dtype="int",
                        initializer=initializers.Zeros(),
                        aggregation="none", name="step_counter"),
                    "dynamic_scale": self.add_variable(
                        shape=(), dtype="float32",
                        initializer=initializers.Constant(
                            self.initial_scale),
                        aggregation="none", name="dynamic_scale")}
            object.__setattr__(self, "_smp_early_scale", early)
            for name, variable in early.items():  # (as `build` sets them)
                object.__setattr__(self, name, variable)
        return early

    def scale_loss(self, loss):
        if self.built or (tf.distribute.has_strategy()
                          and not tf.distribute.in_cross_replica_context()):
            # (In a replica function, as Keras does: a replica thread's
            # `init_scope` would leave the strategy's scope.)
            return original_scale(self, loss)
        return ops.multiply(loss, scale_variables(self)["dynamic_scale"])

    def build(self, var_list):
        early = dict(self.__dict__.pop("_smp_early_scale", None) or {})
        if not early:
            return original_build(self, var_list)

        def add_variable(shape, initializer="zeros", dtype=None,
                         aggregation="none", layout=None, name=None):
            if name in early:  # made ahead by `scale_loss`
                return early.pop(name)
            return type(self).add_variable(
                self, shape, initializer=initializer, dtype=dtype,
                aggregation=aggregation, layout=layout, name=name)

        object.__setattr__(self, "add_variable", add_variable)
        try:
            return original_build(self, var_list)
        finally:
            object.__delattr__(self, "add_variable")

    scale_loss._smp_patched = True
    cls.scale_loss = functools.wraps(original_scale)(scale_loss)
    cls.build = functools.wraps(original_build)(build)


def loss_scale_apply_in_cross_replica_context(optimizer, grads,
                                              trainable_variables):
    """A `LossScaleOptimizer`'s `apply` where its TensorFlow path refuses
    to run ("apply() must be called in a replica context"): outside
    `strategy.run` under a current strategy, as an SMP custom loop applies
    its gradients. Checks the gradients (`check_finite`), then unscales
    and applies them or skips the step, updating the scale, as Keras'
    other backends do (`_common_apply`)."""
    from keras.src import backend

    if not optimizer.built:
        with backend.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(trainable_variables)
        optimizer.built = True
    optimizer._common_apply(grads, trainable_variables)


# The private steps of `keras.optimizers.Optimizer.apply` (TensorFlow
# backend) that keras-smp wraps, by role.
_OPTIMIZER_STEPS = {
    "apply_gradients": "_backend_apply_gradients",  # clip, then update
    "all_reduce": "_all_reduce_sum_gradients",       # in the update step
    "clip": "_clip_gradients",
}


def optimizer_strategy(optimizer):
    """The `tf.distribute.Strategy` an optimizer was created under."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_step_wrapped():
    """Whether `wrap_optimizer_step` has run in this process."""
    import keras

    return getattr(keras.optimizers.Optimizer._backend_apply_gradients,
                   "_smp_wrapped", False)


def wrap_optimizer_step(apply_gradients, all_reduce, clip, check_finite):
    """Replaces the optimizer's private steps by `wrap(original)` each
    (`check_finite`: `LossScaleOptimizer.check_finite`'s)."""
    import functools

    import keras

    targets = [(keras.optimizers.Optimizer, _OPTIMIZER_STEPS[role], wrap)
               for role, wrap in (("apply_gradients", apply_gradients),
                                  ("all_reduce", all_reduce),
                                  ("clip", clip))]
    targets.append((keras.optimizers.LossScaleOptimizer, "check_finite",
                    check_finite))
    for cls, name, wrap in targets:
        original = getattr(cls, name)
        wrapped = functools.wraps(original)(wrap(original))
        wrapped._smp_wrapped = True
        setattr(cls, name, wrapped)


# --- used by keras_smp.pipeline.model (the wrapped model's names) -----------

def model_class_names():
    """Every attribute name of Keras' model classes: `keras.Model`,
    `keras.Sequential` and the functional model class."""
    import keras
    from keras.src.models.functional import Functional

    return frozenset(set(dir(keras.Model)) | set(dir(keras.Sequential))
                     | set(dir(Functional)))


# --- used by keras_smp.runtime.patches (deferred layer weights) -------------

def in_stateless_scope():
    """Whether Keras is tracing symbolically (`compute_output_spec`):
    variables are read for their shapes only."""
    from keras.src.backend.common.stateless_scope import (
        in_stateless_scope as active)

    return active()


def wrap_variable_value(wrap):
    """Replaces the `value` property of Keras variables by
    `wrap(original_getter)` (TensorFlow backend)."""
    from keras.src.backend.common import variables

    cls = variables.Variable
    original = cls.value.fget
    if getattr(original, "_smp_wrapped", False):
        return
    getter = wrap(original)
    getter._smp_wrapped = True
    cls.value = property(getter, doc=cls.value.__doc__)


def _wrap_method(cls, name, wrap):
    """Replaces `cls.<name>` by `wrap(original)`, once."""
    original = getattr(cls, name)
    if getattr(original, "_smp_wrapped", False):
        return
    wrapped = wrap(original)
    wrapped._smp_wrapped = True
    setattr(cls, name, wrapped)


def wrap_layer_build(wrap):
    """Replaces `Layer._maybe_build` (what a layer's first call runs to
    build it) by `wrap(original)`."""
    from keras.src.layers.layer import Layer

    _wrap_method(Layer, "_maybe_build", wrap)


def autocast_value(variable, value):
    """`value` cast as reading `variable` would be (mixed precision)."""
    return variable._maybe_autocast(value)


def stateless_value(variable):
    """The value a Keras stateless scope maps `variable` to, or None."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    return None if scope is None else scope.get_current_value(variable)


def stateless_assigned(scope):
    """The ids of the variables a Keras `StatelessScope` holds values for:
    those it was given and those assigned inside it."""
    return set(scope.state_mapping)


def wrap_variable_direct_assign(wrap):
    """Replaces `_direct_assign(value)` of Keras variables (TensorFlow
    backend: where `assign` writes the storage) by `wrap(original)`."""
    from keras.src.backend.tensorflow.core import Variable

    _wrap_method(Variable, "_direct_assign", wrap)


# --- used by keras_smp.pipeline.shards (sharded checkpoints) ---------------
from keras.src.saving import saving_lib as _saving_lib  # noqa: E402

#: The base class of Keras' weight stores (`_save_state` / `_load_state`
#: accept only its subclasses).
H5IOStore = _saving_lib.H5IOStore


def save_state(saveable, store, inner_path, visited, assets_store=None):
    """Walks `saveable` as `save_weights` does, writing into `store` (and
    layers' assets, such as lookup vocabularies, into `assets_store`).

    Optimizers store their variables themselves, not `variable.numpy()`
    copies as Keras' `save_own_variables` does (same keys): the store sees
    which variable each value is, and nothing is copied yet.
    """
    def save_own_variables(self, store):
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable

    original = BaseOptimizer.save_own_variables
    BaseOptimizer.save_own_variables = save_own_variables
    try:
        _saving_lib._save_state(saveable, weights_store=store,
                                assets_store=assets_store,
                                inner_path=inner_path,
                                visited_saveables=visited)
    finally:
        BaseOptimizer.save_own_variables = original


def load_state(saveable, store, inner_path, visited, skip_mismatch=False):
    """Walks `saveable` as `load_weights` does, reading from `store`.

    Raises Keras' own error naming the objects that could not be loaded
    (a warning with `skip_mismatch`)."""
    failed, errors = set(), {}
    _saving_lib._load_state(
        saveable, weights_store=store, assets_store=None,
        inner_path=inner_path, skip_mismatch=skip_mismatch,
        visited_saveables=visited, failed_saveables=failed,
        error_msgs=errors)
    if failed:
        _saving_lib._raise_loading_failure(errors, warn_only=skip_mismatch)


# --- used by keras_smp.pipeline.step (activation checkpointing) -------------

def global_seed_state():
    """The state variable of Keras' global seed generator (what unseeded
    `keras.random.*` calls draw from), or None while it does not exist
    (this does not create it)."""
    from keras.src.random import seed_generator

    gen = global_state.get_global_attribute(
        seed_generator.GLOBAL_SEED_GENERATOR)
    return None if gen is None else gen.state


#: Names inside a `.keras` archive (Keras' `saving_lib`).
KERAS_CONFIG, KERAS_METADATA, KERAS_WEIGHTS, KERAS_ASSETS = (
    _saving_lib._CONFIG_FILENAME, _saving_lib._METADATA_FILENAME,
    _saving_lib._VARS_FNAME_H5, _saving_lib._ASSETS_DIRNAME)


def assets_store(archive):
    """Keras' store writing layers' assets into the `.keras` zip `archive`
    (close it before the archive)."""
    return _saving_lib.DiskIOStore(KERAS_ASSETS, archive=archive, mode="w")


def wrap_save_model(wrapper):
    """Replaces `keras.src.saving.saving_lib.save_model` (what `Model.save`
    and `keras.saving.save_model` write `.keras` files with) by
    `wrapper(original, model, filepath, *args, **kwargs)`."""
    original = _saving_lib.save_model
    if getattr(original, "_smp_wrapped", False):
        return

    @functools.wraps(original)
    def save_model(model, filepath, *args, **kwargs):
        return wrapper(original, model, filepath, *args, **kwargs)

    save_model._smp_wrapped = True
    _saving_lib.save_model = save_model


def wrap_ema_swaps(wrapper):
    """Replaces `keras.callbacks.SwapEMAWeights._apply_to_ema_optimizers`
    (through which the callback swaps the weights with their moving
    averages, and copies them at the end of `fit`) by
    `wrapper(original, callback, tf_fn, backend_fn)`."""
    import keras

    cls = keras.callbacks.SwapEMAWeights
    original = cls._apply_to_ema_optimizers
    if getattr(original, "_smp_wrapped", False):
        return

    @functools.wraps(original)
    def _apply_to_ema_optimizers(self, tf_fn, backend_fn):
        return wrapper(original, self, tf_fn, backend_fn)

    _apply_to_ema_optimizers._smp_wrapped = True
    cls._apply_to_ema_optimizers = _apply_to_ema_optimizers


def is_multi_optimizer(optimizer):
    """Whether `optimizer` is a `keras.optimizers.MultiOptimizer`."""
    from keras.src.optimizers import multi_optimizer

    return isinstance(optimizer, multi_optimizer.MultiOptimizer)


@contextlib.contextmanager
def choosing_sub_optimizers(optimizer, hook):
    """For the body, calls `hook(sub_optimizer)` with each optimizer a
    `MultiOptimizer`'s map or selector function picks for a variable (its
    `build` picks them, a selector function may make new ones there);
    the map itself is put back after (its `get_config` serializes it)."""
    chooser = optimizer._optimizer_map

    def choose(variable):
        sub = chooser(variable)
        hook(sub)
        return sub

    object.__setattr__(optimizer, "_optimizer_map", choose)
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_optimizer_map", chooser)


def per_weight_state(optimizer):
    """`{id(optimizer variable): model weight}` for optimizer state Keras
    makes per weight with `add_variable` rather than
    `add_variable_from_reference`: `Adafactor`'s factored accumulators
    (`_r`, `_c`, in the order of the weights it was built for), also
    inside a `LossScaleOptimizer` or a `MultiOptimizer`."""
    import keras

    found = {}
    pending = [optimizer]
    while pending:
        target = pending.pop()
        if target is None:
            continue
        pending.append(getattr(target, "inner_optimizer", None))
        if is_multi_optimizer(target):
            pending.extend(target.optimizers)
        if isinstance(target, keras.optimizers.Adafactor) and target.built:
            for weight, r, c in zip(target._trainable_variables,
                                    target._r, target._c):
                for state in (r, c):
                    if state is not None:
                        found[id(state)] = weight
    return found


def sub_optimizer_indices(optimizer):
    """`{variable key: index into optimizer.optimizers}` of a built
    `MultiOptimizer`, and the key function (`optimizer._var_key`)."""
    return dict(optimizer._var_to_optimizer_idx), optimizer._var_key


def wrap_tensorboard_weights(wrapper):
    """Replaces `keras.callbacks.TensorBoard._log_weights` (the weight
    histograms and images written every `histogram_freq` epochs, read
    from `model.layers`' weights) by `wrapper(original, callback, epoch)`."""
    import keras

    def wrap(original):
        def _log_weights(self, epoch):
            return wrapper(original, self, epoch)
        return _log_weights

    _wrap_once(keras.callbacks.TensorBoard, "_log_weights", wrap)


def is_remote_path(path):
    """Whether Keras treats `path` as remote (`gs://`, `hf://`, ...)."""
    from keras.src.utils import file_utils

    return (str(path).startswith("hf://")
            or bool(file_utils.is_remote_path(path)))


def keras_mask(tensor):
    """The Keras mask a layer attached to `tensor`, or None."""
    from keras.src.backend.common import masking

    return masking.get_keras_mask(tensor)


def producer_of(tensor):
    """The layer (operation) whose call made a symbolic `KerasTensor`, or
    None."""
    history = getattr(tensor, "_keras_history", None)
    return getattr(history, "operation", None)


def producing_node(tensor):
    """The graph node (one call of a layer) that made a symbolic
    `KerasTensor`, or None."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None
    return history.operation._inbound_nodes[history.node_index]


def is_variable(value):
    """Whether `value` is a Keras variable (a weight)."""
    from keras.src.backend.common.variables import Variable

    return isinstance(value, Variable)


def own_variables(layer):
    """The variables `layer` made itself (`add_weight` on it, its own
    `SeedGenerator`s), not those of the layers it holds."""
    return (list(layer._trainable_variables)
            + list(layer._non_trainable_variables)
            + [g.state for g in layer._seed_generators])


def implements_call(model):
    """Whether `model`'s class has a `call` (Keras' `Model.call` raises
    NotImplementedError: a model whose custom steps call only its parts,
    such as a GAN's)."""
    import keras

    return type(model).call not in (keras.Model.call,
                                    keras.layers.Layer.call)


def overrides_build(layer):
    """Whether `layer`'s class writes its own `build` (Keras' default one
    of a subclassed model builds nothing)."""
    import keras

    return type(layer).build not in (keras.Model.build,
                                     keras.layers.Layer.build)


def record_build_shapes(layer, input_shape):
    """Records `input_shape` as what `layer` was built for, as Keras'
    `build` does (its `get_build_config`, which `.keras` files keep)."""
    layer._build_shapes_dict = {"input_shape": input_shape}


def consumers(layer):
    """How many calls of other layers take one of `layer`'s outputs (its
    outbound nodes in the functional graphs built so far)."""
    return len(layer._outbound_nodes)


def set_keras_mask(tensor, mask):
    """Attaches a Keras mask to `tensor` (as a layer's call does)."""
    from keras.src.backend.common import masking

    masking.set_keras_mask(tensor, mask)


def model_json(model):
    """`(config.json, metadata.json)` texts of a `.keras` file for `model`
    (its architecture only: no weight is read)."""
    return _saving_lib._serialize_model_as_json(model)


def backing_variable(variable):
    """The TensorFlow variable behind a Keras variable (under a strategy,
    its distributed variable), or `variable` itself."""
    return getattr(variable, "_value", variable)


def in_symbolic_scope():
    """Whether Keras is tracing for shapes only (`compute_output_spec`,
    building a functional model): values computed now are never used."""
    from keras.src.backend.common.symbolic_scope import (
        in_symbolic_scope as symbolic)

    return symbolic()


def initialize_within(variable, context):
    """If Keras deferred making `variable`'s storage (a weight added in a
    stateless scope: a layer built by tracing its `call`), makes it
    inside `context()` when Keras does."""
    if getattr(variable, "_value", None) is not None:
        return
    original = variable._deferred_initialize

    def deferred_initialize():
        with context():
            return original()

    object.__setattr__(variable, "_deferred_initialize", deferred_initialize)


def sublayers(layer):
    """The layers `layer` holds directly (a custom layer's attributes)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def epoch_dataset_spec(epoch_iterator):
    """The `element_spec` of the (distributed) dataset a Keras TensorFlow
    `EpochIterator` feeds `fit`/`evaluate` from, or `None` where it holds
    none (checked against `TFEpochIterator._distributed_dataset`)."""
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    return getattr(dataset, "element_spec", None)


def on_epoch_iterator(hook):
    """Calls `hook(iterator)` right after Keras' TensorFlow trainer makes
    an `EpochIterator` (for `fit`'s data, `fit`'s validation data,
    `evaluate`, `predict`), before any step runs (idempotent; checked
    against `TFEpochIterator.__init__`)."""
    from keras.src.backend.tensorflow import trainer as trainer_lib

    def wrap(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            hook(self)
        return __init__

    _wrap_once(trainer_lib.TFEpochIterator, "__init__", wrap)


# `gradient_share()` of `on_loss_scaling`: this replica's weight in the
# step's gradients, or None.
_gradient_share = [lambda: None]


def on_loss_scaling(keeps_value, unscaled=lambda: False,
                    gradient_share=lambda: None, shares_weighed=lambda: True):
    """Where `keeps_value()` holds (checked as a step is traced), Keras'
    `scale_loss_for_distribution` (a mean loss divided by the replicas in
    sync, so that their gradients sum to the batch's) keeps the loss's
    value and scales only its gradient (`kept_loss`), and
    `unscale_loss_for_distribution` (what Keras logs a loss with) leaves
    such a kept value as it is, and multiplies any other as Keras does; a
    loss reduced by `"sum"` (which Keras never scales: the replicas' sums
    add up to the batch's) keeps its value times the replicas (idempotent;
    checked against `keras.src.losses.loss`, whose functions Keras'
    losses, compile utilities and trainer look up at call time). Where
    `unscaled()` holds, neither scales (a loss's value and gradient stay
    the one device's). Where `gradient_share()` gives a scalar tensor (the
    replica's weight, by which its step's gradients are multiplied before
    the replicas' sum), a kept loss's gradient is divided by it, so that
    the loss's gradient is the one it had; except a mean loss computed
    where `shares_weighed()` does not hold (a loss object called in a
    model's own step, not inside `compute_loss`, which weighs each
    replica's losses by its share): it keeps its value and gradient, as
    a loss computed by hand does, both weighed by the share."""
    from keras.src.losses import loss as loss_module

    _gradient_share[0] = gradient_share

    def wrap_scale(original):
        def scale_loss_for_distribution(value):
            if unscaled():
                return value
            scaled = original(value)
            if scaled is value or not keeps_value():
                return scaled
            if gradient_share() is not None and not shares_weighed():
                return value
            return kept_loss(value, scaled)
        return scale_loss_for_distribution

    def wrap_unscale(original):
        def unscale_loss_for_distribution(value):
            if unscaled() or keeps_value() and _is_kept(value):
                return value
            return original(value)
        return unscale_loss_for_distribution

    def wrap_reduce(original):
        def reduce_values(values, sample_weight=None,
                          reduction="sum_over_batch_size"):
            out = original(values, sample_weight, reduction)
            if (reduction != "sum" or out is values or not keeps_value()
                    or unscaled()):
                return out
            import tensorflow as tf

            # A sum (Keras leaves it unscaled: the replicas' parts sum to
            # the batch's): its value times the replicas, as a mean's.
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            if replicas < 2:
                return out
            return kept_loss(out * tf.cast(replicas, out.dtype), out)
        return reduce_values

    _wrap_once(loss_module, "scale_loss_for_distribution", wrap_scale)
    _wrap_once(loss_module, "unscale_loss_for_distribution", wrap_unscale)
    _wrap_once(loss_module, "reduce_values", wrap_reduce)


# The loss values `kept_loss` made, per graph (`Tensor.ref()`s).
_kept_losses = weakref.WeakKeyDictionary()


def kept_loss(value, part):
    """A loss with the value of `value` and the gradient of `part` (a
    replica's part of it: `value` divided by the replicas; divided by
    `on_loss_scaling`'s `gradient_share()` too, where it gives one),
    marked so that Keras' unscaling leaves it (`on_loss_scaling`)."""
    import tensorflow as tf

    share = _gradient_share[0]()
    if share is not None:
        part = tf.math.divide_no_nan(part, tf.cast(share, part.dtype))
    out = part + tf.stop_gradient(value - part)
    graph = getattr(out, "graph", None)
    if graph is not None:
        _kept_losses.setdefault(graph, set()).add(out.ref())
    return out


def _is_kept(value):
    graph = getattr(value, "graph", None)
    kept = _kept_losses.get(graph, ()) if graph is not None else ()
    while True:
        if hasattr(value, "ref") and value.ref() in kept:
            return True
        op = getattr(value, "op", None)
        if op is None or op.type not in ("Cast", "Identity"):
            return False
        value = op.inputs[0]  # (Keras casts a loss to its dtype)


def before_unbuilt_optimizer_applies(hook):
    """Calls `hook(optimizer, trainable_variables)` as a Keras optimizer
    not built yet is applied with `trainable_variables` (Keras' `apply`
    then builds it on them, where it runs; a hook that builds it leaves
    that out) (idempotent; checked against `BaseOptimizer.apply`,
    `LossScaleOptimizer.apply` and `MultiOptimizer.apply`)."""
    from keras.src.optimizers import base_optimizer
    from keras.src.optimizers import loss_scale_optimizer
    from keras.src.optimizers import multi_optimizer

    def wrap(original):
        def apply(self, grads, trainable_variables=None):
            if trainable_variables is not None and not self.built:
                trainable_variables = list(trainable_variables)
                hook(self, trainable_variables)
            return original(self, grads, trainable_variables)
        return apply

    _wrap_once(base_optimizer.BaseOptimizer, "apply", wrap)
    _wrap_once(loss_scale_optimizer.LossScaleOptimizer, "apply", wrap)
    _wrap_once(multi_optimizer.MultiOptimizer, "apply", wrap)


def _wrap_once(cls, name, wrap, marker="_smp_patched"):
    """Replaces `cls.name` by `wrap(original)` unless already replaced
    (by a wrapper carrying `marker`)."""
    original = getattr(cls, name)
    if getattr(original, marker, False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    setattr(wrapped, marker, True)
    setattr(cls, name, wrapped)


def on_optimizer_apply(transform):
    """Keras optimizers' `apply(grads, trainable_variables)` runs inside
    `with transform(optimizer, grads) as new:` (`grads` a list, `None`s
    kept) and applies `new` instead of `grads`, in the caller's thread,
    before a `LossScaleOptimizer` or a
    `MultiOptimizer` hands them on (a `LossScaleOptimizer` under a
    `tf.distribute` strategy runs its inner optimizer's `apply` in other
    threads, through `merge_call`) (idempotent; checked against
    `BaseOptimizer.apply`, `LossScaleOptimizer.apply` and
    `MultiOptimizer.apply`)."""
    from keras.src.optimizers import base_optimizer
    from keras.src.optimizers import loss_scale_optimizer
    from keras.src.optimizers import multi_optimizer

    def wrap(original):
        def apply(self, grads, trainable_variables=None):
            with transform(self, list(grads)) as new:
                return original(self, new, trainable_variables)
        return apply

    for cls in (base_optimizer.BaseOptimizer,
                loss_scale_optimizer.LossScaleOptimizer,
                multi_optimizer.MultiOptimizer):
        _wrap_once(cls, "apply", wrap, marker="_smp_transforms")


def on_array_dataset(hook):
    """Calls `hook(shuffle)` as Keras' `ArrayDataAdapter` (NumPy arrays,
    tensors) makes its `tf.data` dataset with `shuffle` (`True`,
    `"batch"`, or `False`: in order); a `hook` returning a function makes that the dataset's
    `tf.random.shuffle` (what Keras' 3.15 permutes each epoch's indices,
    or each batch's, with), `None` leaves Keras' (idempotent; checked
    against `ArrayDataAdapter.get_tf_dataset`)."""
    from keras.src.trainers.data_adapters import array_data_adapter

    def wrap(original):
        def get_tf_dataset(self):
            shuffle = self._shuffle
            replacement = hook(shuffle)
            if replacement is None:
                return original(self)
            _dispatch_shuffle()
            _shuffle_override.fn = replacement
            try:  # Keras traces its permutation here, in this thread
                return original(self)
            finally:
                _shuffle_override.fn = None
        return get_tf_dataset

    _wrap_once(array_data_adapter.ArrayDataAdapter, "get_tf_dataset", wrap)


# The replacement of `tf.random.shuffle` while this thread's Keras makes an
# array dataset (`on_array_dataset`).
_shuffle_override = threading.local()


def _dispatch_shuffle():
    """Makes `tf.random.shuffle` this thread's override, if any, for calls
    without an explicit `seed`, TensorFlow's otherwise (once)."""
    import tensorflow as tf

    tensorflow_shuffle = tf.random.shuffle
    if getattr(tensorflow_shuffle, "_smp_dispatch", False):
        return

    @functools.wraps(tensorflow_shuffle)
    def shuffle(value, seed=None, name=None):
        override = getattr(_shuffle_override, "fn", None)
        if override is None or seed is not None:
            return tensorflow_shuffle(value, seed=seed, name=name)
        return override(value)

    shuffle._smp_dispatch = True
    tf.random.shuffle = shuffle


def epoch_iterator_steps(epoch_iterator):
    """The steps per epoch an `EpochIterator` runs (`steps_per_epoch`, or
    its data's batches), or `None` when its data does not say."""
    return epoch_iterator.steps_per_epoch or epoch_iterator.num_batches


def epoch_iterator_dataset(epoch_iterator):
    """The `tf.data.Dataset` given to `fit`/`evaluate`/`predict` that a Keras
    `EpochIterator` reads, or `None` (other data: arrays, generators, a
    distributed dataset; checked against `TFDatasetAdapter`)."""
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    adapter = getattr(epoch_iterator, "data_adapter", None)
    if isinstance(adapter, tf_dataset_adapter.TFDatasetAdapter):
        return adapter.get_tf_dataset()
    return None


def epoch_iterator_shuffles_py_dataset(epoch_iterator):
    """Whether a Keras `EpochIterator` reads a `PyDataset` in an order drawn
    from Python's `random` (`shuffle=True`; checked against
    `PyDatasetAdapter`)."""
    from keras.src.trainers.data_adapters import py_dataset_adapter

    adapter = getattr(epoch_iterator, "data_adapter", None)
    if not (isinstance(adapter, py_dataset_adapter.PyDatasetAdapter)
            and adapter.shuffle):
        return False
    try:  # Keras shuffles only a PyDataset of known length
        return adapter.py_dataset.num_batches is not None
    except NotImplementedError:
        return False


def epoch_iterator_strategy(epoch_iterator):
    """The `tf.distribute.Strategy` a Keras `TFEpochIterator` feeds."""
    return getattr(epoch_iterator, "_distribute_strategy", None)


def ema_lists(optimizer):
    """`(model variables, their moving averages)` of an optimizer with
    `use_ema`, as its EMA updates zip them (`None` without EMA)."""
    averages = getattr(optimizer, "_model_variables_moving_average", None)
    if not getattr(optimizer, "use_ema", False) or averages is None:
        return None
    return list(optimizer._trainable_variables), list(averages)


def set_ema_lists(optimizer, variables, averages):
    """Sets what `ema_lists` returns (untracked: the same variables)."""
    object.__setattr__(optimizer, "_trainable_variables", list(variables))
    object.__setattr__(optimizer, "_model_variables_moving_average",
                       list(averages))


def step_counter(optimizer):
    """The variable counting every `apply` of an optimizer (its
    `iterations` is this divided by `gradient_accumulation_steps` when
    that is set, a tensor that cannot be assigned)."""
    return optimizer._iterations


def outputs_to_numpy(outputs):
    """Keras' conversion of `predict_on_batch` outputs (NumPy arrays,
    ragged tensors kept)."""
    import keras

    from keras.src.backend.tensorflow.trainer import (
        convert_to_np_if_not_ragged)

    return keras.tree.map_structure(convert_to_np_if_not_ragged, outputs)


# --- used by keras_smp.runtime.split_draws ----------------------------------

def route_random_draws(uniform, normal, dropout):
    """Replaces the TensorFlow backend's `uniform`, `normal` and `dropout`
    (what `keras.random.*` and Keras' random layers call, looked up on the
    backend module per call) by `fn(original, *args, **kwargs)`, once."""
    from keras.src.backend.tensorflow import random as tf_random

    for name, fn in (("uniform", uniform), ("normal", normal),
                     ("dropout", dropout)):
        original = getattr(tf_random, name)
        if getattr(original, "_smp_wrapped", False):
            continue
        routed = functools.partial(fn, original)
        routed._smp_wrapped = True
        setattr(tf_random, name, routed)


def route_other_draws_seeds(fn):
    """Replaces the seed function the TensorFlow backend's other draws
    (`randint`, `truncated_normal`, `shuffle`, ...; also `uniform`,
    `normal` and `dropout` as Keras wrote them) call, `draw_seed(seed)`,
    by `fn(original, seed)`, once."""
    from keras.src.backend.tensorflow import random as tf_random

    original = tf_random.draw_seed
    if getattr(original, "_smp_wrapped", False):
        return
    routed = functools.partial(fn, original)
    routed._smp_wrapped = True
    tf_random.draw_seed = routed


def wrap_variable_initializer(wrap):
    """Replaces the TensorFlow backend's
    `Variable._initialize_with_initializer` (a Keras variable drawing its
    initial value from its initializer, when made or when its deferred
    initialization runs) by `wrap(original)`, once."""
    from keras.src.backend.tensorflow import core

    _wrap_method(core.Variable, "_initialize_with_initializer", wrap)


def drawn_seed(seed):
    """The int32 seed tensor Keras' TensorFlow backend draws with for
    `seed` (an int, a `SeedGenerator`, which this advances, or `None`:
    the global generator)."""
    from keras.src.backend.tensorflow import random as tf_random
    from keras.src.random.seed_generator import draw_seed

    return tf_random._cast_seed(draw_seed(seed))


def floatx():
    """Keras' default float dtype."""
    import keras

    return keras.config.floatx()


def once_per_step_states(layers):
    """The variables of `layers` (and the layers inside them) that a
    training call assigns from their own values alone, not from its
    inputs, so that one call on the whole batch assigns them once: the
    states of their `SeedGenerator`s, and a `SpectralNormalization`'s
    kernel (normalised in place) and power-iteration vector. A split
    batch's parts (microbatches) each start from the values the first
    started from, and assign what the whole batch's call assigns."""
    from keras.src.layers.normalization import spectral_normalization

    states = seed_generator_states(layers)
    seen = {id(v) for v in states}
    for layer in layers:
        flatten = getattr(layer, "_flatten_layers", None)
        for sub in (flatten(include_self=True) if flatten else [layer]):
            if (isinstance(sub, spectral_normalization.SpectralNormalization)
                    and sub.built):
                for v in (sub.kernel, sub.vector_u):
                    if id(v) not in seen:
                        seen.add(id(v))
                        states.append(v)
    return states


def seed_generator_states(layers):
    """The state variables of the `SeedGenerator`s `layers` (and the
    layers inside them) hold, each once."""
    states, seen = [], set()
    for layer in layers:
        flatten = getattr(layer, "_flatten_layers", None)
        for sub in (flatten(include_self=True) if flatten else [layer]):
            for gen in getattr(sub, "_seed_generators", None) or []:
                if id(gen.state) not in seen:
                    seen.add(id(gen.state))
                    states.append(gen.state)
    return states
