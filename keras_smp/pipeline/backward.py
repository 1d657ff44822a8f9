"""The backward pass of one pipeline stage for one microbatch.

One function computes it for every schedule and transport, so placement,
tied weights and sparse gradients are handled once:

- `tf.gradients` places each gradient op with its forward op, so a stage's
  backward runs on the stage's device (`tf.GradientTape.gradient` would put
  it on the device active at the call);
- the gradient stops at the stage's inputs: a weight also used by an
  earlier stage (tied) gets only this stage's part of its gradient here;
  the earlier stage adds its own part;
- gradients may be `tf.IndexedSlices` (an `Embedding` or a `tf.gather`):
  `accumulate` sums them over microbatches without densifying.

Zero-bubble schedules split a backward in two (`I`, then `W`):
`input_backward` computes the gradients of the stage's inputs and of the
tensors where weights meet activations (`weight_meetings`: a `MatMul`'s
output, a bias add's), nothing else; `weight_backward` later turns those
saved gradients into the weights' gradients, one meeting op at a time (for
a `Dense` layer: `x^T . dY`), so the previous stage gets its gradients
without waiting for the weight-gradient matmuls. Together they compute
exactly what `stage_backward` computes.
"""

import tensorflow as tf

from keras_smp.runtime.sparse import add_rows


def stage_backward(outputs, inputs, variables, output_grads=None):
    """Gradients of one stage's microbatch w.r.t. its inputs and variables.

    Must be called inside a `tf.function` (it uses `tf.gradients`).

    Args:
        outputs: the tensors the stage produced (on the last stage, the
            scalar loss of the microbatch, as a one-element list).
        inputs: the tensors the stage received (empty on the first stage).
        variables: the `tf.Variable`s to differentiate.
        output_grads: gradients of the loss w.r.t. `outputs`, from the next
            stage (`None` on the last stage).

    Returns:
        `(input_grads, variable_grads)`: lists aligned with `inputs` and
        `variables`: an input unconnected to the outputs gets zeros (the
        previous stage receives a tensor), a variable gets `None` (as
        `tf.GradientTape` gives it: the optimizer then leaves it alone, as
        Keras does, e.g. an output's head when the loss names only the
        other outputs).

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.backward import stage_backward

    w = tf.Variable(3.0)

    @tf.function
    def grads(x):
        y = x * w
        return stage_backward([y], [x], [w], [tf.ones_like(y)])

    (dx,), (dw,) = grads(tf.constant(2.0))
    assert float(dx) == 3.0 and float(dw) == 2.0
    ```
    """
    inputs, variables = list(inputs), list(variables)
    outputs, output_grads = _floating(outputs, output_grads)
    floating = [t for t in inputs if t.dtype.is_floating]
    grads = tf.gradients(
        outputs, floating + variables, grad_ys=output_grads,
        stop_gradients=floating)
    got = iter(grads[:len(floating)])
    input_grads = [next(got) if t.dtype.is_floating else None
                   for t in inputs]
    input_grads = [tf.zeros_like(t) if g is None else g
                   for t, g in zip(inputs, input_grads)]
    return input_grads, grads[len(floating):]


