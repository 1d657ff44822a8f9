"""Bad pipeline input, one case per argument; prints the error of each.

Each case prints one JSON line {"case", "type", "message"} ("type" is null
when no error was raised).
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402

X = np.random.RandomState(0).randn(120, 8).astype("float32")
Y = np.random.RandomState(1).randn(120, 2).astype("float32")


def mlp(n=3):
    return keras.Sequential(
        [keras.Input((8,))]
        + [keras.layers.Dense(8, activation="tanh") for _ in range(n - 1)]
        + [keras.layers.Dense(2)])


class Scoped(keras_smp.DistributedModel):
    def __init__(self, stages):
        super().__init__()
        self.stages = stages
        self.layers_ = [keras.layers.Dense(8) for _ in stages]

    def call(self, x):
        for layer, stage in zip(self.layers_, self.stages):
            with keras_smp.partition(stage):
                x = layer(x)
        return x


class Backward(keras_smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.a, self.b = keras.layers.Dense(8), keras.layers.Dense(2)

    def call(self, x):
        with keras_smp.partition(1):
            h = self.a(x)
        with keras_smp.partition(0):
            return self.b(h)


def fit(model, batch_size=32, **kwargs):
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=batch_size, epochs=1, verbose=0, **kwargs)


def batch_smaller_than_microbatches():
    with keras_smp.SMPStrategy(partitions=2, microbatches=4).scope():
        fit(keras_smp.DistributedModel(mlp()), batch_size=3)


def static_batch_smaller_than_microbatches():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        3, drop_remainder=True)
    with keras_smp.SMPStrategy(partitions=2, microbatches=4).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(ds, epochs=1, verbose=0)


def last_batch_smaller_than_microbatches():
    # 120 rows in batches of 58: the last has 4 (found inside the step).
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(58)  # shape None
    with keras_smp.SMPStrategy(partitions=2, microbatches=5).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(ds, epochs=1, verbose=0)


def regularized_model():
    """An activity regularizer adds a loss in `call`, microbatches=5."""
    with keras_smp.SMPStrategy(partitions=2, microbatches=5).scope():
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(8, activity_regularizer="l2"),
            keras.layers.Dense(2)]))
        model.compile(optimizer="sgd", loss="mse")
    return model


def refused_before_training(model, *args, **kwargs):
    """`model.fit(*args, **kwargs)`, which must raise before a step."""
    try:
        model.fit(*args, **kwargs)
    except ValueError:
        if int(model.optimizer.iterations.numpy()) != 0:
            raise AssertionError("fit trained before refusing the batch")
        raise


def array_last_batch_smaller_than_microbatches():
    # 120 rows of arrays in batches of 58: the last has 4, fewer than
    # microbatches=5. Refused before the first step (not at the end of
    # the epoch): the optimizer has not stepped.
    with keras_smp.SMPStrategy(partitions=2, microbatches=5).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss="mse")
    refused_before_training(model, X, Y, batch_size=58, epochs=1, verbose=0)


class SelfReducingMSE(keras.losses.MeanSquaredError):
    """A "mean_with_sample_weight" loss that reduces itself (overrides
    `Loss.__call__`): keras-smp cannot divide its parts by the batch's
    weights, so it needs equal microbatches without weights or masks (a
    loss reduced by Keras' `Loss.__call__` needs neither)."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return super().__call__(y_true, y_pred, sample_weight)


class SelfReducingSCCE(keras.losses.SparseCategoricalCrossentropy):
    def __call__(self, y_true, y_pred, sample_weight=None):
        return super().__call__(y_true, y_pred, sample_weight)


def array_last_batch_mean_with_sample_weight():
    # Such a loss (reducing itself) needs equal microbatches: 118 rows in
    # batches of 48 end with 22, which does not divide into
    # microbatches=4. Refused before the first step.
    with keras_smp.SMPStrategy(partitions=2, microbatches=4).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss=SelfReducingMSE(
            reduction="mean_with_sample_weight"))
    refused_before_training(model, X[:118], Y[:118], batch_size=48,
                            epochs=1, verbose=0)


def validation_last_batch_with_added_losses():
    # An activity regularizer adds a loss in `call`, so evaluation splits
    # its batches as training does (no padding): validation data of 34
    # rows in batches of 30 ends with 4, fewer than microbatches=5.
    # Refused before the first step.
    model = regularized_model()
    refused_before_training(model, X[:90], Y[:90], batch_size=30, epochs=1,
                            verbose=0, validation_data=(X[86:], Y[86:]))


