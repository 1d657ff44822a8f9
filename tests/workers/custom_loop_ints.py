"""SMP custom loop, one stage per process: ids a `Lambda` computes on the
first stage (`ops.argmax`: int32, where Keras' graph says float32) looked
up in an `Embedding` on the second (manual `partition` scopes), 3 SGD
steps of `@smp.step` (2 microbatches) on a batch of 32; or, with
`--reference`, the same model trained by a tape on one device. Writes
OUT/rank{R}.json (reference.json): the last loss and the weights.

    custom_loop_ints.py OUT [--reference]

Before: the stages' collectives disagreed on the ids' dtype ("expected
... data_type 3 but got ... data_type 1").
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
OUT = sys.argv[1]
REFERENCE = "--reference" in sys.argv[2:]
if not REFERENCE:
    import keras_smp as smp

    smp.init({"partitions": 2, "microbatches": 2, "local_devices": 1,
              "auto_partition": False})

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.RandomState(0)
X = rng.randn(32, 8).astype("float32")
Y = rng.randint(0, 3, 32)
keras.utils.set_random_seed(1)


def stage(i):
    return contextlib.nullcontext() if REFERENCE else smp.partition(i)


class Model(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="tanh")
        self.ids = keras.layers.Lambda(
            lambda t: keras.ops.argmax(t, axis=-1))
        self.emb = keras.layers.Embedding(16, 8)
        self.d2 = keras.layers.Dense(8, activation="tanh")
        self.d3 = keras.layers.Dense(3)

    def call(self, x):
        with stage(0):
            h = self.d1(x)
            ids = self.ids(h)
        with stage(1):
            return self.d3(self.d2(h) + self.emb(ids))


model = Model() if REFERENCE else smp.DistributedModel(Model())
opt = keras.optimizers.SGD(0.1)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if REFERENCE:
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = loss_fn(Y, model(X, training=True))
        opt.apply_gradients(zip(tape.gradient(
            loss, model.trainable_variables), model.trainable_variables))
else:
    @smp.step
    def grads(x, y):
        loss = loss_fn(y, model(x, training=True))
        return opt.get_gradients(loss, model.trainable_variables), loss

    @tf.function
    def train_step(x, y):
        gradients, loss = grads(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in gradients],
                                model.trainable_variables))
        return loss.reduce_mean()

    for _ in range(3):
        loss = train_step(X, Y)
os.makedirs(OUT, exist_ok=True)
name = "reference" if REFERENCE else f"rank{smp.rank()}"
with open(os.path.join(OUT, f"{name}.json"), "w") as f:
    json.dump({"loss": float(loss),
               "weights": [w.tolist() for w in model.get_weights()]}, f)
