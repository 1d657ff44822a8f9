"""Tensor-parallel layouts that cannot run fail early, on every rank, with
errors that name the fix (run under `keras-smp launch -n 2`)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
PIPELINE = "--pipeline" in sys.argv  # 4 processes: tp 2 x pp 2
LOCAL = "--local" in sys.argv  # 1 process: the ranks are 2 local devices

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(
    tensor_parallel_degree=2, collective_timeout_seconds=60,
    **(dict(partitions=2, microbatches=2) if PIPELINE else {}),
    **(dict(local_devices=2) if LOCAL else {}))
x = np.ones((8, 4, 8), "float32")


def expect(what, fn, *words):
    try:
        fn()
    except ValueError as e:
        for word in words:
            assert word in str(e), (what, str(e))
        print(f"ok: {what}", flush=True)
        return
    raise SystemExit(f"no error: {what}")


def mlp(optimizer="sgd", inputs=(4, 8)):
    with keras_smp.tensor_parallelism():
        i = keras.Input(inputs)
        h = keras.layers.Dense(16, activation="relu")(i)
        model = keras.Model(i, keras.layers.Dense(8)(h))
    model.compile(optimizer=optimizer, loss="mse")
    return model


if PIPELINE:
    # A pipeline cut between a Dense pair (its activation stays split).
    with strategy.scope():
        with keras_smp.tensor_parallelism():
            i = keras.Input((4, 8))
            h = keras.layers.Dense(16, activation="relu", name="ff_a")(i)
            h = keras.layers.Dense(8, name="ff_b")(h)
            out = keras.layers.Dense(8, name="last")(h)
        cut = keras_smp.DistributedModel(keras.Model(i, out),
                                         split_points=["ff_b"])
        cut.compile(optimizer="sgd", loss="mse")
    expect("a pipeline cut inside a Dense pair",
           lambda: cut.fit(x, x, batch_size=4, verbose=0),
           "pipeline cut falls between Dense 'ff_a'", "split_points")
    print("errors ok", flush=True)
    raise SystemExit(0)

# Built outside the strategy's scope: the layers would be whole.
outside = mlp()
with strategy.scope():
    outside.compile(optimizer="sgd", loss="mse")
expect("built outside the scope",
       lambda: outside.fit(x, x, batch_size=4, verbose=0),
       "built outside the scope", "strategy.scope()")

with strategy.scope():
    lamb = mlp(keras.optimizers.Lamb())
expect("Lamb", lambda: lamb.fit(x, x, batch_size=4, verbose=0),
       "Lamb optimizer", "element-wise optimizer")

with strategy.scope():
    with keras_smp.tensor_parallelism():
        q = keras.Input((4, 8))
        attention = keras.layers.MultiHeadAttention(2, 4)
        attention(q, q)
expect("attention scores of split heads",
       lambda: attention(x, x, return_attention_scores=True),
       "return_attention_scores=True", "set_tensor_parallelism")

# The vocabulary-parallel loss: metrics that would see one rank's slice,
# and an output that is not a split vocabulary projection.
tokens = np.ones((8, 4), "int32")


def language_model(metrics, activation=None):
    with keras_smp.tensor_parallelism():
        i = keras.Input((4,), dtype="int32")
        h = keras.layers.Embedding(16, 8)(i)
        out = keras.layers.Dense(16, activation=activation)(h)
    model = keras.Model(i, out)
    model.compile(optimizer="sgd", metrics=metrics,
                  loss=keras_smp.VocabParallelSparseCategoricalCrossentropy())
    return model


with strategy.scope():
    metric = language_model(["accuracy"])
expect("vocab-parallel loss with a whole-logits metric",
       lambda: metric.fit(tokens, tokens, batch_size=4, verbose=0),
       "Metrics ['accuracy']", "VocabParallelSparseCategoricalAccuracy")
# predict runs (whole logits; no metric sees them).
assert metric.predict(tokens, batch_size=4, verbose=0).shape == (8, 4, 16)
with strategy.scope():
    # Trained with the vocabulary-parallel loss, then compiled again with
    # Keras' loss and metric: the logits are whole again.
    again = language_model([keras_smp.VocabParallelSparseCategoricalAccuracy])
    again.fit(tokens, tokens, batch_size=4, verbose=0)
    again.compile(optimizer="sgd", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
logs = again.evaluate(tokens, tokens, batch_size=4, verbose=0,
                      return_dict=True)
whole = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
    tokens, again.predict(tokens, batch_size=4, verbose=0))
assert abs(logs["loss"] - float(whole)) < 1e-5, (logs, float(whole))
print("ok: compiled again with Keras' loss", flush=True)
with strategy.scope():
    softmax = language_model([], activation="softmax")
expect("vocab-parallel loss after a softmax",
       lambda: softmax.fit(tokens, tokens, batch_size=4, verbose=0),
       "activation=softmax", "drop the activation")

# The layers that did run are split: half of the MLP's first kernel here.
with strategy.scope():
    fine = mlp()
fine.fit(x, x, batch_size=4, verbose=0)
assert tuple(fine.layers[1].kernel.shape) == (8, 8), fine.layers[1].kernel.shape
if LOCAL:
    # Each local device holds one shard: a direct call (outside Keras'
    # steps and strategy.run) has no rank to compute with.
    try:
        fine(x)
        raise SystemExit("no error: a direct call outside the replicas")
    except RuntimeError as e:
        assert "outside the strategy's replicas" in str(e), str(e)
        assert "model.predict(x)" in str(e), str(e)
    print("ok: a direct call outside the replicas", flush=True)
    assert fine.predict(x, batch_size=4, verbose=0).shape == x.shape
    with strategy.scope():
        eager = mlp()
        eager.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    expect("run eagerly", lambda: eager.fit(x, x, batch_size=4, verbose=0),
           "run_eagerly=True with tensor parallelism", "run_eagerly=False")

    # Split Dense layers inside a custom layer without `build`: Keras
    # makes their weights after tracing its call, outside the layers'
    # own scope; each device must still start from its own shard.
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = keras.layers.Dense(16, activation="relu")
            self.b = keras.layers.Dense(8)

        def call(self, inputs):
            return self.b(self.a(inputs))

    def block_model():
        keras.utils.set_random_seed(3)
        i = keras.Input((4, 8))
        return keras.Model(i, Block()(i))

    with strategy.scope():
        with keras_smp.tensor_parallelism():
            split = block_model()
        split.compile(optimizer="sgd", loss="mse")
    assert sorted(keras_smp.tensor_parallel_layers(split).values()) == [
        "gather", "gather"], keras_smp.tensor_parallel_layers(split)
    plain = block_model()
    plain.compile(optimizer="sgd", loss="mse")
    rows = np.random.RandomState(0).randn(8, 4, 8).astype("float32")
    split.fit(rows, rows, batch_size=4, verbose=0)
    plain.fit(rows, rows, batch_size=4, verbose=0)
    for a, b in zip(split.get_weights(), plain.get_weights()):
        # float32, values of order 1: rounding of the split products only.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("ok: a layer built by tracing its call", flush=True)
print("errors ok", flush=True)
