"""SMP custom loop (@smp.step) with sparse gradients and Adam, against
plain Keras (a GradientTape on the whole batch) from the same weights.

A token embedding (12 ids in 6 x 16 lookups per step: ids repeat) plus a
position embedding looked up at `ops.arange(length)` (keras.io's
TokenAndPositionEmbedding), 2 stages x 4 microbatches, Adam. One device's
gradients are `tf.IndexedSlices` which Adam applies row by row (it
squares each row); `StepOutput.accumulate()` made them dense (a repeated
id's rows merged), and concatenated the position embedding's microbatch
rows. Run alone or with `keras-smp launch -n 2` (2 data-parallel
replicas, each on its half of the global batch).

    python custom_loop_sparse.py get_gradients|tape|uneven

Prints `RESULT {json}` on rank 0: the largest weight difference to plain
Keras (per unit of the weights' magnitude), how far the weights moved,
and the gradients' types one device computes. `uneven` (2 processes):
rank r's sequences are 6 - r long, of unknown length in the traced step;
each rank prints `RAISED <message>` (the replicas' sparse gradients hold
different numbers of rows) and exits 3.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_smp as smp  # noqa: E402

GRADS = sys.argv[1]
smp.init({"partitions": 2, "microbatches": 4})
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCAB, LENGTH, GLOBAL, STEPS = 12, 6, 16, 4


def batch(step):
    rng = np.random.RandomState(100 + step)
    return (rng.randint(0, VOCAB, (GLOBAL, LENGTH)).astype("int32"),
            rng.randint(0, 3, GLOBAL).astype("int32"))


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, 8)
        self.positions = keras.layers.Embedding(LENGTH, 8)

    def call(self, x):
        return self.tokens(x) + self.positions(
            keras.ops.arange(keras.ops.shape(x)[1]))


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.embed = TokenAndPosition()
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.pool(self.embed(x)))


keras.utils.set_random_seed(11)
model = Model()
opt = keras.optimizers.Adam(0.05)
model(batch(0)[0][:1])
initial = model.get_weights()


@smp.step
def get_grads(inputs, labels):
    if GRADS == "tape":
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(inputs, training=True))
        return tape.gradient(loss, model.trainable_variables), loss
    loss = loss_fn(labels, model(inputs, training=True))
    return opt.get_gradients(loss, model.trainable_variables), loss


@tf.function(input_signature=[
    tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32)]
    if GRADS == "uneven" else None)
def train_step(inputs, labels):
    grads, loss = get_grads(inputs, labels)
    grads = [g.accumulate() for g in grads]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss.reduce_mean()


rows = GLOBAL // smp.dp_size()
lo = smp.dp_rank() * rows
if GRADS == "uneven":
    x, y = batch(0)
    try:
        train_step(x[lo:lo + rows, :LENGTH - smp.rank()], y[lo:lo + rows])
    except Exception as e:  # noqa: BLE001
        print("RAISED", " ".join(str(e).split()), flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
    sys.exit(0)
for step in range(STEPS):
    x, y = batch(step)
    train_step(x[lo:lo + rows], y[lo:lo + rows])
got = model.get_weights()

if smp.rank() == 0:
    keras.utils.set_random_seed(11)
    inputs = keras.Input((LENGTH,), dtype="int32")
    plain = keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.GlobalAveragePooling1D()(TokenAndPosition()(inputs))))
    plain.set_weights(initial)
    plain_opt = keras.optimizers.Adam(0.05)
    kinds = None
    for step in range(STEPS):
        x, y = batch(step)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, plain(x, training=True))
        grads = tape.gradient(loss, plain.trainable_variables)
        kinds = kinds or [type(g).__name__ for g in grads]
        plain_opt.apply_gradients(zip(grads, plain.trainable_variables))
    want = plain.get_weights()
    print("RESULT " + json.dumps({
        "replicas": smp.dp_size(),
        "kinds": kinds,
        "diff": max(float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
                    for a, b in zip(got, want)),
        "moved": max(float(np.abs(a - b).max())
                     for a, b in zip(want, initial)),
    }), flush=True)
