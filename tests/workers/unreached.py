"""A model whose trainable weights all reach no loss (used by tests).

`build()`: two outputs; the compiled loss names "cls", which only frozen
layers compute, and "aux", the one trainable head, reaches no loss. Plain
Keras raises "No gradients provided for any variable" in fit.

Run as a script under `keras-smp launch -n 2` (one pipeline stage per
process), it fits such a model and prints one line per process, "ROW " and JSON:
{"rank", "type", "message", "iterations"} ("type" null when fit returned).
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def build():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d1",
                           trainable=False)(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d2",
                           trainable=False)(h)
    cls = keras.layers.Dense(2, name="cls", trainable=False)(h)
    aux = keras.layers.Dense(4, name="aux")(h)
    return keras.Model(inputs, {"cls": cls, "aux": aux})


if __name__ == "__main__":
    import keras_smp

    x = np.random.RandomState(0).randn(64, 8).astype("float32")
    y = np.random.RandomState(1).randn(64, 2).astype("float32")
    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)
    with strategy.scope():
        model = keras_smp.DistributedModel(build())
        model.compile(optimizer="sgd", loss={"cls": "mse"})
    row = {"rank": strategy.topology.rank, "type": None, "message": ""}
    try:
        model.fit(x, {"cls": y}, batch_size=32, epochs=1, verbose=0)
    except Exception as e:  # noqa: BLE001 - reported to the test
        row.update(type=type(e).__name__, message=str(e))
    row["iterations"] = int(model.optimizer.iterations.numpy())
    print("ROW " + json.dumps(row), flush=True)
