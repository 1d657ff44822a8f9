"""A model whose inputs are of unknown length (`keras.Input((None,))`, as
KerasHub backbones declare), with one pipeline stage per process (used by
tests).

Usage: dynamic_length.py --out DIR --mode reference|pipeline

reference: plain Keras on one device. pipeline: 2 stages, one per process
(`keras-smp launch -n 2`); the boundary carries a (batch, None, 16)
tensor and its Keras mask (padded token ids, `mask_zero=True`). Both:

1. fit 2 epochs on arrays of sequences of 12 tokens and predict them;
2. predict sequences of 10 tokens (another length than the first);
3. fit 2 epochs on a `padded_batch` dataset whose batches have 9, 14 and
   6 tokens (16, 16 and 8 rows; a generator: of unknown length), per-token
   targets and sample weights; evaluate it, predict its first batch and
   `predict_on_batch` two batches of different lengths. Rank 1 reads the
   same sequences in another order (batches of other lengths), which
   must not matter: the first stage's rank's batches train.

Writes DIR/rank{R}.npz: the weights after each fit (`w*`, `x*`), losses,
evaluations and predictions.
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["reference", "pipeline"], required=True)
p.add_argument("--jit", action="store_true", help="compile(jit_compile=True)")
p.add_argument("--config", default="{}",
               help="JSON: more SMPStrategy arguments (pipeline, ...)")
p.add_argument("--split", default="d2", help="split points, comma-separated")
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

strategy = None
if args.mode == "pipeline":
    import json

    import keras_smp

    strategy = keras_smp.SMPStrategy(**{
        "partitions": 2, "microbatches": 2, "collective_timeout_seconds": 120,
        **json.loads(args.config)})

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randint(1, 20, size=(32, 12)).astype("int32")
for i, n in enumerate(rng.randint(4, 13, size=32)):  # uneven padding
    x[i, n:] = 0
y = rng.randint(0, 5, size=(32, 12)).astype("int32")

keras.utils.set_random_seed(4)
with strategy.scope() if strategy else contextlib.nullcontext():
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True, name="emb")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    h = keras.layers.Dense(16, activation="relu", name="d2")(h)
    outputs = keras.layers.Dense(5, name="head")(h)
    model = keras.Model(inputs, outputs)
    if strategy:
        model = keras_smp.DistributedModel(model, split_points=args.split.split(","))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=args.jit)
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["loss"] = np.array(history.history["loss"])
result["predict"] = model.predict(x, batch_size=16, verbose=0)
result["predict10"] = model.predict(x[:, :10], batch_size=16, verbose=0)

# Batches of several lengths: the receiving process learns each batch's.
import tensorflow as tf  # noqa: E402

lengths = np.concatenate([rng.randint(2, 10, size=15), [9],
                          rng.randint(2, 15, size=15), [14],
                          rng.randint(2, 7, size=7), [6]])
seqs = [rng.randint(1, 20, size=n).astype("int32") for n in lengths]
tags = [rng.randint(0, 5, size=n).astype("int32") for n in lengths]
weights = [rng.uniform(0.5, 2.0, size=n).astype("float32") for n in lengths]
first_seqs = seqs
rank = strategy.topology.rank if strategy else 0
if strategy and strategy.topology.pp_rank > 0:
    # Another rank's batches (other rows, other lengths) are not used:
    # every rank trains on the first stage's rank's.
    order = np.random.RandomState(rank).permutation(len(seqs))
    seqs, tags, weights = ([a[i] for i in order]
                           for a in (seqs, tags, weights))
ds = tf.data.Dataset.from_generator(
    lambda: zip(seqs, tags, weights), output_signature=(
        tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.float32)))
# (of unknown length: each epoch ends in a step that finds no batch)
ds = ds.padded_batch(16)  # lengths 9, 14, 6; rows 16, 16, 8
history = model.fit(ds, epochs=2, verbose=0)
result["ds_loss"] = np.array(history.history["loss"])
result.update({f"x{i}": w for i, w in enumerate(model.get_weights())})
result["ds_evaluate"] = np.array(model.evaluate(ds, verbose=0))
# (predict traces each rank's own first batch: 9 tokens on rank 0, other
# lengths on rank 1; the predictions are of rank 0's)
result["ds_predict"] = model.predict(ds.take(1), verbose=0)
long = keras.utils.pad_sequences(first_seqs[16:32], padding="post")
result["pob_long"] = model.predict_on_batch(long)
result["pob_short"] = model.predict_on_batch(long[:8, :6])
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
