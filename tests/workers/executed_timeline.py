"""Prints the executed timeline of a 2-stage pipeline as JSON (tests).

Run alone: both stages on logical devices of this process; under
`keras-smp launch -n 2`: one stage per process (every rank prints the
replica's timeline and the image/trace files are written by rank 0).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

schedule = sys.argv[1]
strategy = keras_smp.SMPStrategy(partitions=2, microbatches=4, pipeline=schedule)

import keras  # noqa: E402
import numpy as np  # noqa: E402

with strategy.scope():
    model = keras_smp.DistributedModel(keras.Sequential(
        [keras.Input((64,))] + [keras.layers.Dense(256, activation="relu")
                                for _ in range(4)] + [keras.layers.Dense(4)]))
    model.compile(optimizer="sgd", loss="mse")
x = np.random.RandomState(0).randn(128, 64).astype("float32")
y = np.random.RandomState(1).randn(128, 4).astype("float32")
before = [w.copy() for w in model.get_weights()]
result = {}
for name, args in (("train", (x, y)), ("forward", (x,))):
    t = model.executed_timeline(*args)
    result[name] = {
        "entries": [[[s, e, str(a)] for s, e, a in stage] for stage in t.entries],
        "bubble": t.bubble_fraction(), "makespan": t.makespan}
    if keras_smp.rank() == 0:
        t.draw(os.path.join(sys.argv[2], f"{name}.png"))
        t.to_chrome_trace(os.path.join(sys.argv[2], f"{name}.json"))
result["weights_unchanged"] = all(
    np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
if keras_smp.size() == 1:
    # Compiled without a loss (its loss is what a layer adds, as `fit(x)`
    # trains it): `executed_timeline(x)` times the training step.
    from added_losses import Reconstruction

    with strategy.scope():
        inputs = keras.Input((64,))
        h = keras.layers.Dense(32, activation="tanh")(inputs)
        h = keras.layers.Dense(64)(keras.layers.Dense(32)(h))
        auto = keras_smp.DistributedModel(
            keras.Model(inputs, Reconstruction()([inputs, h])))
        auto.compile(optimizer="sgd")
    start = [w.copy() for w in auto.get_weights()]
    t = auto.executed_timeline(x)
    result["weights_unchanged"] = result["weights_unchanged"] and all(
        np.array_equal(a, b) for a, b in zip(start, auto.get_weights()))
    result["added_loss_only"] = {
        "entries": [[[s, e, str(a)] for s, e, a in stage]
                    for stage in t.entries],
        "bubble": t.bubble_fraction(), "makespan": t.makespan}
result["rank"] = keras_smp.rank()
print("RESULT " + json.dumps(result), flush=True)
