"""A pipeline stage's forward traced once, called once per microbatch.

A pipelined step runs each stage's forward pass m times (once per
microbatch). Built inline, the step's graph held m copies of every stage's
ops: Python traced the stage's layers m times and `tf.gradients`
differentiated each copy, so the time to the first step grew with m (a
25-layer model at m = 16: 20 s, against 4 s for plain Keras;
`benchmarks/first_step.py`). `once_per_shape` makes a stage's forward one
`tf.function`, traced once per input shape (a partial last microbatch is
a second shape) and called per microbatch. TensorFlow differentiates the
calls with one backward function, built once, that reads each call's saved
activations (nothing is recomputed), and inlines the calls when it runs
the step, placing their ops on the caller's device.

The same machinery compiles stages with XLA (`keras_smp.runtime.xla`):
`with_state_outside` passes the layers' non-trainable state (moving
statistics, seed generators) in as values and assigns what the call
changed outside it (a strategy's variables cannot be assigned inside a
nested `tf.function` in a replica context), and re-adds outside the losses
layers add inside.

A forward that cannot be traced once without changing what it does runs
inline, as before (`once_per_shape`; `NotTraceable`):

- it assigns a variable that is not state (a layer assigning its own
  weight, a `stateful=True` RNN's states, a metric's variables);
- Keras' global seed generator is made inside it (by the first unseeded
  `keras.random` call): its first advance would be lost;
- its trace holds collective ops (tensor parallelism's, or a user
  layer's): a collective's instance key is fixed when it is traced, and
  m calls of one trace would reuse it within a step;
- a layer synchronises the replicas in its call (a synchronized
  `BatchNormalization`): TensorFlow refuses a replica context's
  `merge_call` inside a nested `tf.function`;
- it holds TensorFlow's stateful random ops with a fixed seed
  (`tf.random.uniform` in a custom layer after `tf.random.set_seed` or
  `keras.utils.set_random_seed`): each inline copy had its own seed, and
  every call of one trace would draw the same numbers. (Keras' layers
  draw through seed generators, which are state and advance per call.)
"""

import tensorflow as tf

from keras_smp.runtime import keras_private
from keras_smp.runtime import split_draws

# False: every microbatch's forward is built inline (as keras-smp did before
# 2026-11-28), for comparisons (`benchmarks/first_step.py`) and debugging.
TRACE_ONCE = True

# Op types of TensorFlow's collectives.
_COLLECTIVE_PREFIXES = ("Collective", "Nccl")

# TensorFlow's stateful random ops: a recomputation would draw new values;
# with a fixed seed, every call of one trace the same ones.
STATEFUL_RANDOM = {
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "StatefulUniform",
    "StatefulUniformInt", "StatefulUniformFullInt",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "RngReadAndSkip"}


class NotTraceable(NotImplementedError):
    """A function traced once would not do what it does inline (see the
    module docstring); the message says why."""


def _nodes(graph):
    """The `NodeDef`s of `graph` (a `tf.Graph`) and of the functions it
    calls."""
    graph_def = graph.as_graph_def()
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def collective_ops(graph):
    """Sorted op types of collectives in `graph` (a `tf.Graph`), functions
    it calls included."""
    return sorted({node.op for node in _nodes(graph)
                   if node.op.startswith(_COLLECTIVE_PREFIXES)})


def loops(graph):
    """Sorted names of `graph`'s while loops (`tf.while_loop`: a Keras RNN
    layer not unrolled, `keras.ops.scan`, `fori_loop`, `while_loop`),
    functions it calls included."""
    return sorted({node.name for node in _nodes(graph)
                   if node.op in ("While", "StatelessWhile")})


def loops_once(concrete, found):
    """`loops(concrete.graph)` of a traced function (a
    `ConcreteFunction`), looked up once: `found` is the caller's cache
    (a step traces a stage's call once per microbatch)."""
    hit = found.get(id(concrete))
    if hit is None or hit[0] is not concrete:
        hit = found[id(concrete)] = (concrete, loops(concrete.graph))
    return hit[1]


