"""XLA compilation of keras-smp's compute, with communication outside it.

`model.compile(..., jit_compile=True)` under an `SMPStrategy` does not
compile Keras' whole step function with XLA, as plain Keras does: the step
holds collectives (pipeline transfers, gradient all-reduce) and variables of
several devices, which XLA cannot compile on CPU. Instead the step stays a
plain `tf.function` and its compute is compiled:

- a pipelined model (`DistributedModel`): each stage's forward of one
  microbatch is one XLA computation (`compiled(stage_fn)`), and so is its
  backward: TensorFlow differentiates a call of a compiled function with a
  compiled backward function that reads the forward's saved activations
  (nothing is recomputed; the first stage's backward computes no gradient
  for the batch itself). Transfers, gradient accumulation and the
  optimizer run between them, as TensorFlow ops.
- a plain Keras model under data parallelism: the model's forward
  (`model.call`) is compiled while Keras traces its step (`compiled_calls`),
  hence its backward too; the loss, the gradient all-reduce and the
  optimizer stay outside.

A stage (or model) holding a layer that says it cannot be compiled
(`layer.supports_jit = False`, Keras' own flag) runs uncompiled, with a
warning naming the layer.

Every compiled function is traced once per input shape, so a pipeline step
of `m` microbatches compiles one forward and one backward per stage, not m.
"""

import contextlib
import functools
import warnings

import tensorflow as tf

from keras_smp.runtime import keras_private
from keras_smp.runtime import tracing


def wanted(model):
    """Whether `model`'s compute is to be compiled: `jit_compile=True`
    (for a `DistributedModel`, also when Keras turned it off because some
    layer cannot be compiled: its other stages still are)."""
    if getattr(model, "run_eagerly", False):
        return False
    return (getattr(model, "_smp_xla", False)
            or getattr(model, "jit_compile", False) is True)


def stage_by_stage(model, jit_compile):
    """`DistributedModel.compile`: the `jit_compile` to give Keras.

    Keras turns XLA off for a whole model when one layer cannot be
    compiled (`supports_jit=False`); a pipeline compiles stage by stage, so
    Keras gets `False` and the request is kept in `model._smp_xla`.
    """
    blocked = jit_compile is True and bool(blocking_layers(
        keras_private.flatten_layers(model)))
    model._smp_xla = blocked
    return False if blocked else jit_compile


@contextlib.contextmanager
def uncompiled_step(model):
    """While Keras makes a step function: its outer `tf.function` is not
    compiled (the compute inside it is, see the module docstring)."""
    before = model.jit_compile
    model.jit_compile = False
    try:
        yield
    finally:
        model.jit_compile = before


def blocking_layers(layers):
    """Names of `layers` that Keras marks as not compilable."""
    return [layer.name for layer in layers
            if not getattr(layer, "supports_jit", True)]


def compiled(fn, name, layers=(), read_outside=(), differentiated=True):
    """`fn` as an XLA-compiled `tf.function`, or `fn` itself (with a
    warning naming them) when one of `layers` cannot be compiled.

    The layers' non-trainable state (`BatchNormalization`'s moving
    statistics, `Dropout`'s seed) is read and updated outside the compiled
    function (`tracing.with_state_outside`): a strategy's variables cannot
    be assigned inside a nested `tf.function` in a replica context. So are
    the variables `read_outside` (weights several stages of one process
    use, which live on one stage's device: XLA cannot read a variable of
    another device); their gradients flow through the values read.

    `differentiated`: whether the step takes the call's gradient. Such a
    call holding a while loop (a Keras RNN layer, `keras.ops.scan`) runs
    inline, uncompiled, with a warning (`_inline_loops`); its inference
    stays compiled."""
    layers = list(layers)
    blocking = blocking_layers(layers)
    if blocking:
        warnings.warn(
            f"jit_compile=True: {name} runs without XLA because layer(s) "
            f"{', '.join(blocking)} cannot be compiled (supports_jit=False). "
            "Move them to a stage of their own, or compile with "
            "jit_compile=False to silence this.", stacklevel=3)
        return fn
    state = tracing.layer_state(layers)
    state += [v for v in read_outside
              if all(v is not known for known in state)]
    inline = _inline_loops(name) if differentiated else None
    if state or keras_private.may_add_losses(layers):
        return tracing.with_state_outside(
            fn, state, tracing.loss_owner(layers), layers,
            inline_loops=inline)
    plain = tf.function(_refusing_helper_losses(fn, name, layers),
                        jit_compile=True, autograph=False)
    if inline is None:
        return plain
    looping = {}

    def run(*args, **kwargs):
        found = tracing.loops_once(
            plain.get_concrete_function(*args, **kwargs), looping)
        if found:
            inline(found)
            return fn(*args, **kwargs)
        return plain(*args, **kwargs)

    return run


