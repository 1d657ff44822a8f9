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
(offsets add up). Draws whose first dimension is not the part's rows (a
noise shape broadcast over the batch, a draw of a fixed shape) are drawn
as before. The seed must be the whole batch's too: the pipeline step
gives each microbatch's forward the stage's seed-generator states as they
were before the first (`keras_smp.pipeline.step`), so the generators
advance once per step, as on one device.

What stays as before (other numbers, the same distribution): normal draws
inside XLA-compiled code (XLA's normal values depend on the whole shape);
Keras' global seed generator (unseeded `keras.random` calls) in a
pipeline; integer and categorical draws; shuffles.

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
    lifted out of it (a weight's initializer, run in `tf.init_scope` when
    a layer is built in its first call)."""
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
    through this module (idempotent). Outside a part they are Keras'
    own; so are a variable initializer's draws (a layer built in its
    first call, inside a part: its weights are no rows of the batch)."""
    keras_private.route_random_draws(_uniform, _normal, _dropout)
    keras_private.wrap_variable_initializer(_outside_parts)


def _outside_parts(fn):
    """`fn` (a method) run with no current part."""
    def run(*args, **kwargs):
        with exactly(None):
            return fn(*args, **kwargs)

    return run


def _offset_of(shape):
    """`(shape, element offset)` of a draw of `shape` in the current part
    (an int64 scalar tensor: 0 when its first dimension is not the part's
    rows), or `None` when nothing is to be offset (no part, or a scalar)."""
    if not _applies_here():
        return None
    value = current()
    shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
    if shape.shape.rank != 1 or shape.shape[0] == 0:
        return None
    offset, rows = (tf.cast(v, tf.int64) for v in value)
    row_elements = tf.reduce_prod(shape[1:])
    return shape, tf.where(tf.equal(shape[0], rows), offset * row_elements,
                           tf.zeros([], tf.int64))


def _raw(op, shape, elements, seed, dtype):
    """`op` (a stateless V2 kernel) drawing `shape` from `seed`, starting
    at element `elements` of the draw: Philox's counter moved on by whole
    blocks, and the remainder's elements dropped."""
    per_block = 2 if tf.as_dtype(dtype).size == 8 else 4
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    blocks, skip = elements // per_block, elements % per_block
    counter = counter_plus(counter, blocks)
    count = tf.reduce_prod(shape)
    flat = op(shape=tf.reshape(skip + count, [1]), key=key, counter=counter,
              alg=_AUTO_SELECT, dtype=dtype)
    return tf.reshape(flat[skip:], shape)


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


def _uniform(original, shape, minval=0.0, maxval=1.0, dtype=None,
             seed=None):
    dtype = tf.as_dtype(dtype or keras_private.floatx())
    placed = _offset_of(shape) if dtype.is_floating else None
    if placed is None:
        return original(shape, minval=minval, maxval=maxval, dtype=dtype,
                        seed=seed)
    shape, elements = placed
    rnd = _raw(tf.raw_ops.StatelessRandomUniformV2, shape, elements,
               _seed(seed), dtype)
    # As `tf.random.stateless_uniform` does.
    minval, maxval = tf.cast(minval, dtype), tf.cast(maxval, dtype)
    return tf.math.add(rnd * (maxval - minval), minval)


def _normal(original, shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    dtype = tf.as_dtype(dtype or keras_private.floatx())
    placed = (None if tf_private.in_xla_context()
              else _offset_of(shape))
    if placed is None:
        return original(shape, mean=mean, stddev=stddev, dtype=dtype,
                        seed=seed)
    shape, elements = placed
    rnd = _raw(tf.raw_ops.StatelessRandomNormalV2, shape, elements,
               _seed(seed), dtype)
    # As `tf.random.stateless_normal` does.
    mean = tf.convert_to_tensor(mean, dtype=dtype)
    stddev = tf.convert_to_tensor(stddev, dtype=dtype)
    return tf.math.add(rnd * stddev, mean)


def _dropout(original, inputs, rate, noise_shape=None, seed=None):
    if not _applies_here() or tf.is_tensor(rate) or rate in (0.0, 1.0):
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    x = tf.convert_to_tensor(inputs)
    concrete = tf.shape(x)
    if noise_shape is not None:
        concrete = tf.stack([concrete[i] if dim is None else dim
                             for i, dim in enumerate(noise_shape)])
    placed = _offset_of(concrete)
    if placed is None:
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    shape, elements = placed
    noise = _raw(tf.raw_ops.StatelessRandomUniformV2, shape, elements,
                 _seed(seed), x.dtype)
    # As `tf.nn.experimental.stateless_dropout` does (Keras' rate is a
    # Python number).
    kept = tf.math.multiply(x, tf.constant(1 / (1 - rate), x.dtype))
    out = tf.where(noise >= rate, kept, tf.zeros([], x.dtype))
    out.set_shape(x.shape)
    return out
