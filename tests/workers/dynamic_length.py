"""A model whose inputs are of unknown length (`keras.Input((None,))`, as
KerasHub backbones declare), with one pipeline stage per process (used by
tests).

Usage: dynamic_length.py --out DIR --mode reference|pipeline

reference: plain Keras on one device. pipeline: 2 stages, one per process
(`keras-smp launch -n 2`); the boundary carries a (batch, None, 16)
tensor and its Keras mask (padded token ids, `mask_zero=True`). Both fit
2 epochs on sequences of 12 tokens and predict them; the pipeline then
predicts sequences of 10 (refused: one length per run). Writes
DIR/rank{R}.npz: the trained weights, losses, predictions and the error.
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["reference", "pipeline"], required=True)
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

strategy = None
if args.mode == "pipeline":
    import keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                     collective_timeout_seconds=120)

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
        model = keras_smp.DistributedModel(model, split_points=["d2"])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["loss"] = np.array(history.history["loss"])
result["predict"] = model.predict(x, batch_size=16, verbose=0)
rank = 0
if strategy:
    rank = strategy.topology.rank
    try:
        model.predict(x[:, :10], batch_size=16, verbose=0)
        result["error"] = np.array("")
    except ValueError as e:
        result["error"] = np.array(str(e))
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