def indivisible_batch_mean_with_sample_weight():
    # Such a loss (reducing itself) divides each microbatch by its own
    # weight sum: equal microbatches only (and no sample weights, see
    # loss_weight).
    with keras_smp.SMPStrategy(partitions=2, microbatches=4).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss=SelfReducingMSE(
            reduction="mean_with_sample_weight"))
    model.fit(X, Y, batch_size=30, epochs=1, verbose=0)


def partition_index_out_of_range():
    strategy = keras_smp.SMPStrategy(partitions=2, auto_partition=False)
    with strategy.scope():
        Scoped([0, 1, 2]).build((None, 8))


def empty_stage():
    strategy = keras_smp.SMPStrategy(partitions=3, auto_partition=False)
    with strategy.scope():
        Scoped([0, 0, 2]).build((None, 8))


def more_partitions_than_layers():
    with keras_smp.SMPStrategy(partitions=4).scope():
        keras_smp.DistributedModel(mlp(2))


def backward_data_flow():
    strategy = keras_smp.SMPStrategy(partitions=2, auto_partition=False)
    with strategy.scope():
        Backward().build((None, 8))


def plain_model_under_pipeline():
    with keras_smp.SMPStrategy(partitions=2).scope():
        fit(mlp())


def unknown_split_point():
    with keras_smp.SMPStrategy(partitions=2).scope():
        keras_smp.DistributedModel(mlp(), split_points=["no_such_layer"])


def layers_built_outside_the_scope():
    model = mlp()
    with keras_smp.SMPStrategy(partitions=2).scope():
        fit(keras_smp.DistributedModel(model))


from added_losses import HelperPenalty  # noqa: E402  (a helper's add_loss)


def added_loss_outside_class_with_unused_head():
    # Two outputs, a loss on one: the pipeline decides before the step
    # which weights reach a loss; a loss added from a helper function
    # (not seen in the layer's class) could reach others.
    with keras_smp.SMPStrategy(partitions=2).scope():
        inputs = keras.Input((8,))
        # d1 adds a loss its class shows (an activity regularizer), in
        # the same stage: the helper's is still found.
        h = HelperPenalty()(keras.layers.Dense(
            8, name="d1", activity_regularizer="l2")(inputs))
        aux = keras.layers.Dense(2, name="aux")(h)
        out = keras.layers.Dense(2, name="out")(
            keras.layers.Dense(8, name="d2")(h))
        model = keras_smp.DistributedModel(
            keras.Model(inputs, {"out": out, "aux": aux}))
        model.compile(optimizer="sgd", loss={"out": "mse"})
    model.fit(X, {"out": Y}, batch_size=32, epochs=1, verbose=0)


def no_trainable_weight_reaches_the_loss():
    # The loss names "cls", computed by frozen layers only; "aux", the
    # one trainable head, reaches no loss. Keras raises "No gradients
    # provided"; so does every pipeline mode (in one process and, where
    # each stage would otherwise take an empty step, across processes:
    # tests/test_pipeline_model.py).
    from unreached import build
    with keras_smp.SMPStrategy(partitions=2).scope():
        model = keras_smp.DistributedModel(build())
        model.compile(optimizer="sgd", loss={"cls": "mse"})
    refused_before_training(model, X, {"cls": Y}, batch_size=32,
                            epochs=1, verbose=0)


class AssignsItsKernel(keras.layers.Dense):
    """Assigns a trainable weight in `call` (not its non-trainable state)."""

    def call(self, x):
        self.kernel.assign(self.kernel * 0.5)
        return super().call(x)


def xla_stage_assigning_a_trainable_weight():
    # A compiled stage without state keeps its plain compiled function, so
    # the layer's assignment runs inside it: the same as plain Keras
    # compiled whole (through a StatelessScope the gradient differed).
    weights = []
    for pipelined in (False, True):
        keras.utils.set_random_seed(3)
        with (keras_smp.SMPStrategy(partitions=2).scope() if pipelined
              else contextlib.nullcontext()):
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(8, activation="tanh"),
                 AssignsItsKernel(2)])
            if pipelined:
                model = keras_smp.DistributedModel(model)
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        model.fit(X, Y, batch_size=32, epochs=1, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def xla_stage_with_helper_add_loss():
    with keras_smp.SMPStrategy(partitions=2).scope():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(8, name="d1")(inputs)
        h = HelperPenalty()(keras.layers.Dense(8, name="d2")(h))
        model = keras_smp.DistributedModel(keras.Model(
            inputs, keras.layers.Dense(2, name="out")(h)),
            split_points=["d2"])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def xla_stateful_stage_assigning_a_weight():
    with keras_smp.SMPStrategy(partitions=2).scope():
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8, activation="tanh"),
             keras.layers.BatchNormalization(), AssignsItsKernel(2)]),
            split_points=["batch_normalization"])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


