"""`fit` on a dataset the strategy already distributed
(`strategy.experimental_distribute_dataset`), data parallel over the
processes of `keras-smp launch -n 2` (used by tests/test_strategy.py).

The check that every rank reads infinite data or none read the dataset's
`cardinality` as a method; a distributed dataset holds it as a number
(the fit failed: "'numpy.int64' object is not callable"). Prints
`LOSS <rank> <first epoch's loss>`.
"""

import numpy as np

import keras_smp

strategy = keras_smp.SMPStrategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

x = np.random.RandomState(0).randn(64, 8).astype("float32")
y = x[:, :2]
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
data = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
loss = model.fit(data, epochs=1, verbose=0).history["loss"][0]
print(f"LOSS {keras_smp.rank()} {loss!r}", flush=True)
