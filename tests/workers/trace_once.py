"""`tracing.once_per_shape` on stage functions, against the same functions
built inline (used by tests/test_runtime.py).

Each check runs a stage function (a few Keras layers, training) on 3
microbatches inside one `tf.function` step, as the pipeline does: traced
once, and inline (`tracing.TRACE_ONCE = False`), from the same initial
weights. Prints one line per check, "ROW " + JSON: {"check", "runs" and
"inline_runs" (how often the forward's Python ran: 1 when traced once, 3
inline, 4 when the trace was dropped and the stage ran inline), "diff"
(largest difference from inline of the outputs, the weights' gradients,
the state after the step and the added losses), "scale" (the largest of
those values inline), "state_moved" (how far the
state moved in the step), "draws" (distinct outputs of the 3 microbatches),
"counted" (the call counter's value after the step)}.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_smp.runtime import keras_private  # noqa: E402
from keras_smp.runtime import tracing  # noqa: E402

M = 3


class Noise(keras.layers.Layer):
    """TensorFlow's seeded random noise (not a Keras seed generator)."""

    def call(self, x):
        return x + tf.random.uniform(tf.shape(x))


class Counting(keras.layers.Layer):
    """Counts its calls in a trainable weight it assigns (not state)."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros",
                                     name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return x


def layers_for(check):
    keras.utils.set_random_seed(1)
    return {
        "dense": lambda: [keras.layers.Dense(5, activation="tanh"),
                          keras.layers.Dense(3)],
        "batchnorm_dropout": lambda: [keras.layers.Dense(5),
                                      keras.layers.BatchNormalization(),
                                      keras.layers.Dropout(0.3)],
        "activity_regularizer": lambda: [
            keras.layers.Dense(5, activity_regularizer="l2")],
        "seeded_tf_random": lambda: [Noise()],
        "assigns_a_weight": lambda: [keras.layers.Dense(5), Counting()],
    }[check]()


def run(check, once):
    tracing.TRACE_ONCE = once
    layers = layers_for(check)
    model = keras.Sequential([keras.Input((6,))] + layers)
    rng = np.random.RandomState(0)
    x = (np.zeros((M, 4, 6)) if check == "seeded_tf_random"
         else rng.randn(M, 4, 6)).astype("float32")
    runs = [0]

    def forward(tensors):
        runs[0] += 1
        return [model(tensors[0], training=True)]

    stage = tracing.once_per_shape(forward, "stage 0", model.layers)
    before = [v.numpy() for v in model.non_trainable_weights]

    @tf.function(autograph=False)
    def step():
        outs, added = [], []
        for mb in range(M):
            keras_private.clear_added_losses(model.layers)
            outs.append(stage([tf.constant(x[mb])])[0])
            losses = keras_private.added_losses(model.layers)
            added.append(tf.add_n(losses) if losses else tf.zeros([]))
        total = tf.add_n([tf.reduce_sum(o ** 2) for o in outs] + added)
        weights = [w.value for w in model.trainable_weights]
        grads = tf.gradients(total, weights) if weights else []
        return outs, [g for g in grads if g is not None], added

    outs, grads, added = step()
    return dict(runs=runs[0], outs=[o.numpy() for o in outs],
                grads=[g.numpy() for g in grads],
                state=[v.numpy() for v in model.non_trainable_weights],
                before=before, added=[a.numpy() for a in added],
                counted=[float(layer.calls.numpy()) for layer in layers
                         if isinstance(layer, Counting)])


def biggest(a, b):
    return max([float(np.max(np.abs(p - q))) for p, q in zip(a, b)]
               or [0.0])


for check in ("dense", "batchnorm_dropout", "activity_regularizer",
              "seeded_tf_random", "assigns_a_weight"):
    traced, inline = run(check, True), run(check, False)
    print("ROW " + json.dumps(dict(
        check=check, runs=traced["runs"], inline_runs=inline["runs"],
        diff=max(biggest(traced[k], inline[k])
                 for k in ("grads", "state", "added", "outs")
                 if not (check == "seeded_tf_random" and k == "outs")),
        scale=max(float(np.max(np.abs(v))) for k in ("grads", "added",
                                                      "outs")
                  for v in inline[k]),
        grads=len(traced["grads"]),
        state_moved=biggest(traced["state"], traced["before"]),
        added=float(np.sum(traced["added"])),
        draws=len({o.tobytes() for o in traced["outs"]}),
        counted=traced["counted"])), flush=True)
