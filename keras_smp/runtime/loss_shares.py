"""Losses split over replicas (or microbatches) that sum to one device's.

Keras divides a mean loss by what its batch holds: the rows (times the
entries per row), or, under a Keras mask, the unmasked entries. A step
whose batch is split computes each part's loss with the part's own
divisor, so the parts' losses, averaged, equal the batch's only when the
parts hold equal shares. They do not when a batch does not divide evenly
(a partial last batch of 27 rows split 14/13, or 16/11, over two
replicas) or when a mask keeps different numbers of entries in each part
(padded token sequences).

Here a part's loss is scaled by `parts x its share of the divisor`: its
output's sample weights for the compiled loss (a scalar scales any loss
shape), the rows' share for losses layers add in `call` (activity
regularizers are divided by the batch's rows). A loss dividing by its
sample weights' sum (`"mean_with_sample_weight"`) cannot be scaled through
its weights (the scale cancels): each part (a replica's, a microbatch's)
divides by all parts' sum instead (`divided_by`,
`divided_by_all_weights`). The shares of replicas are
summed across them (one small all-reduce per step, only where a share
can differ). Loss-weight bookkeeping only: what the losses are, which
outputs they use and how Keras lays out sample weights is read through
`keras_private`.
"""

import contextlib
import threading
import warnings

import keras
import tensorflow as tf

from keras_smp.runtime import keras_private

MEANS = ("sum_over_batch_size", "mean")


def reduction_of(loss):
    """A compiled Keras loss's reduction (`"sum_over_batch_size"` for
    loss functions without one, as Keras wraps them)."""
    fn = getattr(loss, "fn", loss)
    return (getattr(fn, "reduction", None) or getattr(loss, "reduction", None)
            or "sum_over_batch_size")


def custom_mean_with_sample_weight(model):
    """Whether a compiled loss of `model` with
    `reduction="mean_with_sample_weight"` reduces itself (overrides
    `Loss.__call__`): its parts cannot be divided by the whole batch's
    weights (`divided_by`), so it needs equal parts without weights or
    masks."""
    return any(reduction_of(loss) == "mean_with_sample_weight"
               and not divides_by_weights(loss)
               for loss in keras_private.compiled_loss_objects(model))


def divides_by_weights(loss):
    """Whether `loss` (a compiled Keras loss) is reduced by Keras'
    `Loss.__call__` with `reduction="mean_with_sample_weight"` (a
    subclass overriding `__call__` reduces as it likes: left as it is)."""
    return (reduction_of(loss) == "mean_with_sample_weight"
            and isinstance(loss, keras.losses.Loss)
            and type(loss).__call__ is keras.losses.Loss.__call__)


def count_batch_values_per_row(model, y, y_pred):
    """Makes `model`'s compiled mean losses count a value that their
    `call` gives for a whole part of a split batch (one scalar: a loss
    function that reduces over the rows itself, `ops.mean(...)`) as the
    value of each of the part's rows.

    On one device Keras reduces such a scalar as it is (the user means it
    as the batch's mean). `tf.distribute` replicas divide per-row mean
    losses by their number (`scale_loss_for_distribution`) but not such
    a value, so their summed gradients were the replicas' count times one
    device's (stock Keras under `MirroredStrategy` too), and the parts'
    shares (`scaled_sample_weights`) could not weigh it. Filled over the
    part's rows it is reduced as per-row values are: replicas and
    microbatches then count by their shares of the rows. Only while a
    split batch's part is computed (`computing_parts`): a whole batch
    keeps Keras' own reduction. With sample weights or a Keras mask on
    the output, the value is no longer a scalar once Keras weighs it, and
    Keras' own reduction stays, with a warning: one device weighs the
    batch's value by the whole batch's mean weight, each part by its own
    part's, which no sum of the parts can turn into one device's.
    `"sum"` and unreduced (`None`) losses and losses with a `__call__` of
    their own are left as they are (a scalar that is the part's *sum* is
    taken for its mean: give such a loss `reduction="sum"`). Builds the
    compiled loss from `y` and `y_pred` if Keras has not; idempotent.

    Example:

    ```python
    import keras
    import tensorflow as tf
    from keras_smp.runtime import keras_private
    from keras_smp.runtime import loss_shares

    def batch_mse(y_true, y_pred):  # reduces over the batch itself
        return keras.ops.mean((y_true - y_pred) ** 2)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", loss=batch_mse)
    x, y = tf.ones([4, 2]), tf.zeros([4, 1])
    loss = keras_private.compiled_loss(model)
    before = float(loss(y, model(x)))
    loss_shares.count_batch_values_per_row(model, y, model(x))
    assert float(loss(y, model(x))) == before  # a whole batch: as Keras
    with loss_shares.computing_parts("2 replicas", {(): (False, False)}):
        part = float(loss(y, model(x)))  # filled, then the mean of 4 rows
    assert abs(part - before) <= 1e-6 * abs(before)
    ```
    """
    if keras_private.compiled_loss(model) is None:
        return
    keras_private.compiled_loss_entries(model, y, y_pred)  # built
    keras_private.rewrap_compiled_losses(model, _per_row)


