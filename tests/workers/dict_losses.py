"""Losses, loss weights and metrics given as dicts keyed by output name
(Keras maps them by `model.output_names`): a 2-output functional model
trained by plain Keras and as a `DistributedModel` of 2 stages on 2
logical CPUs, same seeds; then again on a dataset of 9-row batches of a
known size (unequal microbatches of 5 and 4: Keras weights its per-output
loss metrics by that size). Prints one JSON line: the largest weight and
loss differences, the largest difference of any logged value, the logged
keys of both, the weights' magnitude.

    dict_losses.py
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402
import keras_smp  # noqa: E402
import numpy as np  # noqa: E402

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = {"cls": np.random.RandomState(1).randint(0, 3, 64),
     "reg": np.random.RandomState(2).randn(64, 1).astype("float32")}


def build():
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return inp, [keras.layers.Dense(3, name="cls")(h),
                 keras.layers.Dense(1, name="reg")(h)]


strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                 local_devices=2)


def train(pipelined, static=False):
    keras.utils.set_random_seed(0)
    if pipelined:
        with strategy.scope():
            model = keras_smp.DistributedModel(*build())
            compile_(model)
    else:
        model = keras.Model(*build())
        compile_(model)
    if static:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            9, drop_remainder=True)
        history = model.fit(data, epochs=3, verbose=0)
    else:
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                            shuffle=False)
    return model.get_weights(), history.history


def compile_(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"]})


ref_w, ref_h = train(False)
got_w, got_h = train(True)
ref_sw, ref_sh = train(False, static=True)
got_sw, got_sh = train(True, static=True)
print(json.dumps({
    "weights": max(float(np.max(np.abs(a - b)))
                   for a, b in zip(ref_w + ref_sw, got_w + got_sw)),
    "scale": max(float(np.max(np.abs(a))) for a in ref_w + ref_sw),
    "loss": float(np.max(np.abs(np.array(ref_h["loss"])
                                - np.array(got_h["loss"])))),
    "logged": max(float(np.max(np.abs(np.subtract(r[k], g[k]))))
                  for r, g in ((ref_h, got_h), (ref_sh, got_sh)) for k in r),
    "logged_scale": max(float(np.max(np.abs(v)))
                        for r in (ref_h, ref_sh) for v in r.values()),
    "keys": [sorted(ref_h), sorted(got_h), sorted(ref_sh), sorted(got_sh)],
}))
