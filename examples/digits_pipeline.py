"""Pipeline-parallel training of a digit classifier with keras-smp.

    python examples/digits_pipeline.py                  # 2 stages, 1 replica
    python examples/digits_pipeline.py --replicas 2     # 2 replicas x 2 stages
    keras-smp launch -n 2 -- python examples/digits_pipeline.py
                                  # 2 worker processes, each a 2-stage pipeline

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
from digits_data import datasets  # noqa: E402

# Batches must divide into microbatches x replicas: drop the remainders.
train, test, num_test = datasets(args.global_batch, drop_test_remainder=True)

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

if keras_smp.is_chief():
    print(model.partition_summary())
    print(f"workers={keras_smp.size()} replicas={strategy.num_replicas_in_sync} stages={model.num_stages} "
          f"microbatches={model.num_microbatches} schedule={args.pipeline} "
          f"(ideal bubble {model.schedule.ideal_bubble_fraction():.2f})",
          flush=True)
model.fit(train, epochs=args.epochs, validation_data=test, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
if keras_smp.is_chief():
    print(f"held-out accuracy: {accuracy:.4f} (loss {loss:.4f}) on "
          f"{num_test} test images", flush=True)
