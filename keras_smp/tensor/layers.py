"""Tensor-parallel Keras layers (Megatron-LM's layouts) and their API.

`keras_smp.tensor_parallelism()` and `keras_smp.set_tensor_parallelism`
make plain Keras layers tensor-parallel; the model is built and trained
as usual under an `SMPStrategy(tensor_parallel_degree=T)` running `T`
processes per model replica. Each rank holds 1/T of those layers' weights
(and so of their optimizer slots):

| layer | split | collectives |
|---|---|---|
| `Dense` followed by a `Dense` (e.g. a transformer MLP) | first by columns (output units), second by rows (input units) | one all-reduce forward (after the second), one backward (before the first) |
| `Dense` alone | by columns | all-gather of the output |
| `EinsumDense` | by the first output-only axis | all-gather of the output |
| `MultiHeadAttention` | by heads: query/key/value by columns, output projection by rows | as a Dense pair |
| `Embedding` | by vocabulary rows | one all-reduce forward |
| `ReversibleEmbedding` | by vocabulary rows; `reverse=True` (tied output projection) by vocabulary columns | all-reduce forward; all-gather of the logits |

Biases of split outputs are split; the bias of a row-parallel layer is
added once, after the sum. Other layers (LayerNormalization, ...) run
replicated: every rank computes them on the same values, and the
optimizer averages their gradients over the group (one fused all-reduce)
so that rounding differences between processes cannot make the copies
drift apart.

Example (without a tensor-parallel strategy the layers are plain Keras):

```python
import keras, numpy as np, keras_smp

with keras_smp.tensor_parallelism():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(8)(h)
model = keras.Model(inputs, outputs)
assert keras_smp.tensor_parallel_layers(model) == {
    model.layers[1].name: "column", model.layers[2].name: "row"}
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 8)), np.ones((4, 8)), verbose=0)
```
"""

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_smp import tensor
from keras_smp.pipeline import residency
from keras_smp.runtime import keras_private
from keras_smp.runtime import patches
from keras_smp.runtime import placement

__all__ = ["tensor_parallelism", "set_tensor_parallelism",
           "tensor_parallel_layers"]


# --------------------------------------------------------------------------
# The group a layer splits over.
# --------------------------------------------------------------------------


def current_group():
    """The `TensorGroup` of the `SMPStrategy` in scope, or without one,
    of `smp.init` (`None`: neither, or `tensor_parallel_degree=1`)."""
    if not tf.distribute.has_strategy():
        return tensor.process_group()  # smp.init's, or None
    return getattr(tf.distribute.get_strategy(), "_smp_tensor_group", None)


def _set(layer, name, value):
    """A keras-smp attribute, past Keras' attribute tracking."""
    object.__setattr__(layer, name, value)


def _check_supported(layer):
    for attr in ("kernel_regularizer", "bias_regularizer",
                 "embeddings_regularizer", "kernel_constraint",
                 "bias_constraint", "embeddings_constraint",
                 "activity_regularizer"):
        if getattr(layer, attr, None) is not None:
            raise ValueError(
                f"Layer '{layer.name}' ({type(layer).__name__}) has "
                f"{attr}={getattr(layer, attr)!r}, which keras-smp cannot "
                "apply to a tensor-parallel layer yet (each rank holds a "
                "shard, so the penalty or constraint would see part of the "
                "weight). Remove it, or keep this layer replicated: "
                "`keras_smp.set_tensor_parallelism(layer, False)` or create "
                "it outside `keras_smp.tensor_parallelism()`.")
    if getattr(layer, "quantization_mode", None):
        raise ValueError(
            f"Layer '{layer.name}' is quantized "
            f"({layer.quantization_mode!r}); keras-smp does not split "
            "quantized layers. Keep it replicated.")
    if getattr(layer, "lora_rank", None):
        raise ValueError(
            f"Layer '{layer.name}' uses LoRA (lora_rank="
            f"{layer.lora_rank}), which keras-smp does not split; keep it "
            "replicated (`set_tensor_parallelism(layer, False)`).")


