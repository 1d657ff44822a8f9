"""SMP-style custom loop (`smp.init`, `@smp.step`) vs a plain full-batch loop.

Prints one JSON line: the largest weight difference after 3 steps between
the pipelined custom loop (partitions=2, microbatches=4, gradients from
`optimizer.get_gradients` or a `tf.GradientTape` inside the step) and plain
Keras/TF training on the whole batch, and the loss history. With
"tape_added_losses", layers of both stages have activity regularizers and
both loops add `sum(model.losses)` to the loss, as Keras custom loops do.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
GRADS = sys.argv[1]  # "get_gradients", "tape" or "tape_added_losses"
ADDED = GRADS == "tape_added_losses"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_smp as smp  # noqa: E402

ACTIVITY = [keras.regularizers.L2(1e-2) if ADDED else None,
            keras.regularizers.L1(1e-2) if ADDED else None]

smp.init({"partitions": 2, "microbatches": 4})

x = np.random.RandomState(0).randn(32, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="tanh",
                                     activity_regularizer=ACTIVITY[0])
        self.d2 = keras.layers.Dense(16, activation="relu")
        self.d3 = keras.layers.Dense(3, activity_regularizer=ACTIVITY[1])

    def call(self, inputs):
        return self.d3(self.d2(self.d1(inputs)))


keras.utils.set_random_seed(7)
model = Model()
model(x[:1])
plain = keras.Sequential([
    keras.Input((8,)),
    keras.layers.Dense(16, "tanh", activity_regularizer=ACTIVITY[0]),
    keras.layers.Dense(16, "relu"),
    keras.layers.Dense(3, activity_regularizer=ACTIVITY[1])])
initial = model.get_weights()
plain.set_weights(initial)
opt = keras.optimizers.SGD(0.1, momentum=0.9)
plain_opt = keras.optimizers.SGD(0.1, momentum=0.9)


@smp.step
def get_grads(inputs, labels):
    if GRADS != "get_gradients":
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = loss_fn(labels, logits)
            if ADDED:
                assert len(model.losses) == 2, model.losses
                loss += tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
    else:
        logits = model(inputs, training=True)
        loss = loss_fn(labels, logits)
        grads = opt.get_gradients(loss, model.trainable_variables)
    return grads, loss, logits


@tf.function
def train_step(inputs, labels):
    grads, loss, logits = get_grads(inputs, labels)
    grads = [g.accumulate() for g in grads]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss.reduce_mean(), logits.merge()


@tf.function
def plain_step(inputs, labels):
    with tf.GradientTape() as tape:
        logits = plain(inputs, training=True)
        loss = loss_fn(labels, logits)
        if ADDED:
            loss += tf.add_n(plain.losses)
    grads = tape.gradient(loss, plain.trainable_variables)
    plain_opt.apply_gradients(zip(grads, plain.trainable_variables))
    return loss, logits


losses, plain_losses, logit_diff = [], [], 0.0
for _ in range(3):
    loss, logits = train_step(x, y)
    ploss, plogits = plain_step(x, y)
    losses.append(float(loss))
    plain_losses.append(float(ploss))
    logit_diff = max(logit_diff, float(np.abs(logits - plogits).max()))
weight_diff = max(float(np.abs(a - b).max())
                  for a, b in zip(model.get_weights(), plain.get_weights()))
moved = max(float(np.abs(a - b).max())
            for a, b in zip(model.get_weights(), initial))
print("RESULT " + json.dumps({
    "weight_diff": weight_diff, "logit_diff": logit_diff, "losses": losses,
    "plain_losses": plain_losses, "moved": moved,
    "stages": model.num_stages, "microbatches": model.num_microbatches}))
