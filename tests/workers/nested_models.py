"""`expand_nested_models` on symbolic graphs (used by tests).

Builds models holding nested models and prints one JSON object: for each,
which nested models were expanded, whether the expanded graph computes
what the model computes for `training` None, True and False (a layer
whose output shows the `training` it got), and whether its weights are
the model's own objects.
"""

import json
import os
import textwrap
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_smp.pipeline import graph as graph_lib  # noqa: E402


class Mode(keras.layers.Layer):
    """x * 3 in training, x * 2 in inference, x without a `training`."""

    def call(self, x, training=None):
        if training is None:
            return x
        return x * (3.0 if training else 2.0)


class Custom(keras.Model):
    """A subclassed model with its own `call`: kept whole."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return self.dense(x)


def functional(name, body, shape=(4,), dtype="float32"):
    x = keras.Input(shape, dtype=dtype)
    return keras.Model(x, body(x), name=name)


def check(model, keep=lambda m: False, feed=None):
    inputs, outputs = model._inputs_struct, model._outputs_struct
    new, models = graph_lib.expand_nested_models(inputs, outputs, keep)
    flat = keras.Model(inputs, new)
    feed = np.arange(8, dtype="float32").reshape(2, 4) if feed is None \
        else feed
    same = {}
    for training in (None, True, False):
        a = keras.tree.flatten(model(feed, training=training))
        a_losses = [float(v) for v in model.losses]
        b = keras.tree.flatten(flat(feed, training=training))
        b_losses = [float(v) for v in flat.losses]
        same[str(training)] = all(
            np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(a, b)) and a_losses == b_losses
    return {
        "expanded": [m.name for m in models],
        "same": same,
        "unchanged": new is outputs,
        "layers": sorted(l.name for l in flat.layers
                         if not isinstance(l, keras.layers.InputLayer)),
        "own_weights": {id(w) for w in flat.weights}
        == {id(w) for w in model.weights},
    }


out = {}

# Nested twice: outer -> a (training=False) -> b (training=True) -> Mode;
# a's own Mode; c (no training) -> Mode; a Sequential with a Dense.
b = functional("b", lambda x: Mode(name="mode_b")(x))
a = functional("a", lambda x: Mode(name="mode_a")(b(x, training=True)))
c = functional("c", lambda x: Mode(name="mode_c")(x))
seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="sd")],
                       name="seq")
x = keras.Input((4,))
out["training"] = check(keras.Model(x, keras.layers.Add()(
    [a(x, training=False), c(x), seq(x)])))

# A nested model whose second output nothing uses (its branch adds a
# loss): kept whole; the other nested model is expanded.
two = keras.Model(x, [keras.layers.Dense(4, name="used")(x),
                      keras.layers.ActivityRegularization(
                          l1=1.0, name="unused")(x)], name="two")
other = functional("other", lambda t: keras.layers.Dense(4, name="od")(t))
out["unused_output"] = check(keras.Model(x, other(two(x)[0])))

# Two different layers named alike (factory-made blocks): nothing is
# expanded, with a warning naming them.
def named_block(name):
    return functional(name, lambda t: keras.layers.Dense(4, name="conv")(t))


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["same_names"] = check(keras.Model(
        x, named_block("first")(named_block("second")(x))))
out["same_names"]["warned"] = any(
    "share the name(s) ['conv']" in str(w.message) for w in caught)

# Kept whole: a subclassed model, a call with a mask, floats into an int
# input (cast by the model's call), and a model `keep` names; expanded: a
# dict-input model.
custom = Custom(name="custom")
custom.build((None, 4))
masked = functional("masked", lambda t: keras.layers.Dense(4, name="md")(t))
casting = functional("casting", lambda t: keras.layers.Flatten()(
    keras.layers.Embedding(8, 1, name="ce")(t)), dtype="int32")
kept = functional("kept", lambda t: keras.layers.Dense(4, name="kd")(t))
di = {"p": keras.Input((4,), name="p"), "q": keras.Input((4,), name="q")}
dict_model = keras.Model(di, keras.layers.Add(name="dadd")(
    [di["p"], di["q"]]), name="dict_model")
h = keras.layers.Add()([
    custom(x),
    masked(keras.layers.Rescaling(1.0)(x), mask=keras.ops.ones_like(
        x[:, 0]) > 0),
    casting(x), kept(x), dict_model({"p": x, "q": x})])
out["kept"] = check(keras.Model(x, h), keep=lambda m: m.name == "kept")

# Built-in layers with sublayers of fixed names (two MultiHeadAttention:
# "query", "key", ...) do not stop a nested block from expanding.
seq_in = keras.Input((3, 4))
attend = [keras.layers.MultiHeadAttention(1, 2) for _ in range(2)]
h = attend[1](attend[0](seq_in, seq_in), seq_in)
out["sublayer_names"] = check(
    keras.Model(seq_in, functional("blk", lambda t: keras.layers.Dense(
        4, name="bd")(t), shape=(3, 4))(h)),
    feed=np.arange(24, dtype="float32").reshape(2, 3, 4) / 24)

# Mixed precision: a float16 output fed to a nested model's float32
# input, cast there as its call casts it.
keras.config.set_dtype_policy("mixed_float16")
try:
    pre = keras.layers.Dense(4, name="pre")(x)
    mixed_block = functional("mixed_block", lambda t: keras.layers.Dense(
        4, name="md2")(t))
    out["mixed_precision"] = check(keras.Model(x, mixed_block(pre)))
    out["mixed_precision"]["input_dtypes"] = [
        str(pre.dtype), str(mixed_block.inputs[0].dtype)]
finally:
    keras.config.set_dtype_policy("float32")

# No nested model: the same outputs object back.
plain = keras.Model(x, keras.layers.Dense(2)(x))
out["plain"] = check(plain)

# The docstring example.
doc = graph_lib.expand_nested_models.__doc__.split("```python")[1].split(
    "```")[0]
exec(compile(textwrap.dedent(doc), "expand_nested_models docstring", "exec"), {})
out["docstring"] = True
print(json.dumps(out))
