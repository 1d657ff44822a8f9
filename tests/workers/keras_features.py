"""Keras features under an SMPStrategy, against the same model trained by
plain Keras on one device (same seeds):

- the input sources users feed `fit` with: NumPy arrays with
  `shuffle=True`, a tf.data dataset that reshuffles each epoch, a Python
  generator (one pass), a `PyDataset` (`shuffle=True`);
- optimizer options whose updates Keras makes inside `tf.cond`:
  `gradient_accumulation_steps` (with and without `clipnorm` and
  `weight_decay`), `use_ema` with `ema_overwrite_frequency`;
- `predict_on_batch`.

Each case trains twice from scratch (plain, then under the strategy) and
reports the largest weight difference, the weights' magnitude and both
optimizers' step counts.

    keras_features.py MODE OUT

MODE: `dp` (a plain model, `local_devices=2`: 2 data-parallel replicas),
`pp_dp` (a `DistributedModel`, `partitions=2, local_devices=4`: 2
pipelines of 2 stages in one process); under `keras-smp launch -n 2`:
`mp` (one stage per process), `mp_dp` (a plain model, 2 data-parallel
processes). Writes OUT/rank{R}.json.

Before keras-smp handled them: Keras builds a model under a strategy by
drawing a batch from a new iterator over the data and dropping it (a
generator lost 3 of 8 batches, reshuffling sources started on their
second order), and the conditional optimizer updates failed ("`merge_call`
called while defining a new graph").
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
CONFIGS = {"dp": dict(local_devices=2),
           "pp_dp": dict(partitions=2, microbatches=2, local_devices=4),
           "mp": dict(partitions=2, microbatches=2),
           "mp_dp": dict()}
strategy = keras_smp.SMPStrategy(**CONFIGS[MODE])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCHES, ROWS = 8, 32
rng = np.random.RandomState(0)
X = rng.randn(BATCHES * ROWS, 8).astype("float32")
Y = rng.randint(0, 3, size=BATCHES * ROWS)


def momentum_sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def build(distributed, optimizer=momentum_sgd, frozen=False,
          two_inputs=False):
    keras.utils.set_random_seed(1)

    def layers():
        # The pipelines split at d2: stage 0 holds d1 (all of it frozen,
        # with `frozen`: a stage with nothing to train).
        first = keras.layers.Dense(16, activation="tanh", name="d1",
                                   trainable=not frozen)
        if two_inputs:
            a, b = keras.Input((5,)), keras.Input((3,))
            h = first(keras.layers.Concatenate()([a, b]))
            inputs = [a, b]
        else:
            inputs = keras.Input((8,))
            h = first(inputs)
        h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
        return keras.Model(inputs, keras.layers.Dense(3, name="d3")(h))

    def compile_(model):
        # Momentum carries each step's batch into every later step.
        model.compile(optimizer(),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        return model

    if not distributed:
        return compile_(layers())
    with strategy.scope():
        model = layers()
        if MODE not in ("dp", "mp_dp"):
            model = keras_smp.DistributedModel(model, split_points=["d2"])
        return compile_(model)


def generator():
    for i in range(BATCHES):
        yield X[i * ROWS:(i + 1) * ROWS], Y[i * ROWS:(i + 1) * ROWS]


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        return X[i * ROWS:(i + 1) * ROWS], Y[i * ROWS:(i + 1) * ROWS]


SOURCES = {
    "arrays": lambda m: m.fit(X, Y, batch_size=ROWS, epochs=2, verbose=0),
    "tf.data": lambda m: m.fit(
        tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(
            len(X), seed=3).batch(ROWS, drop_remainder=True),
        epochs=2, verbose=0),
    "generator": lambda m: m.fit(generator(), epochs=1, verbose=0),
    "PyDataset": lambda m: m.fit(Batches(), epochs=2, verbose=0),
}

OPTIMIZERS = {
    "gradient_accumulation": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=2),
    "gradient_accumulation_clipnorm_weight_decay": lambda: (
        keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01,
                             clipnorm=0.5, gradient_accumulation_steps=2)),
    "gradient_accumulation_global_clipnorm": lambda: (
        keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.2,
                             gradient_accumulation_steps=2)),
    "ema_overwrite": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, use_ema=True, ema_overwrite_frequency=3),
}
# A first stage with nothing to train (fine-tuning) still takes part in
# the clip's norm, and in the loss-scale decision, on the right steps.
FROZEN = {
    "frozen_stage_accumulation_global_clipnorm": lambda: (
        keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.2,
                             gradient_accumulation_steps=2)),
    "loss_scale_ema_frozen_stage_accumulation": lambda: (
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(
            0.1, momentum=0.9, global_clipnorm=0.2,
            gradient_accumulation_steps=2, use_ema=True,
            ema_overwrite_frequency=3))),
}
CASES = {name: (momentum_sgd, fit, False) for name, fit in SOURCES.items()}
CASES.update({name: (optimizer, SOURCES["arrays"], False)
              for name, optimizer in OPTIMIZERS.items()})
CASES.update({name: (optimizer, SOURCES["arrays"], True)
              for name, optimizer in FROZEN.items()})

report = {}
for name, (optimizer, fit, frozen) in CASES.items():
    runs = []
    for distributed in (False, True):
        model = build(distributed, optimizer, frozen)
        start = model.get_weights()
        fit(model)
        runs.append((model.get_weights(), int(model.optimizer.iterations.numpy())))
    (ref, ref_steps), (got, got_steps) = runs
    report[name] = dict(
        diff=max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got)),
        moved=max(float(np.max(np.abs(a - b))) for a, b in zip(start, got)),
        scale=max(float(np.max(np.abs(a))) for a in ref),
        steps=[ref_steps, got_steps])

for name, two_inputs in (("predict_on_batch", False),
                         ("predict_on_batch_two_inputs", True)):
    # Two inputs given as a list (tf.data reads a list as one tensor).
    x = [X[:, :5], X[:, 5:]] if two_inputs else X
    predictions = []
    for distributed in (False, True):
        model = build(distributed, two_inputs=two_inputs)
        model.fit(x, Y, batch_size=ROWS, epochs=1, verbose=0, shuffle=False)
        batch = [part[:ROWS] for part in x] if two_inputs else x[:ROWS]
        predictions.append(model.predict_on_batch(batch))
    report[name] = dict(
        shapes=[list(p.shape) for p in predictions],
        diff=(float(np.max(np.abs(predictions[0] - predictions[1])))
              if predictions[0].shape == predictions[1].shape else None),
        scale=float(np.max(np.abs(predictions[0]))))

with open(os.path.join(OUT, f"rank{strategy.topology.rank}.json"), "w") as f:
    json.dump(report, f)
