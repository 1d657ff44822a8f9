"""Gradient fusion: pack many small tensors into few flat buckets.

The bucket plan (`plan_buckets`) is pure Python over shapes and dtypes so it is
identical on every worker; `pack` and `unpack` do the TensorFlow part.
Collectives then run once per bucket instead of once per gradient, as
Horovod's tensor fusion and PyTorch DDP's gradient buckets do.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """Indices (into the flat gradient list) packed together, one dtype."""

    dtype: str
    indices: tuple
    sizes: tuple

    @property
    def num_elements(self):
        return sum(self.sizes)


def plan_buckets(shapes, dtypes, itemsizes, threshold_bytes):
    """Groups tensors into buckets of at most `threshold_bytes` per dtype.

    Tensors keep their relative order inside a bucket; a tensor larger than
    the threshold gets a bucket of its own. `threshold_bytes=0` disables
    fusion (one bucket per tensor).

    Args:
        shapes: list of fully defined shapes (tuples of ints).
        dtypes: list of dtype names, same length.
        itemsizes: list of bytes per element, same length.
        threshold_bytes: bucket capacity in bytes.

    Returns:
        A list of `Bucket`, in a deterministic order.

    Example:

    >>> [b.indices for b in plan_buckets(
    ...     [(2,), (3,), (4,)], ["float32"] * 3, [4] * 3, 20)]
    [(0, 1), (2,)]
    """
    buckets = []
    open_buckets = {}  # dtype -> (indices, sizes, bytes)
    for i, (shape, dtype, itemsize) in enumerate(zip(shapes, dtypes, itemsizes)):
        size = math.prod(shape)
        nbytes = size * itemsize
        if threshold_bytes <= 0:
            buckets.append(Bucket(dtype, (i,), (size,)))
            continue
        idx, sizes, used = open_buckets.get(dtype, ([], [], 0))
        if idx and used + nbytes > threshold_bytes:
            buckets.append(Bucket(dtype, tuple(idx), tuple(sizes)))
            idx, sizes, used = [], [], 0
        idx.append(i)
        sizes.append(size)
        open_buckets[dtype] = (idx, sizes, used + nbytes)
    for dtype, (idx, sizes, _) in open_buckets.items():
        if idx:
            buckets.append(Bucket(dtype, tuple(idx), tuple(sizes)))
    return buckets


def pack(tensors, bucket):
    """Concatenates the bucket's tensors into one flat tensor."""
    import tensorflow as tf

    parts = [tf.reshape(tensors[i], [-1]) for i in bucket.indices]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def unpack(flat, bucket, shapes):
    """Inverse of `pack`: returns `{index: tensor}` with original shapes."""
    import tensorflow as tf

    parts = [flat] if len(bucket.sizes) == 1 else tf.split(flat, bucket.sizes)
    return {
        i: tf.reshape(p, shapes[i]) for i, p in zip(bucket.indices, parts)
    }


def sum_sparse_as_dense(rows, dense_rows, replicas):
    """Whether a sparse gradient is cheaper to sum densely across replicas.

    A sparse gradient (`tf.IndexedSlices`: `rows` gathered rows of a
    `dense_rows`-row variable, e.g. an embedding table) is summed by
    all-gathering every replica's rows: each replica receives
    `replicas x rows` rows. Summed densely, it is one all-reduce of
    `dense_rows` rows, fused with the other dense gradients. Dense wins once
    the gathered rows would be as many as the table's (small vocabularies,
    large batches); with unknown sizes the gradient stays sparse.

    >>> sum_sparse_as_dense(rows=512, dense_rows=1000, replicas=2)
    True
    >>> sum_sparse_as_dense(rows=512, dense_rows=50_000, replicas=8)
    False
    """
    if rows is None or dense_rows is None or replicas <= 1:
        return False
    return replicas * rows >= dense_rows