def weight_meetings(ops, inputs, variables, outputs=None):
    """Where the stage's weights meet activations among the ops of one
    forward pass.

    Args:
        ops: the ops the forward pass created, in creation order.
        inputs: the tensors the stage received (the activations' sources).
        variables: the `tf.Variable`s being trained (their reads are the
            weights; other variables' reads, such as a seed generator's or
            moving statistics, count as constants).
        outputs: the stage's outputs (the loss on the last stage), when
            known: one computed from weights alone cannot be split.

    Returns:
        A list of `(op, weight_inputs)`: each op with an input computed
        from the stage's inputs and an input computed from the weights only
        (their `ReadVariableOp`s and ops of those alone), and the positions
        of the latter; or `None` when the forward pass cannot be split: a
        weight reaches an op other than its read as a resource (a function
        call or XLA-compiled stage capturing it, a sparse read), or meets
        activations in an op whose gradient is one unit (a custom gradient
        such as a recomputed layer, a function call, control flow), or a
        stage output comes from weights alone, or no weight is read.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.backward import weight_meetings

    w = tf.Variable(tf.ones([2, 2]))

    @tf.function
    def meetings(x):
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        y = tf.nn.relu(x @ w)
        found = weight_meetings(graph.get_operations()[before:], [x], [w])
        return tf.constant([op.type for op, _ in found])

    assert meetings(tf.ones([3, 2])).numpy().tolist() == [b"MatMul"]
    ```
    """
    handles = _handles_in_graph(variables)
    # (a sparse input: its component tensors)
    act = {t.ref() for t in tf.nest.flatten(inputs, expand_composites=True)}
    weighted = set()
    found = []
    reads = 0
    for op in ops:
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        trained = [t for t in resources if t.ref() in handles]
        if op.type == "ReadVariableOp" and trained:
            weighted.update(t.ref() for t in op.outputs)
            reads += 1
            continue
        if trained:
            return None
        a_in = [i for i, t in enumerate(op.inputs) if t.ref() in act]
        w_in = [i for i, t in enumerate(op.inputs) if t.ref() in weighted]
        if a_in:
            act.update(t.ref() for t in op.outputs)
            if w_in:
                if op.type in _WHOLE_GRADIENT_OPS or _overrides_gradient(op):
                    # Its gradient is one unit (a custom gradient such as
                    # a recomputed layer, a function, control flow): split,
                    # W would run it a second time.
                    return None
                found.append((op, w_in))
        elif w_in:
            weighted.update(t.ref() for t in op.outputs)
    if variables and not reads:
        return None  # no weight read seen: nothing to split safely
    if outputs is not None and any(
            t.ref() in weighted for t in outputs if t.dtype.is_floating):
        # A stage output computed from weights alone (a learned constant
        # such as a position embedding): its gradient would reach no
        # meeting op.
        return None
    return found