class _TensorParallel:
    """Mixin of every tensor-parallel layer class.

    `_smp_tp_mode`: `"column"` (output split, kept split), `"gather"`
    (output split, then gathered), `"row"` (input split, output summed) or
    `"vocab"` (embedding rows split). `_smp_split`: weight name -> axis.
    """

    _smp_tp_mode = "gather"

    # XLA on CPU compiles no collectives: a split layer says it cannot be
    # compiled (Keras' flag), so Keras turns `jit_compile` off for a model
    # holding it, and a pipeline stage holding it runs uncompiled with a
    # warning naming it (keras_smp.runtime.xla).
    @property
    def supports_jit(self):
        if self._smp_tp_group() is not None:
            return False
        return getattr(self, "_smp_supports_jit", True)

    @supports_jit.setter
    def supports_jit(self, value):
        object.__setattr__(self, "_smp_supports_jit", value)

    def add_weight(self, shape=None, initializer=None, dtype=None,
                   name=None, **kwargs):
        group = current_group()
        axis = self._smp_split_axis(name, shape)
        if group is None or group.size == 1 or axis is None:
            return super().add_weight(shape=shape, initializer=initializer,
                                      dtype=dtype, name=name, **kwargs)
        _check_supported(self)
        full = tuple(int(d) for d in shape)
        start, stop = tensor.shard_bounds(
            full[axis], group.size, group.rank,
            what=f"weight '{name}' of layer '{self.name}' (shape {full}, "
                 f"axis {axis})")
        local = list(full)
        local[axis] = stop - start
        init = keras.initializers.get(initializer)
        sync = group.initial_value_sync
        made = {}
        variable_dtype = dtype or self.variable_dtype

        def shard_of(rank, dtype=None):
            # The whole weight as one device would initialise it (the same
            # seeds give the same values), made identical on every rank of
            # the stage, once, then the rank's slice: training starts where
            # single-device training does.
            value = made.get("whole")
            if value is None:
                value = tf.convert_to_tensor(
                    init(full, dtype=dtype or variable_dtype))
                value = value if sync is None else sync(value)
                if tf.executing_eagerly():
                    # Kept for the other ranks' copies (an unseeded
                    # initializer draws anew each call); not a value
                    # traced for shapes only in Keras' scratch graph.
                    made["whole"] = value
            index = [slice(None)] * len(full)
            index[axis] = slice(rank * local[axis], (rank + 1) * local[axis])
            return value[tuple(index)]

        def sharded(shape, dtype=None):
            return shard_of(group.rank, dtype)

        @contextlib.contextmanager
        def creating():
            # Ranks that are local devices: each local replica's copy of
            # the variable starts from its rank's shard.
            shards = (placement.local_shards(shard_of) if group.local
                      else contextlib.nullcontext())
            with placement.consistent_initial_values(), shards:
                yield

        with creating():
            variable = super().add_weight(
                shape=tuple(local), initializer=sharded, dtype=dtype,
                name=name, **kwargs)
        # Keras makes a weight added while it traces a layer's `call` for
        # its build later, outside this scope: make it the same way then.
        keras_private.initialize_within(variable, creating)
        object.__setattr__(variable, "_smp_tp_axis", axis)
        object.__setattr__(variable, "_smp_tp_group", group)
        _set(self, "_smp_group", group)
        return variable

    def _smp_split_axis(self, name, shape):
        return None

    def _smp_linear(self, group, inputs, product, gather_axis):
        """A Dense-like call on this rank's shard: `product(x, kernel)`,
        the collective of the layer's mode, the bias, the activation."""
        mode = self._smp_tp_mode
        x = inputs if mode == "row" else group.copy_to(inputs)
        x = product(x, self.kernel)
        if mode == "row":
            x = group.reduce_from(x)  # the bias is added once, after
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if mode == "gather" and not _keeps_split(self):
            x = group.gather_from(x, gather_axis)
        # After the gather: any activation sees every unit (a split
        # output stays split only under an element-wise one).
        if self.activation is not None:
            x = self.activation(x)
        return x

    def _smp_tp_group(self):
        group = getattr(self, "_smp_group", None)
        return group if group is not None and group.size > 1 else None

    # Checkpoints hold whole weights: a tensor-parallel model's files load
    # into plain Keras and into any other tensor_parallel_degree. Every
    # rank of the group takes part (each gathers the whole weights).
    # These layers (leaves, not quantized, no LoRA) store their weights in
    # Keras' order: `self.weights`, numbered from 0.
    def save_own_variables(self, store):
        group = self._smp_tp_group()
        if group is None:
            return super().save_own_variables(store)
        for i, v in enumerate(self.weights):
            if residency.is_local(v):
                # Another pipeline stage's weight (no storage here): its
                # own processes save it.
                store[str(i)] = v
                continue
            store[str(i)] = WholeWeight.of(patches.whole_value(v), v)

    def load_own_variables(self, store):
        group = self._smp_tp_group()
        if group is None:
            return super().load_own_variables(store)
        variables = self.weights
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Layer '{self.name}' expects {len(variables)} variables in "
                f"the checkpoint, found {len(store.keys())}.")
        for i, v in enumerate(variables):  # check all, then assign
            patches.rank_part(store[str(i)], v, f"Layer {self.name} weight")
        for i, v in enumerate(variables):
            patches.assign_whole(v, store[str(i)],
                                 f"Layer {self.name} weight")


