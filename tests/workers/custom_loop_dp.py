"""SMP custom loop on every worker process (data parallel x 2-stage pipeline).

Run with `keras-smp launch -n N`. Each process is a data-parallel replica
running a 2-stage, 2-microbatch pipeline on its shard (contiguous rows,
by `smp.dp_rank()`) of a fixed global batch per step; gradients are
averaged over replicas in `accumulate()`. Adam, so optimizer slots and the
step counter must survive a checkpoint.

    --steps N        train until step N
    --stop-at K      save a checkpoint after step K and exit (an interruption)
    --ckpt DIR       CheckpointManager directory; restore() is called before
                     the first step, before the model has weights
    --out DIR        rank{R}.json: final weights, losses, comms results;
                     rank 0 also trains a plain Keras model on the whole
                     global batch from the same initial weights (reference)
    --save-model DIR DistributedModel.save_model at the end
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_smp as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--save-model", default=None)
args = parser.parse_args()

smp.init({"partitions": 2, "microbatches": 2})
GLOBAL = 32
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(step):
    rng = np.random.RandomState(100 + step)
    return (rng.randn(GLOBAL, 8).astype("float32"),
            rng.randint(0, 3, GLOBAL).astype("int32"))


class Model(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="tanh")
        self.d2 = keras.layers.Dense(16, activation="relu")
        self.d3 = keras.layers.Dense(3)

    def call(self, inputs):
        return self.d3(self.d2(self.d1(inputs)))


# Different seeds per rank: replicas must agree because keras-smp copies
# rank 0's initial weights, not because of the seed.
keras.utils.set_random_seed(11 + smp.rank())
model = Model()
opt = keras.optimizers.Adam(0.01)
ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
manager = smp.CheckpointManager(ckpt, args.ckpt) if args.ckpt else None
start = 0
initial = None
if manager is not None and manager.latest_checkpoint:
    # SMP scripts restore before the first step: the model has no weights.
    assert not model.variables
    path = manager.restore()
    start = int(path.rsplit("-", 1)[1])
else:
    model(batch(0)[0][:1])
    initial = model.get_weights()


@smp.step
def get_grads(inputs, labels):
    logits = model(inputs, training=True)
    loss = loss_fn(labels, logits)
    return opt.get_gradients(loss, model.trainable_variables), loss


@tf.function
def train_step(inputs, labels):
    grads, loss = get_grads(inputs, labels)
    grads = [g.accumulate() for g in grads]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss.reduce_mean()


rows = GLOBAL // smp.dp_size()
lo = smp.dp_rank() * rows
# SMP's broadcast pattern: `smp.broadcast` on rank 0, `smp.recv_from(0)`
# on the others, here after training: the first step's copy of rank 0's
# weights (keras-smp's own broadcast, between the same ranks) comes
# between the send and the receive.
if smp.rank() == 0 and smp.size() > 1:
    smp.broadcast({"smp": "pattern"})
losses = []
for step in range(start, args.steps):
    x, y = batch(step)
    losses.append(float(train_step(x[lo:lo + rows], y[lo:lo + rows])))
    if args.stop_at is not None and step + 1 == args.stop_at:
        manager.save(checkpoint_number=step + 1)
        print(f"rank {smp.rank()}: saved at step {step + 1}, stopping")
        raise SystemExit(0)

# Over the replicas, as accumulate(): a sum over microbatches (the rows
# of this replica's half) is the global batch's (32 rows on every rank).
rows_of = smp.step(lambda x: tf.cast(tf.shape(x)[0], tf.float32))
global_rows = float(rows_of(batch(0)[0][lo:lo + rows]).reduce_sum())

# The communication helpers on Python objects (first the receive of SMP's
# broadcast pattern, see above: objects from one rank arrive in order).
smp_broadcast = (smp.recv_from(0, smp.RankType.WORLD_RANK)
                 if smp.rank() != 0 else None)
comms = {
    "smp_broadcast": smp_broadcast,
    "broadcast": smp.broadcast({"from": smp.rank()}),
    "allgather": smp.allgather(smp.rank() * 10),
    "dp_allgather": smp.allgather(smp.dp_rank(), smp.CommGroup.DP_GROUP),
}
if smp.size() > 1:
    if smp.rank() == 0:
        for r in range(1, smp.size()):
            smp.send({"to": r, "arr": np.arange(r)}, r, smp.RankType.WORLD_RANK)
        comms["recv"] = [smp.recv_from(r, smp.RankType.DP_RANK)
                         for r in range(1, smp.size())]
    else:
        got = smp.recv_from(0)
        comms["recv"] = {"to": got["to"], "arr": got["arr"].tolist()}
        smp.send(f"hello from {smp.rank()}", 0)
    # A broadcast that finds a send of the same rank first says so (it
    # returned the send's object); as the error advises, the send's object
    # is received first, then the broadcast's.
    if smp.rank() == 0:
        smp.send("sent first", 1)
    try:
        smp.broadcast("broadcast" if smp.rank() == 0 else None)
        comms["mixed"] = None
    except ValueError as e:
        comms["mixed"] = str(e)
    if smp.rank() == 1:
        comms["after_mixed"] = [smp.recv_from(0),
                                smp.broadcast(None)]
smp.barrier()
smp.dp_barrier()

result = {
    "rank": smp.rank(), "dp_size": smp.dp_size(), "start": start,
    "losses": losses, "comms": comms, "global_rows": global_rows,
    "weights": [w.tolist() for w in model.get_weights()],
    "iterations": int(opt.iterations.numpy()),
}

if smp.rank() == 0 and initial is not None:
    plain = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, "tanh"),
        keras.layers.Dense(16, "relu"), keras.layers.Dense(3)])
    plain.set_weights(initial)
    plain_opt = keras.optimizers.Adam(0.01)

    @tf.function
    def plain_step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, plain(inputs, training=True))
        grads = tape.gradient(loss, plain.trainable_variables)
        plain_opt.apply_gradients(zip(grads, plain.trainable_variables))
        return loss

    result["plain_losses"] = [float(plain_step(*batch(s)))
                              for s in range(args.steps)]
    result["plain_weights"] = [w.tolist() for w in plain.get_weights()]
    result["initial"] = [w.tolist() for w in initial]

if args.save_model:
    model.save_model(args.save_model)
    x = batch(0)[0]
    result["predict"] = model.predict(x, verbose=0).tolist()
    result["x"] = x.tolist()

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{smp.rank()}.json"), "w") as f:
    json.dump(result, f)
