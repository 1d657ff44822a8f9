"""Sparse gradients (`tf.IndexedSlices`) split over microbatches or replicas.

Keras optimizers apply a sparse gradient row by row as it comes: Adam adds
each row's square to its second moment, so a row repeated in the slices
updates it otherwise than the rows summed first (`v += (1-b2)(g1^2 - v) +
(1-b2)(g2^2 - v)`, not `(1-b2)((g1+g2)^2 - v)`). Training split into parts
is then single-device training only when the parts' slices, put together,
are the slices the whole batch gives:

- a lookup of the data (an `Embedding` of token ids) gives a row per
  looked-up id: the whole batch's slices are the parts' slices one after
  the other (`tf.concat`), repeated ids included;
- a lookup whose ids do not come from the data (a position embedding,
  `Embedding(maxlen)(ops.arange(length))`, added to every row) gives one
  row per id whatever the batch: the whole batch's rows are the parts'
  rows summed id by id (`merge_rows`).

`follows_data` tells the two apart in a traced graph.

Example:

```python
import tensorflow as tf
from keras_smp.runtime.sparse import merge_rows
a = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([4, 3]))
b = tf.IndexedSlices(2 * tf.ones([2, 3]), tf.constant([0, 1]),
                     tf.constant([4, 3]))
merged = merge_rows([a, b])
assert merged.indices.numpy().tolist() == [0, 1]
assert merged.values.numpy().tolist() == [[3.0] * 3] * 2
```
"""

import tensorflow as tf

# Ops whose outputs depend on their inputs' shapes only.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank",
                        "VariableShape", "TensorListLength"})


def follows_data(tensor, sources):
    """Whether `tensor` is computed from the values of `sources` (tensors of
    the same graph), not only from their shapes, constants and variables.

    Walks `tensor`'s inputs back through the graph (not into functions it
    calls: a function call's outputs follow all its inputs).
    """
    targets = {s.op.name for s in sources}
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in targets:
            return True
        if op.type in _SHAPE_OPS:
            continue
        stack.extend(t.op for t in op.inputs)
    return False


def merge_rows(parts):
    """One `tf.IndexedSlices` holding each id of `parts` once, its rows
    summed, in the order the ids first come (the first part's order when
    every part has the same ids: what one lookup of those ids gives for
    the whole batch)."""
    values = tf.concat([p.values for p in parts], axis=0)
    ids = tf.concat([p.indices for p in parts], axis=0)
    unique, where = tf.unique(ids)
    summed = tf.math.unsorted_segment_sum(values, where, tf.size(unique))
    return tf.IndexedSlices(summed, unique, parts[0].dense_shape)