class WholeWeight(np.ndarray):
    """A whole weight gathered from its shards, knowing the variable it
    came from (`source`): a pipeline's sharded checkpoint files it under
    that variable's stage."""

    source = None

    @classmethod
    def of(cls, array, source):
        whole = np.asarray(array).view(cls)
        whole.source = source
        return whole


class TensorParallelDense(_TensorParallel, keras.layers.Dense):
    """`keras.layers.Dense`, split by columns or (paired) by rows."""

    def __call__(self, *args, **kwargs):
        if not self.built:
            _pair_with_producer(self, args[0] if args else
                                kwargs.get("inputs"))
        outputs = super().__call__(*args, **kwargs)
        if self._smp_tp_mode == "row" and self.input_spec is not None:
            # Its input arrives split (1/T of the units Keras' graph
            # shows), so Keras' check of the last axis does not apply.
            self.input_spec = None
        return outputs

    def _smp_split_axis(self, name, shape):
        if name == "kernel":
            return 0 if self._smp_tp_mode == "row" else 1
        if name == "bias" and self._smp_tp_mode != "row":
            return 0
        return None

    def call(self, inputs, training=None):
        group = self._smp_tp_group()
        if group is None:
            return super().call(inputs, training=training)
        return self._smp_linear(group, inputs, ops.matmul, -1)


class TensorParallelEinsumDense(_TensorParallel, keras.layers.EinsumDense):
    """`keras.layers.EinsumDense`, split on one kernel axis."""

    def _smp_letter(self):
        if self._smp_tp_mode == "row":
            return tensor.row_letter(self.equation)
        return tensor.column_letter(self.equation)

    def _smp_split_axis(self, name, shape):
        letter = self._smp_letter()
        if letter is None:
            raise ValueError(
                f"EinsumDense '{self.name}' ({self.equation!r}) has no axis "
                f"to split {self._smp_tp_mode}-parallel; keep it replicated "
                "(`keras_smp.set_tensor_parallelism(layer, False)`).")
        kernel_spec = tensor.split_einsum(self.equation)[1]
        if name == "kernel":
            return kernel_spec.index(letter)
        if name == "bias" and self._smp_tp_mode != "row":
            out = tensor.split_einsum(self.equation)[2]
            bias_axes = self.bias_axes or ""
            if letter not in bias_axes:
                return None
            first = min(out.index(c) for c in bias_axes)
            return out[first:].index(letter)
        return None

    def call(self, inputs, training=None):
        group = self._smp_tp_group()
        if group is None:
            return super().call(inputs, training=training)
        axis = (tensor.output_axis(self.equation, self._smp_letter())
                if self._smp_tp_mode == "gather" else None)
        return self._smp_linear(
            group, inputs, lambda x, k: ops.einsum(self.equation, x, k), axis)