def weighted_or_masked(model, y, y_pred, sample_weight):
    """`{path: (weighted, masked)}` of each compiled loss's output: given
    sample weights of its own (the step's `sample_weight`), holding a
    Keras mask (read from `y_pred` as the model gave it: the `y_pred`
    that `Loss.call` gets is converted to the loss's dtype, which drops
    the mask where the dtype changes, e.g. a float16 output)."""
    if keras_private.compiled_loss(model) is None:
        return {}
    entries = keras_private.compiled_loss_entries(model, y, y_pred)
    flat = keras.tree.flatten(y_pred)
    index = keras_private.compiled_loss_output_index(model, y_pred,
                                                     len(flat))
    return {path: (weights_at(path, sample_weight) is not None,
                   keras_private.keras_mask(flat[index[path]]) is not None)
            for path, _ in entries}


class _Parts(threading.local):
    """What the compiled loss computing in this thread (a replica's) is
    a part of: `None` (a whole batch), or `(parts, {path: (weighted,
    masked)})`."""

    current = None


_parts = _Parts()


@contextlib.contextmanager
def computing_parts(parts, outputs):
    """While the compiled loss computes one of `parts` (a description,
    e.g. "2 replicas"; None: a whole batch) of a step whose outputs are
    `outputs` (`weighted_or_masked`): a loss giving one value for its
    part then counts it as each row's, or warns where the parts cannot
    add up to the batch's (`count_batch_values_per_row`)."""
    before = _parts.current
    _parts.current = None if parts is None else (parts, outputs)
    try:
        yield
    finally:
        _parts.current = before


def _per_row(loss, path):
    """`loss`, or a copy whose `call` fills a scalar value over the
    output's rows while a part of a split batch is computed (see
    `count_batch_values_per_row`)."""
    if (getattr(loss, "_smp_per_row", False)
            or not isinstance(loss, keras.losses.Loss)
            or type(loss).__call__ is not keras.losses.Loss.__call__
            or loss.reduction not in MEANS + ("mean_with_sample_weight",)):
        return loss

    coupled = _couples_rows(loss)

    def call(own, y_true, y_pred):
        out = own(y_true, y_pred)
        if _parts.current is not None and coupled:
            _warn_coupled_rows(loss.name, _parts.current[0], coupled)
        elif (_parts.current is not None and loss.reduction in MEANS
                and keras_private.keras_mask(out) is not None
                and not keras_private.masks_by_labels(loss)):
            # ("mean_with_sample_weight": divided by all parts' weights,
            # its values' mask included, or refused: `divided_by`)
            _warn_own_mask(loss.name, _parts.current[0])
        values = keras.ops.convert_to_tensor(out)
        first = keras.tree.flatten(y_pred)[0]
        if (_parts.current is None or values.shape.rank != 0
                or first.shape.rank == 0):
            return values
        parts, outputs = _parts.current
        weighted, masked = outputs.get(path, (False, False))
        if weighted or masked:
            # Keras weighs the value by the part's weights (no longer a
            # scalar: divided by the replicas as per-row losses are).
            _warn_weighted_parts(loss.name, parts, weighted, masked)
            return values
        # ([rows, 1]: never squeezed to a scalar against a scalar factor)
        return tf.fill(tf.stack([tf.shape(first)[0], 1]), values)

    proxy = keras_private.loss_with_call(loss, call)
    proxy._smp_per_row = True
    return proxy