# Ops whose gradient is computed as one unit: a weight meeting an
# activation there cannot be split into I and W.
_WHOLE_GRADIENT_OPS = frozenset((
    "IdentityN", "PartitionedCall", "StatefulPartitionedCall", "While",
    "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "SymbolicGradient", "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3"))


def _overrides_gradient(op):
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return False
    return True


def _handles_in_graph(variables):
    """`{ref of a variable's resource handle as the current graph sees it:
    the variable's index}` (a `tf.function` captures each handle as a
    placeholder)."""
    graph = tf.compat.v1.get_default_graph()
    inner = {}
    for external, internal in getattr(graph, "captures", ()):
        inner[id(external)] = internal
    refs = {}
    for i, v in enumerate(variables):
        handle = getattr(v, "handle", None)
        if handle is None:
            continue
        refs[inner.get(id(handle), handle).ref()] = i
    return refs


def input_backward(outputs, inputs, meetings, output_grads=None):
    """The first half of a split backward (`I`): input gradients.

    Args:
        outputs, inputs, output_grads: as for `stage_backward`.
        meetings: `weight_meetings(...)` of the microbatch's forward.

    Returns:
        `(input_grads, saved)`: `input_grads` as `stage_backward`'s;
        `saved`, for `weight_backward`: each meeting op with the gradients
        reaching its outputs.
    """
    inputs = list(inputs)
    outputs, output_grads = _floating(outputs, output_grads)
    floating = [t for t in inputs if t.dtype.is_floating]
    met = [(op, w_in, [t for t in op.outputs if t.dtype.is_floating])
           for op, w_in in meetings]
    met_outs = [t for _, _, outs in met for t in outs]
    grads = tf.gradients(
        outputs, floating + met_outs, grad_ys=output_grads,
        stop_gradients=floating)
    got = iter(grads[:len(floating)])
    input_grads = [(next(got) if t.dtype.is_floating else tf.zeros_like(t))
                   for t in inputs]
    input_grads = [tf.zeros_like(t) if g is None else g
                   for t, g in zip(inputs, input_grads)]
    reaching = iter(grads[len(floating):])
    saved = []
    for op, w_in, outs in met:
        pairs = [(t, g) for t, g in zip(outs, [next(reaching) for _ in outs])
                 if g is not None]
        if pairs:
            saved.append((op, w_in, pairs))
    return input_grads, saved


def weight_backward(saved, variables):
    """The second half of a split backward (`W`): the variables' gradients
    from what `input_backward` saved.

    Each meeting op's gradient is taken towards its weight-side inputs only
    (the gradient stops at its activation-side inputs, whose share the
    input half already counted), then carried back to the variables
    through the weight-only ops (reads, casts).

    Returns:
        Gradients aligned with `variables` (`None` where unconnected, as
        `stage_backward`'s).
    """
    variables = list(variables)
    handles = _handles_in_graph(variables)
    direct = [None] * len(variables)
    by_tensor = {}
    for op, w_in, pairs in saved:
        xs, seen = [], set()
        for i in w_in:  # each weight-side tensor once
            if op.inputs[i].ref() not in seen:
                seen.add(op.inputs[i].ref())
                xs.append(op.inputs[i])
        # This op's own partial derivative only: the gradient stops at
        # every input (an input computed from another, such as a read and
        # its cast, would otherwise count the path between them twice).
        local = tf.gradients([t for t, _ in pairs], xs,
                             grad_ys=[g for _, g in pairs],
                             stop_gradients=list(op.inputs))
        for x, g in zip(xs, local):
            if g is None or not x.dtype.is_floating:
                continue
            index = (handles.get(x.op.inputs[0].ref())
                     if x.op.type == "ReadVariableOp" else None)
            if index is not None:
                # A variable's read: its gradient as is (an embedding's
                # stays sparse).
                direct[index] = accumulate(direct[index], g)
                continue
            ref = x.ref()
            tensor, total = by_tensor.get(ref, (x, None))
            by_tensor[ref] = (tensor, accumulate(total, g))
    carried = [None] * len(variables)
    if by_tensor:
        ys = [t for t, _ in by_tensor.values()]
        grad_ys = [dense(g) for _, g in by_tensor.values()]
        carried = tf.gradients(ys, variables, grad_ys=grad_ys)
    return [accumulate(a, b) for a, b in zip(direct, carried)]


def _floating(outputs, output_grads):
    """The floating `outputs` and their gradients: only those carry
    gradients (a Keras mask or token ids crossing a stage boundary get
    zeros of their dtype back)."""
    outputs = list(outputs)
    if output_grads is None:
        return [y for y in outputs if y.dtype.is_floating], None
    pairs = [(y, g) for y, g in zip(outputs, output_grads)
             if y.dtype.is_floating]
    return [y for y, _ in pairs], [g for _, g in pairs]


def variable_gradients(loss, variables):
    """Gradients of a scalar `loss` w.r.t. Keras or TF `variables`.

    Each replica differentiates w.r.t. its own copy of mirrored variables;
    gradient ops are colocated with their forward ops. `None` for a
    variable the loss does not depend on.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.backward import variable_gradients
    w = tf.Variable(2.0)

    @tf.function
    def grads():
        return variable_gradients(w * w, [w])

    assert float(grads()[0]) == 4.0
    ```
    """
    tensors = [_replica_variable(v) for v in variables]
    return tf.gradients(loss, tensors)


def _replica_variable(v):
    """The `tf.Variable` this replica computes with (Keras or TF variable)."""
    # Keras 3 variables wrap a tf.Variable in `.value` (tf.Variable's own
    # `value` is a method).
    value = getattr(v, "value", v)
    if callable(value):
        value = v
    if isinstance(value, tf.distribute.DistributedValues):
        # Inside a replica: this replica's component (on its own device).
        value = value._get_on_device_or_primary()
    return value


def accumulate(total, grad, merge=False, what="a sparse gradient"):
    """`total + grad` for dense or sparse (`tf.IndexedSlices`) gradients.

    Sparse plus sparse stays sparse: the slices are concatenated (a
    lookup with a row per sample: one lookup of the whole batch gives
    their rows one after the other), or with `merge` added position by
    position (`sparse.add_rows`: a lookup whose ids do not depend on the
    batch, which gives the same ids for any batch, each row summed over
    it; `what` names the gradient in the error when the ids differ).
    Sparse plus dense becomes dense.

    Example:

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.backward import accumulate
    a = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    b = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([3, 2]))
    s = accumulate(a, b)
    assert tf.convert_to_tensor(s).numpy().sum() == 4.0
    ```
    """
    if total is None:
        return grad
    if grad is None:
        return total
    sparse = (isinstance(total, tf.IndexedSlices),
              isinstance(grad, tf.IndexedSlices))
    if all(sparse) and merge:
        return add_rows(total, grad, what)
    if all(sparse):
        return tf.IndexedSlices(
            tf.concat([total.values, grad.values], axis=0),
            tf.concat([total.indices, grad.indices], axis=0),
            total.dense_shape)
    if any(sparse):
        return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)
    return total + grad


def dense(grad):
    """`grad` as a dense tensor (for transfers and collectives)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad
