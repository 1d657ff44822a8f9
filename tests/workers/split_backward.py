"""Checks the split backward (I, then W) against the whole backward.

For several Keras models, inside a `tf.function`: the forward of one
"stage" is recorded, `weight_meetings` finds where weights meet
activations, `input_backward` + `weight_backward` compute the gradients,
and `stage_backward` (one `tf.gradients`) computes them whole. Prints one
`RESULT {json}` line per model: the largest difference (input and weight
gradients), the largest gradient, the meeting ops found (or null when the
stage cannot be split), and whether every weight got a nonzero gradient.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_smp.pipeline.backward import _replica_variable  # noqa: E402
from keras_smp.pipeline.backward import dense  # noqa: E402
from keras_smp.pipeline.backward import input_backward  # noqa: E402
from keras_smp.pipeline.backward import stage_backward  # noqa: E402
from keras_smp.pipeline.backward import weight_backward  # noqa: E402
from keras_smp.pipeline.backward import weight_meetings  # noqa: E402

keras.utils.set_random_seed(0)
L = keras.layers


def mlp():
    return keras.Sequential([keras.Input((8,)), L.Dense(16, activation="tanh"),
                             L.LayerNormalization(), L.Dropout(0.3),
                             L.Dense(6)])


class Tied(keras.Model):
    """One Dense applied twice (its weights meet activations twice)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = L.Dense(8, activation="tanh"), L.Dense(6)

    def call(self, x):
        return self.b(self.a(self.a(x)))


def embed():
    ids = keras.Input((5,), dtype="int32")
    h = L.Embedding(20, 8)(ids)
    h = L.MultiHeadAttention(2, 4)(h, h)
    return keras.Model(ids, L.Dense(6)(L.GlobalAveragePooling1D()(h)))


def conv():
    return keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(4, 3),
                             L.BatchNormalization(), L.Flatten(), L.Dense(6)])


class Nested(keras.layers.Layer):
    """Reads its weight inside a nested tf.function: cannot be split."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 6))

    def call(self, x):
        return tf.function(lambda t: t @ self.w)(x)


def nested():
    return keras.Sequential([keras.Input((8,)), L.Dense(8), Nested()])


class Twice(keras.layers.Layer):
    """One op takes the same weight twice and the weight's cast: each
    counted once."""

    def build(self, shape):
        self.w = self.add_weight(shape=(4, shape[-1]))

    def call(self, x):
        w = tf.reduce_sum(self.w, 0, keepdims=True)
        w4 = tf.broadcast_to(w, [4, 8])  # the batch of this test: 4 rows
        h = tf.add_n([x * w, w4, w4, tf.identity(w4)])
        return tf.concat([h, w4], axis=1)


def twice():
    return keras.Sequential([keras.Input((8,)), Twice(), L.Dense(6)])


class Learned(keras.Model):
    """Returns a tensor made of weights alone (a learned constant), as a
    stage output: cannot be split."""

    def __init__(self):
        super().__init__()
        self.d = L.Dense(6)
        self.c = self.add_weight(shape=(4, 6))

    def call(self, x):
        return self.d(x) + 0.0 * self.c, self.c * 2.0


MODELS = {"mlp": mlp, "tied": Tied, "embed": embed, "conv": conv,
          "nested": nested, "twice": twice, "learned": Learned}
INPUTS = {"embed": np.random.RandomState(1).randint(0, 20, (4, 5)),
          "conv": np.random.RandomState(1).randn(4, 6, 6, 2)}

for name, make in MODELS.items():
    model = make()
    x = tf.constant(INPUTS.get(name, np.random.RandomState(1).randn(4, 8)),
                    "int32" if name == "embed" else "float32")
    model(x)
    variables = [_replica_variable(v) for v in model.trainable_weights]
    outputs_of = (lambda out: list(out)) if name == "learned" else (
        lambda out: [out])
    seeds = {"learned": [tf.ones([4, 6]), tf.ones([4, 6]) * 3.0]}
    seed = tf.constant(np.random.RandomState(2).randn(4, 6), "float32")

    @tf.function
    def grads(x):
        graph = tf.compat.v1.get_default_graph()
        # A float input, as a stage boundary would give (ids stay ints).
        inp = tf.identity(x)
        first = len(graph.get_operations())
        # The seed generator's state is read and assigned in the forward:
        # the same draws for both backwards (one forward, differentiated
        # twice).
        out = outputs_of(model(inp, training=True))
        grads_of_out = seeds.get(name, [seed])
        ops = graph.get_operations()[first:]
        whole_in, whole_w = stage_backward(out, [inp], variables,
                                           grads_of_out)
        meetings = weight_meetings(ops, [inp], variables, out)
        if meetings is None:
            return whole_in, whole_w, whole_in, whole_w, tf.constant([], tf.string)
        split_in, saved = input_backward(out, [inp], meetings, grads_of_out)
        split_w = weight_backward(saved, variables)
        return (whole_in, whole_w, split_in, split_w,
                tf.constant([op.type for op, _ in meetings]))

    whole_in, whole_w, split_in, split_w, found = grads(x)
    sparse = [type(g).__name__ for g in split_w
              if isinstance(g, tf.IndexedSlices)]
    pairs = list(zip(whole_in, split_in)) + list(zip(whole_w, split_w))
    diff = max(float(np.max(np.abs(tf.convert_to_tensor(dense(a)).numpy()
                                   - tf.convert_to_tensor(dense(b)).numpy())))
               for a, b in pairs)
    scale = max(float(np.max(np.abs(tf.convert_to_tensor(dense(a)).numpy())))
                for a, _ in pairs)
    nonzero = all(float(np.max(np.abs(tf.convert_to_tensor(dense(g)).numpy())))
                  > 0 for g in split_w)
    kinds = sorted({k.decode() for k in found.numpy()})
    print("RESULT " + json.dumps({
        "model": name, "diff": diff, "scale": scale, "nonzero": nonzero,
        "meetings": kinds if found.shape[0] else None, "sparse": sparse,
        "num_weights": len(variables)}), flush=True)
