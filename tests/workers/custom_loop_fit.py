"""SMP-style custom loop (`smp.init`, `@smp.step`) vs a plain full-batch loop.

Prints one JSON line: the largest weight difference after 3 steps between
the pipelined custom loop (partitions=2, microbatches=4, gradients from
`optimizer.get_gradients` or a `tf.GradientTape` inside the step) and plain
Keras/TF training on the whole batch, and the loss history. With
"tape_added_losses", layers of both stages have activity regularizers and
both loops add `sum(model.losses)` to the loss, as Keras custom loops do.
With "loss_scale", mixed_float16 and a LossScaleOptimizer on both (the
steps scale their losses with `optimizer.scale_loss`; the pipelined
loop's optimizer is built by its first `apply_gradients`, after its step
was traced; the plain one's before), and step 1 made to overflow in
both loops (the scale set to 2^40; 2^10 again for step 2): both skip it.
With "dropout", a Dropout on each stage (GaussianNoise on the second),
gradients from a tape: each microbatch draws its rows of the whole
batch's masks, and the seed generators end where the plain loop's do; and
a SpectralNormalization, normalising its kernel once per step.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
GRADS = sys.argv[1]  # "get_gradients", "tape" or "tape_added_losses"
ADDED = GRADS == "tape_added_losses"
SCALED = GRADS == "loss_scale"
DROPOUT = GRADS == "dropout"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_smp as smp  # noqa: E402

ACTIVITY = [keras.regularizers.L2(1e-2) if ADDED else None,
            keras.regularizers.L1(1e-2) if ADDED else None]

smp.init({"partitions": 2, "microbatches": 4})
if SCALED:
    keras.mixed_precision.set_global_policy("mixed_float16")

x = np.random.RandomState(0).randn(32, 8).astype("float32")
y = np.random.RandomState(1).randint(0, 3, 32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="tanh",
                                     activity_regularizer=ACTIVITY[0])
        self.d2 = _second()
        self.d3 = keras.layers.Dense(3, activity_regularizer=ACTIVITY[1])

        self.drops = _random_layers()

    def call(self, inputs):
        h = self.drops[0](self.d1(inputs))
        return self.d3(self.drops[1](self.d2(h)))


def _second():
    # With "dropout", also a SpectralNormalization: its training call
    # normalises its kernel in place, once per step as in the plain loop
    # (each microbatch normalised it again).
    dense = keras.layers.Dense(16, activation="relu")
    return keras.layers.SpectralNormalization(dense) if DROPOUT else dense


def _random_layers():
    if not DROPOUT:
        return [keras.layers.Identity(), keras.layers.Identity()]
    return [keras.layers.Dropout(0.3, seed=5),
            keras.layers.GaussianNoise(0.3, seed=6)]


keras.utils.set_random_seed(7)
model = Model()
model(x[:1])
plain = keras.Sequential([
    keras.Input((8,)),
    keras.layers.Dense(16, "tanh", activity_regularizer=ACTIVITY[0]),
    (drops := _random_layers())[0],
    _second(), drops[1],
    keras.layers.Dense(3, activity_regularizer=ACTIVITY[1])])
initial = model.get_weights()
plain.set_weights(initial)
opt = keras.optimizers.SGD(0.1, momentum=0.9)
plain_opt = keras.optimizers.SGD(0.1, momentum=0.9)
if SCALED:
    opt, plain_opt = (keras.optimizers.LossScaleOptimizer(
        o, initial_scale=2.0 ** 10) for o in (opt, plain_opt))
    plain_opt.build(plain.trainable_variables)  # (Keras' own scale_loss)


def scaled(optimizer, loss):
    return optimizer.scale_loss(loss) if SCALED else loss


@smp.step
def get_grads(inputs, labels):
    if GRADS != "get_gradients":
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = loss_fn(labels, logits)
            if ADDED:
                assert len(model.losses) == 2, model.losses
                loss += tf.add_n(model.losses)
            scaled_loss = scaled(opt, loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
    else:
        logits = model(inputs, training=True)
        loss = loss_fn(labels, logits)
        grads = opt.get_gradients(scaled(opt, loss),
                                  model.trainable_variables)
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
        scaled_loss = scaled(plain_opt, loss)
    grads = tape.gradient(scaled_loss, plain.trainable_variables)
    plain_opt.apply_gradients(zip(grads, plain.trainable_variables))
    return loss, logits


losses, plain_losses, logit_diff, logit_size, scales = [], [], 0.0, 0.0, []
for step in range(3):
    if SCALED and step:  # step 1: far above float16's range, both skip
        for o in (opt, plain_opt):
            o.dynamic_scale.assign(2.0 ** (40 if step == 1 else 10))
    loss, logits = train_step(x, y)
    ploss, plogits = plain_step(x, y)
    losses.append(float(loss))
    plain_losses.append(float(ploss))
    logit_diff = max(logit_diff, float(np.abs(logits - plogits).max()))
    logit_size = max(logit_size, float(np.abs(plogits).max()))
    if SCALED:
        scales.append([float(o.dynamic_scale.numpy())
                       for o in (opt, plain_opt)])
seeds = [[v.numpy().tolist() for v in m.variables if "seed" in v.path]
         for m in (model, plain)]
weight_diff = max(float(np.abs(a - b).max())
                  for a, b in zip(model.get_weights(), plain.get_weights()))
moved = max(float(np.abs(a - b).max())
            for a, b in zip(model.get_weights(), initial))
print("RESULT " + json.dumps({
    "weight_diff": weight_diff, "logit_diff": logit_diff, "losses": losses,
    "plain_losses": plain_losses, "moved": moved, "scales": scales,
    "seeds": seeds,
    "iterations": [int(o.iterations.numpy()) for o in (opt, plain_opt)],
    "magnitude": max(float(np.abs(w).max()) for w in plain.get_weights()),
    "logit_magnitude": logit_size,
    "stages": model.num_stages, "microbatches": model.num_microbatches}))
