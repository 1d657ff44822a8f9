"""Pipeline-parallel training of a digit classifier with keras-smp.

    python examples/digits_pipeline.py                  # 2 stages, 1 replica
    python examples/digits_pipeline.py --replicas 2     # 2 replicas x 2 stages

The model is split into `--partitions` stages (automatic balanced
partitioning), each batch into `--microbatches` microbatches run with the
1F1B schedule, on logical CPU devices (GPUs when present). Uses
scikit-learn's bundled digits data set, so it needs no download.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--partitions", type=int, default=2)
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--pipeline", default="1f1b", choices=["1f1b", "gpipe"])
args = parser.parse_args()

strategy = keras_smp.SMPStrategy(
    partitions=args.partitions, microbatches=args.microbatches,
    pipeline=args.pipeline, local_devices=args.partitions * args.replicas)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
x_train, x_test, y_train, y_test = train_test_split(
    x, y, test_size=0.2, random_state=0, stratify=y)

# Batches must divide into microbatches x replicas: drop the remainder.
train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
         .shuffle(len(x_train), seed=0)
         .batch(args.global_batch, drop_remainder=True))
test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(
    40, drop_remainder=True)

with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ]))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

print(model.partition_summary())
print(f"replicas={strategy.num_replicas_in_sync} stages={model.num_stages} "
      f"microbatches={model.num_microbatches} schedule={args.pipeline} "
      f"(ideal bubble {model.schedule.ideal_bubble_fraction():.2f})",
      flush=True)
model.fit(train, epochs=args.epochs, validation_data=test, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
print(f"held-out accuracy: {accuracy:.4f} (loss {loss:.4f}) on "
      f"{(len(x_test) // 40) * 40} test images", flush=True)
