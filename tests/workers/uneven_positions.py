"""Data-parallel worker processes whose batches have different lengths
(each pads its own sequences: `distribute_datasets_from_function`, lengths
unknown when traced), through a position embedding (`ops.arange(length)`)
trained with Adam. One device adds the replicas' rows position by
position, which needs the same positions on every replica: each rank must
fail at the first step naming the embedding, not wait in a collective or
sum rows of different positions. Prints `RAISED <type> <message>` and
exits 3, or `NO ERROR`.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

strategy = keras_smp.SMPStrategy({"collective_timeout_seconds": 60})

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(20, 8)
        self.positions = keras.layers.Embedding(16, 8, name="positions")

    def call(self, x):
        return self.tokens(x) + self.positions(ops.arange(ops.shape(x)[-1]))


with strategy.scope():
    inputs = keras.Input((None,), dtype="int32")
    outputs = keras.layers.Dense(3)(TokenAndPosition()(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))


def dataset(context):
    length = 5 + context.input_pipeline_id  # 5 on rank 0, 6 on rank 1
    x = np.ones((32, length), "int32")
    y = np.zeros((32, length), "int32")

    def rows():
        yield from zip(x, y)

    return tf.data.Dataset.from_generator(rows, output_signature=(
        tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.int32))).batch(8)


data = strategy.distribute_datasets_from_function(dataset)
try:
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
except Exception as e:  # noqa: BLE001
    print("RAISED", type(e).__name__, " ".join(str(e).split()), flush=True)
    sys.exit(3)
print("NO ERROR", flush=True)
