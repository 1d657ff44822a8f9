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
half is whether the ids' shape changes with the batch size: the model is
traced at two batch sizes (`note_reads` notes each trace's ids, `batch_free`
compares them; `StagedGraph.batch_free_sparse` for a pipeline's stages,
`runtime.patches` for a plain model's step).

The same holds across data-parallel replicas: TensorFlow sums a sparse
gradient over the replicas by gathering their rows, one after the other,
which is one device's layout for token lookups but not for a position
embedding's. Within `summed_by_position(variables)` (set by the step),
`all_reduce` sums those variables' rows position by position instead (the
rows' values all-reduced as a dense tensor, fused with the dense
gradients when their shape is known; the ids kept).

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

# Ids' shapes per read of weights 1 and 2 traced at batch sizes 2 and 3:
# weight 1's do not change with the batch.
from keras_smp.runtime.sparse import batch_free
assert batch_free({1: [(8,)], 2: [(16,)]}, {1: [(8,)], 2: [(24,)]}) == {1}
```
"""

import contextlib
import threading

import tensorflow as tf

from keras_smp.runtime import deferred

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


# Ops a sparse gradient's ids pass through unchanged (values or order).
_ID_PASS_OPS = frozenset({"Identity", "Cast", "Reshape"})
# {output index: op types}: outputs holding distinct ids.
_DISTINCT_IDS = {0: frozenset({"Unique", "UniqueV2"}),
                 1: frozenset({"SparseSegmentSumGradV2",
                               "SparseSegmentMeanGradV2",
                               "SparseSegmentSqrtNGradV2"})}
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


def from_unique(indices):
    """Whether the ids `indices` of a traced sparse gradient are the
    distinct ids of one lookup: `tf.unique`'s first output (Keras' matmul
    of a sparse input, `tf.nn.embedding_lookup_sparse`, gathers each id
    once, its row summed over the batch) or the ids a sparse segment
    reduction's gradient gives (an `Embedding` of sparse ids), passed on
    unchanged, also through function calls. One device's gradient then
    holds each id of the batch once: the parts of a split batch (the
    microbatches', the replicas') are summed by id (`summed_by_id`).
    False for anything else: ids with a row per sample, the reads of two
    lookups put together (`distinct_lookups`), and eager tensors (no
    graph to read: `run_eagerly=True` keeps each part's rows)."""
    return distinct_lookups(indices, concatenated=False) == 1


def distinct_lookups(indices, concatenated=True):
    """How many lookups of distinct ids (see `from_unique`) the ids
    `indices` of a traced sparse gradient put together (`tf.concat`, as a
    tape adds a weight's reads: a layer called on two sparse inputs), or
    0 when any part of them is something else. `concatenated=False`:
    only one lookup's, passed on unchanged."""
    from keras_smp.runtime import tf_private

    # (tensor, the call ops whose function graphs it is in, innermost
    # last: a function's input is its caller's input)
    stack, found = [(indices, ())], 0
    try:
        while stack:
            t, calls = stack.pop()
            op = t.op
            if op.type in _DISTINCT_IDS.get(t.value_index, ()):
                found += 1
            elif op.type in _ID_PASS_OPS:
                stack.append((op.inputs[0], calls))
            elif op.type == "ConcatV2" and concatenated:
                # (the last input: the axis)
                stack.extend((x, calls) for x in op.inputs[:-1])
            elif op.type in _CALL_OPS:
                graph = tf_private.called_graph(op)
                if graph is None:
                    return 0
                stack.append((graph.outputs[t.value_index], calls + (op,)))
            elif op.type == "Placeholder" and calls:
                inputs = [id(x) for x in op.graph.inputs]
                if id(t) not in inputs:
                    return 0
                stack.append((calls[-1].inputs[inputs.index(id(t))],
                              calls[:-1]))
            else:
                return 0
        return found
    except AttributeError:  # an eager tensor
        return 0


_warned_lookups = set()


def warn_split_lookups(variable, lookups, parts):
    """Once per weight: `variable`'s gradient (None: one of SMP's custom
    loop, whose variable is not known) puts together `lookups` (> 1)
    lookups of distinct ids, and the batch is split into `parts`."""
    name = (getattr(variable, "path", None) or getattr(variable, "name", None)
            if variable is not None else None)
    what = (f"the weight {name!r}" if name else
            "a weight whose gradient `StepOutput.accumulate` sums")
    if what in _warned_lookups:
        return
    _warned_lookups.add(what)
    import warnings

    warnings.warn(
        f"keras-smp: {what} is read by {lookups} lookups of "
        "distinct ids (a layer called on several sparse inputs), and this "
        f"step splits the batch into {parts}: one device's sparse gradient "
        "holds each id once per lookup, summed over the batch; the parts' "
        "gradients hold it once per part and lookup, which optimizers "
        "other than SGD (Adam, Adagrad, RMSprop, ...) apply one row after "
        "another, so the step differs from one device's (SGD steps alike). "
        "Give each sparse "
        "input a layer of its own, or concatenate the inputs into one "
        "sparse input, or use microbatches=1 with one replica.",
        stacklevel=3)


def summed_by_id(grad):
    """The sparse gradient `grad` (`tf.IndexedSlices`) with each id once,
    its rows summed, in order of first appearance: what one device's
    lookup of distinct ids (`from_unique`) gives for the batch whose
    parts' gradients `grad` concatenates (an optimizer like Adam applies
    a repeated id's rows one after the other, not their sum). Its ids are
    `tf.unique`'s: `from_unique` holds for the result.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.runtime.sparse import summed_by_id

    g = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]),
                         tf.constant([3, 0, 3]), tf.constant([5, 1]))
    s = summed_by_id(g)
    assert s.indices.numpy().tolist() == [3, 0]
    assert s.values.numpy().tolist() == [[5.0], [2.0]]
    ```
    """
    ids, where = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, where, tf.size(ids))
    return tf.IndexedSlices(values, ids, grad.dense_shape)


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


def note_reads(found, seen, outputs, training, free=None):
    """Notes in `found` (`id(weight) -> sparse?`) the weights of `seen`
    (`(weight, value read)` pairs of one traced call: values of the traced
    graph, `patches.variable_reads`), and in training whether the
    gradient of the call's `outputs` (its added losses included) for each
    trainable one is sparse (`tf.IndexedSlices`: an `Embedding` lookup)
    in every read of it (`None`: an inference read, a non-trainable
    weight, or no gradient: the read reaches no output). A gradient
    TensorFlow cannot take here counts as dense. `free`: a dict taking
    `id(weight) -> [per read: the static shape of its sparse gradient's
    ids when they are computed from constants and shapes alone
    (`from_shapes`), else None]`."""
    outs = [t for t in tf.nest.flatten(outputs)
            if tf.is_tensor(t) and t.dtype.is_floating]
    wanted = [i for i, (w, _) in enumerate(seen)
              if getattr(w, "trainable", False)]
    grads = [None] * len(seen)
    if training and outs and wanted:
        try:
            found_grads = tf.gradients(outs, [seen[i][1] for i in wanted],
                                       unconnected_gradients="none")
        except (LookupError, ValueError, TypeError):
            found_grads = [tf.zeros([])] * len(wanted)  # (dense)
        for i, grad in zip(wanted, found_grads):
            grads[i] = grad
    for (w, _), grad in zip(seen, grads):
        found.setdefault(id(w), None)
        if grad is not None:
            sparse = isinstance(grad, tf.IndexedSlices)
            before = found[id(w)]
            found[id(w)] = sparse if before is None else before and sparse
            if free is not None:
                free.setdefault(id(w), []).append(
                    tuple(grad.indices.shape)
                    if sparse and from_shapes(grad.indices) else None)


def batch_free(first, second):
    """The weights (ids) whose sparse gradients' ids are computed from
    constants and shapes alone in every read and have the same fully known
    shape in two traces at different batch sizes (`note_reads`' `free`
    dicts): their rows are the same for any batch (position embeddings).

    >>> sorted(batch_free({1: [(8,)], 2: [(16,)], 3: [None]},
    ...                   {1: [(8,)], 2: [(24,)], 3: [None]}))
    [1]
    """
    return {w for w, shapes in first.items()
            if shapes == second.get(w) and all(
                shape is not None and None not in shape for shape in shapes)}


# `summed_by_position`'s variables: `id -> [entries, name]`. Process-wide
# (a multiset, entered by each replica's thread): Keras' loss-scale
# optimizer applies the gradients in threads of its own (`merge_call`).
_by_position = {}
_by_position_lock = threading.Lock()


@contextlib.contextmanager
def summed_by_position(variables):
    """Within, `all_reduce` sums the sparse gradients of `variables`
    (Keras or TensorFlow variables: those `batch_free` finds) position by
    position across the replicas."""
    from keras_smp.runtime import keras_private

    names = {}
    for v in variables:
        for x in (v, keras_private.backing_variable(v)):
            names[id(x)] = getattr(v, "path", None) or v.name
    with _by_position_lock:
        for key, name in names.items():
            _by_position.setdefault(key, [0, name])[0] += 1
    try:
        yield
    finally:
        with _by_position_lock:
            for key in names:
                entry = _by_position[key]
                entry[0] -= 1
                if not entry[0]:
                    del _by_position[key]


def _distributed(variable):
    return isinstance(getattr(variable, "value", variable),
                      tf.distribute.DistributedValues)


def local_copy(variable, of_value=False):
    """A Keras variable's local `tf.Variable`: this replica's copy of a
    mirrored one (outside `strategy.run` its handle is not available);
    `of_value`: the variable's `value` otherwise (else the variable)."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return value._get_on_device_or_primary()
    return value if of_value else variable


