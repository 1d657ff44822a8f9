"""Optimizer state saved by the stage processes, then resumed (used by
tests/test_keras_features.py).

Run under `keras-smp launch -n 2` (2 stages, one per process). For each
optimizer: fit 1 epoch, `save_weights(OUT/NAME.weights.json)` (weights and
optimizer state, each stage writing its own), fit another epoch; then a new
model loads the file and fits that epoch again. Prints per optimizer
`RESUME {json}`: the largest difference between the saved and the loaded
weights, and between the uninterrupted run's and the resumed run's final
weights. At the save, the same state is also written as `OUT/NAME.keras`
(streamed from the stages) and `OUT/NAME_gathered/` (`zipped=False`:
Keras' writer on the gathered model, which copied other stages' Adafactor
factors from this process's never-updated copy).

- "multi_optimizer": a `MultiOptimizer` (Adam for the first stage's layer,
  SGD with momentum for the rest);
- "adafactor": `Adafactor`, whose factored accumulators Keras makes per
  weight with `add_variable` (not as slots of the weight): the last
  stage's were written from the first stage's copy (never updated there),
  so the resumed run drifted (weights off by 0.05).

First, a `MultiOptimizer` whose sub-optimizer sets `global_clipnorm` is
refused at the first step on every rank (`REFUSED {json}`). Last, a model
whose last layer has another width fails to load the checkpoint on every
rank (`MISMATCH {json}`).

    optimizer_resume.py OUT
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

OUT = sys.argv[1]
x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = x[:, :2] * 2
OPTIMIZERS = {
    "multi_optimizer": lambda: keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.05, momentum=0.9),
            {"enc/.*": keras.optimizers.Adam(1e-2)})),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
}


def build(optimizer, head=2):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inp = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu", name="enc")(inp)
        h = keras.layers.Dense(16, activation="relu", name="dec")(h)
        model = keras_smp.DistributedModel(
            keras.Model(inp, keras.layers.Dense(head, name="head")(h)))
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    return model


def largest(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


# A sub-optimizer whose update needs all its weights together, across the
# stages: refused at the first step, on every rank (it clipped by this
# stage's norm alone).
OPTIMIZERS["clipped_sub_optimizer"] = lambda: keras.optimizers.MultiOptimizer(
    keras.optimizers.OptimizerMap(
        keras.optimizers.SGD(0.05, global_clipnorm=0.1),
        {"enc/.*": keras.optimizers.Adam(1e-2)}))
model = build("clipped_sub_optimizer")
try:
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    refused = None
except NotImplementedError as e:
    refused = str(e)
print("REFUSED " + json.dumps(dict(rank=keras_smp.rank(), refused=refused)),
      flush=True)
del OPTIMIZERS["clipped_sub_optimizer"]

for name in OPTIMIZERS:
    path = os.path.join(OUT, f"{name}.weights.json")
    model = build(name)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save_weights(path)
    # The same state as a streamed `.keras` file (from the stages' shards)
    # and as Keras' writer on the gathered model (a folder): the test
    # compares their optimizer variables.
    model.save(os.path.join(OUT, f"{name}.keras"))
    model.save(os.path.join(OUT, f"{name}_gathered"), zipped=False)
    saved = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    resumed = build(name)
    with strategy.scope():
        resumed.build((None, 8))
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    loaded = resumed.get_weights()
    resumed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    print("RESUME " + json.dumps(dict(
        rank=keras_smp.rank(), optimizer=name,
        loaded=largest(saved, loaded),
        moved=largest(saved, model.get_weights()),
        resumed=largest(model.get_weights(), resumed.get_weights()))),
        flush=True)

# A checkpoint whose last layer has another width: only the last stage's
# process holds that layer, and it alone raised (the first stage went on
# with a half-loaded model). Every process raises.
other = build("adafactor", head=3)
with strategy.scope():
    other.build((None, 8))
try:
    other.load_weights(os.path.join(OUT, "adafactor.weights.json"))
    mismatch = None
except ValueError as e:
    mismatch = str(e)
print("MISMATCH " + json.dumps(dict(rank=keras_smp.rank(), error=mismatch)),
      flush=True)