_warned = set()


def _first_time(key):
    """Whether a warning keyed `key` (its kind, the loss's name) is given
    now: once per process."""
    if key in _warned:
        return False
    _warned.add(key)
    return True


def _warn_weighted_parts(name, parts, weighted, masked):
    """Once per loss: a value for the whole batch weighed by its part's
    sample weights or mask (see `count_batch_values_per_row`)."""
    if not _first_time(name):
        return
    what = " and ".join(
        (["sample weights (or class_weight)"] if weighted else [])
        + (["a Keras mask on its output"] if masked else []))
    warnings.warn(
        f"keras-smp: the loss {name!r} returns one value for the whole "
        "batch (it reduces over the rows itself; Keras' own losses do so "
        "on outputs of shape (batch,)), and this step splits the batch "
        f"into {parts} with {what}: each part's value is weighed by its "
        "own part's weights, so the step's loss and gradients differ from "
        "one device's (which weighs the batch's value by the whole batch's "
        "weights) where the parts' mean weights differ. Return one loss "
        "per row to train as on one device (reduce over the other axes "
        "only, e.g. `ops.mean(..., axis=-1)`; for Keras' losses give the "
        "outputs and targets the shape (batch, 1)).", stacklevel=2)


def _couples_rows(loss):
    """How `loss` makes one value of several rows of its batch together,
    which the parts of a split batch cannot add up to (None: it does
    not): Keras' `Dice` and `Tversky` without `axis` (one ratio of sums
    over the whole batch), `Circle` (pairs of the batch's rows)."""
    fn = getattr(loss, "fn", None)  # compile(loss="dice") wraps it
    if ((isinstance(loss, (keras.losses.Dice, keras.losses.Tversky))
         and getattr(loss, "axis", None) is None)
            or (not isinstance(loss, (keras.losses.Dice,
                                      keras.losses.Tversky))
                and fn in (keras.losses.dice, keras.losses.tversky))):
        return ("one ratio of sums over the whole batch (axis=None); give "
                "it `axis` (the non-batch axes, e.g. axis=-1, or (1, 2, 3) "
                "for images) for one score per row, which the parts add up "
                "to, or")
    if isinstance(loss, keras.losses.Circle) or fn is keras.losses.circle:
        return "a score over pairs of the batch's rows;"
    return None


def _warn_coupled_rows(name, parts, how):
    """Once per loss: a loss coupling its batch's rows (`_couples_rows`)
    computed on parts of a split batch."""
    if not _first_time(("coupled", name)):
        return
    warnings.warn(
        f"keras-smp: the loss {name!r} computes {how} use microbatches=1 "
        f"with one replica. This step splits the batch into {parts}, each "
        "computing it over its own rows, so the step's loss and gradients "
        "differ from one device's (as BatchNormalization's per-part "
        "statistics do).", stacklevel=2)


def _warn_own_mask(name, parts):
    """Once per loss: a loss whose `call` masks its values itself in a
    way `keras_private.label_mask` does not know ahead (it knows Keras'
    `ignore_class`), computed on parts of a split batch."""
    if not _first_time(("mask", name)):
        return
    warnings.warn(
        f"keras-smp: the loss {name!r} attaches a Keras mask to its values "
        f"in its `call`, and this step splits the batch into {parts}: each "
        "part's mean divides by its own unmasked entries, where one device "
        "divides by the whole batch's, so the step's loss and gradients "
        "differ from one device's wherever the parts' unmasked counts "
        "differ. Give the mask as sample weights (0 or 1 per entry) to a "
        "loss with reduction='mean_with_sample_weight' (divided by the "
        "whole batch's weights), or use microbatches=1 with one replica.",
        stacklevel=2)