def _inline_loops(name):
    """The warning, once, for a compiled call of `name` to be
    differentiated that holds while loops: it runs uncompiled."""
    warned = []

    def warn(found):
        if warned:
            return
        warned.append(True)
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        warnings.warn(
            f"jit_compile=True: {name} runs without XLA in training "
            f"because it holds a while loop ({shown}): a Keras RNN layer "
            "(LSTM, GRU, SimpleRNN) not unrolled, or keras.ops.scan, "
            "fori_loop or while_loop. keras-smp compiles a call's forward "
            "and backward as two XLA computations, and TensorFlow cannot "
            "pass a loop's per-iteration values from one to the other "
            "('Support for TensorList crossing the XLA/TF boundary is not "
            "implemented'). It trains as plain Keras without XLA does "
            "(its random layers draw TensorFlow's numbers, not XLA's); "
            "its evaluate and predict stay compiled. To compile it in "
            "training too, unroll the RNN (unroll=True, for a fixed "
            "sequence length); to keep more of the model compiled, move "
            "the loop to a stage of its own. jit_compile=False silences "
            "this.", stacklevel=2)

    return warn


def _refusing_helper_losses(fn, name, layers):
    """`fn`, raising (when traced) if one of `layers` adds a loss: none
    was foreseen from their classes' code (`may_add_losses`), so the
    compiled function would keep it inside its graph (TensorFlow's "out
    of scope" error later)."""
    def run(*args, **kwargs):
        before = {id(t) for t in keras_private.added_losses(layers)}
        out = fn(*args, **kwargs)
        if any(id(t) not in before
               for t in keras_private.added_losses(layers)):
            raise NotImplementedError(
                f"jit_compile=True: a layer of {name} added a loss "
                "(add_loss()) from code outside its class's methods (a "
                "helper function), which keras-smp does not see before "
                "compiling the stage. Call add_loss() in the layer's own "
                "call (or a method of its class), or compile with "
                "jit_compile=False.")
        return out

    return run


def compiled_calls(model, step_function, differentiated=True):
    """`step_function` tracing `model.call` as a compiled function.

    For a plain Keras model (data parallelism): Keras' own `train_step`
    (or the user's) calls `model(...)`, whose `call` is then one XLA
    computation, and so is its gradient. (Keras itself turns
    `jit_compile` off, with its own warning, for a model holding a layer
    that cannot be compiled.) `differentiated`: whether it is the train
    step (see `compiled`).
    """
    original = model.call

    def call(*args, **kwargs):
        # `training` and `mask` stay Python values (static in the trace).
        # The outputs' Keras masks (an `Embedding(mask_zero=True)`'s, for
        # the loss) come out beside them: a compiled function's outputs
        # carry none.
        out = original(*args, **kwargs)
        return out, [keras_private.keras_mask(t)
                     for t in tf.nest.flatten(out)]

    compiled_call = compiled(call, f"model {model.name!r}",
                             keras_private.flatten_layers(model),
                             differentiated=differentiated)

    def fast(*args, **kwargs):
        out, masks = compiled_call(*args, **kwargs)
        for t, mask in zip(tf.nest.flatten(out), masks):
            if mask is not None:
                keras_private.set_keras_mask(t, mask)
        return out

    @functools.wraps(step_function)
    def run(*args, **kwargs):
        # An instance attribute: `Layer.__call__` calls `self.call`.
        before = model.__dict__.get("call")
        object.__setattr__(model, "call", fast)
        try:
            return step_function(*args, **kwargs)
        finally:
            if before is None:
                object.__delattr__(model, "call")
            else:
                object.__setattr__(model, "call", before)

    return run


@contextlib.contextmanager
def plain_calls(model):
    """Within, `model.call` is its class's again, not `compiled_calls`'
    compiled function (a trace that takes gradients of the weights' reads
    inside the call: they would be inside the compiled function's
    graph)."""
    compiled_call = model.__dict__.get("call")
    if compiled_call is None:
        yield
        return
    object.__delattr__(model, "call")
    try:
        yield
    finally:
        object.__setattr__(model, "call", compiled_call)