def seeded_random_ops(graph):
    """Sorted op types of `graph`'s stateful random ops with a fixed seed
    (`tf.random.uniform` and the like after `tf.random.set_seed`, which
    `keras.utils.set_random_seed` calls): traced once and called m times,
    every call would draw the same numbers (inline, each copy had its own
    seed). Keras' own layers draw through seed generators (state), which
    advance per call."""
    return sorted({node.op for node in _nodes(graph)
                   if node.op in STATEFUL_RANDOM
                   and (node.attr["seed"].i or node.attr["seed2"].i)})


def layer_state(layers):
    """The distinct non-trainable variables of `layers` (moving statistics,
    seed generators): what a traced function or a recomputation of them
    must be given and must write back. Leaves out another stage
    process's weights (`_smp_local`): a layer called in several stages
    holds weights only the calls of another read (an untied
    `ReversibleEmbedding`, frozen)."""
    state, seen = [], set()
    for layer in layers:
        for v in getattr(layer, "non_trainable_variables", None) or []:
            if getattr(v, "_smp_local", False):
                continue
            if id(v) not in seen:
                seen.add(id(v))
                state.append(v)
    return state


def loss_owner(layers):
    """The layer of `layers` the losses added inside a traced function are
    added to again outside it (with Keras' own `Layer.add_loss`, which a
    functional model overrides to raise), where Keras collects them: the
    first Keras layer; `None` when there is none (`keras.ops` nodes add no
    losses)."""
    import keras

    return next((layer for layer in layers
                 if isinstance(layer, keras.layers.Layer)), None)


def _check_nothing_lost(scope, passed, layers, what, new_seeds_ok,
                        error=NotTraceable):
    """Raises `error` if the traced call assigned a variable the
    caller does not write back (`passed`): the scope recorded the
    assignment, and it would be lost. Keras' global seed generator, made
    by the first unseeded `keras.random` call inside, is let through when
    `new_seeds_ok`: from the next call on it is passed in (its first
    advance is not kept)."""
    seeds = keras_private.global_seed_state()
    lost = {key for key in scope.state_mapping if key not in passed
            and (not new_seeds_ok or seeds is None or key != id(seeds))}
    if not lost:
        return
    names = sorted({getattr(v, "path", getattr(v, "name", "?"))
                    for layer in layers
                    for v in list(getattr(layer, "variables", None) or [])
                    + list(getattr(layer, "metrics_variables", None) or [])
                    if id(v) in lost}) or ["a variable outside the layers"]
    raise error(
        f"{what}: the call assigned {', '.join(names)}, which "
        "keras-smp does not carry out of a compiled stage (or a compiled "
        "model call) whose layers hold state or add losses: only their "
        "non-trainable variables are written back, so the assignment "
        "would be lost. Compile with jit_compile=False, or move the "
        "layer to a stage of its own.")