# Called with the sources of every gradient `held_gradients` takes, before
# it takes it (`check_gradient_sources`).
_source_checks = []


def check_gradient_sources(check):
    """From now on `check(sources)` runs before `held_gradients` takes a
    gradient (`smp.init` with one stage per process: a gradient call
    leaving out a stage's weights is refused as the step is traced)."""
    if check not in _source_checks:
        _source_checks.append(check)


def held_gradients(sources, gradients):
    """Gradients of `sources` (a flat list) with another pipeline stage's
    weights' `None` (one stage per process: they have no storage here):
    `gradients(held)` computes those of the others, in order."""
    for check in _source_checks:
        check(sources)
    held = [v for v in sources if not deferred.holds_no_copy(v)]
    found = iter(gradients(held) if held else [])
    return [None if deferred.holds_no_copy(v) else next(found)
            for v in sources]


class _Sources(threading.local):
    noted = None  # {id(gradient): (gradient, variable)} while noting


_sources = _Sources()


@contextlib.contextmanager
def noting_sources():
    """Within: the variable of each gradient (sparse or dense) that
    `optimizer.get_gradients` (`note_source`) or `tf.GradientTape.gradient`
    returns is recorded; yields `source(gradient)`, the variable of a
    gradient noted (or `None`)."""
    before, _sources.noted = _sources.noted, {}
    noted = _sources.noted
    original = tf.GradientTape.gradient

    def gradient(self, target, sources, *args, **kwargs):
        flat = tf.nest.flatten(sources)
        if any(deferred.holds_no_copy(v) or _distributed(v) for v in flat):
            # One stage per process (`smp.init`'s strategy, outside
            # `strategy.run`): another stage's weight has no gradient here
            # (`None`), a mirrored one's is its local copy's.
            grads = tf.nest.pack_sequence_as(sources, held_gradients(
                flat, lambda held: original(
                    self, target, [local_copy(v) for v in held], *args,
                    **kwargs)))
        else:
            grads = original(self, target, sources, *args, **kwargs)
        for variable, grad in zip(tf.nest.flatten(sources),
                                  tf.nest.flatten(grads)):
            note_source(grad, variable)
        return grads

    tf.GradientTape.gradient = gradient
    try:
        yield lambda grad: noted.get(id(grad), (None, None))[1]
    finally:
        tf.GradientTape.gradient = original
        _sources.noted = before


