"""SMP usage pattern 3: manual split with `smp.partition` scopes.

`auto_partition=False`: the layers built and called inside
`with smp.partition(i):` form stage `i`; the rest go to
`default_partition`. Run it in one process or with
`keras-smp launch -n 2 -- python examples/smp_manual_split.py`.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_smp as smp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_data import smp_datasets  # noqa: E402

smp.init({"partitions": 2, "microbatches": 2, "pipeline": "simple",
          "auto_partition": False, "default_partition": 0})


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Dense(128, activation="relu")
        self.body = keras.layers.Dense(64, activation="relu")
        self.head = keras.layers.Dense(10)

    def call(self, x):
        with smp.partition(0):
            x = self.embed(x)
        with smp.partition(1):
            x = self.body(x)
            return self.head(x)


model = Model()
optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@smp.step
def get_grads(images, labels):
    predictions = model(images, training=True)
    loss = loss_object(labels, predictions)
    grads = optimizer.get_gradients(loss, model.trainable_variables)
    return grads, loss


@tf.function
def train_step(images, labels):
    gradients, loss = get_grads(images, labels)
    gradients = [g.accumulate() for g in gradients]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss.reduce_mean()


train, x_test, y_test = smp_datasets(32, smp.dp_rank(), smp.dp_size())
losses = []
for epoch in range(int(os.environ.get("EPOCHS", 4))):
    losses.append(np.mean([float(train_step(x, y)) for x, y in train]))
    if smp.rank() == 0:
        print(f"epoch {epoch + 1}: loss {losses[-1]:.4f}")

if smp.rank() == 0:
    print(model.partition_summary())
    test_acc = np.mean(
        np.argmax(model.predict(x_test, verbose=0), -1) == y_test)
    print(f"test accuracy {test_acc:.3f}")
    print(f"LOSS {losses[0]:.4f} -> {losses[-1]:.4f}")
