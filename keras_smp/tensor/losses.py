"""A vocabulary-parallel cross-entropy and accuracy (Megatron's).

The tied output projection of a language model (`ReversibleEmbedding`
with `reverse=True`) or a lone split `Dense` gives each tensor-parallel
rank the logits of its slice of the vocabulary. Gathering them makes the
whole `(batch, sequence, vocabulary)` tensor on every rank, the largest
activation of a large-vocabulary model. Compiled with these, training and
evaluation never gather it: each rank keeps its slice, and the softmax's
maximum, its normaliser and the label's logit are reduced over the group
(three all-reduces of `(batch, sequence)` values). `predict` still returns the
whole logits.

Example:

```python
import keras, keras_smp

model.compile(
    optimizer="adam",
    loss=keras_smp.VocabParallelSparseCategoricalCrossentropy(),
    metrics=[keras_smp.VocabParallelSparseCategoricalAccuracy()])
```

Without tensor parallelism (or on a layer that is not split) they are
Keras' `SparseCategoricalCrossentropy(from_logits=True)` and
`SparseCategoricalAccuracy`, with the same numbers.
"""

import contextlib
import functools

import keras
import tensorflow as tf
from keras import ops

from keras_smp import tensor
from keras_smp.runtime import keras_private
from keras_smp.tensor.layers import TensorParallelDense
from keras_smp.tensor.layers import TensorParallelEinsumDense
from keras_smp.tensor.layers import TensorParallelReversibleEmbedding
from keras_smp.tensor.layers import current_group
from keras_smp.tensor.layers import current_group_of

__all__ = ["VocabParallelSparseCategoricalCrossentropy",
           "VocabParallelSparseCategoricalAccuracy", "vocab_parallel_logits"]


def _split_logits():
    """The group when the logits reaching a loss or metric now are this
    rank's vocabulary slice (a train or test step of a model compiled
    with a vocabulary-parallel loss), else `None`."""
    group = current_group()
    if group is None or group.size == 1 or not tensor.logits_kept_split():
        return None
    return group


def _labels(y_true, y_pred):
    labels = ops.convert_to_tensor(y_true)
    if len(labels.shape) == len(y_pred.shape):  # (..., 1) labels
        labels = ops.squeeze(labels, axis=-1)
    return ops.cast(labels, "int32")


def vocab_parallel_cross_entropy(group, labels, logits):
    """Per-position cross-entropy of whole-vocabulary `labels` against
    this rank's slice of the logits (rank `r` holds columns
    `[r * V_r, (r + 1) * V_r)`), reduced over `group`.

    A custom gradient, as Megatron's: the forward keeps one buffer of the
    slice's size (the exponentials) for the backward, which is
    `softmax - one_hot(label)` on the slice. Three all-reduces of one
    value per position, in one order: the maximum, the label's logit, the
    normaliser.
    """
    width = logits.shape[-1]
    vocab = width * group.size
    check = tf.debugging.assert_less(
        tf.cast(tf.logical_or(labels < 0, labels >= vocab), tf.int32), 1,
        message=(f"keras-smp: VocabParallelSparseCategoricalCrossentropy "
                 f"got a label outside [0, {vocab}) (the vocabulary); "
                 "labels must be ids of the whole vocabulary."))
    with tf.control_dependencies([check]):
        local = labels - group.rank * width
    mine = tf.logical_and(local >= 0, local < width)
    index = tf.where(mine, local, 0)

    @tf.custom_gradient
    def cross_entropy(logits):
        values = tf.cast(logits, tf.float32)
        # Any constant per position: the group's maximum keeps exp() in
        # range.
        peak = group.maximum(tf.reduce_max(values, axis=-1))
        shifted = values - peak[..., None]
        picked = tf.gather(shifted, index, axis=-1,
                           batch_dims=len(labels.shape))
        exps = tf.exp(shifted)
        target = group.sum(tf.where(mine, picked, 0.0))
        # In one order on every rank (NCCL needs it). (One all-reduce of
        # both stacked kept a slice-sized buffer more alive: measured.)
        with tf.control_dependencies([target]):
            total = group.sum(tf.reduce_sum(exps, axis=-1))

        def grad(dy):
            # (softmax - one_hot(label, on its rank)) * dy.
            hot = tf.one_hot(tf.where(mine, local, -1), width,
                             dtype=tf.float32)  # all zero off this rank
            g = (exps / total[..., None] - hot) * dy[..., None]
            return tf.cast(g, logits.dtype)

        return tf.math.log(total) - target, grad

    return cross_entropy(logits)