def note_source(grad, variable):
    """Notes that the gradient `grad` (sparse or dense) is `variable`'s
    (inside `noting_sources`; the gradient is kept alive with it)."""
    if _sources.noted is not None and isinstance(
            grad, (tf.IndexedSlices, tf.Tensor)):
        _sources.noted[id(grad)] = (grad, variable)


def active():
    """Whether a step sums some sparse gradients by position."""
    return bool(_by_position)


def same_counts(counts, reduce_sum, replicas):
    """`(same, mean)`: for each of the integer scalars `counts`, whether
    every replica holds the same value, and their mean, from one
    all-reduce (`reduce_sum` of a float64 vector over the `replicas`).
    The same on every replica iff replicas x the sum of squares is the
    square of the sum (exact in float64 below 2^26)."""
    c = tf.cast(tf.stack(counts), tf.float64)
    n = len(counts)
    summed = reduce_sum(tf.concat([c, c * c], 0))
    return (tf.equal(summed[n:] * replicas, summed[:n] * summed[:n]),
            summed[:n] / replicas)


def all_reduce(reduce, grads, variables, context):
    """`reduce(grads) -> grads` (the sum of `grads`, `None`s kept, over
    the replicas of the replica context `context`), with the sparse
    gradient of each variable `summed_by_position` summed as one device
    computes it for the replicas' batches put together: the ids kept, the
    rows added
    position by position (their values all-reduced as one dense tensor).
    Other gradients go as they are (a sparse one's rows gathered, one
    replica's after another's, which is one device's layout for ids with
    a row per sample). Where the number of ids is not known when traced
    (a sequence length left unknown), the replicas first check they hold
    the same number (a small all-reduce), and fail naming the variable
    rather than sum rows of different positions."""
    with _by_position_lock:
        names = {key: entry[1] for key, entry in _by_position.items()}
    marked = [i for i, (g, v) in enumerate(zip(grads, variables))
              if isinstance(g, tf.IndexedSlices) and id(v) in names]
    replicas = context.num_replicas_in_sync
    if not marked or replicas <= 1:
        return reduce(list(grads))
    grads = list(grads)
    unknown = [i for i in marked
               if grads[i].values.shape[:1].num_elements() is None]
    checks = []
    if unknown:
        with tf.device(grads[unknown[0]].values.device):  # (its stage's)
            # (float64 counts: exact, never compressed with the gradients,
            # `keras_smp.distribute.compression.compresses`)
            same, mean = same_counts(
                [tf.shape(grads[i].indices)[0] for i in unknown],
                lambda t: context.all_reduce(tf.distribute.ReduceOp.SUM, t),
                replicas)
        for k, i in enumerate(unknown):
            checks.append(tf.debugging.Assert(same[k], [
                f"keras-smp: the data-parallel replicas hold different "
                f"numbers of ids in the sparse gradient of "
                f"{names[id(variables[i])]} (a position "
                "embedding: ids that do not depend on the batch, whose rows "
                "one device adds position by position). Give every "
                "replica the same length of batch (pad the global batch "
                "before it is distributed: `padded_batch`, then `fit` or "
                "`strategy.experimental_distribute_dataset`).",
                "Ids on this replica:", tf.shape(grads[i].indices)[0],
                "mean over the replicas:", mean[k]]))
    with tf.control_dependencies(checks):
        values = [tf.identity(grads[i].values) if checks
                  else grads[i].values for i in marked]
    sent = list(grads)
    for i, v in zip(marked, values):
        sent[i] = v
    out = list(reduce(sent))
    for i in marked:
        out[i] = tf.IndexedSlices(out[i], grads[i].indices,
                                  grads[i].dense_shape)
    return out
