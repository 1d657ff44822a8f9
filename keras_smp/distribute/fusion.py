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


def plan_pieces(num_elements, itemsize, max_pieces, min_piece_bytes=2**20):
    """Sizes (elements) of the pieces one bucket is all-reduced in.

    On CPU, TensorFlow's ring all-reduce runs over gRPC, and a bucket sent as
    a few pieces in flight together takes less wall and CPU time than the
    same bytes in one piece (`benchmarks/allreduce_cost.py`). A bucket is
    cut into at most `max_pieces` near-equal pieces of at least
    `min_piece_bytes` each; a smaller bucket stays whole. The plan depends
    only on its arguments, so every replica cuts the same pieces.

    Args:
        num_elements: elements in the bucket.
        itemsize: bytes per element.
        max_pieces: int >= 1; 1 keeps every bucket whole.
        min_piece_bytes: smallest piece worth a collective of its own.

    Returns:
        A list of piece sizes (elements) that sum to `num_elements`.

    Example: the 32 MB of gradients of 8 x Dense(1024) (kernels and
    biases) in 4 pieces.

    >>> plan_pieces(8 * (1024 * 1024 + 1024), 4, max_pieces=4)
    [2099200, 2099200, 2099200, 2099200]
    >>> plan_pieces(2**19 + 1, 4, max_pieces=4)  # 2 MB: 2 pieces of >= 1 MB
    [262145, 262144]
    >>> plan_pieces(1000, 4, max_pieces=4)
    [1000]
    """
    if (not isinstance(max_pieces, int) or isinstance(max_pieces, bool)
            or max_pieces < 1):
        raise ValueError(
            f"max_pieces must be an int >= 1; received {max_pieces!r}.")
    pieces = max(1, min(max_pieces, num_elements,
                        num_elements * itemsize // max(1, min_piece_bytes)))
    return [num_elements // pieces + (1 if i < num_elements % pieces else 0)
            for i in range(pieces)]


def pieces_in_flight(pieces, algorithm, devices):
    """How many pieces in flight a bucket may be cut into (`plan_pieces`'s
    `max_pieces`): `pieces` for the ring all-reduce when every device is a
    CPU, else 1. On GPUs, NCCL needs every rank to launch its collectives in
    one order, which pieces on separate streams would not keep; the
    hierarchical and Horovod paths pipeline their own way.

    Args:
        pieces: the `allreduce_pieces` option, an int >= 1.
        algorithm: "ring", "hierarchical" or "horovod".
        devices: the device strings the collectives run on, as TensorFlow
            canonicalises them (".../device:CPU:0").

    >>> pieces_in_flight(4, "ring", ["/job:worker/replica:0/task:0/device:CPU:0"])
    4
    >>> pieces_in_flight(4, "ring", ["/job:localhost/replica:0/task:0/device:GPU:0"])
    1
    >>> pieces_in_flight(4, "hierarchical", ["/job:worker/replica:0/task:1/device:CPU:0"])
    1
    """
    if not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
        raise ValueError(
            f"allreduce_pieces must be an int >= 1; received {pieces!r}.")
    types = {d.rsplit("device:", 1)[-1].split(":", 1)[0].upper()
             for d in devices}
    return pieces if algorithm == "ring" and types == {"CPU"} else 1


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
    large batches); with unknown sizes the gradient stays sparse. Summed
    densely, the rows of an id repeated in the batch merge: only an
    optimizer linear in the gradient (SGD) steps as with the rows one by
    one, so the all-reduce asks this for SGD alone
    (`runtime.patches.rows_sum_linearly`).

    >>> sum_sparse_as_dense(rows=512, dense_rows=1000, replicas=2)
    True
    >>> sum_sparse_as_dense(rows=512, dense_rows=50_000, replicas=8)
    False
    """
    if rows is None or dense_rows is None or replicas <= 1:
        return False
    return replicas * rows >= dense_rows
