"""Feeds bad inputs to the TensorFlow side of keras-smp, one case after another.

One process (2 logical CPU devices, a 2-stage in-process pipeline) runs every
case in try/except and prints one JSON line: case -> [exception type,
message, seconds to fail]. tests/test_bad_inputs.py checks each message.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = np.random.RandomState(1).randn(64, 2).astype("float32")


def pipelined():
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(16), keras.layers.Dense(2)]))
        model.compile(optimizer="sgd", loss="mse")
    return model


class BadIndex(keras_smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(4)
        self.b = keras.layers.Dense(2)

    def call(self, inputs):
        with keras_smp.partition(0):
            h = self.a(inputs)
        with keras_smp.partition(3):
            return self.b(h)


def case_dataset_without_drop_remainder():
    # One replica of 2 stages: the last batch of 2 rows is smaller than
    # microbatches=4 (larger ones that do not divide train).
    ds = tf.data.Dataset.from_tensor_slices((x[:34], y[:34])).batch(16)
    pipelined().fit(ds, epochs=1, verbose=0)


def case_feature_shape_mismatch():
    pipelined().fit(x[:, :7], y, batch_size=16, epochs=1, verbose=0)


def case_label_shape_mismatch():
    pipelined().fit(x, y[:, :1].repeat(3, axis=1), batch_size=16, epochs=1,
                    verbose=0)


def case_string_features():
    pipelined().fit(np.array([["a"] * 8] * 64), y, batch_size=16, epochs=1,
                    verbose=0)


def case_partition_index_out_of_range():
    with strategy.scope():
        model = BadIndex()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def case_microbatches_more_than_batch():
    pipelined().fit(x, y, batch_size=2, epochs=1, verbose=0)


def case_step_batch_not_divisible():
    @keras_smp.step
    def f(a):
        return a

    f(np.zeros((10, 2), "float32"))


def case_get_gradients_eagerly():
    keras_smp.init({"partitions": 2, "microbatches": 4})
    v = keras.Variable(1.0)
    keras.optimizers.SGD().get_gradients(v * 2.0, [v])


def case_checkpoint_of_wrong_type():
    keras_smp.CheckpointManager({"model": 1}, "/tmp/unused")


def case_wrap_a_distributed_model():
    keras_smp.DistributedModel(keras_smp.DistributedModel(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(2)]),
        name="already"))


def case_save_model_before_build():
    class Unbuilt(keras_smp.DistributedModel):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, inputs):
            return self.d(inputs)

    Unbuilt().save_model("/tmp/unused_model")


def case_save_weights_max_shard_size():
    pipelined().save_weights("/tmp/unused.weights.json", max_shard_size=1)


def case_optimizer_created_outside_the_scope():
    # Its momentum slots are made under the default strategy.
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16),
            keras.layers.Dense(2)]))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)


class OwnTrainStep(keras.Model):
    def train_step(self, data):
        return {"loss": 0.0}


def case_wrap_a_model_with_its_own_train_step():
    inputs = keras.Input((8,))
    keras_smp.DistributedModel(OwnTrainStep(
        inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs))))


class OwnLoss(BadIndex):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training)


def case_subclass_with_its_own_compute_loss():
    with strategy.scope():
        OwnLoss().compile(optimizer="sgd", loss="mse")


def case_wrap_a_non_model():
    keras_smp.DistributedModel("not a model")


results = {}
for name, fn in sorted(globals().items()):
    if not name.startswith("case_"):
        continue
    start = time.monotonic()
    try:
        fn()
        results[name[5:]] = [None, "no error", time.monotonic() - start]
    except Exception as e:  # noqa: BLE001 - recorded for the test
        results[name[5:]] = [type(e).__name__, str(e)[:2000],
                             time.monotonic() - start]
print("RESULT " + json.dumps(results))
