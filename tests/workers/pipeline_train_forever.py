"""Trains on 2 workers until killed (tests): a 2-stage, one-stage-per-process
pipeline, or (`--partitions 1`) plain data parallelism.

Prints `STEP <n>` after each batch so the test knows training is under way;
used to check that a peer that dies or hangs ends this worker with a clear
error within the collective timeout, and (`--fail-rank R`) that a peer
raising an exception ends it with that exception named.
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--timeout", type=float, default=15)
p.add_argument("--partitions", type=int, default=2,
               help="1: plain data parallelism over the 2 workers")
p.add_argument("--fail-rank", type=int, default=-1,
               help="this rank raises after --fail-step steps (its peer "
                    "is then in the next step's collectives)")
p.add_argument("--fail-step", type=int, default=3)
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy(
    partitions=args.partitions, microbatches=2,
    collective_timeout_seconds=args.timeout)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = np.random.RandomState(1).randn(64, 2).astype("float32")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
    16, drop_remainder=True).repeat()


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"STEP {batch}", flush=True)
        if (keras_smp.rank() == args.fail_rank
                and batch + 1 >= args.fail_step):
            raise RuntimeError(f"rank {args.fail_rank} fails on purpose")


with strategy.scope():
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(2)])
    if args.partitions > 1:
        model = keras_smp.DistributedModel(model)
    model.compile(optimizer="sgd", loss="mse")
model.fit(ds, steps_per_epoch=10**6, epochs=1, verbose=0,
          callbacks=[Report()])
