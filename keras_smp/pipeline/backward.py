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
"""

import tensorflow as tf


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
        `variables` (zeros where unconnected).

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
    outputs = list(outputs)
    # Only floating tensors carry gradients: a Keras mask (bool) or token
    # ids crossing a stage boundary get zeros (of their dtype) back.
    if output_grads is not None:
        pairs = [(y, g) for y, g in zip(outputs, output_grads)
                 if y.dtype.is_floating]
        outputs, output_grads = ([y for y, _ in pairs],
                                 [g for _, g in pairs])
    else:
        outputs = [y for y in outputs if y.dtype.is_floating]
    floating = [t for t in inputs if t.dtype.is_floating]
    grads = tf.gradients(
        outputs, floating + variables, grad_ys=output_grads,
        stop_gradients=floating, unconnected_gradients="zero")
    got = iter(grads[:len(floating)])
    input_grads = [next(got) if t.dtype.is_floating else tf.zeros_like(t)
                   for t in inputs]
    return input_grads, grads[len(floating):]


def variable_gradients(loss, variables):
    """Gradients of a scalar `loss` w.r.t. Keras or TF `variables`.

    Each replica differentiates w.r.t. its own copy of mirrored variables;
    gradient ops are colocated with their forward ops.

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
    return tf.gradients(loss, tensors, unconnected_gradients="zero")


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


def accumulate(total, grad):
    """`total + grad` for dense or sparse (`tf.IndexedSlices`) gradients.

    Sparse plus sparse stays sparse (the slices are concatenated; the
    optimizer sums duplicate rows); sparse plus dense becomes dense.

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
