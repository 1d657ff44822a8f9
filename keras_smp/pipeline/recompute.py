"""Activation checkpointing: recompute a forward pass in its backward.

Two granularities, one mechanism:

- a whole stage (`activation_checkpointing=True` or a stage index): the
  pipeline runtime keeps only the stage's inputs between a microbatch's
  forward and backward, and recomputes the stage in the backward action
  (`Stage.replay`, built by `keras_smp.pipeline.step`);
- one layer (`activation_checkpointing=["layer_name", ...]`, or
  `keras_smp.set_activation_checkpointing(layer)`): inside its stage, the
  layer keeps only its inputs; its backward recomputes its forward
  (`checkpointed`, a `tf.custom_gradient`), so the activations inside the
  layer (a transformer block's attention scores and MLP hidden layer) are
  never held between forward and backward.

Either way the recomputation runs in a Keras `StatelessScope` whose state
is the non-trainable variables (random seeds, moving statistics) as read
before the forward: random layers draw what the forward drew, and state
updates the recomputation makes are discarded (the forward made them). So
training is unchanged. TensorFlow's stateful random ops (and unseeded
`keras.random` calls) cannot be drawn again: the first trace raises,
naming the op and the fix.
"""

import contextlib

import keras
import tensorflow as tf
from keras import tree

from keras_smp import tensor
from keras_smp.runtime import keras_private
from keras_smp.runtime import split_draws
from keras_smp.runtime import tracing


def state_of(operations):
    """The distinct non-trainable variables of `operations` (layers)."""
    return tracing.layer_state(operations)


def snapshot(state):
    """The values a recomputation must see: `state`, the global seed, and
    the part of the batch being drawn for (`runtime.split_draws`: a
    layer's recomputation runs in the backward, outside its microbatch's
    forward)."""
    seeds = keras_private.global_seed_state()
    return (seeds, None if seeds is None else tf.identity(seeds.value),
            [tf.identity(v.value) for v in state], split_draws.current())


def rerun(state, snap, fn, what, fix, collect_losses=False, weights=()):
    """Runs `fn()` again as it ran when `snap` was taken (see the module).

    `what` names the recomputed part in errors ("stage 1", "layer
    'block_2'"); `fix` says how to stop recomputing it. Returns `fn()`'s
    result (`run_stateless` also returns the state updates).
    `collect_losses`: layers' `add_loss()` losses are kept for `fn` to
    collect (`keras_private.added_losses`); otherwise Keras drops them.
    `weights`: the recomputed layers' weights; `fn` assigning a trainable
    one (a `SpectralNormalization` normalises its kernel in place in
    training, which a recomputation would do again to the normalised
    kernel, and differentiate through) raises a `ValueError` naming it
    and `fix`.
    """
    return run_stateless(state, snap, fn, what, fix, collect_losses,
                         weights)[0]


def run_stateless(state, snap, fn, what, fix, collect_losses=False,
                  weights=()):
    """`(fn(), updates)`: `fn()` run as `rerun` runs it, and
    `[(variable, new value)]` of the state it assigned (not applied)."""
    seeds, seeds_value, values, part = snap
    mapping = list(zip(state, values))
    if seeds is not None:  # unseeded keras.random calls draw again
        mapping.append((seeds, seeds_value))
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    with split_draws.exactly(part), keras.StatelessScope(
            state_mapping=mapping, collect_losses=collect_losses) as scope:
        out = fn()
    now = keras_private.global_seed_state()
    stateful = sorted({op.type for op in graph.get_operations()[first:]
                       if op.type in tracing.STATEFUL_RANDOM})
    if stateful or (seeds is None and now is not None
                    and scope.get_current_value(now) is not None):
        raise ValueError(
            f"activation_checkpointing: {what} draws random numbers the "
            "recomputation cannot draw again "
            f"({', '.join(stateful) or 'an unseeded keras.random call'}). "
            "Use Keras layers (Dropout, GaussianNoise...) or keras.random "
            "ops with a `keras.random.SeedGenerator` attached to the layer, "
            f"or {fix}.")
    # A trainable weight of the recomputed layers assigned (other
    # variables outside the mapping, a metric's, are written by the
    # forward and their second write dropped, as before).
    assigned = keras_private.stateless_assigned(scope)
    names = sorted(v.path for v in weights
                   if v.trainable and id(v) in assigned)
    if names:
        raise ValueError(
            f"activation_checkpointing: {what} assigns weights {names} "
            "in its training call (a SpectralNormalization normalises "
            "its kernel in place); a recomputation would assign them "
            "again and differ from the forward pass. Keep that layer out "
            f"of the recomputed part, or {fix}.")
    updates = []
    for v, before in mapping:
        value = scope.get_current_value(v)
        if value is not None and value is not before:  # assigned
            updates.append((v, value))
    return out, updates


def set_activation_checkpointing(layers, enabled=True):
    """Recomputes these layers' forward passes in their backward passes.

    SageMaker model parallelism's `smp.set_activation_checkpointing(module)`
    for Keras layers of a `DistributedModel`: each marked layer keeps only
    its inputs between its forward and backward pass (its inner
    activations are recomputed), trading one more forward of the layer for
    memory. Best on layers with large inner activations relative to their
    inputs (a transformer block, a wide MLP, a nested `keras.Model`).
    Training is unchanged (random layers draw the same values). The same
    as naming the layers in `activation_checkpointing` of the config.

    Args:
        layers: a Keras layer or a list of them (layers of the model given
            to `DistributedModel`, or of its nested models). A nested
            Sequential or functional model is recomputed as one unit only
            when marked before `DistributedModel(model)` is made: otherwise
            its layers are placed one by one, and a later mark is an error
            at the first step.
        enabled: `False` turns it off again (before the model's first
            step).

    Example:

    ```python
    import keras, numpy as np, keras_smp
    block = keras.layers.Dense(64, activation="relu", name="block")
    model = keras_smp.DistributedModel(keras.Sequential(
        [keras.Input((8,)), block, keras.layers.Dense(1)]))
    keras_smp.set_activation_checkpointing(block)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 8)), np.ones((8, 1)), verbose=0)
    ```
    """
    for layer in layers if isinstance(layers, (list, tuple)) else [layers]:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "set_activation_checkpointing takes Keras layers; received "
                f"{layer!r} ({type(layer).__name__}). Pass the layer "
                "objects, or name them in the config's "
                "activation_checkpointing list.")
        layer._smp_recompute = bool(enabled)


def marked(layer, names):
    """Whether `layer` is to be recomputed (marked, or named in `names`)."""
    return bool(getattr(layer, "_smp_recompute", False)
                or getattr(layer, "name", None) in names)


def checkpointed(call, layer):
    """`call(*args, **kwargs)` of `layer`, recomputed in its backward.

    Must run inside a `tf.function`. Floating tensors among the arguments
    are the inputs differentiated; other arguments are held as they are. The
    forward itself runs statelessly inside the custom gradient (a
    strategy's variable updates cannot run there) and its state updates
    are assigned right after it. Losses the layer adds (`add_loss()`, an
    activity regularizer) are outputs of the custom gradient too, added
    to the layer after it: their gradients come from the recomputation.
    """
    state = state_of([layer])
    what = f"layer {layer.name!r}"
    fix = (f"stop recomputing layer {layer.name!r} "
           "(keras_smp.set_activation_checkpointing(layer, False), or drop "
           "its name from activation_checkpointing)")

    def run(*args, **kwargs):
        flat = tree.flatten((args, kwargs))
        # Floating tensors are differentiated, each once (a layer called
        # as `(x, x)` must not get x's gradient twice); masks, ids and
        # Python values are held as they are.
        unique, slot, where = [], {}, []
        for i, a in enumerate(flat):
            if tf.is_tensor(a) and a.dtype.is_floating:
                if id(a) not in slot:
                    slot[id(a)] = len(unique)
                    unique.append(a)
                where.append((i, slot[id(a)]))
        structure = (args, kwargs)

        def rebuild(tensors):
            items = list(flat)
            for i, k in where:
                items[i] = tensors[k]
            return tree.pack_sequence_as(structure, items)

        snap = snapshot(state)
        # The inputs' Keras masks as the layer sees them (a layer may clear
        # them when called, as MultiHeadAttention does): the recomputation
        # sees them again.
        masks = [keras_private.keras_mask(t) for t in unique]
        out_structure = []

        updates = []

        # A tensor-parallel layer's collectives, recomputed in the
        # backward, belong to the stage that ran the forward; split
        # logits stay split.
        stage = tensor.current_stage()
        split = tensor.logits_kept_split()

        def with_losses(out):
            # Inside the (re)computation's scope: the losses this call of
            # the layer (and of layers inside it) added.
            return out, keras_private.added_losses(
                keras_private.flatten_layers(layer))

        counts = []

        @tf.custom_gradient
        def forward(*tensors):
            a, k = rebuild(tensors)
            (out, losses), made = run_stateless(
                state, snap, lambda: with_losses(call(*a, **k)), what, fix,
                collect_losses=True, weights=layer.weights)
            updates.extend(made)
            out_structure.append(out)
            counts.append(len(losses))
            # The added losses are outputs too: their gradients come from
            # the recomputation, with the outputs'.
            outs = tree.flatten(out) + list(losses)

            def backward(*dys, variables=None):
                variables = list(variables or [])
                now = [keras_private.keras_mask(t) for t in tensors]
                for t, mask in zip(tensors, masks):
                    keras_private.set_keras_mask(t, mask)
                with tf.GradientTape() as tape, tensor.stage(stage), (
                        tensor.keep_logits_split() if split
                        else contextlib.nullcontext()):
                    tape.watch(list(tensors))
                    a2, k2 = rebuild(tensors)
                    again, again_losses = rerun(
                        state, snap, lambda: with_losses(call(*a2, **k2)),
                        what, fix, collect_losses=True,
                        weights=layer.weights)
                for t, mask in zip(tensors, now):
                    keras_private.set_keras_mask(t, mask)
                if len(again_losses) != counts[0]:
                    raise ValueError(
                        f"activation_checkpointing: {what} added "
                        f"{counts[0]} loss(es) in its forward pass but "
                        f"{len(again_losses)} when recomputed; its losses "
                        "must not depend on Python state that changes "
                        f"between calls. Or {fix}.")
                # Only floating outputs carry gradients.
                pairs = [(y, dy) for y, dy in zip(
                    tree.flatten(again) + list(again_losses), dys)
                    if y.dtype.is_floating]
                grads = tape.gradient(
                    [y for y, _ in pairs], list(tensors) + variables,
                    output_gradients=[
                        tf.zeros_like(y) if dy is None else dy
                        for y, dy in pairs],
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return grads[:len(tensors)], grads[len(tensors):]

            return outs, backward

        outs = list(forward(*unique))
        for v, value in updates:
            v.assign(value)
        if counts[0]:  # the layer's losses, as its own call adds them
            outs, losses = outs[:-counts[0]], outs[-counts[0]:]
            for loss in losses:  # Keras' own (a functional model's raises)
                keras.layers.Layer.add_loss(layer, loss)
        inner = tree.flatten(out_structure[0])
        for t, o in zip(inner, outs):
            mask = keras_private.keras_mask(t)
            if mask is not None:  # the layer's output mask, kept
                keras_private.set_keras_mask(o, mask)
        return tree.pack_sequence_as(out_structure[0], outs)

    return run
