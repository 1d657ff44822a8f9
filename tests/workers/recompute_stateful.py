"""Activation checkpointing with random and stateful layers: a model with
Dropout and BatchNormalization, 2 stages x 4 microbatches in one process,
trained with and without recomputation. Prints one JSON line: the largest
differences (weights, BatchNorm's moving statistics included; losses), how
many recomputations were traced, and the errors a stage drawing TensorFlow's
stateful random numbers, or holding a `SpectralNormalization` (which assigns
its trainable kernel in training), gets with recomputation on.

    recompute_stateful.py
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402
from replays import count as replays  # noqa: E402
from replays import layer_count as layer_replays  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(64, 8).astype("float32")
y = rng.randint(0, 3, 64)


class Noise(keras.layers.Layer):
    """Multiplies by TensorFlow's stateful random numbers (not Keras')."""

    def call(self, x):
        return x * tf.random.uniform(tf.shape(x))


def train(recompute, noise=False, spectral=False):
    strategy = keras_smp.SMPStrategy(
        partitions=2, microbatches=4, activation_checkpointing=recompute,
        local_devices=2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dropout(0.3, name="drop1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(16, activation="tanh", name="d2"),
            keras.layers.Dropout(0.2, name="drop2")]
            + ([Noise(name="noise")] if noise else [])
            + ([keras.layers.SpectralNormalization(
                keras.layers.Dense(16), name="sn")] if spectral else [])
            + [keras.layers.Dense(3, name="out")]))
        model.compile(optimizer="adam", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        shuffle=False)
    return model.get_weights(), np.array(history.history["loss"])


plain_w, plain_loss = train(False)
assert replays[0] == 0
ck_w, ck_loss = train(True)
# Per layer: the random and stateful layers themselves, and a Dense.
LAYERS = ["drop1", "bn", "d2", "drop2"]
layer_w, layer_loss = train(LAYERS)


def train_attention(recompute):
    # Token ids with padding (0) -> Embedding(mask_zero) -> Dense -> self-
    # attention called as (h, h) -> masked average -> Dense: a recomputed
    # layer must keep its output mask and differentiate a tensor it gets
    # twice once.
    strategy = keras_smp.SMPStrategy(
        partitions=2, microbatches=4, activation_checkpointing=recompute,
        local_devices=2)
    keras.utils.set_random_seed(0)
    ids = np.random.RandomState(2).randint(0, 10, (64, 6))
    ids[:, 4:] = 0
    with strategy.scope():
        inp = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(10, 8, mask_zero=True, name="emb")(inp)
        h = keras.layers.Dense(8, activation="tanh", name="proj")(h)
        h = keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        model = keras_smp.DistributedModel(
            inp, keras.layers.Dense(3, name="head")(h), split_points=["pool"])
        model.compile(optimizer="adam", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(ids, y, batch_size=16, epochs=2, verbose=0,
                        shuffle=False)
    return model.get_weights(), np.array(history.history["loss"])


att_w, att_loss = train_attention(False)
att_layer_w, att_layer_loss = train_attention(["proj", "mha"])


def error_of(*args, **kwargs):
    """The ValueError message training with these arguments raises."""
    try:
        train(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


random_error = error_of(True, noise=True)
layer_random_error = error_of(["noise"], noise=True)
# A SpectralNormalization normalises its (trainable) kernel in place in
# training: recomputing it would normalise it again.
spectral_error = error_of(True, spectral=True)
layer_spectral_error = error_of(["sn"], spectral=True)
unknown_error = error_of(["d9"])
print(json.dumps({
    "random_error": random_error,
    "layer_random_error": layer_random_error,
    "spectral_error": spectral_error,
    "layer_spectral_error": layer_spectral_error,
    "unknown_error": unknown_error,
    "replays": replays[0],
    "layer_replays": layer_replays[0],
    "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(plain_w, ck_w)),
    "layer_weights": max(float(np.max(np.abs(a - b)))
                         for a, b in zip(plain_w, layer_w)),
    "layer_loss": float(np.max(np.abs(plain_loss - layer_loss))),
    "attention_weights": max(float(np.max(np.abs(a - b)))
                             for a, b in zip(att_w, att_layer_w)),
    "attention_scale": max(float(np.max(np.abs(a))) for a in att_w),
    "attention_loss": float(np.max(np.abs(att_loss - att_layer_loss))),
    "scale": max(float(np.max(np.abs(a))) for a in plain_w),
    "loss": float(np.max(np.abs(plain_loss - ck_loss))),
    "moving_stats_changed": bool(any(
        np.any(w != (0 if i % 2 == 0 else 1)) for i, w in enumerate(
            plain_w[4:6]))),
}))
