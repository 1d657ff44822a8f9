"""A model's own methods through `DistributedModel`, and `fit` under
`smp.init` of a model not built yet.

`init` (one process, `smp.init`, 2 stages x 2 microbatches; `bare`: the
same without `smp.init`, the config from `SMP_CONFIG`): a subclassed
`DistributedModel` and a wrapped subclassed model, neither built, trained
with `fit` and `evaluate`; the wrapped model is built by its own method
called through the wrapper (`model.score(x)`) before `fit`. Each is
compared with plain Keras trained from the same initial weights.

`mp` (2 processes, one stage per process, `SMPStrategy`): the wrapped
model's method after a step is a clear error until `sync_weights()`, then
equals the pipelined `predict`.

Prints `RESULT {json}` per process.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MODE = sys.argv[1]

import keras_smp as smp  # noqa: E402

strategy = None
if MODE == "init":
    smp.init({"partitions": 2, "microbatches": 2})
elif MODE == "mp":
    strategy = smp.SMPStrategy({"partitions": 2, "microbatches": 2})
# "bare": neither (the config from SMP_CONFIG)

import keras  # noqa: E402
import numpy as np  # noqa: E402


class Scorer(keras.Model):
    """A user's model with methods of its own."""

    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(1)
        self.label = "scorer"

    def call(self, x):
        return self.d2(self.d1(x))

    def score(self, x):
        return float(keras.ops.sum(self(x)))

    @property
    def width(self):
        return self.d1.units


class Net(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(1)

    def call(self, x):
        return self.d2(self.d1(x))


def plain_twin():
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


class Initial(keras.callbacks.Callback):
    """The weights training starts from (the model is built by then)."""

    def on_train_begin(self, logs=None):
        self.weights = self.model.get_weights()


x = np.random.RandomState(0).randn(32, 4).astype("float32")
y = np.random.RandomState(1).randn(32, 1).astype("float32")
report = {}


def train(model, name):
    initial = Initial()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        shuffle=False, callbacks=[initial])
    twin = plain_twin()
    twin.set_weights(initial.weights)
    twin.compile(keras.optimizers.SGD(0.05), "mse")
    expected = twin.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        shuffle=False)
    report[name] = dict(
        loss=history.history["loss"], plain_loss=expected.history["loss"],
        weight_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(
            model.get_weights(), twin.get_weights())),
        evaluate=float(model.evaluate(x, y, batch_size=8, verbose=0)),
        plain_evaluate=float(twin.evaluate(x, y, batch_size=8, verbose=0)))
    return twin


if MODE in ("init", "bare"):
    keras.utils.set_random_seed(3)
    net = Net()
    train(net, "subclassed")
    report["stages"] = net.staged_graph.num_stages
    keras.utils.set_random_seed(3)
    scorer = Scorer()
    scorer.compile(keras.optimizers.SGD(0.05), "mse")
    model = smp.DistributedModel(scorer)  # keeps the compile
    # Keras' own attributes stay this model's (a delegated `optimizer`
    # made Keras skip setting this model's own).
    report["own_optimizer"] = "optimizer" in vars(model)
    report["score_before_fit"] = model.score(x)  # builds the wrapped model
    twin = train(model, "wrapped")
    report["score"] = model.score(x)
    report["plain_score"] = float(np.sum(twin.predict(x, verbose=0)))
    report["attributes"] = [model.width, model.d1 is model.inner_model.d1,
                            model.score.__name__]
    errors = []
    for name in ("no_such_thing", "inputs", "label"):
        try:
            getattr(model, name)
            errors.append(None)
        except AttributeError as e:
            errors.append(str(e))
    report["errors"] = errors
else:
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = smp.DistributedModel(Scorer())
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    try:
        report["score_unheld"] = model.score(x)
    except ValueError as e:
        report["score_unheld"] = str(e)
    model.sync_weights()
    report["score"] = model.score(x)
    report["predicted"] = float(np.sum(model.predict(x, batch_size=8,
                                                     verbose=0)))
    report["rank"] = smp.rank()

print("RESULT " + json.dumps(report), flush=True)
