"""`.keras` files of a model trained with one stage per process (issue 17).

Run under `keras-smp launch -n 2`: 2 stages, one per process, Adam, 2 epochs
(a `ModelCheckpoint` writing the whole model each epoch), then:

- `model.save(OUT/streamed.keras)` and
  `keras.saving.save_model(model, OUT/api.keras)`: streamed from the
  stages (no process gathers the model);
- `model.save_model(OUT/savedmodel)`: SMP's SavedModel export, from the
  stages' shards too;
- `model.save(OUT/gathered, zipped=False)`: Keras' own writer on the
  gathered model (the comparison);
- `model.save(OUT/streamed.keras, overwrite=False)` raises
  `FileExistsError` on every process.

Each process writes OUT/rank{R}.json: what the save left in OUT and the
predictions of the trained model on fixed inputs (rank 0 writes
predict.npy).

    keras_save.py OUT
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

out = sys.argv[1]
rank = strategy.topology.rank
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"])
x = np.random.RandomState(0).randn(32, 6).astype("float32")
y = np.random.RandomState(1).randn(32, 3).astype("float32")
model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
    keras.callbacks.ModelCheckpoint(os.path.join(out, "epoch{epoch}.keras"))])

streamed = os.path.join(out, "streamed.keras")
model.save(streamed)
keras.saving.save_model(model, os.path.join(out, "api.keras"))
model.save_model(os.path.join(out, "savedmodel"))  # SMP's export
# No gathering so far (the epochs' checkpoints, both saves and the export
# were written from the stages' shards).
gathers_before = model._smp_residency()._syncs
model.save(os.path.join(out, "gathered"), zipped=False)
gathered_once = model._smp_residency()._syncs - gathers_before
try:
    model.save(streamed, overwrite=False)
    refused = None
except FileExistsError as e:
    refused = str(e)
predict = model.predict(x, verbose=0)
if rank == 0:
    np.save(os.path.join(out, "predict.npy"), predict)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"files": sorted(os.listdir(out)), "refused": refused,
               "gathers_before": gathers_before,
               "gathered_once": gathered_once}, f)