@keras.saving.register_keras_serializable(package="keras_smp")
class VocabParallelSparseCategoricalCrossentropy(keras.losses.Loss):
    """`SparseCategoricalCrossentropy(from_logits=True)` on logits split
    by vocabulary across tensor-parallel ranks, never gathered.

    Compile a model whose output is a tensor-parallel vocabulary
    projection (`ReversibleEmbedding(reverse=True)`, or a lone `Dense`
    without activation, made in `keras_smp.tensor_parallelism()`) with
    it: `fit` and `evaluate` then leave that output split on each rank.
    Metrics must then be vocabulary-parallel too
    (`VocabParallelSparseCategoricalAccuracy`); others fail early, as
    they would see one rank's slice. Labels are whole-vocabulary ids.

    Args:
        reduction: as for any Keras loss (default `"sum_over_batch_size"`).
        name: the loss's name.
        dtype: the loss's computation dtype (default: Keras' float type).

    Example (one process: Keras' own cross-entropy):

    ```python
    import numpy as np, keras_smp
    loss = keras_smp.VocabParallelSparseCategoricalCrossentropy()
    logits = np.log(np.array([[0.25, 0.75]], "float32"))
    assert abs(float(loss(np.array([1]), logits)) + np.log(0.75)) < 1e-6
    ```
    """

    def __init__(self, reduction="sum_over_batch_size",
                 name="vocab_parallel_sparse_categorical_crossentropy",
                 dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        group = _split_logits()
        if group is None:
            return keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True)
        return vocab_parallel_cross_entropy(
            group, _labels(y_true, y_pred), y_pred)

    def get_config(self):
        return {"reduction": self.reduction, "name": self.name,
                "dtype": self.dtype}


def vocab_parallel_accuracy(y_true, y_pred):
    """Whether each position's most likely id (the first, on ties, as
    `argmax`) is its label, on split or whole logits."""
    group = _split_logits()
    if group is None:
        return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)
    labels = _labels(y_true, y_pred)
    logits = tf.cast(y_pred, tf.float32)
    width = logits.shape[-1]
    best = tf.reduce_max(logits, axis=-1)
    peak = group.maximum(best)
    index = tf.argmax(logits, axis=-1, output_type=tf.int32)
    # The first whole-vocabulary id holding the maximum.
    candidate = tf.where(best >= peak, index + group.rank * width,
                         tf.int32.max)
    predicted = group.minimum(candidate)
    return tf.cast(tf.equal(predicted, labels), keras.backend.floatx())


