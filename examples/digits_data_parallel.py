"""Data-parallel training of a digit classifier with keras-smp.

Run on 2 local worker processes (`make demo` runs the pipelined example,
examples/digits_pipeline.py):

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
from digits_data import datasets  # noqa: E402

train, test, num_test = datasets(args.global_batch)

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
          f"{num_test} test images", flush=True)
