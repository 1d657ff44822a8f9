"""Compressed gradient all-reduce: gradients sent as 16-bit floats.

`SMPStrategy(allreduce_compression="bfloat16")` (or `"float16"`) rounds
each replica's float32 dense gradient to that dtype for the
data-parallel all-reduce, sums it in that dtype and casts the sum back:
half the bytes to serialise, copy and send, as Horovod's
`hvd.Compression.fp16` and PyTorch DDP's `bf16_compress_hook` do. Only
gradient sums are compressed (`keras_smp.runtime.summing_gradients`);
sparse gradients kept sparse, gradients of other dtypes (16-bit,
float64), integer values, metrics and losses travel as they are.

float16's range ends at 65504: where a float16 sum is not finite
(`summed`), that sync's values are summed again as float32, exactly, so
an overflow of the wire dtype never reaches the weights. Every replica
gets the same sums, so all of them take the same branch.

Example:

```python
import tensorflow as tf

from keras_smp.distribute import compression

g = tf.constant([1.0, 1.0 + 2.0**-10, 3.0])
wire = compression.to_wire(g, "bfloat16")
assert wire.dtype == tf.bfloat16
back = compression.from_wire(wire, g.dtype)
assert back.dtype == tf.float32
# bfloat16 keeps 8 significant bits: 1 + 2**-10 rounds to 1.
assert back.numpy().tolist() == [1.0, 1.0, 3.0]
assert compression.to_wire(tf.constant([1, 2]), "bfloat16").dtype == tf.int32
assert not compression.compresses(tf.constant([1.0], tf.float64), "float16")

# A float16 sum that overflows is summed again in float32.
twice = lambda values: [2.0 * v for v in values]  # 2 replicas' sum
(big,) = compression.summed([tf.constant([40000.0])], "float16", twice)
assert big.dtype == tf.float32 and big.numpy().tolist() == [80000.0]
```
"""

import tensorflow as tf

#: `allreduce_compression`'s values (besides None).
DTYPES = ("bfloat16", "float16")


def compresses(t, dtype):
    """Whether `t` (a dense tensor) travels as `dtype`: a float32 tensor,
    and `dtype` is set (float64 values, such as exact counts, never)."""
    return (dtype is not None and isinstance(t, tf.Tensor)
            and t.dtype == tf.float32)


def to_wire(t, dtype):
    """`t` as it travels: rounded to `dtype` where `compresses`."""
    return tf.cast(t, dtype) if compresses(t, dtype) else t


def from_wire(t, dtype):
    """A value that travelled, back in its own `dtype`."""
    return t if t.dtype == dtype else tf.cast(t, dtype)


def summed(values, dtype, reduce):
    """The replicas' sums of `values`, the float32 ones sent as `dtype`.

    Args:
        values: dense tensors.
        dtype: the wire dtype (`"bfloat16"`, `"float16"`) or `None`.
        reduce: a function of a list of tensors giving their sums over
            the replicas (a collective: every replica calls it alike).

    Returns:
        The sums, in `values`' dtypes. With `"float16"`, where any
        compressed sum is not finite (above 65504, or a replica's value
        already was not finite), the values are summed again as they are
        (`tf.cond` on a value every replica shares, so they all take the
        same branch): the step gets float32 sums, and an infinity or NaN
        only where the values themselves hold one. bfloat16 has float32's
        range and is not checked.
    """
    values = list(values)
    if not any(compresses(v, dtype) for v in values):
        return reduce(values)
    got = [from_wire(s, v.dtype) for s, v in
           zip(reduce([to_wire(v, dtype) for v in values]), values)]
    if dtype != "float16":
        return got
    finite = tf.reduce_all(tf.stack(
        [tf.reduce_all(tf.math.is_finite(g))
         for g, v in zip(got, values) if compresses(v, dtype)]))
    return tf.cond(finite, lambda: got, lambda: reduce(values))
