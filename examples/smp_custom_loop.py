"""SMP usage pattern 1: automatic split, custom training loop.

A script written for SageMaker's `smdistributed.modelparallel.tensorflow`,
with only the import changed (and Keras 3 names). keras-smp splits the
model into 2 pipeline stages automatically and runs each batch as 4
microbatches.

    python examples/smp_custom_loop.py                 # one process
    keras-smp launch -n 2 -- python examples/smp_custom_loop.py
                                      # 2 data-parallel replicas x 2 stages
    SMP_CONFIG='{"local_devices": 1}' \
        keras-smp launch -n 2 -- python examples/smp_custom_loop.py
                                      # SMP's layout: one stage per process
"""

import os
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_smp as smp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_data import smp_datasets  # noqa: E402

smp.init({"partitions": 2, "microbatches": 4, "pipeline": "interleaved",
          "auto_partition": True})


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.hidden1 = keras.layers.Dense(128, activation="relu")
        self.hidden2 = keras.layers.Dense(64, activation="relu")
        self.hidden3 = keras.layers.Dense(64, activation="relu")
        self.logits = keras.layers.Dense(10)

    def call(self, x):
        return self.logits(self.hidden3(self.hidden2(self.hidden1(x))))


model = Model()
optimizer = keras.optimizers.Adam(1e-3)
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_accuracy = keras.metrics.SparseCategoricalAccuracy()
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
ckpt_dir = os.environ.get("CKPT_DIR") or tempfile.mkdtemp()
ckpt_manager = smp.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2)
ckpt_manager.restore()  # SMP scripts restore before the first step


@smp.step
def get_grads(images, labels):
    predictions = model(images, training=True)
    loss = loss_object(labels, predictions)
    grads = optimizer.get_gradients(loss, model.trainable_variables)
    return grads, loss, predictions


@tf.function
def train_step(images, labels):
    gradients, loss, predictions = get_grads(images, labels)
    gradients = [g.accumulate() for g in gradients]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    train_accuracy(labels, predictions.merge())
    return loss.reduce_mean()


train, x_test, y_test = smp_datasets(32, smp.dp_rank(), smp.dp_size())
losses = []
for epoch in range(int(os.environ.get("EPOCHS", 4))):
    train_accuracy.reset_state()
    epoch_loss = [float(train_step(x, y)) for x, y in train]
    losses.append(np.mean(epoch_loss))
    ckpt_manager.save()
    if smp.rank() == 0:
        print(f"epoch {epoch + 1}: loss {losses[-1]:.4f} "
              f"accuracy {float(train_accuracy.result()):.3f}")

test_acc = np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test)
if smp.rank() == 0:
    print(f"test accuracy {test_acc:.3f}; stages {model.num_stages}, "
          f"replicas {smp.dp_size()}")
    print(f"LOSS {losses[0]:.4f} -> {losses[-1]:.4f}")