TOKENS = np.random.RandomState(2).randint(0, 9, size=(32, 6))


def _masked_tagger():
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(9, 4, mask_zero=True)(inputs)
    h = keras.layers.Dense(4, activation="relu", name="d1")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def masked_mean_with_sample_weight():
    # Such a loss (reducing itself) divides by each microbatch's own count
    # of unmasked entries (its sample-weight sum under the mask).
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(_masked_tagger())
        model.compile(optimizer="sgd", loss=SelfReducingSCCE(
            from_logits=True, reduction="mean_with_sample_weight"))
    model.fit(TOKENS, TOKENS % 3, batch_size=16, epochs=1, verbose=0)


# Accepted: data that trains is not refused by fit's early checks.

def unbuilt_subclass_with_validation():
    # A subclassed model is built by its first step: the validation check
    # (which needs to know whether layers add losses) waits for it.
    with keras_smp.SMPStrategy(partitions=2, microbatches=2,
                               auto_partition=False).scope():
        model = Scoped([0, 1])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y[:, :1].repeat(8, axis=1), batch_size=30, epochs=1,
              verbose=0, validation_data=(X[:34], Y[:34, :1].repeat(8, 1)))


def validation_not_run_is_not_checked():
    # validation_freq=2 over one epoch: the validation data (34 rows in
    # batches of 30, the last too small for microbatches=5 with an added
    # loss) is never used.
    model = regularized_model()
    model.fit(X[:90], Y[:90], batch_size=30, epochs=1, verbose=0,
              validation_data=(X[86:], Y[86:]), validation_freq=2)


class MaskingMSE(keras.losses.MeanSquaredError):
    """Returns its values with a Keras mask of their own (rows whose
    target is all zeros left out): not known before the step."""

    def call(self, y_true, y_pred):
        values = super().call(y_true, y_pred)
        values._keras_mask = tf.reduce_any(tf.not_equal(y_true, 0), axis=-1)
        return values


def values_masked_mean_with_sample_weight():
    # Keras merges that mask into the weights it divides by; the pipeline
    # sums the step's weights before the microbatches run.
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss=MaskingMSE(
            reduction="mean_with_sample_weight"))
    model.fit(X[:32], Y[:32], sample_weight=np.ones(32), batch_size=32,
              epochs=1, verbose=0)


