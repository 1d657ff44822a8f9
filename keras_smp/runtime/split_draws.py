"""Random draws of a split batch: each part draws its rows of the whole's.

Keras' random layers (`Dropout`, `SpatialDropout1D/2D/3D`, `AlphaDropout`,
`GaussianNoise`, `GaussianDropout`, an RNN's `dropout`, a layer calling
`keras.random.normal(..., seed=self.seed_generator)`) draw with
TensorFlow's stateless Philox generator, from the seed their
`SeedGenerator` gives per call. A microbatch, or a replica's share of the
batch, drew numbers for its own shape: in every part the first rows of
what the whole batch draws, so its masks and noise differed from
single-device training.

TensorFlow's stateless Philox kernels (CPU, GPU, and XLA's uniform) give
element `i` of a draw from counter block `i // k` (`k` = 2 for 64-bit
floats, 4 for the others), whatever the draw's shape: a draw is a prefix
of any larger one from the same seed (measured for uniform and normal
draws of float16, bfloat16, float32 and float64). A part whose rows start
at row `r` of the whole batch draws exactly its rows of the whole batch's
draw by starting the counter `r * (elements per row) // k` blocks on (and
dropping the few elements before its first): no more numbers than its
own.

`part(offset, rows)` says, while a part's forward is built, where its rows
start and how many there are; `SMPStrategy` opens one per replica (its
rows of the global batch), the pipeline step one per microbatch inside it
(offsets add up), `@smp.step` one per microbatch. A draw whose first
dimension is not the part's rows (a noise shape broadcast over the batch,
a draw of a fixed shape) is the whole batch's, the same in every part. The
seed must be the whole batch's too: each microbatch's forward starts from
the seed-generator states the first started from (`remembered_seeds`), so
the generators advance once per step, as on one device.

Where a part cannot draw its rows of the whole batch's numbers it draws
others, from a seed folded with its offset (each microbatch starts from
the same generator state, so without it every microbatch would repeat the
first's numbers): normal draws inside XLA-compiled code (XLA's normal
values depend on the whole shape); Keras' other draws (`randint`,
`truncated_normal`, `categorical`, `shuffle`, `gamma`, `binomial`,
`beta`). Draws of unseeded `keras.random` calls (Keras' global generator)
in a pipeline are other numbers too.

Example (one device: two halves drawn as parts equal the whole batch's):

```python
import keras
import numpy as np
import tensorflow as tf
from keras_smp.runtime import split_draws

split_draws.install()
x = tf.ones([4, 3])
whole = keras.random.dropout(x, 0.5, seed=7)
halves = []
for offset in (0, 2):
    with split_draws.part(offset, 2):
        halves.append(keras.random.dropout(x[offset:offset + 2], 0.5,
                                           seed=7))
assert np.array_equal(whole.numpy(), tf.concat(halves, 0).numpy())
```
"""

import contextlib
import threading

import tensorflow as tf

from keras_smp.runtime import keras_private
from keras_smp.runtime import tf_private

_local = threading.local()

# TensorFlow's `Algorithm.AUTO_SELECT` (Philox on CPU and GPU), what
# `tf.random.stateless_*` pass by default.
_AUTO_SELECT = 3


def current():
    """`(offset, rows)` of the part being built in this thread (int32
    scalar tensors or Python ints: its first row in the whole batch, its
    rows), or `None`."""
    value = getattr(_local, "part", None)
    return None if value is None else value[:2]


def _graph():
    """The graph being built (`None` when executing eagerly)."""
    return (None if tf.executing_eagerly()
            else tf.compat.v1.get_default_graph())


def _applies_here():
    """Whether the current part applies to ops built now: in the graph
    its forward is built in, or a function traced inside it, not in code
    lifted out of it into `tf.init_scope` (eager, or an outer graph)."""
    value = getattr(_local, "part", None)
    if value is None:
        return False
    graph, home = _graph(), value[2]
    while graph is not None and graph is not home:
        graph = getattr(graph, "outer_graph", None)
    return graph is home


@contextlib.contextmanager
def exactly(value):
    """Sets the current part to `value` (`(offset, rows)` or `None`),
    whatever encloses it: inside a traced function, its arguments."""
    before = getattr(_local, "part", None)
    _local.part = None if value is None else (*value, _graph())
    try:
        yield
    finally:
        _local.part = before