class TensorParallelEmbedding(_TensorParallel, keras.layers.Embedding):
    """`keras.layers.Embedding`, split by vocabulary rows."""

    _smp_tp_mode = "vocab"

    def _smp_split_axis(self, name, shape):
        return 0 if name == "embeddings" else None

    def call(self, inputs):
        group = self._smp_tp_group()
        if group is None:
            return super().call(inputs)
        return _vocab_lookup(self, group, inputs)


def _vocab_lookup(layer, group, inputs):
    """Rows of this rank's part of the vocabulary, zeros for the others'
    ids, summed over the group: every id's row, from the rank holding it."""
    if inputs.dtype not in ("int32", "int64"):
        inputs = ops.cast(inputs, "int32")
    table = layer.embeddings
    rows = table.shape[0]
    local = inputs - ops.cast(group.rank * rows, inputs.dtype)
    inside = ops.logical_and(local >= 0, local < rows)
    local = ops.where(inside, local, ops.zeros_like(local))
    out = ops.take(table, local, axis=0)
    out = out * ops.cast(ops.expand_dims(inside, -1), out.dtype)
    return ops.cast(group.reduce_from(out), layer.compute_dtype)


class TensorParallelReversibleEmbedding(_TensorParallel,
                                        keras.layers.ReversibleEmbedding):
    """`keras.layers.ReversibleEmbedding`: vocabulary rows split; the
    reverse (tied output) projection split by vocabulary, then gathered."""

    _smp_tp_mode = "vocab"

    def _smp_split_axis(self, name, shape):
        if name == "embeddings":
            return 0
        if name == "reverse_embeddings":
            return 1
        return None

    def call(self, inputs, reverse=False):
        group = self._smp_tp_group()
        if group is None:
            return super().call(inputs, reverse=reverse)
        if not reverse:
            result = _vocab_lookup(self, group, inputs)
            mask = keras.layers.Embedding.compute_mask(self, inputs)
            if mask is not None:
                keras_private.set_keras_mask(result, mask)
            return result
        kernel = (ops.transpose(self.embeddings) if self.tie_weights
                  else self.reverse_embeddings)
        x = group.copy_to(inputs)
        if self.reverse_dtype is not None:
            x = ops.cast(x, self.reverse_dtype)
            kernel = ops.cast(kernel, self.reverse_dtype)
        logits = ops.matmul(x, kernel)
        if self.logit_soft_cap is not None:
            cap = self.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        if _keeps_split(self):
            return logits  # a vocabulary-parallel loss takes them split
        return group.gather_from(logits, -1)


def _keeps_split(layer):
    """Whether `layer` (the output projection of a model compiled with a
    vocabulary-parallel loss) leaves its logits split now: in its train
    and test steps (`keras_smp.tensor.losses`)."""
    return (getattr(layer, "_smp_vocab_output", False)
            and tensor.logits_kept_split())


