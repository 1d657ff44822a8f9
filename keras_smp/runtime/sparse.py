"""Sparse gradients (`tf.IndexedSlices`) split over microbatches.

Keras optimizers apply a sparse gradient row by row as it comes: Adam adds
each row's square to its second moment, so an id repeated in the slices
updates it otherwise than the rows summed first (`v += (1-b2)(g1^2 - v) +
(1-b2)(g2^2 - v)`, not `(1-b2)((g1+g2)^2 - v)`). Training split into
microbatches is then single-device training only when the microbatches'
slices, put together, hold the rows the whole batch gives:

- a lookup of ids with a row per sample (an `Embedding` of token ids, or
  position ids broadcast over the batch) gives a row per id looked up:
  the whole batch's rows are the microbatches' rows one after the other
  (`tf.concat`), repeated ids included;
- a lookup whose ids neither come from the data nor grow with the batch
  (a position embedding looked up at `ops.arange(length)` and added to
  every row) gives the same rows for any batch, each the sum over the
  batch: the whole batch's rows are the microbatches' rows added position
  by position (`add_rows`).

`from_shapes` is half of telling them apart in a traced graph; the other
half is whether the ids' shape changes with the batch size
(`StagedGraph.batch_free_sparse` traces at two sizes).

Example:

```python
import tensorflow as tf
from keras_smp.runtime.sparse import add_rows
a = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 0]), tf.constant([4, 3]))
b = tf.IndexedSlices(2 * tf.ones([2, 3]), tf.constant([0, 0]),
                     tf.constant([4, 3]))
summed = add_rows(a, b)
assert summed.indices.numpy().tolist() == [0, 0]  # repeats kept
assert summed.values.numpy().tolist() == [[3.0] * 3] * 2
```
"""

import tensorflow as tf

# Ops whose outputs depend on their inputs' shapes only.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank",
                        "VariableShape", "TensorListLength"})


def from_shapes(tensor):
    """Whether `tensor` is computed from constants and tensors' shapes alone:
    from no tensor's values (the model's inputs, variables, function
    arguments) and by no stateful op (a random draw). Such ids are the
    same in every microbatch of a batch. (They may still grow with the
    batch, `ops.zeros(ops.shape(x))`: told by tracing at two sizes.)

    Walks `tensor`'s inputs back through the graph, not into the inputs
    of shape ops; a function call counts by its inputs when it is
    stateless (its body is then pure) and as data when it is stateful.
    """
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _SHAPE_OPS or op.type == "Const":
            continue
        if not op.inputs or op.op_def.is_stateful:
            return False  # a placeholder, a variable, a draw, a call
        stack.extend(t.op for t in op.inputs)
    return True


def add_rows(total, part, what="a sparse gradient"):
    """`total` and `part` (`tf.IndexedSlices` of the same ids in the same
    order) as one: their rows added position by position, the ids (and
    their repeats) kept. Fails when the ids differ (`what` names the
    gradient): they were expected not to depend on the batch."""
    a, b = total.indices, part.indices
    same_size = tf.equal(tf.size(a), tf.size(b))
    same = tf.cond(
        same_size,
        lambda: tf.reduce_all(tf.equal(a, tf.reshape(b, tf.shape(a)))),
        lambda: tf.constant(False))
    check = tf.debugging.Assert(same, [
        f"keras-smp: the ids of {what} differ between microbatches, where "
        "the model's trace found them independent of the batch (computed "
        "from shapes and constants, their number the same at any batch "
        "size). Use microbatches=1, or report the model to keras-smp.",
        a, b],
        summarize=8)
    with tf.control_dependencies([check]):
        return tf.IndexedSlices(total.values + part.values, total.indices,
                                total.dense_shape)
