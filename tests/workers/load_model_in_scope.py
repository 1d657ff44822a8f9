"""A compiled plain Keras model saved mid-training (`model.save`), loaded
with `keras.models.load_model` inside a pipeline SMPStrategy's scope and
wrapped, `DistributedModel(loaded)`, then trained on without compiling
again: it goes on as plain Keras does after `load_model` (used by tests).

Usage: load_model_in_scope.py --out DIR --mode reference|pipeline
       [--local-devices 2]

reference: plain Keras on one device trains a seeded model for 2 steps
with Adam, saves it to DIR/plain.keras (weights, compile, optimizer
state), loads it back and trains 4 more steps. pipeline: 2 stages (one
process with 2 logical CPUs: `--local-devices 2`, or one stage per
process under `keras-smp launch -n 2`) load FILE in the scope, wrap it and
train the same 4 steps; with `--local-devices` also the errors of a
loaded model left unwrapped. Writes DIR/rank{R}.npz: weights, losses,
the optimizer's step count (also right after wrapping:
"loaded_iterations"), its variables (reference: "o{I}") and the
predictions; the trained model is saved again to DIR/trained.keras
(pipeline: `model.save` of the DistributedModel, before its first `fit`
too: DIR/wrapped.keras).
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["reference", "pipeline"], required=True)
p.add_argument("--file", default=None)
p.add_argument("--local-devices", type=int, default=None)
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(64, 8).astype("float32")
y = rng.randint(0, 3, size=64)
result = {}
rank = 0

if args.mode == "reference":
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh", name="d1"),
        keras.layers.Dense(16, activation="relu", name="d2"),
        keras.layers.Dense(3, name="head"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.save(os.path.join(args.out, "plain.keras"))
    model = keras.models.load_model(os.path.join(args.out, "plain.keras"))
else:
    import keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                     local_devices=args.local_devices,
                                     collective_timeout_seconds=120)
    rank = strategy.topology.rank
    if args.local_devices:
        # Left unwrapped, a loaded model is not pipelined: clear errors
        # (TensorFlow's "colocate_vars_with must only be passed a
        # variable created in this tf.distribute.Strategy.scope()").
        errors = []
        with strategy.scope():
            plain = keras.models.load_model(args.file)
        try:
            plain.fit(x, y, batch_size=32, verbose=0)
        except ValueError as e:
            errors.append(str(e))
        try:
            with strategy.scope():
                plain.optimizer.build(plain.trainable_variables)
        except ValueError as e:
            errors.append(str(e))
        result["errors"] = np.array(errors)
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.models.load_model(args.file))
    result["stage_layers"] = np.array(
        [len(model.staged_graph.stage_nodes(s)) for s in range(2)])
    # The loaded optimizer state, before any step.
    result["loaded_iterations"] = np.array(
        int(model.optimizer.iterations.numpy()))
    model.save(os.path.join(args.out, "wrapped.keras"))

history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
result.update({f"w{i}": w for i, w in enumerate(model.get_weights())})
result["loss"] = np.array(history.history["loss"])
result["accuracy"] = np.array(history.history["accuracy"])
result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
result["predict"] = model.predict(x, batch_size=32, verbose=0)
if args.mode == "reference":
    result.update({f"o{i}": v.numpy()
                   for i, v in enumerate(model.optimizer.variables)})
model.save(os.path.join(args.out, "trained.keras"))
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