class TensorParallelMultiHeadAttention(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with its heads split: the query,
    key and value projections by heads (columns), the output projection by
    heads (rows)."""

    def call(self, *args, return_attention_scores=False, **kwargs):
        query = getattr(self, "_query_dense", None)
        if (return_attention_scores and query is not None
                and query._smp_tp_group() is not None):
            raise ValueError(
                f"MultiHeadAttention '{self.name}' is split by heads across "
                "tensor-parallel ranks; return_attention_scores=True would "
                "give each rank's heads only. Keep this layer whole "
                "(`keras_smp.set_tensor_parallelism(layer, False)` before "
                "it is built) to read its attention scores.")
        return super().call(*args, return_attention_scores=
                            return_attention_scores, **kwargs)


# Sublayers MultiHeadAttention.build creates, by name, and their split.
_ATTENTION_ROLES = {"query": "column", "key": "column", "value": "column",
                    "gate": "column", "attention_output": "row"}


def _attention_build(layer, build):
    @functools.wraps(build)
    def tensor_parallel_build(*args, **kwargs):
        with tensor.scope(False), _attention_roles(layer):
            return build(*args, **kwargs)

    return tensor_parallel_build


@contextlib.contextmanager
def _attention_roles(layer):
    previous = getattr(tensor._state, "attention", None)
    tensor._state.attention = layer
    try:
        yield
    finally:
        tensor._state.attention = previous


def _attention_sublayer(layer):
    """An EinsumDense created by a tensor-parallel attention's build."""
    parent = getattr(tensor._state, "attention", None)
    if parent is None or type(layer) is not keras.layers.EinsumDense:
        return False
    role = _ATTENTION_ROLES.get(layer.name)
    if role is None:
        return False
    _swap(layer, TensorParallelEinsumDense, role)
    return True


# --------------------------------------------------------------------------
# Conversion.
# --------------------------------------------------------------------------


_CLASSES = {
    keras.layers.Dense: TensorParallelDense,
    keras.layers.EinsumDense: TensorParallelEinsumDense,
    keras.layers.Embedding: TensorParallelEmbedding,
    keras.layers.ReversibleEmbedding: TensorParallelReversibleEmbedding,
    keras.layers.MultiHeadAttention: TensorParallelMultiHeadAttention,
}
_ORIGINAL = {v: k for k, v in _CLASSES.items()}

# A tensor-parallel layer presents itself as its Keras class: Keras names
# the weights of a checkpoint after class names, and `.keras` files record
# the class and module, so files written from a tensor-parallel model are
# plain Keras files (and `model.summary()` shows the familiar names).
for _tp_class, _keras_class in _ORIGINAL.items():
    _tp_class.__name__ = _keras_class.__name__
    _tp_class.__qualname__ = _keras_class.__qualname__
    _tp_class.__module__ = _keras_class.__module__


def _swap(layer, cls, mode=None):
    layer.__class__ = cls
    if mode is not None:
        _set(layer, "_smp_tp_mode", mode)


def _convert(layer):
    if getattr(layer, "built", False):
        raise ValueError(
            f"Layer '{layer.name}' is already built: its weights exist "
            "whole. Make it tensor-parallel before it is built: create it "
            "inside `keras_smp.tensor_parallelism()`, or call "
            "`keras_smp.set_tensor_parallelism(layer)` before calling it "
            "on inputs.")
    cls = _CLASSES[type(layer)]
    if cls is TensorParallelMultiHeadAttention:
        _swap(layer, cls)
        _set(layer, "_smp_keras_build", layer.build)
        layer.build = _attention_build(layer, layer.build)
        return
    _swap(layer, cls, cls._smp_tp_mode)


def _on_created(layer):
    if _attention_sublayer(layer):
        return
    if tensor.marking() and type(layer) in _CLASSES:
        _convert(layer)


if _on_created not in tensor.HOOKS:
    tensor.HOOKS.append(_on_created)
patches.install_layer_hook()


def _pair_with_producer(layer, inputs):
    """A Dense called on a (not yet paired) column-parallel Dense's output
    is split by rows, and that Dense's output stays split: one all-reduce
    for the pair (Megatron's MLP)."""
    if layer._smp_tp_mode == "row":
        return
    producer = keras_private.producer_of(inputs)
    if (isinstance(producer, TensorParallelDense)
            and producer._smp_tp_mode == "gather"
            and not getattr(producer, "_smp_paired", False)
            and _elementwise(producer.activation)
            and keras_private.consumers(producer) == 0):
        _set(producer, "_smp_tp_mode", "column")
        _set(producer, "_smp_paired", True)
        _set(producer, "_smp_partner", layer.name)
        _set(layer, "_smp_tp_mode", "row")


# Keras activations that act on each value alone: a Dense with one of them
# may keep its output split (softmax and custom functions may not).
_ELEMENTWISE = frozenset((
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "tanh",
    "sigmoid", "hard_sigmoid", "softplus", "softsign", "silu", "swish",
    "hard_silu", "hard_swish", "mish", "exponential", "celu",
    "log_sigmoid", "tanh_shrink", "hard_tanh", "soft_shrink",
    "hard_shrink", "squareplus", "sparse_plus", "sparse_sigmoid",
    "threshold"))


def _elementwise(activation):
    if activation is None:
        return True
    name = getattr(activation, "__name__", None)
    return (name in _ELEMENTWISE
            and getattr(keras.activations, name, None) is activation)


# Keras optimizers whose update of a weight depends on the whole weight
# (its norm, or its rows and columns): on a shard they would compute
# something else.
_WHOLE_WEIGHT_OPTIMIZERS = ("Lamb", "Adafactor", "Muon", "LARS")


def _check_model(model):
    """Layouts of a tensor-parallel model that cannot run, found before
    its step functions are made."""
    group = current_group_of(model)
    layers = keras_private.flatten_layers(model)
    if group is not None and group.local and getattr(model, "run_eagerly",
                                                     False):
        raise ValueError(
            "run_eagerly=True with tensor parallelism over the local "
            "devices of one process: eagerly, TensorFlow runs the devices' "
            "steps one after another, so a rank's collective would wait "
            "for a rank that has not started. Compile with "
            "run_eagerly=False (the default).")
    if group is not None:
        outside = [layer.name for layer in layers
                   if isinstance(layer, _TensorParallel) and layer.built
                   and layer._smp_tp_group() is None and layer.weights]
        if outside:
            raise ValueError(
                f"Layers {outside} are marked tensor-parallel but were "
                "built outside the scope of the tensor-parallel "
                "SMPStrategy, so every rank holds them whole. Build the "
                "model inside `strategy.scope()`.")
        optimizer = getattr(model, "optimizer", None)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        name = type(inner).__name__ if inner is not None else None
        if name in _WHOLE_WEIGHT_OPTIMIZERS:
            raise ValueError(
                f"The {name} optimizer scales each weight's update by "
                "statistics of the whole weight, which a tensor-parallel "
                "rank does not hold (it holds a shard). Use an element-"
                "wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, "
                "Lion, ...) with tensor parallelism.")
    stage_of = _stage_of_layers(model)
    for layer in layers:
        partner = getattr(layer, "_smp_partner", None)
        if (isinstance(layer, TensorParallelDense) and partner is not None
                and stage_of.get(layer.name) != stage_of.get(partner)):
            raise ValueError(
                f"The pipeline cut falls between Dense '{layer.name}' "
                f"(split by columns, output kept split) and Dense "
                f"'{partner}' (split by rows), which must run in one "
                "stage. Move the cut: `DistributedModel(model, "
                "split_points=[...])` or `keras_smp.partition(i)` scopes.")
    for layer in layers:
        if (isinstance(layer, TensorParallelDense)
                and layer._smp_tp_mode == "column"
                and keras_private.consumers(layer) > 1):
            raise ValueError(
                f"Dense '{layer.name}' is split by columns and its output "
                "stays split for the Dense it feeds (a Megatron pair), but "
                "another layer also uses that output. Keep the pair's "
                "output to one user, or make the first Dense whole-output: "
                f"`keras_smp.set_tensor_parallelism(layer, False)` on one of "
                "them, or create the other user's input from a separate "
                "Dense.")


def current_group_of(model):
    """The tensor-parallel group of the strategy `model` runs under (or,
    for a model built outside it, its optimizer was made under)."""
    optimizer = getattr(model, "optimizer", None)
    for strategy in (getattr(model, "distribute_strategy", None),
                     optimizer is not None
                     and keras_private.optimizer_strategy(optimizer)):
        group = getattr(strategy, "_smp_tensor_group", None)
        if group is not None and group.size > 1:
            return group
    group = tensor.process_group()
    if group is not None and any(
            getattr(v, "_smp_tp_group", None) is group
            for v in model.weights):
        return group
    return None


def _stage_of_layers(model):
    """`{layer name: pipeline stage}` of a `DistributedModel` ({} else)."""
    if not getattr(model, "_smp_pipelined", False):
        return {}
    try:
        graph = model.staged_graph
    except ValueError:  # not built yet
        return {}
    return {node.operation.name: s for s in range(graph.num_stages)
            for node in graph.stage_nodes(s)}


if _check_model not in tensor.MODEL_CHECKS:
    tensor.MODEL_CHECKS.append(_check_model)


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def tensor_parallelism(enabled=True):
    """Layers created inside are tensor-parallel (SageMaker smp's API).

    Supported layers: `Dense`, `EinsumDense`, `MultiHeadAttention`,
    `Embedding`, `ReversibleEmbedding` (exactly these classes; subclasses
    and other layers stay replicated). They are split across the
    `tensor_parallel_degree` processes of an `SMPStrategy`, and are plain
    layers without one. `enabled=False` opens a scope of replicated
    layers inside a tensor-parallel one.

    Example:

    ```python
    import keras, keras_smp

    with keras_smp.tensor_parallelism():
        dense = keras.layers.Dense(4)
        with keras_smp.tensor_parallelism(False):
            norm = keras.layers.Dense(4)
    assert keras_smp.is_tensor_parallel(dense)
    assert not keras_smp.is_tensor_parallel(norm)
    ```
    """
    with tensor.scope(enabled):
        yield


def set_tensor_parallelism(layer, enabled=True):
    """Makes one layer tensor-parallel, or replicated (SMP's API).

    Call it before the layer is built (before it is first called on
    inputs). Supported classes as for `tensor_parallelism()`.

    Raises:
        ValueError: an unsupported layer class, or a built layer.

    Example:

    ```python
    import keras, keras_smp

    dense = keras.layers.Dense(8)
    keras_smp.set_tensor_parallelism(dense)
    assert keras_smp.is_tensor_parallel(dense)
    keras_smp.set_tensor_parallelism(dense, False)
    assert type(dense) is keras.layers.Dense
    ```
    """
    if not isinstance(layer, keras.layers.Layer):
        raise ValueError(
            f"set_tensor_parallelism takes a Keras layer; received "
            f"{type(layer).__name__} {layer!r}.")
    if isinstance(layer, _TensorParallel) or isinstance(
            layer, TensorParallelMultiHeadAttention):
        if enabled:
            return
        if layer.built:
            raise ValueError(
                f"Layer '{layer.name}' is already built with split weights; "
                "call set_tensor_parallelism(layer, False) before building "
                "it.")
        original = getattr(layer, "_smp_keras_build", None)
        if original is not None:
            layer.build = original
        layer.__class__ = _ORIGINAL[type(layer)]
        return
    if not enabled:
        return
    if type(layer) not in _CLASSES:
        supported = ", ".join(c.__name__ for c in _CLASSES)
        raise ValueError(
            f"Layer '{layer.name}' is a {type(layer).__name__}, which keras-smp "
            f"cannot split; supported: {supported} (exactly these classes). "
            "Other layers run replicated on every tensor-parallel rank.")
    _convert(layer)


def is_tensor_parallel(layer):
    """Whether `layer` is split across tensor-parallel ranks when trained
    under a tensor-parallel `SMPStrategy`."""
    return isinstance(layer, (_TensorParallel,
                              TensorParallelMultiHeadAttention))


def tensor_parallel_layers(model):
    """`{layer name: split}` of a model's tensor-parallel layers: `"column"`
    (output split and kept split for the next layer), `"row"`, `"gather"`
    (output split then gathered), `"vocab"` (embedding rows) or `"heads"`
    (attention)."""
    out = {}
    for layer in _walk(model):
        if isinstance(layer, TensorParallelMultiHeadAttention):
            out[layer.name] = "heads"
        elif isinstance(layer, _TensorParallel):
            out[layer.name] = layer._smp_tp_mode
    return out


def _walk(model):
    """Every layer inside `model`, in its order, nested ones (in models
    and custom layers) after them; not the projections inside a split
    attention (reported as its heads)."""
    seen = set()
    stack = list(model.layers)
    while stack:
        layer = stack.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        if isinstance(layer, TensorParallelMultiHeadAttention):
            continue
        stack.extend(layer.layers if isinstance(layer, keras.Model)
                     else keras_private.sublayers(layer))
