"""Splitting a batch into microbatches and merging results back.

Shared by `DistributedModel`'s steps and SMP's `@smp.step`, so both check
batches the same way and give the same error.
"""

import tensorflow as tf

#: Substring of the error raised (in a graph) for an indivisible batch.
BATCH_ERROR = "does not divide into microbatches"
#: ... and for a batch with fewer samples than microbatches.
FEW_ERROR = "is smaller than microbatches"


def lead(flat):
    """The index in `flat` (a batch's tensors) of the tensor whose rows
    count the batch: the first dense one with rows, else the first sparse
    or ragged one, else 0."""
    return next((i for i, t in enumerate(flat) if isinstance(t, tf.Tensor)
                 and t.shape.rank != 0), next((
                     i for i, t in enumerate(flat) if isinstance(
                         t, (tf.SparseTensor, tf.RaggedTensor))), 0))


def batch_rows(flat):
    """The rows of the batch of tensors `flat` (an int32 tensor): its
    `lead` tensor's."""
    return rows(flat[lead(flat)])


def rows(tensor, axis=0):
    """The size of `tensor`'s `axis` (an int32 tensor), for dense, sparse
    (`tf.SparseTensor`) and ragged (`tf.RaggedTensor`, axis 0) tensors."""
    if isinstance(tensor, tf.SparseTensor):
        return tf.cast(tensor.dense_shape[axis], tf.int32)
    if isinstance(tensor, tf.RaggedTensor) and axis == 0:
        return tensor.nrows(out_type=tf.int32)
    return tf.shape(tensor)[axis]


def _tensor(tensor):
    return (tensor if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor))
            else tf.convert_to_tensor(tensor))


def _check(tensor, axis, ok, error, what, m, advice):
    """Checks `ok(rows)` of `tensor`'s `axis`: a known size now (a
    `ValueError`), an unknown one by the returned `tf.debugging.Assert`
    ops (their message names the size at run time)."""
    t = _tensor(tensor)
    static = t.shape[axis] if t.shape.rank is not None else None
    if static is not None:
        if not ok(static):
            raise ValueError(f"{what} of {static} samples {error}={m}{advice}")
        return []
    n = rows(t, axis)
    return [tf.debugging.Assert(
        ok(n), [what + " of", n, f"samples {error}={m}{advice}"])]


def check_divisible(tensor, m, what="The per-replica batch", advice="",
                    axis=0):
    """Checks that `tensor`'s `axis` divides into `m` microbatches.

    A known size is checked now (`ValueError`); an unknown one returns a
    list of `tf.debugging.Assert` ops to depend on (its message names the
    size at run time).

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.microbatch import check_divisible
    assert check_divisible(tf.zeros([8, 2]), 4) == []
    try:
        check_divisible(tf.zeros([6, 2]), 4)
    except ValueError as e:
        assert "6 samples does not divide into microbatches=4" in str(e)
    ```
    """
    return _check(tensor, axis, lambda rows: rows % m == 0, BATCH_ERROR,
                  what, m, f". {advice}")


def check_enough(tensor, m, what="The per-replica batch", advice=""):
    """Checks that `tensor`'s batch has at least `m` rows, one per
    microbatch (a known size now, an unknown one by the returned Assert
    ops, as `check_divisible`): `check_enough(tf.zeros([3, 2]), 4)`
    raises "... of 3 samples is smaller than microbatches=4 ..."."""
    return _check(tensor, 0, lambda rows: rows >= m, FEW_ERROR, what, m,
                  f" (a microbatch needs at least one sample). {advice}")


def check_last_batch(samples, batch_size, m, replicas=1,
                     what="training data", divisible=False,
                     batch_arg="batch_size", trim=True,
                     fails="training would fail at the end of the first "
                     "epoch"):
    """Raises before training when data of `samples` rows, in batches of
    `batch_size`, ends with a batch that would certainly fail at the end
    of the first epoch (`check_enough`, `check_divisible`): some
    replica's part of it is smaller than `m` (a microbatch needs at least
    one sample), or, with `divisible` (a loss needing equal
    microbatches), some part does not divide into `m`.

    Only a certain failure is raised: however a last batch of `r` rows is
    split over the replicas, one of them holds at most `r // replicas`,
    and parts that each divide into `m` add up to a multiple of `m`. (A
    larger last batch may still fail: how TensorFlow splits a partial
    batch depends on the strategy. Within a process each replica in turn
    gets `ceil(r / replicas)` rows, so 7 rows over 3 replicas are 3, 3
    and 1; across worker processes full per-replica batches come first,
    so 17 rows in batches of 32 over 2 workers are 16 and 1.)

    `batch_arg` names the argument to change, `trim=False` leaves out the
    advice to drop the last samples (under `validation_split` that moves
    the split), `fails` says what would fail.

    Example:

    ```python
    from keras_smp.pipeline.microbatch import check_last_batch
    check_last_batch(100, 32, 4)             # last batch: 4 rows, fine
    check_last_batch(96, 32, 4, replicas=2)  # no partial batch
    try:
        check_last_batch(99, 32, 4, replicas=2)  # 3 rows: 1 or 2 each
    except ValueError as e:
        assert "last batch has 3 samples" in str(e)
    ```
    """
    last = samples % batch_size
    if not last:
        return
    if divisible:
        if not last % m:
            return
        problem = ((f"split over {replicas} replicas, its parts cannot all "
                    "divide" if replicas > 1 else "it does not divide")
                   + f" into microbatches={m} (a loss with reduction="
                   "'mean_with_sample_weight' that overrides "
                   "`Loss.__call__` needs equal microbatches)")
    elif last // replicas >= m:
        return
    else:
        problem = ((f"split over {replicas} replicas, a replica's part of "
                    "it " if replicas > 1 else "it ")
                   + f"{FEW_ERROR}={m} (a microbatch needs at least one "
                   "sample)")
    raise ValueError(
        f"The {what}'s last batch has {last} samples ({samples} samples in "
        f"batches of {batch_size}): {problem}, so {fails}. Use a "
        f"{batch_arg} that divides the "
        f"{samples} samples"
        + (f", or leave the last {last} samples out." if trim else "."))