@keras.saving.register_keras_serializable(package="keras_smp")
class VocabParallelSparseCategoricalAccuracy(keras.metrics.MeanMetricWrapper):
    """`SparseCategoricalAccuracy` on logits split by vocabulary across
    tensor-parallel ranks (see `VocabParallelSparseCategoricalCrossentropy`).

    Example (one process: Keras' own accuracy):

    ```python
    import numpy as np, keras_smp
    metric = keras_smp.VocabParallelSparseCategoricalAccuracy()
    metric.update_state(np.array([1, 0]),
                        np.array([[0.1, 0.9], [0.2, 0.8]], "float32"))
    assert float(metric.result()) == 0.5
    ```
    """

    def __init__(self, name="sparse_categorical_accuracy", dtype=None):
        super().__init__(vocab_parallel_accuracy, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


# --------------------------------------------------------------------------
# The model: its output projection stays split in train and test steps.
# --------------------------------------------------------------------------


def _output_projection(model):
    """The layer making `model`'s output, checked to be a split
    vocabulary projection; raises naming the fix otherwise."""
    functional = getattr(model, "inner_model", model)  # DistributedModel
    outputs = getattr(functional, "outputs", None)
    fix = ("Make the model's single output the logits of a tensor-parallel "
           "vocabulary projection (`ReversibleEmbedding(...)(h, "
           "reverse=True)`, or a `Dense(vocab)` without activation, built "
           "in `keras_smp.tensor_parallelism()`), or compile with "
           "`keras.losses.SparseCategoricalCrossentropy(from_logits=True)`.")
    if not outputs or len(outputs) != 1:
        raise ValueError(
            "VocabParallelSparseCategoricalCrossentropy needs a functional "
            "Keras model with one output (its logits), got "
            f"{type(model).__name__} with "
            f"{'no known' if not outputs else len(outputs)} outputs. " + fix)
    layer = keras_private.producer_of(outputs[0])
    split = (isinstance(layer, TensorParallelReversibleEmbedding)
             or (isinstance(layer, (TensorParallelDense,
                                    TensorParallelEinsumDense))
                 and layer._smp_tp_mode == "gather"))
    if not split or layer._smp_tp_group() is None:
        raise ValueError(
            "VocabParallelSparseCategoricalCrossentropy: the model's output "
            f"comes from layer '{getattr(layer, 'name', layer)}' "
            f"({type(layer).__name__}), which is not split by vocabulary "
            "across the tensor-parallel ranks. " + fix)
    activation = getattr(layer, "activation", None)
    if activation is not None and activation is not keras.activations.linear:
        raise ValueError(
            f"VocabParallelSparseCategoricalCrossentropy takes logits, but "
            f"Dense '{layer.name}' applies activation={activation.__name__}"
            "; drop the activation (the loss applies the softmax).")
    if isinstance(layer, TensorParallelEinsumDense) and tensor.output_axis(
            layer.equation, tensor.column_letter(layer.equation)) != -1:
        raise ValueError(
            f"VocabParallelSparseCategoricalCrossentropy: EinsumDense "
            f"'{layer.name}' ({layer.equation!r}) splits an output axis "
            "other than the last; the logits' vocabulary must be last.")
    return layer


def _metrics_take_split_logits(model):
    bad = [m for m in keras_private.compiled_metric_specs(model)
           if not (isinstance(m, VocabParallelSparseCategoricalAccuracy) or (
               isinstance(m, type)
               and issubclass(m, VocabParallelSparseCategoricalAccuracy)))]
    if bad:
        names = [getattr(m, "name", getattr(m, "__name__", m)) for m in bad]
        raise ValueError(
            f"Metrics {names} would see one tensor-parallel rank's slice of "
            "the logits: with VocabParallelSparseCategoricalCrossentropy "
            "the logits stay split in fit and evaluate. Use "
            "`keras_smp.VocabParallelSparseCategoricalAccuracy()`, or "
            "compute other metrics on `model.predict` (whole logits).")


def _keep_split_in(model, name):
    step = getattr(model, name)
    if getattr(step, "_smp_keeps_logits_split", False):
        return

    @functools.wraps(step)
    def keeping_split(*args, **kwargs):
        # When the step is traced (predict has no metrics to check).
        _metrics_take_split_logits(model)
        with tensor.keep_logits_split():
            return step(*args, **kwargs)

    keeping_split._smp_keeps_logits_split = True
    object.__setattr__(model, name, keeping_split)


def _stop_keeping_split(model):
    """Undoes `_check_vocab_parallel` (a re-compile with another loss)."""
    for name in ("train_step", "test_step"):
        wrapper = model.__dict__.get(name)
        if getattr(wrapper, "_smp_keeps_logits_split", False):
            inner = wrapper.__wrapped__
            if getattr(inner, "__func__", None) is getattr(type(model), name,
                                                           None):
                del model.__dict__[name]  # the class's own step again
            else:
                model.__dict__[name] = inner  # one the user set
    layer = model.__dict__.get("_smp_vocab_layer")
    if layer is not None:
        object.__setattr__(layer, "_smp_vocab_output", False)
        del model.__dict__["_smp_vocab_layer"]


def _check_vocab_parallel(model):
    """A model compiled with the vocabulary-parallel loss, under tensor
    parallelism: its output projection keeps the logits split in train
    and test steps (predict gathers them); its metrics must take split
    logits. Compiled with another loss, it gathers them again."""
    _stop_keeping_split(model)
    losses = keras_private.compiled_loss_specs(model)
    if not any(isinstance(loss, VocabParallelSparseCategoricalCrossentropy)
               for loss in losses):
        return
    if current_group_of(model) is None:
        return  # Keras' own cross-entropy
    layer = _output_projection(model)
    object.__setattr__(layer, "_smp_vocab_output", True)
    object.__setattr__(model, "_smp_vocab_layer", layer)
    _keep_split_in(model, "train_step")
    _keep_split_in(model, "test_step")


if _check_vocab_parallel not in tensor.MODEL_CHECKS:
    tensor.MODEL_CHECKS.append(_check_vocab_parallel)


@contextlib.contextmanager
def vocab_parallel_logits(model):
    """Within: `model`'s calls leave its logits split by vocabulary, for
    `VocabParallelSparseCategoricalCrossentropy` and `-Accuracy` called
    directly (SMP custom loops: `compile`/`fit` need no scope).

    Example (inside an `@smp.step` function, with `smp.init` and
    `tensor_parallel_degree > 1`; without it the logits are whole):

    ```python
    import keras, numpy as np, keras_smp
    tokens = keras.Input((4,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(16, 8)
    model = keras.Model(tokens, emb(emb(tokens), reverse=True))
    loss_fn = keras_smp.VocabParallelSparseCategoricalCrossentropy()
    x = np.ones((2, 4), "int32")
    with keras_smp.vocab_parallel_logits(model):
        loss = loss_fn(x, model(x))
    assert model(x).shape == (2, 4, 16)
    ```
    """
    if current_group_of(model) is None:
        if current_group() is not None and not model.weights:
            raise ValueError(
                "vocab_parallel_logits: the model has no weights yet, so "
                "its split output projection is not known. Build it first "
                "(call it once on data, or `model.build(input_shape)`).")
        yield  # whole logits: Keras' own numbers
        return
    layer = _output_projection(model)
    previous = getattr(layer, "_smp_vocab_output", False)
    object.__setattr__(layer, "_smp_vocab_output", True)
    try:
        with tensor.keep_logits_split():
            yield
    finally:
        object.__setattr__(layer, "_smp_vocab_output", previous)
