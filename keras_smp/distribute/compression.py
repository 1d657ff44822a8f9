"""Compressed gradient all-reduce: gradients sent as 16-bit floats.

`SMPStrategy(allreduce_compression="bfloat16")` (or `"float16"`) rounds
each replica's float32 dense gradient to that dtype for the
data-parallel all-reduce, sums it in that dtype and casts the sum back:
half the bytes to serialise, copy and send, as Horovod's
`hvd.Compression.fp16` and PyTorch DDP's `bf16_compress_hook` do. Only
gradient sums are compressed (`keras_smp.runtime.summing_gradients`);
sparse gradients kept sparse, gradients of other dtypes (16-bit,
float64), integer values, metrics and losses travel as they are.

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