def sizes(rows, m):
    """The rows of each of `m` microbatches of a batch of `rows`: as equal
    as can be, the larger first (Python ints for a known `rows`, else an
    int32 tensor).

    Example:

    ```python
    from keras_smp.pipeline.microbatch import sizes
    assert sizes(10, 4) == [3, 3, 2, 2] and sizes(8, 4) == [2, 2, 2, 2]
    ```
    """
    if isinstance(rows, int):
        return [rows // m + (i < rows % m) for i in range(m)]
    rows = tf.convert_to_tensor(rows, tf.int32)
    return rows // m + tf.cast(tf.range(m) < rows % m, tf.int32)


def pad(tensor, m):
    """`tensor` with rows appended (copies of its first rows) so that its
    batch divides into `m` microbatches; unchanged when it already does.

    For steps without a backward: the padding's outputs are dropped.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.microbatch import pad
    assert pad(tf.range(5), 4).numpy().tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert pad(tf.range(4), 4).shape == [4]
    ```
    """
    t = _tensor(tensor)
    static = t.shape[0] if t.shape.rank else None
    if static is not None and static % m == 0:
        return t
    n = rows(t)
    padded = (n + m - 1) // m * m
    if isinstance(t, tf.SparseTensor):
        # Copies of its rows one after the other (2 do when it has at
        # least m rows, else up to m), cut to `padded`.
        copies = tf.cond(n >= m, lambda: tf.sparse.concat(0, [t, t]),
                         lambda: tf.sparse.concat(0, [t] * m))
        out = tf.sparse.slice(
            copies, tf.zeros_like(copies.dense_shape),
            tf.concat([[tf.cast(padded, tf.int64)], copies.dense_shape[1:]],
                      0))
        if t.shape.rank is not None:
            out.set_shape([None] + t.shape[1:].as_list())
        return out
    return tf.gather(t, tf.range(padded) % n)


def split_rows(tensor, m, sizes=None):
    """`tensor` split along its rows into `m` equal parts (or parts of
    `sizes`): `tf.split`, also for sparse and ragged tensors.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.microbatch import split_rows
    r = tf.ragged.constant([[1], [2, 3], [4, 5, 6]])
    assert [p.to_list() for p in split_rows(r, 2, [2, 1])] == [
        [[1], [2, 3]], [[4, 5, 6]]]
    s = tf.sparse.from_dense([[0, 1], [2, 0], [0, 3], [4, 0]])
    assert tf.sparse.to_dense(split_rows(s, 2)[1]).numpy().tolist() == [
        [0, 3], [4, 0]]
    ```
    """
    if not isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        return tf.split(tensor, m if sizes is None else sizes, axis=0, num=m)
    # Equal parts of a batch that divides (`check_divisible` first).
    static = tensor.shape[0] if tensor.shape.rank else None
    sizes = ([(rows(tensor) if static is None else static) // m] * m
             if sizes is None else [sizes[i] for i in range(m)])
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    if isinstance(tensor, tf.RaggedTensor):
        return [tensor[start:start + size]
                for start, size in zip(starts, sizes)]
    rest = tensor.dense_shape[1:]
    parts = [tf.sparse.slice(
        tensor,
        tf.concat([[tf.cast(start, tf.int64)], tf.zeros_like(rest)], 0),
        tf.concat([[tf.cast(size, tf.int64)], rest], 0))
        for start, size in zip(starts, sizes)]
    if tensor.shape.rank is not None:  # (a slice's shape is dynamic)
        for part, size in zip(parts, sizes):
            part.set_shape([size if isinstance(size, int) else None]
                           + tensor.shape[1:].as_list())
    return parts


def split(structure, m, axis=0, sizes=None):
    """Splits every tensor of a nested `structure` into `m` equal parts
    (or parts of `sizes`, see `sizes()`).

    Returns a list of `m` structures like `structure`; `None` leaves stay
    `None`, and `structure=None` gives `[None] * m`.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.microbatch import split
    parts = split({"a": tf.range(4), "b": None}, 2)
    assert parts[1]["a"].numpy().tolist() == [2, 3] and parts[1]["b"] is None
    ```
    """
    if structure is None:
        return [None] * m
    flat = tf.nest.flatten(structure)
    parts = [None if t is None else (
        split_rows(t, m, sizes) if axis == 0 else tf.split(
            t, m if sizes is None else sizes, axis=axis, num=m))
        for t in flat]
    return [tf.nest.pack_sequence_as(
        structure, [None if p is None else p[i] for p in parts])
        for i in range(m)]


def merge(parts, axis=0):
    """Concatenates per-microbatch tensors (the inverse of `split`).

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.microbatch import merge, split
    x = tf.range(6)
    assert merge(split(x, 3)).numpy().tolist() == [0, 1, 2, 3, 4, 5]
    ```
    """
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    return tf.concat(parts, axis=axis)
