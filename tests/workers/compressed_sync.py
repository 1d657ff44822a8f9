"""Trains a small MLP with SGD for 3 steps and dumps what the weights
did, to compare gradient sync with and without `allreduce_compression`.

Usage: compressed_sync.py --out DIR --mode MODE [--config JSON] [--clip]
                          [--scale S]

MODE:
  reference    plain Keras on one device, global batches of 32 rows
  fit          `model.fit` under `SMPStrategy(config)` (run by `keras-smp
               launch -n 2`: data parallel, or with `partitions` a
               pipeline in each process)
  custom_loop  `smp.init(config)`, an `@smp.step` whose gradients are
               averaged by `StepOutput.accumulate()`, each rank training
               on its half of every global batch (SMP's custom loop)

`--clip`: the optimizer clips (`global_clipnorm`, large enough never to
bind): keras-smp sums the gradients before clipping, another path.
`--scale S`: the loss is multiplied by S and the learning rate divided by
it (S a power of 2: the same updates, up to rounding), so that gradients
exceed float16's range (65504).

Writes DIR/rank{R}.npz: the initial and final weights (`w0_i`, `w_i`),
and `compressed`: how many gradients the data-parallel all-reduce sent
compressed (traced), -1 where not known (custom loops, the reference).
"""

import argparse
import json
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", required=True,
               choices=["reference", "fit", "custom_loop"])
p.add_argument("--config", default="{}")
p.add_argument("--clip", action="store_true")
p.add_argument("--scale", type=float, default=1.0)
args = p.parse_args()
config = json.loads(args.config)

import numpy as np  # noqa: E402

STEPS, BATCH, LR = 3, 32, 0.1

rng = np.random.RandomState(0)
X = rng.randn(STEPS * BATCH, 16).astype("float32")
Y = rng.randn(STEPS * BATCH, 8).astype("float32")


def build(keras):
    keras.utils.set_random_seed(1234)
    return keras.Sequential([keras.Input((16,)),
                             keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(8)])


def optimizer(keras):
    return keras.optimizers.SGD(
        LR / args.scale, global_clipnorm=1e6 if args.clip else None)


def loss(keras, y, pred):
    return keras.ops.mean((pred - y) ** 2, axis=-1) * args.scale


rank, compressed = 0, -1
if args.mode == "custom_loop":
    import keras_smp as smp

    smp.init(config)
    import keras
    import tensorflow as tf

    rank = smp.rank()
    model = smp.DistributedModel(build(keras))
    opt = optimizer(keras)
    # This rank's half of every global batch.
    half = BATCH // smp.dp_size()
    start = smp.dp_rank() * half

    @smp.step
    def grads(x, y):
        value = keras.ops.mean(loss(keras, y, model(x, training=True)))
        return opt.get_gradients(value, model.trainable_variables), value

    @tf.function
    def train(x, y):
        g, loss = grads(x, y)
        opt.apply_gradients(zip([t.accumulate() for t in g],
                                model.trainable_variables))
        return loss.reduce_mean()

    initial = None
    for s in range(STEPS):
        rows = slice(s * BATCH + start, s * BATCH + start + half)
        if initial is None:
            # The weights are made (and rank 0's shared) by the first
            # step: read them through a forward step first.
            smp.step(lambda x: model(x, training=False))(X[rows])
            initial = [v.numpy() for v in model.trainable_variables]
        train(X[rows], Y[rows])
    final = [v.numpy() for v in model.trainable_variables]
else:
    strategy = None
    if args.mode == "fit":
        import keras_smp

        strategy = keras_smp.SMPStrategy(config)
        rank = strategy.topology.rank
    import keras

    def compile_model():
        model = build(keras)
        if config.get("partitions", 1) > 1:
            model = keras_smp.DistributedModel(model)
        model.compile(optimizer=optimizer(keras), loss=(
            "mse" if args.scale == 1 else
            lambda y, pred: loss(keras, y, pred)))
        return model

    if strategy is not None:
        with strategy.scope():
            model = compile_model()
    else:
        model = compile_model()
    # (whole weights: with one stage per process a collective that
    # gathers every stage's; the model's weights are all trainable)
    initial = model.get_weights()
    model.fit(X, Y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    final = model.get_weights()
    if strategy is not None:
        compressed = strategy.gradient_sync.compressed_traced

out = {f"w0_{i}": w for i, w in enumerate(initial)}
out.update({f"w_{i}": w for i, w in enumerate(final)})
np.savez(os.path.join(args.out, f"rank{rank}.npz"), compressed=compressed,
         **out)
print(f"compressed_sync: rank {rank} done", flush=True)