def mean_with_sample_weight_reduced_by_keras():
    # The same data as the refused cases above with Keras' own losses:
    # each microbatch is divided by the step's weights (the values are
    # compared with one device in tests/test_replica_shares.py).
    with keras_smp.SMPStrategy(partitions=2, microbatches=4).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"))
    model.fit(X[:118], Y[:118], batch_size=48, epochs=1, verbose=0)
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(_masked_tagger())
        model.compile(optimizer="sgd", loss=(
            keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight")))
    model.fit(TOKENS, TOKENS % 3, sample_weight=np.ones(TOKENS.shape),
              batch_size=16, epochs=1, verbose=0)


def nested_model_marked_after_wrapping():
    # Its layers were placed one by one when DistributedModel was made:
    # a mark on the nested model afterwards cannot recompute it whole.
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        block = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                                  keras.layers.Dense(8)], name="block")
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)), block, keras.layers.Dense(2)]))
        keras_smp.set_activation_checkpointing(block)
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def subclassed_call_branching_on_training():
    # `if training:` in a wrapped subclassed model's call: one trace would
    # freeze the branch (the noise layer would never run in training).
    class Noisy(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(8)
            self.noise = keras.layers.GaussianNoise(0.1, name="noise")
            self.out = keras.layers.Dense(2)

        def call(self, x, training=False):
            h = self.first(x)
            if training:
                h = self.noise(h, training=training)
            return self.out(h)

    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(Noisy())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def subclassed_model_adds_its_own_loss():
    # A VAE-style `self.add_loss(...)` on the model in its call: Keras'
    # "can only be called from inside build() or call()" on the traced
    # symbolic tensor, said with the fix.
    class Regularized(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(8)
            self.out = keras.layers.Dense(2)

        def call(self, x):
            h = self.first(x)
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(h)))
            return self.out(h)

    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(Regularized())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def subclassed_model_with_its_own_weight():
    # A weight the model makes itself, used by keras.ops in call: no stage
    # would train it (it was left at its initial value, silently).
    class Scaled(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(8)
            self.scale = self.add_weight(shape=(8,), initializer="ones")
            self.out = keras.layers.Dense(2)

        def call(self, x):
            return self.out(self.first(x) * self.scale)

    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(Scaled())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def subclassed_call_negating_training():
    class Negated(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(8)
            self.drop = keras.layers.Dropout(0.1, name="drop")
            self.out = keras.layers.Dense(2)

        def call(self, x, training=None):
            return self.out(self.drop(self.first(x), training=not training))

    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(Negated())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)


def subclassed_call_reading_a_weight():
    # A tied output projection written with keras.ops on the embedding's
    # weight: traced once, it would keep the weight's value at the trace.
    class Tied(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = keras.layers.Embedding(10, 8)
            self.d = keras.layers.Dense(8)

        def call(self, ids):
            h = self.d(self.emb(ids))
            return keras.ops.matmul(h, keras.ops.transpose(
                self.emb.embeddings))

    ids = np.random.RandomState(0).randint(0, 10, (32, 3))
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(Tied())
        model.compile(optimizer="sgd", loss=(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    model.fit(ids, ids, batch_size=32, epochs=1, verbose=0)


def operation_takes_a_weight_of_another_stage():
    # A tied output projection written with keras.ops on the embedding's
    # weight, in a functional model: the projection's stage would not give
    # the embedding (stage 0) this use's gradient.
    ids = keras.Input((3,), dtype="int32")
    emb = keras.layers.Embedding(10, 8, name="emb")
    h = keras.layers.Dense(8, name="d")(emb(ids))
    logits = keras.ops.einsum("btd,vd->btv", h, emb.embeddings)
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(keras.Model(ids, logits),
                                           split_points=["d"])


def compiled_to_run_eagerly():
    # Its steps are graphs: in one process the backward failed in
    # tf.gradients; with one stage per process the stages waited on each
    # other until the collective timeout.
    with keras_smp.SMPStrategy(partitions=2, microbatches=2).scope():
        model = keras_smp.DistributedModel(mlp())
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    try:
        model.predict(X, verbose=0)
    except ValueError as e:
        predict_error = str(e)
    assert "run_eagerly=True" in predict_error, predict_error
    # ... and every function run eagerly: evaluate says how to undo it.
    model.run_eagerly = False
    tf.config.run_functions_eagerly(True)
    try:
        model.evaluate(X, Y, verbose=0)
    except ValueError as e:
        evaluate_error = str(e)
    finally:
        tf.config.run_functions_eagerly(False)
    assert "tf.config.run_functions_eagerly(False)" in evaluate_error, (
        evaluate_error)
    model.run_eagerly = True
    refused_before_training(model, X, Y, batch_size=8, epochs=1, verbose=0)


def stateful_rnn(pipelined, **config):
    """A `stateful=True` LSTM (one state row per batch row) trained for 2
    epochs of 4 batches of 30 under `SMPStrategy(**config)`, wrapped with
    `pipelined`, then evaluated and run through predict: must raise
    before a step where the strategy splits batches (refused_before_training),
    else end equal to plain Keras on one device (the states carried from
    batch to batch and epoch to epoch)."""
    xs = X.reshape(120, 2, 4)
    results = []
    for strategy in (None, keras_smp.SMPStrategy(**config)):
        keras.utils.set_random_seed(3)
        with (strategy.scope() if strategy else contextlib.nullcontext()):
            model = keras.Sequential([
                keras.Input((2, 4), batch_size=30),
                keras.layers.LSTM(8, stateful=True, name="lstm"),
                keras.layers.Dense(2)])
            if strategy and pipelined:
                model = keras_smp.DistributedModel(model)
            model.compile(optimizer="adam", loss="mse")
        if strategy:
            refused_before_training(model, xs, Y, batch_size=30, epochs=2,
                                    verbose=0, shuffle=False)
        else:
            model.fit(xs, Y, batch_size=30, epochs=2, verbose=0,
                      shuffle=False)
        results.append(model.get_weights() + [
            model.evaluate(xs, Y, batch_size=30, verbose=0),
            model.predict(xs, batch_size=30, verbose=0)])
    for a, b in zip(*results):
        # float32 rounding of values of magnitude ~1 (observed: equal)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def stateful_rnn_in_microbatches():
    stateful_rnn(True, partitions=2, microbatches=2)


def stateful_rnn_in_replicas():
    stateful_rnn(False, local_devices=2)


def stateful_rnn_in_pipeline_replicas():
    stateful_rnn(True, partitions=2, microbatches=1, local_devices=4)


def stateful_rnn_in_one_microbatch():
    stateful_rnn(True, partitions=2, microbatches=1)


def devices_not_divisible():
    keras_smp.SMPStrategy(partitions=3, local_devices=4)


for name in sys.argv[1:]:
    row = {"case": name, "type": None, "message": ""}
    try:
        globals()[name]()
    except Exception as e:  # noqa: BLE001 - reported to the test
        row.update(type=type(e).__name__, message=str(e))
    print(json.dumps(row), flush=True)