def weights_at(path, given):
    """The sample weights Keras' compiled loss gives the loss at `path`
    (from `compiled_loss_entries`) of the step's `given` ones: None, the
    same array for every output, or its entry of a structure."""
    if given is not None and keras.tree.is_nested(given):
        return keras_private.resolve_path(path, given)
    return given


def scaled_sample_weights(model, entries, outputs, given, factors):
    """The sample weights to give `model`'s compiled loss so that the
    loss of the output at `path` is scaled by `factors[path]` (a scalar).

    Args:
        model: the compiled Keras model.
        entries: `keras_private.compiled_loss_entries(model, ...)`.
        outputs: the structure of the model's outputs (any leaves).
        given: the sample weights of the step (`None`, one array for
            every output, or a structure like the outputs').
        factors: `{path: scalar}` for the outputs to scale.

    Returns:
        Sample weights laid out as the compiled loss looks them up (by
        each loss's path in the outputs as it was built).

    Example:

    ```python
    import keras
    import tensorflow as tf
    from keras_smp.runtime import keras_private
    from keras_smp.runtime.loss_shares import scaled_sample_weights

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = tf.ones([4, 2]), tf.zeros([4, 1])
    entries = keras_private.compiled_loss_entries(model, y, model(x))
    sw = scaled_sample_weights(model, entries, model.outputs[0], None,
                               {(): tf.constant(2.0)})
    assert float(sw) == 2.0
    ```
    """
    floatx = keras.config.floatx()
    weights = {}
    for path, _ in entries:
        w = weights_at(path, given)
        if path in factors:
            f = factors[path]
            w = f if w is None else tf.cast(w, floatx) * f
        weights[path] = w
    if not keras.tree.is_nested(outputs):
        return weights[()]
    layout = keras_private.compiled_loss_layout(model, outputs)
    return keras.tree.pack_sequence_as(layout, [
        weights.get(path) for path, _ in keras.tree.flatten_with_path(layout)])


ROWS = "rows"
WEIGHTS = "sample weights"  # (key) "mean_with_sample_weight" losses


def share_dtype():
    """The dtype shares of the batch, the replicas' counts and sums, and
    gradient norms are taken in: float32 (a 16-bit model's widened),
    float64 in a float64 model (`keras.config.floatx()`, the same in
    every process of a job), whose losses and gradients a float32 share
    or norm would round (1e-9 apart)."""
    return tf.float64 if keras.config.floatx() == "float64" else tf.float32


def replica_context(strategy):
    """The replica context whose replicas split the batch, when `strategy`
    runs several data-parallel replicas whose `all_reduce` sums over
    them, else `None` (one replica; or tensor-parallel ranks as the local
    replicas of one data replica, whose replica all-reduce sums nothing:
    their shares stay Keras')."""
    if strategy.num_replicas_in_sync < 2:
        return None
    if getattr(strategy.extended, "_smp_local_tp", 1) > 1:
        return None
    return tf.distribute.get_replica_context()


def replica_divisors(model, y, y_pred, static, weighted=False):
    """What each mean loss of `model` divides by in this replica's part
    of the batch: `{path: divisor}` (`ROWS` for a loss divided by the
    part's rows), or `None` when every replica's part holds the same
    share (no output has a Keras mask, the rows are `static`, the same
    in every replica, and no `"mean_with_sample_weight"` loss is given
    sample weights: `weighted`).

    A masked output (its `y_pred` holds a Keras mask, or its loss masks
    targets out: `keras_private.label_mask`, e.g. `ignore_class`) divides
    by its unmasked entries; any other mean loss by its rows times its entries
    per row, assumed the same in every replica (a dataset that pads each
    replica's sequences to its own length breaks this). `"sum"` losses
    add up across replicas as they are. A `"mean_with_sample_weight"`
    loss divides by its sample weights' sum (without weights: its masked
    or all entries), which differs between the replicas: the key
    `WEIGHTS` (True) says `shared_loss` divides it by all replicas' sum
    (`divided_by_all_weights`).
    """
    compiled = keras_private.compiled_loss(model)
    entries = (keras_private.compiled_loss_entries(model, y, y_pred)
               if compiled is not None else [])
    divisors, masked = {}, False
    if entries:
        flat = keras.tree.flatten(y_pred)
        index = keras_private.compiled_loss_output_index(model, y_pred,
                                                         len(flat))
        targets = (keras_private.compiled_loss_targets(model, y, y_pred)
                   if any(keras_private.masks_by_labels(loss)
                          for _, loss in entries) else {})
        for path, loss in entries:
            mask = keras_private.keras_mask(flat[index[path]])
            labels = (keras_private.label_mask(loss, targets[path])
                      if path in targets else None)
            if divides_by_weights(loss):
                if (weighted or mask is not None or labels is not None
                        or not static):
                    divisors[WEIGHTS] = masked = True
                continue
            if reduction_of(loss) not in MEANS:
                continue
            if mask is not None or labels is not None:
                masked = True
                divisors[path] = keras_private.counted_entries(mask, labels)
            else:
                divisors[path] = ROWS
    if not masked and static:
        return None
    return divisors