def part(offset, rows):
    """The forward built inside is the part of the current batch (the
    enclosing part's rows, else the whole batch) whose first row is
    `offset` of it, with `rows` rows (int scalars or tensors)."""
    outer = current()
    if outer is not None:
        offset = outer[0] + offset
    return exactly((offset, rows))


def as_arguments():
    """The current part as a traced function's arguments: `(offset, rows)`
    int32 tensors, or `None`."""
    value = current()
    if value is None:
        return None
    return tuple(tf.cast(v, tf.int32) for v in value)


def install():
    """Routes Keras' TensorFlow `uniform`, `normal` and `dropout` draws
    through this module, and the seeds its other draws take (idempotent).
    Outside a part they are Keras' own; so are a variable initializer's
    draws (a layer built in its first call inside a part: Keras computes
    its initial value in the step's graph, and weights are no rows of the
    batch)."""
    keras_private.route_random_draws(_uniform, _normal, _dropout)
    keras_private.route_other_draws_seeds(_other_draws_seed)
    keras_private.wrap_variable_initializer(_outside_parts)


def remembered_seeds(states, store, key):
    """Gives `states` (seed-generator state variables) the values they
    held when this was first called with `key` (it then remembers them in
    `store`, a dict): each microbatch's forward draws from the seeds the
    whole batch's draws from, and the generators advance once per step."""
    if key not in store:
        store[key] = ([id(v) for v in states],
                      [tf.identity(v.value) for v in states])
        return
    # By variable: a layer first built by the first microbatch's call
    # (in the trace that creates the variables, which `tf.function`
    # traces again once they exist) has none before it.
    before = dict(zip(*store[key]))
    for v in states:
        if id(v) in before:
            v.assign(before[id(v)])


def _outside_parts(fn):
    """`fn` (a method) run with no current part."""
    def run(*args, **kwargs):
        with exactly(None):
            return fn(*args, **kwargs)

    return run


def _in_part():
    """`(offset, rows)` as int64 tensors when the current part applies to
    ops built now, else `None`."""
    if not _applies_here():
        return None
    return tuple(tf.cast(v, tf.int64) for v in current())


def _offset_of(shape, batch_dim=True):
    """`(shape, element offset, rows match)` of a draw of `shape` in the
    current part: the offset is the part's first element when the draw's
    first dimension is the part's rows (and `batch_dim`), else 0 (the
    whole batch's draw: a fixed shape, a mask broadcast over the batch);
    `None` when no part applies or the draw is a scalar."""
    part_now = _in_part()
    if part_now is None:
        return None
    shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
    if shape.shape.rank != 1 or shape.shape[0] == 0:
        return None
    offset, rows = part_now
    matches = tf.logical_and(tf.constant(batch_dim), tf.equal(shape[0], rows))
    row_elements = tf.reduce_prod(shape[1:])
    return shape, tf.where(matches, offset * row_elements,
                           tf.zeros([], tf.int64)), matches


def _static(shape):
    """The static shape of a draw's `shape` argument, as far as known."""
    if isinstance(shape, (list, tuple)):
        return tf.TensorShape([d if isinstance(d, int) else None
                               for d in shape])
    value = tf.get_static_value(shape)
    return tf.TensorShape(None if value is None else value.tolist())


def _raw(op, shape, elements, seed, dtype):
    """`op` (a stateless V2 kernel) drawing `shape` from `seed`, starting
    at element `elements` of the draw: Philox's counter moved on by whole
    blocks, and the remainder's elements dropped. The kernel draws a
    size that does not depend on the offset (`per_block - 1` more than
    needed; XLA compiles the draw once, whatever the microbatch)."""
    per_block = 2 if tf.as_dtype(dtype).size == 8 else 4
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    blocks, skip = elements // per_block, elements % per_block
    counter = counter_plus(counter, blocks)
    count = tf.reduce_prod(shape)
    flat = op(shape=tf.reshape(count + (per_block - 1), [1]), key=key,
              counter=counter, alg=_AUTO_SELECT, dtype=dtype)
    return tf.reshape(tf.slice(flat, tf.reshape(skip, [1]),
                               tf.reshape(count, [1])), shape)


