"""SMP usage pattern 2: hybrid model + data parallelism with Horovod.

Each process runs a 2-stage pipeline; Horovod averages the gradients over
the processes (data-parallel replicas). keras-smp initialises Horovod over
the replicas (do not call `hvd.init()`). Needs Horovod (TensorFlow 2.15.1,
built by `bash scripts/horovod-env.sh`):

    .venv-hvd/bin/keras-smp launch --horovod -n 2 -- \
        .venv-hvd/bin/python examples/smp_hybrid_horovod.py
"""

import os
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import keras_smp as smp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_data import smp_datasets  # noqa: E402

smp.init({"partitions": 2, "microbatches": 4, "horovod": True})


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.hidden1 = keras.layers.Dense(128, activation="relu")
        self.hidden2 = keras.layers.Dense(64, activation="relu")
        self.logits = keras.layers.Dense(10)

    def call(self, x):
        return self.logits(self.hidden2(self.hidden1(x)))


model = Model()
optimizer = keras.optimizers.Adam(1e-3)
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@smp.step
def get_grads(images, labels):
    predictions = model(images, training=True)
    loss = loss_object(labels, predictions)
    grads = optimizer.get_gradients(loss, model.trainable_variables)
    return grads, loss


@tf.function
def train_step(images, labels, first_batch):
    gradients, loss = get_grads(images, labels)
    gradients = [hvd.allreduce(g.accumulate()) for g in gradients]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    # SMP's docs broadcast after the first batch (keras-smp already started
    # every replica from rank 0's weights; this keeps the SMP script as is).
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)
    return loss.reduce_mean()


train, x_test, y_test = smp_datasets(32, smp.dp_rank(), smp.dp_size())
losses = []
for epoch in range(int(os.environ.get("EPOCHS", 4))):
    epoch_loss = [float(train_step(x, y, epoch == 0 and i == 0))
                  for i, (x, y) in enumerate(train)]
    losses.append(np.mean(epoch_loss))
    if smp.rank() == 0:
        print(f"epoch {epoch + 1}: loss {losses[-1]:.4f}")

# Replicas must hold the same weights: compare with rank 0's.
mine = np.concatenate([w.ravel() for w in model.get_weights()])
same = float(np.abs(mine - hvd.broadcast(mine, root_rank=0).numpy()).max())
if smp.rank() == 0:
    test_acc = np.mean(
        np.argmax(model.predict(x_test, verbose=0), -1) == y_test)
    print(f"test accuracy {test_acc:.3f}; horovod size {hvd.size()}; "
          f"max weight difference to rank 0 {same:g}")
    print(f"LOSS {losses[0]:.4f} -> {losses[-1]:.4f}")
