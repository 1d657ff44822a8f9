"""One stage per process: one model trained, evaluated and asked to predict
with different batch sizes in turn (each size crosses the stage boundary
with its own shapes), with and without metrics (a step sharing only its
loss, then steps sharing outputs); batches that do not divide into the
microbatches (evaluate and predict pad them), against plain Keras with the
same weights.

    batch_sizes.py OUT      writes OUT/rank{R}.npz: the predictions and
                            evaluations of each call
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3)]))
    model.compile(optimizer="adam", loss="mse")  # no metrics
x = np.random.RandomState(0).randn(32, 6).astype("float32")
y = np.random.RandomState(1).randn(32, 3).astype("float32")
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
out = {}
# 7 and 9 rows (a last batch of 4 and 5) do not divide into 2
# microbatches: evaluate and predict pad them.
for b in (8, 32, 16, 8, 4, 7, 9):
    out[f"predict{b}"] = model.predict(x, batch_size=b, verbose=0)
for b in (16, 8, 7, 9):
    out[f"evaluate{b}"] = np.array(model.evaluate(x, y, batch_size=b,
                                                  verbose=0))
# Plain Keras with the same weights, on this process's default device.
plain = keras.Sequential([keras.Input((6,)),
                          keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(3)])
plain.set_weights(model.get_weights())
plain.compile(loss="mse")
out["plain_predict"] = plain.predict(x, batch_size=7, verbose=0)
for b in (7, 9):
    out[f"plain_evaluate{b}"] = np.array(plain.evaluate(
        x, y, batch_size=b, verbose=0))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # a new training size
out["after"] = model.predict(x, batch_size=32, verbose=0)
np.savez(os.path.join(sys.argv[1], f"rank{strategy.topology.rank}.npz"),
         **out)
