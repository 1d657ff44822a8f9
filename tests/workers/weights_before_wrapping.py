"""A model given its weights (`load_weights`) before it is wrapped in a
DistributedModel, trained: the fine-tuning pattern (used by tests).

Usage: weights_before_wrapping.py --out DIR --model sequential|subclassed
       --mode reference|pipeline [--weights FILE] [--after]

reference: plain Keras on one device; writes the initial weights it was
given (its own, seeded, scaled) to DIR/initial.weights.h5 before training.
pipeline: an SMPStrategy with 2 stages (one process with 2 logical CPUs:
`--local-devices 2`, or one stage per process under `keras-smp launch -n
2`); the model is
built inside the scope, loads FILE, and only then is wrapped (`--after`:
wrapped, built from shapes, then loads FILE).
Writes DIR/rank{R}.npz: the trained weights and the predictions.
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--model", choices=["sequential", "subclassed"],
               required=True)
p.add_argument("--mode", choices=["reference", "pipeline"], required=True)
p.add_argument("--weights", default=None)
p.add_argument("--after", action="store_true",
               help="wrap the model first (built from shapes: `build`), "
               "then load the weights (each stage process reads its own)")
p.add_argument("--local-devices", type=int, default=None,
               help="2: both stages in this process, on 2 logical CPUs")
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

strategy = None
if args.mode == "pipeline":
    import keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                     local_devices=args.local_devices,
                                     collective_timeout_seconds=120)

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(64, 8).astype("float32")
y = rng.randint(0, 3, size=64)


class Subclassed(keras.Model):
    """Its own call; a Sequential block built at construction."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, activation="tanh", name="first")
        self.block = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(16, activation="relu", name="b1"),
            keras.layers.Dense(16, activation="tanh", name="b2"),
        ], name="block")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, inputs, training=None):
        return self.head(self.block(self.first(inputs), training=training))


def build():
    keras.utils.set_random_seed(5)
    if args.model == "subclassed":
        model = Subclassed()
        if not args.after:  # built by a call (Keras' build() builds none)
            model(x[:1])
        return model
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh", name="d1"),
        keras.layers.Dense(16, activation="relu", name="d2"),
        keras.layers.Dense(3, name="head"),
    ])


with strategy.scope() if strategy else contextlib.nullcontext():
    model = build()
    if args.mode == "reference":
        # "Pretrained" weights: not the ones the seed gives.
        model.set_weights([1.5 * w + 0.01 for w in model.get_weights()])
        model.save_weights(os.path.join(args.out, "initial.weights.h5"))
    elif args.after:
        model = keras_smp.DistributedModel(model)
        model.build((None, 8))
        model.load_weights(args.weights)
    else:
        model.load_weights(args.weights)
        model = keras_smp.DistributedModel(model)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["predict"] = model.predict(x, batch_size=32, verbose=0)
# Elements this process holds (one stage per process: its stage's only).
result["held"] = np.array(sum(int(np.prod(w.value.shape))
                              for w in model.weights))
rank = strategy.topology.rank if strategy else 0
if strategy is not None:
    result["stage_layers"] = np.array(
        [len(model.staged_graph.stage_nodes(s)) for s in range(2)])
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
