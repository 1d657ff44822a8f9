"""SMP custom loop (`smp.init`, `@smp.step`) with tensor parallelism.

Run with `keras-smp launch -n N`: `tensor_parallel_degree=2`, so N / 2
data-parallel replicas; each process runs its pipeline's `--partitions`
stages on its own (logical CPU) devices. The model is a small transformer
LM built inside `smp.tensor_parallelism()` (vocabulary-parallel tied
embedding, split attention heads, a Dense pair, LayerNorm replicated),
trained with SGD momentum and `global_clipnorm` (the norm sums over the
tensor-parallel ranks).

    --steps N      train until step N
    --stop-at K    save a CheckpointManager checkpoint after step K and exit
    --ckpt DIR     CheckpointManager directory; restore() before the first
                   step (before the model has weights)
    --out DIR      rank{R}.npz: whole weights (gathered), losses; rank 0
                   also trains plain Keras on the whole global batch from the
                   same initial weights (the reference), and writes
                   model.weights.h5 (whole weights, read by plain Keras)
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--partitions", type=int, default=1)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--vocab-parallel", action="store_true",
                    help="the step's loss on split logits "
                         "(smp.vocab_parallel_logits)")
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_smp as smp  # noqa: E402

smp.init({"partitions": args.partitions, "microbatches": 2,
          "tensor_parallel_degree": 2, "collective_timeout_seconds": 120})
assert smp.tp_size() == 2 and smp.mp_size() == 2, (smp.tp_size(),
                                                    smp.mp_size())
VOCAB, SEQ, WIDTH, HEADS, GLOBAL = 32, 6, 16, 4, 16
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch(step):
    rng = np.random.RandomState(100 + step)
    x = rng.randint(1, VOCAB, size=(GLOBAL, SEQ)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def build(seed):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(VOCAB, WIDTH, name="tok_emb")
    h = emb(tokens)
    a = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, name="mha")(
        h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="ln0")(h + a)
    f = keras.layers.Dense(4 * WIDTH, activation="relu", name="ff_a")(h)
    f = keras.layers.Dense(WIDTH, name="ff_b")(f)
    h = keras.layers.LayerNormalization(name="ln1")(h + f)
    return keras.Model(tokens, emb(h, reverse=True))


def optimizer():
    return keras.optimizers.SGD(0.2, momentum=0.9, global_clipnorm=0.5)


# Other seeds per rank: the processes agree because keras-smp copies rank
# 0's whole initial weights (each rank keeping its shard), not by seed.
with smp.tensor_parallelism():
    model = smp.DistributedModel(build(11 + smp.rank()))
opt = optimizer()
assert smp.tensor_parallel_layers(model) == {
    "tok_emb": "vocab", "mha": "heads", "ff_a": "column", "ff_b": "row"}, \
    smp.tensor_parallel_layers(model)
ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
manager = smp.CheckpointManager(ckpt, args.ckpt) if args.ckpt else None
start, initial = 0, None
if manager is not None and manager.latest_checkpoint:
    path = manager.restore()
    start = int(path.rsplit("-", 1)[1])
else:
    model(batch(0)[0][:2])
    initial = model.get_weights()  # whole weights (gathered)
# This rank holds half of each split weight.
shapes = {w.path: tuple(w.shape) for w in model.weights}
assert shapes["tok_emb/embeddings"] == (VOCAB // 2, WIDTH), shapes
assert shapes["ff_a/kernel"] == (WIDTH, 2 * WIDTH), shapes


vp_loss = smp.VocabParallelSparseCategoricalCrossentropy()


@smp.step
def get_grads(inputs, labels):
    if args.vocab_parallel:
        with smp.vocab_parallel_logits(model):
            logits = model(inputs, training=True)
            # This rank's half of the vocabulary, never gathered.
            assert logits.shape[-1] == VOCAB // 2, logits.shape
            loss = vp_loss(labels, logits)
    else:
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
losses = []
for step in range(start, args.steps):
    x, y = batch(step)
    losses.append(float(train_step(x[lo:lo + rows], y[lo:lo + rows])))
    if args.stop_at is not None and step + 1 == args.stop_at:
        manager.save(checkpoint_number=step + 1)
        print(f"rank {smp.rank()}: saved at step {step + 1}, stopping",
              flush=True)
        raise SystemExit(0)

out = {"losses": np.array(losses), "start": np.array(start),
       "iterations": np.array(int(opt.iterations.numpy()))}
for i, w in enumerate(model.get_weights()):
    out[f"w{i}"] = w
path = os.path.join(args.out, "model.weights.h5")
os.makedirs(args.out, exist_ok=True)
model.save_weights(path)  # whole weights; every rank takes part
if smp.rank() == 0:
    plain = build(0)
    plain.load_weights(path)
    for i, w in enumerate(plain.get_weights()):
        np.testing.assert_array_equal(w, out[f"w{i}"])
    if initial is not None:
        plain.set_weights(initial)
        plain_opt = optimizer()

        @tf.function
        def plain_step(inputs, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, plain(inputs, training=True))
            grads = tape.gradient(loss, plain.trainable_variables)
            plain_opt.apply_gradients(zip(grads, plain.trainable_variables))
            return loss

        out["plain_losses"] = np.array(
            [float(plain_step(*batch(s))) for s in range(args.steps)])
        for i, w in enumerate(plain.get_weights()):
            out[f"plain{i}"] = w
try:  # every rank: no collective runs before the error
    model.save_model(os.path.join(args.out, "saved"))
    raise SystemExit("save_model of a tensor-parallel model did not fail")
except ValueError as e:
    assert "model.save_weights" in str(e), e
np.savez(os.path.join(args.out, f"rank{smp.rank()}.npz"), **out)
print(f"rank {smp.rank()}: ok", flush=True)