def counter_plus(counter, blocks):
    """Philox's 128-bit `counter` (2 uint64 words, low first) plus
    `blocks` (an int64 scalar >= 0), carried into the high word."""
    low, high = tf.unstack(tf.bitcast(counter, tf.int64))
    moved = low + blocks
    # The carry when the low word wraps: an unsigned compare.
    sign = tf.constant(-2 ** 63, tf.int64)
    carry = tf.cast(tf.less(tf.bitwise.bitwise_xor(moved, sign),
                            tf.bitwise.bitwise_xor(low, sign)), tf.int64)
    return tf.bitcast(tf.stack([moved, high + carry]), tf.uint64)


def _seed(seed):
    return keras_private.drawn_seed(seed)


def _folded(seed):
    """`seed` folded with the current part's offset: a draw a part cannot
    take as its rows of the whole batch's draws other numbers than the
    other parts' (each microbatch starts from the same generator state)."""
    offset, _ = _in_part()
    return tf.random.experimental.stateless_fold_in(
        tf.cast(seed, tf.int32), tf.cast(offset, tf.int32))


def _other_draws_seed(original, seed):
    """The seed Keras' other draws (`randint`, `truncated_normal`,
    `categorical`, `shuffle`, `gamma`, `binomial`, `beta`) take: folded
    with the part's offset inside a part."""
    drawn = original(seed)
    return drawn if _in_part() is None else _folded(drawn)


def _uniform(original, shape, minval=0.0, maxval=1.0, dtype=None,
             seed=None):
    dtype = tf.as_dtype(dtype or keras_private.floatx())
    placed = _offset_of(shape) if dtype.is_floating else None
    if placed is None:
        return original(shape, minval=minval, maxval=maxval, dtype=dtype,
                        seed=seed)
    shape_t, elements, _ = placed
    rnd = _raw(tf.raw_ops.StatelessRandomUniformV2, shape_t, elements,
               _seed(seed), dtype)
    # As `tf.random.stateless_uniform` does.
    minval, maxval = tf.cast(minval, dtype), tf.cast(maxval, dtype)
    out = tf.math.add(rnd * (maxval - minval), minval)
    out.set_shape(_static(shape))
    return out


def _normal(original, shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    dtype = tf.as_dtype(dtype or keras_private.floatx())
    placed = _offset_of(shape)
    if placed is None:
        return original(shape, mean=mean, stddev=stddev, dtype=dtype,
                        seed=seed)
    shape_t, elements, matches = placed
    # As `tf.random.stateless_normal` does.
    mean = tf.convert_to_tensor(mean, dtype=dtype)
    stddev = tf.convert_to_tensor(stddev, dtype=dtype)
    if tf_private.in_xla_context():
        # XLA's normal values depend on the whole shape: a part draws for
        # its own, from a seed of its own.
        seed = _seed(seed)
        seed = tf.where(matches, _folded(seed), tf.cast(seed, tf.int32))
        out = tf.random.stateless_normal(shape_t, seed=seed, mean=mean,
                                         stddev=stddev, dtype=dtype)
    else:
        rnd = _raw(tf.raw_ops.StatelessRandomNormalV2, shape_t, elements,
                   _seed(seed), dtype)
        out = tf.math.add(rnd * stddev, mean)
    out.set_shape(_static(shape))
    return out


def _dropout(original, inputs, rate, noise_shape=None, seed=None):
    if _in_part() is None or tf.is_tensor(rate) or rate in (0.0, 1.0):
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    x = tf.convert_to_tensor(inputs)
    concrete = tf.shape(x)
    if noise_shape is not None:
        concrete = tf.stack([concrete[i] if dim is None else dim
                             for i, dim in enumerate(noise_shape)])
    # A noise shape of one row (`(1, n)`: one mask for every row) is no
    # batch dimension, also for a part of one row (unless the input's
    # rows are 1 where traced: `SpatialDropout1D` gives its rows).
    broadcast = (noise_shape is not None
                 and isinstance(noise_shape[0], int) and noise_shape[0] == 1
                 and x.shape[0] != 1)
    placed = _offset_of(concrete, batch_dim=not broadcast)
    if placed is None:
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    shape, elements, _ = placed
    noise = _raw(tf.raw_ops.StatelessRandomUniformV2, shape, elements,
                 _seed(seed), x.dtype)
    # As `tf.nn.experimental.stateless_dropout` does (Keras' rate is a
    # Python number).
    kept = tf.math.multiply(x, tf.constant(1 / (1 - rate), x.dtype))
    out = tf.where(noise >= rate, kept, tf.zeros([], x.dtype))
    out.set_shape(x.shape)
    return out
