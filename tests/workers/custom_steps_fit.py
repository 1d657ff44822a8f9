"""Models with steps of their own (`tests/workers/custom_steps.py`: a
GAN, a loss object with its own metrics, Keras' guide's steps, a VAE
whose loss is written by hand) trained
by `fit` as data-parallel worker processes (`keras-smp launch -n 2`,
`--mode strategy`) or on one device (`--mode plain`). Writes
OUT/rank{R}.json: `{model: {"history": ..., "weights": [...]}}`.

    custom_steps_fit.py OUT [--mode plain]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--mode", choices=["strategy", "plain"], default="strategy")
args = p.parse_args()

strategy = None
if args.mode == "strategy":
    import keras_smp

    strategy = keras_smp.SMPStrategy()

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from custom_steps import GuideSteps  # noqa: E402
from custom_steps import OwnLossSteps  # noqa: E402
from custom_steps import make_gan  # noqa: E402
from custom_steps import make_vae  # noqa: E402

rng = np.random.RandomState(0)
X = rng.randn(128, 6).astype("float32")
Y = rng.randn(128, 1).astype("float32")


def gan():
    return make_gan(), (X,), {}


def vae():
    return make_vae(), (X,), {}


def own_loss():
    inputs = keras.Input((6,))
    model = OwnLossSteps(inputs, keras.layers.Dense(1)(
        keras.layers.Dense(16, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return model, (X, Y), {"validation_data": (X, Y)}


def guide():
    model = GuideSteps([keras.Input((6,)),
                        keras.layers.Dense(16, activation="tanh"),
                        keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse",
                  metrics=["mae"])
    return model, (X, Y), {"validation_data": (X, Y)}


results = {}
for name, make in (("gan", gan), ("own_loss", own_loss), ("guide", guide),
                   ("vae", vae)):
    keras.utils.set_random_seed(7)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model, data, kwargs = make()
    history = model.fit(*data, batch_size=32, epochs=2, shuffle=False,
                        verbose=0, **kwargs).history
    results[name] = {"history": {k: [float(v) for v in vs]
                                 for k, vs in history.items()},
                     "weights": [w.tolist() for w in model.get_weights()]}
rank = keras_smp.rank() if strategy else 0
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
