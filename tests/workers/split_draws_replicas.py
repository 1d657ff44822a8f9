"""Each data-parallel replica's part (`runtime.split_draws`) starts at its
first row of the global batch (used by tests/test_split_draws.py).

Run with `keras-smp launch -n 2`: 2 processes x 2 local replicas (logical
CPUs), global batches of 8 rows whose values are their row numbers. Prints
"PARTS " + JSON per batch: per local replica, [its part's offset, its first
row's place in the global batch, its part's rows, its rows].
"""

import json

import numpy as np

import keras_smp

strategy = keras_smp.SMPStrategy(local_devices=2)

import tensorflow as tf  # noqa: E402

from keras_smp.runtime import split_draws  # noqa: E402

x = np.arange(32, dtype="float32").reshape(32, 1)
batches = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices(x).batch(8))


@tf.function
def step(batch):
    def parts(t):
        offset, rows = split_draws.current()
        return tf.stack([tf.cast(offset, tf.float32), t[0, 0] % 8,
                         tf.cast(rows, tf.float32),
                         tf.cast(tf.shape(t)[0], tf.float32)])
    return strategy.run(parts, args=(batch,))


for batch in batches:
    print("PARTS " + json.dumps([
        v.numpy().tolist()
        for v in strategy.experimental_local_results(step(batch))]),
        flush=True)