def shared_loss(model, context, divisors, y, y_pred, sample_weight, rows,
                rows_share=None, keep_values=False):
    """The compiled loss of this replica's part with each mean loss
    scaled by the replica's share of its divisor (`divisors`, from
    `replica_divisors`), and the replica's share of the rows:
    `(loss or None without a compiled loss, rows share)`. With
    `keep_values` (in a model's own step, where Keras' mean losses keep
    their value: `keras_private.on_loss_scaling`) a loss divided by all
    replicas' sample weights keeps the replicas' mean too.

    The masked divisors (and the `rows`, unless their share is given)
    are summed across the replicas of `context` in one all-reduce; none
    when there is nothing to sum."""
    local = {path: d for path, d in divisors.items()
             if path is not WEIGHTS and d is not ROWS}
    if rows_share is None:
        local[ROWS] = rows
    shares = global_shares(context, local)
    if rows_share is None:
        rows_share = shares[ROWS]
    compiled = keras_private.compiled_loss(model)
    loss = None
    if compiled is not None:
        entries = keras_private.compiled_loss_entries(model, y, y_pred)
        factors = {path: (tf.cast(rows_share, keras.config.floatx())
                          if d is ROWS else shares[path])
                   for path, d in divisors.items() if path is not WEIGHTS}
        weights = (scaled_sample_weights(model, entries, y_pred,
                                         sample_weight, factors)
                   if factors else sample_weight)
        if divisors.get(WEIGHTS):
            compiled = keras_private.compiled_loss_replacing(
                model, divided_by_all_weights(context, keep_values),
                divides_by_weights)
        loss = compiled(y, y_pred, weights)
    return loss, rows_share


def divided_by_all_weights(context, keep_values=False):
    """`wrap(loss, path) -> fn(y_true, y_pred, sample_weight)`: the
    replica's part of a `"mean_with_sample_weight"` loss, its weighted sum
    divided by the sample weights' sum over all replicas of `context`
    (one all-reduce), as one device divides the batch's. Keras divides
    each replica's by its own sum, and scaling the weights cannot change
    that (the scale cancels). The parts, summed over the replicas, are
    the batch's loss, as the shared mean losses' are (with `keep_values`,
    their values times the replicas, which average to it; the gradients
    the same). Without weights or masks Keras divides by the loss values'
    entries: so does this, by all replicas' entries.

    Example (one replica, where this is Keras' loss):

    ```python
    import keras
    import tensorflow as tf
    from keras_smp.runtime.loss_shares import divided_by_all_weights

    mse = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    y, p = tf.zeros([4, 1]), tf.constant([[1.], [2.], [3.], [4.]])
    w = tf.constant([1., 1., 2., 4.])  # (1 + 4 + 18 + 64) / 8
    part = divided_by_all_weights(tf.distribute.get_replica_context())(
        mse, ())
    assert abs(float(part(y, p, w)) - 10.875) < 1e-6
    assert abs(float(mse(y, p, w)) - 10.875) < 1e-6
    ```
    """
    def divisor(path, values, weights, values_masked=False):
        local = (tf.cast(tf.size(values), share_dtype()) if weights is None
                 else tf.reduce_sum(tf.cast(weights, share_dtype())))
        # Summed in float32 at least (a float16 loss's sum could
        # overflow).
        return context.all_reduce(tf.distribute.ReduceOp.SUM, local)

    wrap = divided_by(divisor)
    if not keep_values:
        return wrap
    replicas = context.num_replicas_in_sync

    def kept(loss, path):
        fn = wrap(loss, path)

        def part(y_true, y_pred, sample_weight=None):
            value = fn(y_true, y_pred, sample_weight)
            return keras_private.kept_loss(
                value * tf.cast(replicas, value.dtype), value)
        return part

    return kept