def with_state_outside(fn, state, owner, layers=(), jit_compile=True,
                       what="jit_compile=True", inline_loops=None):
    """`fn` as a `tf.function` (XLA-compiled with `jit_compile`) with
    `state` (Keras variables) passed in as values and the values it
    assigns returned, then assigned by the caller (in the step's own
    graph, where Keras' inline layers assign them). Keras' global seed
    generator (unseeded `keras.random` calls), when it exists, is state
    too. Losses layers add with `add_loss()` inside are returned and added
    to `owner` (a layer of `fn`), where Keras collects them as it would
    have.

    Raises (when traced) `NotImplementedError` if the call assigns another
    variable; without `jit_compile`, `NotTraceable` for that, and if it
    makes Keras' global seed generator, holds collective ops or seeded
    random ops, or synchronises replicas. `what` starts the message.
    `inline_loops`: for a call to be differentiated, a function of the
    loops' names (`loops`) called once when the trace holds a while loop,
    after which `fn` runs inline: TensorFlow cannot differentiate a
    compiled call of a loop outside it (its per-iteration values, lists,
    cannot leave the XLA computation)."""
    import keras

    compiled_for, looping = {}, {}

    def compiled_with(variables):
        passed = {id(v) for v in variables}

        def pure(args, kwargs, values, part):
            with split_draws.exactly(part), keras.StatelessScope(
                    state_mapping=list(zip(variables, values)),
                    collect_losses=True) as scope:
                try:
                    out = fn(*args, **kwargs)
                except RuntimeError as e:
                    if jit_compile or "merge_call" not in str(e):
                        raise
                    # A layer synchronising replicas (a synchronized
                    # BatchNormalization's all-reduce): TensorFlow allows
                    # it only in the step's own graph.
                    raise NotTraceable(
                        f"{what}: a layer synchronises the replicas "
                        "(merge_call) in its call.") from e
            _check_nothing_lost(
                scope, passed, layers, what, new_seeds_ok=jit_compile,
                error=NotImplementedError if jit_compile else NotTraceable)
            if not jit_compile:
                graph = tf.compat.v1.get_default_graph()
                found = collective_ops(graph)
                if found:
                    raise NotTraceable(
                        f"{what}: holds collective ops ({', '.join(found)}), "
                        "whose keys are fixed when traced.")
                found = seeded_random_ops(graph)
                if found:
                    raise NotTraceable(
                        f"{what}: holds seeded random ops "
                        f"({', '.join(found)}): every call would draw the "
                        "same numbers.")
            updates = {}
            for i, (v, before) in enumerate(zip(variables, values)):
                value = scope.get_current_value(v)
                if value is not None and value is not before:  # assigned
                    updates[i] = value
            return out, updates, list(scope.losses)

        return tf.function(pure, jit_compile=jit_compile, autograph=False)

    def run(*args, **kwargs):
        variables = list(state)
        seeds = keras_private.global_seed_state()
        if seeds is not None and all(seeds is not v for v in variables):
            variables.append(seeds)
        key = tuple(id(v) for v in variables)
        if key not in compiled_for:
            compiled_for[key] = compiled_with(variables)
        # Tensors, not variables: a compiled function reads a variable
        # argument as a resource, which XLA cannot do across devices (a
        # stage on another device than the layer's seed generator).
        values = [tf.identity(v.value) for v in variables]
        # The microbatch's (or replica's) rows as arguments: a trace
        # called per microbatch must not capture the first one's.
        call = (args, kwargs, values, split_draws.as_arguments())
        if inline_loops is not None:
            found = loops_once(
                compiled_for[key].get_concrete_function(*call), looping)
            if found:
                inline_loops(found)
                return fn(*args, **kwargs)
        out, updates, losses = compiled_for[key](*call)
        for i, value in sorted(updates.items()):
            variables[i].assign(value)
        for loss in losses:  # only layers add losses: `owner` exists
            keras.layers.Layer.add_loss(owner, loss)
        return out

    return run


def once_per_shape(fn, name, layers=()):
    """A stage's forward `fn(list_of_tensors)`, traced once per input
    signature (see the module docstring).

    Args:
        fn: `list[Tensor] -> list[Tensor]`, the forward of `layers`.
        name: what `fn` is, for messages ("stage 1").
        layers: the Keras layers (and operations) `fn` calls.

    Returns:
        A callable with `fn`'s signature. Called inside a `tf.function`
        (the step), each call is one function call op and the state
        updates after it; when the first trace raises `NotTraceable`, `fn`
        runs inline from then on. `fn` itself when `TRACE_ONCE` is False.

    Example:

    ```python
    import keras
    import tensorflow as tf
    from keras_smp.runtime.tracing import once_per_shape

    dense = keras.layers.Dense(1, kernel_initializer="ones")
    dense.build((None, 2))
    traced = []

    def forward(tensors):
        traced.append(1)
        return [dense(tensors[0])]

    stage = once_per_shape(forward, "stage 0", [dense])

    @tf.function
    def step(a, b):
        ys = [stage([a])[0], stage([b])[0]]
        return tf.gradients(ys, [dense.kernel.value])[0]

    grad = step(tf.ones([1, 2]), 2 * tf.ones([1, 2]))
    assert grad.numpy().tolist() == [[3.0], [3.0]]
    assert len(traced) == 1  # one trace for both microbatches
    ```
    """
    if not TRACE_ONCE:
        return fn
    layers = list(layers)
    traced = with_state_outside(fn, layer_state(layers), loss_owner(layers),
                                layers, jit_compile=False, what=name)
    inline = [False]

    def run(tensors):
        if not inline[0]:
            try:
                return traced(list(tensors))
            except NotTraceable:
                inline[0] = True
        return fn(list(tensors))

    return run
