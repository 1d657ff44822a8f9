"""`keras.callbacks.BackupAndRestore(double_checkpoint=True)` with one
pipeline stage per process (used by tests).

Usage: double_backup.py --out DIR --mode reference|pipeline
       [--fail-at-epoch E]

reference: plain Keras on one device, 3 epochs, uninterrupted.
pipeline: 2 stages, one per process (`keras-smp launch -n 2`), the same
fit with `BackupAndRestore(DIR/backup, double_checkpoint=True)`; with
`--fail-at-epoch E` it raises as epoch E (0-based) begins, after the
backup of epoch E-1 (so the last backup is E epochs in, the one before
E-1). Writes DIR/rank{R}.npz: the trained weights and the predictions.
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["reference", "pipeline"], required=True)
p.add_argument("--fail-at-epoch", type=int, default=None)
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

strategy = None
if args.mode == "pipeline":
    import keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                     collective_timeout_seconds=120)

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(64, 8).astype("float32")
y = rng.randint(0, 3, size=64)


class FailAt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == args.fail_at_epoch:
            raise RuntimeError(f"fails on purpose at epoch {epoch}")


keras.utils.set_random_seed(3)
with strategy.scope() if strategy else contextlib.nullcontext():
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh", name="d1"),
        keras.layers.Dense(16, activation="relu", name="d2"),
        keras.layers.Dense(3, name="head"),
    ])
    if strategy:
        model = keras_smp.DistributedModel(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
callbacks = []
if strategy:
    callbacks = [keras.callbacks.BackupAndRestore(
        os.path.join(args.out, "backup"), double_checkpoint=True,
        delete_checkpoint=False), FailAt()]
model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=2,
          callbacks=callbacks)
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["predict"] = model.predict(x, batch_size=16, verbose=0)
rank = strategy.topology.rank if strategy else 0
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