def divided_by(divisor):
    """`wrap(loss, path) -> fn(y_true, y_pred, sample_weight)`: a
    `"mean_with_sample_weight"` loss (at `path` of the compiled loss's
    entries) whose weighted sum is divided by `divisor(path, values,
    weights, values_masked)` (a float32 scalar; `values` as `loss.call`
    returned them, `weights` as Keras merges the sample weights and masks,
    None without either; `values_masked`: the values carry a Keras mask of
    their own, merged into `weights`), not by the part's own weights: how
    parts of a batch (replicas, microbatches) sum to the batch's loss.

    Example (the batch's own weights: Keras' loss):

    ```python
    import keras
    import tensorflow as tf
    from keras_smp.runtime.loss_shares import divided_by

    mse = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    y, p = tf.zeros([2, 1]), tf.constant([[1.], [3.]])
    w = tf.constant([1., 3.])  # (1 + 27) / 4 = 7
    own = divided_by(lambda path, values, weights, values_masked:
                     tf.reduce_sum(weights))
    assert abs(float(own(mse, ())(y, p, w)) - 7.0) < 1e-6
    ```
    """
    def wrap(loss, path):
        def part(y_true, y_pred, sample_weight=None):
            with tf.name_scope(loss.name):
                convert = lambda t: keras.ops.convert_to_tensor(  # noqa: E731
                    t, dtype=loss.dtype)
                values = loss.call(keras.tree.map_structure(convert, y_true),
                                   keras.tree.map_structure(convert, y_pred))
                masked = keras_private.keras_mask(values) is not None
                values, weights = keras_private.loss_weights_and_mask(
                    loss, values, y_pred, sample_weight)
                # (A loss reducing over the rows itself gives a scalar,
                # filled over the part's rows by `loss.call` here:
                # `count_batch_values_per_row`.)
                total = divisor(path, values, weights, masked)
                if weights is not None:
                    values = values * weights
                return tf.math.divide_no_nan(
                    tf.reduce_sum(values), tf.cast(total, values.dtype))

        return part

    return wrap


def logged_value(total, rows_share, unshared=None):
    """`total` whose value (not gradient) is the replica's part of it
    divided by the replica's `rows_share`, plus `unshared` (terms every
    replica holds whole: weight regularizers): Keras logs a step's loss
    as `Mean.update_state(value, sample_weight=rows)`, so the replicas'
    weighted mean of such values is the sum of their parts plus
    `unshared`, the single-device loss (a replica without rows weighs
    nothing)."""
    share = tf.cast(rows_share, total.dtype)
    whole = tf.zeros_like(total) if unshared is None else tf.cast(
        unshared, total.dtype)
    value = tf.where(share > 0,
                     (total - whole) / tf.where(share > 0, share, 1.0)
                     + whole, total)
    return total + tf.stop_gradient(value - total)


def global_shares(context, local):
    """`{key: replicas x local / sum over replicas}` of the scalars
    `local`, summed across the replicas of `context` in one all-reduce
    (a replica holding the average share gets 1.0)."""
    keys = sorted(local, key=repr)
    if not keys:
        return {}
    values = tf.stack([tf.cast(local[k], share_dtype()) for k in keys])
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    shares = tf.math.divide_no_nan(
        values * float(context.num_replicas_in_sync), total)
    floatx = keras.config.floatx()
    return {k: tf.cast(shares[i], floatx) for i, k in enumerate(keys)}
