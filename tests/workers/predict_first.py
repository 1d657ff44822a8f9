"""`predict` as the first call of a `DistributedModel` not built yet (a
Sequential without an `Input`, a subclassed `keras.Model` wrapped), under
`SMPStrategy(partitions=2)`: in one process (2 logical CPUs) or one stage
per process (`keras-smp launch -n 2`). Plain Keras builds such a model in
its first call, `predict` included.

For each case: the first call (`predict` of arrays, of a `tf.data`
dataset, or `predict_on_batch`), the weights it built (`get_weights`,
gathered from the stages), then one epoch of `fit` and `predict` again.
The test compares them with plain Keras on one device given the same
initial weights (`--mode reference`, one process). Writes
OUT/rank{R}.json: `{case: {"first", "initial", "loss", "after"}}`.

    predict_first.py OUT [--mode reference] CASE [CASE ...]
    CASE = MODEL:FIRST, MODEL in sequential|subclassed,
           FIRST in predict|dataset|on_batch
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("cases", nargs="+")
p.add_argument("--mode", choices=["strategy", "reference"],
               default="strategy")
p.add_argument("--initial", default=None,
               help="reference: the JSON file of the strategy's run whose "
               "initial weights to start from")
args = p.parse_args()

strategy = None
if args.mode == "strategy":
    import keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.RandomState(0)
X = rng.randn(64, 8).astype("float32")
Y = rng.randint(0, 3, 64)
BATCH = 16


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(16, activation="relu")
        self.d2 = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        h = self.d1(x)
        return self.out(self.d2(h) + h)


def make(kind):
    keras.utils.set_random_seed(1)
    if kind == "sequential":  # no Input: built by its first call
        return keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])
    return Subclassed()


def run(case, initial=None):
    kind, first = case.split(":")
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = make(kind)
        if strategy:
            model = keras_smp.DistributedModel(model)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if initial is not None:  # plain Keras from the strategy's weights
        model(X[:1])  # builds it
        model.set_weights([np.array(w, "float32") for w in initial])
    if first == "predict":
        out = model.predict(X, batch_size=BATCH, verbose=0)
    elif first == "dataset":
        out = model.predict(tf.data.Dataset.from_tensor_slices(X).batch(
            BATCH), verbose=0)
    else:
        out = model.predict_on_batch(X[:BATCH])
    weights = [w.tolist() for w in model.get_weights()]
    hist = model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False,
                     verbose=0)
    after = model.predict(X, batch_size=BATCH, verbose=0)
    return {"first": np.asarray(out).tolist(), "initial": weights,
            "loss": hist.history["loss"], "after": after.tolist()}


rank = keras_smp.rank() if strategy else 0
initials = {}
if args.initial:
    with open(args.initial) as f:
        initials = {c: r["initial"] for c, r in json.load(f).items()}
results = {}
for case in args.cases:
    try:
        results[case] = run(case, initials.get(case))
    except Exception as e:  # noqa: BLE001 - the test shows it
        results[case] = {"error": f"{type(e).__name__}: {e}"[:600]}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
