"""Data-parallel training of a digit classifier with keras-smp.

Run on 2 local worker processes (what `make demo` does):

    keras-smp launch -n 2 -- python examples/digits_data_parallel.py

or on one process: `python examples/digits_data_parallel.py`. Uses
scikit-learn's bundled digits data set (1797 8x8 images), so it needs no
download. Every worker runs this same script; the dataset is the global
batch and SMPStrategy shards it across workers. Only the chief prints.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--global-batch", type=int, default=64)
args = parser.parse_args()

# Create the strategy first: it starts TensorFlow's distributed runtime.
strategy = keras_smp.SMPStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
x_train, x_test, y_train, y_test = train_test_split(
    x, y, test_size=0.2, random_state=0, stratify=y)

# Same seed on every worker: every worker sees the same global batches,
# of which the strategy gives each its own share.
train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
         .shuffle(len(x_train), seed=0)
         .batch(args.global_batch, drop_remainder=True))
test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(40)

with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

if keras_smp.is_chief():
    print(f"workers={keras_smp.size()} replicas={strategy.num_replicas_in_sync}"
          f" allreduce={strategy.allreduce_algorithm} "
          f"global_batch={args.global_batch}", flush=True)

model.fit(train, epochs=args.epochs, validation_data=test, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
if keras_smp.is_chief():
    print(f"held-out accuracy: {accuracy:.4f} (loss {loss:.4f}) on "
          f"{len(x_test)} test images", flush=True)
