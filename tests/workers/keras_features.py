"""Keras features under an SMPStrategy, against the same model trained by
plain Keras on one device (same seeds):

- the input sources users feed `fit` with: NumPy arrays with
  `shuffle=True`, a tf.data dataset that reshuffles each epoch, a Python
  generator (one pass), a `PyDataset` (`shuffle=True`); shuffled arrays
  and `PyDataset` with each stage process seeded differently (`mp`);
- optimizer options whose updates Keras makes inside `tf.cond`:
  `gradient_accumulation_steps` (with and without `clipnorm` and
  `weight_decay`), `use_ema` with `ema_overwrite_frequency`; a
  `MultiOptimizer` (an `OptimizerMap`, and a selector function);
  `ScheduleFreeAdamW` (slots its `build` copies from the weights);
- callbacks that touch the weights: `EarlyStopping` with
  `restore_best_weights`, `SwapEMAWeights` (evaluating and finishing with
  the moving averages), `ModelCheckpoint` with `save_best_only` into a
  `.keras` file that plain Keras loads; `validation_freq`; `TensorBoard`
  with `histogram_freq` (every layer's weight histograms, compared on the
  chief);
- `predict_on_batch`, `train_on_batch` and `test_on_batch` of a model
  with `Dropout`; a model quantized to int8 with LoRA adapters; variables of dtypes
  TensorFlow's broadcast lacks; `export` (served outputs); `evaluate` and
  `predict` with batches that do not divide into the microbatches, and
  `fit` with a last batch that does not;
- a model compiled without a loss, whose loss is what its layers add in
  `call` (an autoencoder's reconstruction error, an activity regularizer);
- a model with two outputs compiled with a loss on one: the other's head
  gets no gradient, so weight decay and its constraint leave it alone (a
  pipeline decayed and renormalised it);
- with one stage per process, reading another stage's layer's weights is a
  clear error (it returned empty arrays).

Each case trains twice from scratch (plain, then under the strategy) and
reports the largest weight difference, the weights' magnitude, both
optimizers' step counts and both `History`s (every key, every epoch).

    keras_features.py MODE OUT [ONLY]

MODE: `dp` (a plain model, `local_devices=2`: 2 data-parallel replicas),
`pp_dp` (a `DistributedModel`, `partitions=2, local_devices=4`: 2
pipelines of 2 stages in one process); under `keras-smp launch -n 2`:
`mp` (one stage per process), `mp_dp` (a plain model, 2 data-parallel
processes). Writes OUT/rank{R}.json. ONLY (default: everything) is a
comma-separated list of training cases and/or `inference` (predict_on_batch,
partial batches, export, and with `mp` another stage's layer), so that the
cases split over several processes, each well inside its test's timeout;
the report lists what ran under `ran`.

Before keras-smp handled them: Keras builds a model under a strategy by
drawing a batch from a new iterator over the data and dropping it (a
generator lost 3 of 8 batches, reshuffling sources started on their
second order), and the conditional optimizer updates failed ("`merge_call`
called while defining a new graph"); with one stage per process
`SwapEMAWeights` failed (an `AssertionError` in TensorFlow's `_update`:
it swapped the other stages' weights too).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
ONLY = sys.argv[3].split(",") if len(sys.argv) > 3 else None
CONFIGS = {"dp": dict(local_devices=2),
           "pp_dp": dict(partitions=2, microbatches=2, local_devices=4),
           "mp": dict(partitions=2, microbatches=2),
           "mp_dp": dict()}
strategy = keras_smp.SMPStrategy(**CONFIGS[MODE])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from added_losses import Reconstruction  # noqa: E402

BATCHES, ROWS = 8, 32
rng = np.random.RandomState(0)
X = rng.randn(BATCHES * ROWS, 8).astype("float32")
Y = rng.randint(0, 3, size=BATCHES * ROWS)
XV = rng.randn(2 * ROWS, 8).astype("float32")
YV = rng.randint(0, 3, size=2 * ROWS)
RANK = strategy.topology.rank


def momentum_sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def build(distributed, optimizer=momentum_sgd, frozen=False,
          two_inputs=False, loss_only=False, partial_loss=False,
          dropout=False, quantized=False):
    keras.utils.set_random_seed(1)

    def autoencoder():
        # Its loss is what its layers add: the reconstruction error and an
        # activity regularizer (stage 1), and d1's weight regularizer
        # (stage 0, whose layers add nothing).
        inputs = keras.Input((8,))
        code = keras.layers.Dense(4, activation="tanh", name="d1",
                                  kernel_regularizer="l2")(inputs)
        h = keras.layers.Dense(16, activation="tanh", name="d2",
                               activity_regularizer="l2")(code)
        h = keras.layers.Dense(8, name="d3")(h)
        return keras.Model(inputs, Reconstruction()([inputs, h]))

    def layers():
        if loss_only:
            return autoencoder()
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
        if partial_loss:  # a head in stage 0 that no loss names
            aux = keras.layers.Dense(
                4, name="aux",
                kernel_constraint=keras.constraints.UnitNorm())(h)
        if dropout:
            h = keras.layers.Dropout(0.25, seed=5, name="drop")(h)
        h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
        out = keras.layers.Dense(3, name="d3")(h)
        if partial_loss:
            return keras.Model(inputs, {"cls": out, "aux": aux})
        model = keras.Model(inputs, out)
        if quantized:  # int8 kernels (not trained), float32 biases;
            model.quantize("int8")  # LoRA on two (Keras' QLoRA recipe)
            for name in ("d2", "d3"):
                model.get_layer(name).enable_lora(2)
        return model

    def compile_(model):
        if loss_only:  # compiled without a loss, as Keras allows
            model.compile(optimizer())
            return model
        # Momentum carries each step's batch into every later step.
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer(), {"cls": loss} if partial_loss else loss)
        if not distributed and isinstance(
                model.optimizer, keras.optimizers.ScheduleFreeAdamW):
            # Built now, as Keras builds it under any tf.distribute
            # strategy: plain Keras without one builds it inside the traced
            # step, where the copy of the weights its `build` assigns is
            # lost (the slots start at zero and the first step discards
            # the initial weights), a Keras bug.
            model.optimizer.build(model.trainable_variables)
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


def seeded_per_rank(fit):
    """`fit` after seeding Keras' shuffle: with one stage per process each
    process differently (rank R: seed 1 + R; each reads its own order), the
    plain model and the other modes with seed 1. The first stage's rank's
    order is the one trained: the others' targets used to train its
    inputs' outputs (the loss barely fell)."""
    def run(model):
        distributed = isinstance(model.distribute_strategy,
                                 keras_smp.SMPStrategy)
        keras.utils.set_random_seed(
            1 + (RANK if distributed and MODE == "mp" else 0))
        return fit(model)
    return run


SOURCES["arrays_seeded_per_rank"] = seeded_per_rank(SOURCES["arrays"])
SOURCES["PyDataset_seeded_per_rank"] = seeded_per_rank(SOURCES["PyDataset"])

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
    # Slots that `build` sets from the weights (a copy of each), with a
    # warmup: every stage and replica builds its slots from the weights it
    # trains.
    "schedule_free": lambda: keras.optimizers.ScheduleFreeAdamW(
        0.05, warmup_steps=2),
    # One optimizer per group of weights: with one stage per process, a
    # stage holding none of a sub-optimizer's weights (the first stage
    # has no "d3") still steps it (before, the slots of the other stage's
    # weights failed to build: "colocate_vars_with must only be passed a
    # variable created in this tf.distribute.Strategy.scope()").
    "multi_optimizer_map": lambda: keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1, momentum=0.9),
            {"d3/.*": keras.optimizers.Adam(0.01)})),
    # ... chosen by a function making them as the optimizer is built (as
    # in Keras' MultiOptimizer documentation).
    "multi_optimizer_selector": lambda: keras.optimizers.MultiOptimizer(
        lambda v: (keras.optimizers.Adam(0.01) if v.path.startswith("d3")
                   else keras.optimizers.SGD(0.1, momentum=0.9))),
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
    # ... and steps each sub-optimizer of a MultiOptimizer (their step
    # counts are saved from the first stage).
    "frozen_stage_multi_optimizer": lambda: keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1, momentum=0.9),
            {"d3/.*": keras.optimizers.Adam(0.01)})),
}


def checkpoint_path(model):
    # Every process of a job saves into one file; the plain references of
    # the two processes into their own.
    folder = (os.path.join(OUT, f"plain{RANK}")
              if not isinstance(model.distribute_strategy,
                                keras_smp.SMPStrategy) else OUT)
    return os.path.join(folder, "best.keras")


def tensorboard_dir(distributed):
    # The chief writes the job's log (the other ranks write to scratch);
    # the plain references of the two processes into their own.
    return os.path.join(OUT if distributed else os.path.join(
        OUT, f"plain{RANK}"), "tensorboard")


def histograms(log_dir):
    """`{tag: [[left, right, count] rows of its last histogram]}` of the
    weight histograms TensorBoard wrote into `log_dir/train`."""
    found = {}
    train = os.path.join(log_dir, "train")
    for name in sorted(os.listdir(train)):
        for record in tf.data.TFRecordDataset(os.path.join(train, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag.endswith("/histogram"):
                    found[value.tag] = tf.make_ndarray(value.tensor)
    return found


def fit_with(*callbacks, epochs=4, **kwargs):
    return lambda m: m.fit(X, Y, batch_size=ROWS, epochs=epochs, verbose=0,
                           validation_data=(XV, YV),
                           callbacks=[c(m) for c in callbacks], **kwargs)


CALLBACKS = {
    # min_delta=10: only the first epoch counts as an improvement, so
    # training stops after the second and restores the first's weights.
    "early_stopping_restore_best_weights": (momentum_sgd, fit_with(
        lambda m: keras.callbacks.EarlyStopping(
            "val_loss", patience=1, min_delta=10,
            restore_best_weights=True))),
    # Validation (and the end of fit) on the moving averages.
    "swap_ema_weights": (
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True),
        fit_with(lambda m: keras.callbacks.SwapEMAWeights(
            swap_on_epoch=True), epochs=2)),
    # ... with a loss-scale optimizer around the moving averages (mixed
    # precision training with EMA weights).
    "swap_ema_weights_loss_scale": (
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(
            0.1, momentum=0.9, use_ema=True)),
        fit_with(lambda m: keras.callbacks.SwapEMAWeights(
            swap_on_epoch=True), epochs=2)),
    "model_checkpoint_best_keras": (momentum_sgd, fit_with(
        lambda m: keras.callbacks.ModelCheckpoint(
            checkpoint_path(m), monitor="val_loss", save_best_only=True))),
    "validation_freq": (momentum_sgd, fit_with(epochs=3, validation_freq=2)),
    # Weight histograms of every layer (with one stage per process the
    # chief wrote the other stage's weights as zeros).
    "tensorboard_histograms": (momentum_sgd, fit_with(
        lambda m: keras.callbacks.TensorBoard(tensorboard_dir(isinstance(
            m.distribute_strategy, keras_smp.SMPStrategy)), histogram_freq=1),
        epochs=2)),
}
# A model compiled without a loss: its loss is what its layers add.
LOSS_ONLY = {"added_loss_only": lambda m: m.fit(
    X, batch_size=ROWS, epochs=2, verbose=0, validation_data=(XV,))}

# Two outputs, a loss on "cls" only: the "aux" head has no gradient.
PARTIAL_LOSS = {"partial_loss_weight_decay": (
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05),
    lambda m: m.fit(X, {"cls": Y}, batch_size=ROWS, epochs=2, verbose=0,
                    validation_data=(XV, {"cls": YV})))}

# Training with a last batch that does not divide into the microbatches
# or the replicas: 23 rows (replicas of 12 and 11 rows: microbatches of
# 6 + 6 and 6 + 5), with one replica 21 (11 and 10); each replica's loss
# counts by its share of the rows, as one device's would. With Dropout:
# each replica's microbatches draw their rows of one device's masks (the
# second pipeline drew rows 11..21, not 12..22).
N_PARTIAL = BATCHES * ROWS - ROWS + (21 if MODE == "mp" else 23)
PARTIAL = {"partial_last_batch": lambda m: m.fit(
    X[:N_PARTIAL], Y[:N_PARTIAL], batch_size=ROWS, epochs=2, verbose=0,
    shuffle=False, validation_data=(XV, YV))}

CASES = {name: (momentum_sgd, fit, False) for name, fit in SOURCES.items()}
CASES.update({name: (momentum_sgd, fit, False)
              for name, fit in PARTIAL.items()})
CASES.update({name: (optimizer, fit, False)
              for name, (optimizer, fit) in PARTIAL_LOSS.items()})
CASES.update({name: (momentum_sgd, fit, False)
              for name, fit in LOSS_ONLY.items()})
CASES.update({name: (optimizer, fit, False)
              for name, (optimizer, fit) in CALLBACKS.items()})
CASES.update({name: (optimizer, SOURCES["arrays"], False)
              for name, optimizer in OPTIMIZERS.items()})
# ... with the whole model gathered after each epoch (a callback reading
# `get_weights()`): with one stage per process that replaces the other
# stage's weights' storage, by whose ids a MultiOptimizer looks them up
# at the end of fit (it raised a KeyError).
CASES["multi_optimizer_map"] = (OPTIMIZERS["multi_optimizer_map"], fit_with(
    lambda m: keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: m.get_weights()), epochs=2), False)
CASES.update({name: (optimizer, SOURCES["arrays"], True)
              for name, optimizer in FROZEN.items()})

if ONLY is not None:
    unknown = sorted(set(ONLY) - set(CASES) - {"inference"})
    if unknown:
        raise SystemExit(f"keras_features.py: unknown cases {unknown}; "
                         f"choose from {sorted(CASES)} and 'inference'")
    CASES = {name: case for name, case in CASES.items() if name in ONLY}
INFERENCE = ONLY is None or "inference" in ONLY

report = {"ran": sorted([*CASES] + (["inference"] if INFERENCE else []))}
for name, (optimizer, fit, frozen) in CASES.items():
    runs = []
    for distributed in (False, True):
        model = build(distributed, optimizer, frozen,
                      loss_only=name in LOSS_ONLY,
                      partial_loss=name in PARTIAL_LOSS,
                      dropout=name in PARTIAL)
        start = model.get_weights()
        history = fit(model).history
        weights = model.get_weights()
        if name == "model_checkpoint_best_keras":  # what plain Keras loads
            if distributed:
                keras_smp.barrier()  # rank 0's last save is complete
            weights = keras.models.load_model(
                checkpoint_path(model)).get_weights()
        # The optimizer's step count, and each sub-optimizer's.
        steps = [int(o.iterations.numpy()) for o in [model.optimizer] + list(
            getattr(model.optimizer, "optimizers", []))]
        runs.append((weights, steps, history))
    (ref, ref_steps, ref_history), (got, got_steps, got_history) = runs
    report[name] = dict(
        diff=max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got)),
        moved=max(float(np.max(np.abs(a - b))) for a, b in zip(start, got)),
        scale=max(float(np.max(np.abs(a))) for a in ref),
        steps=[ref_steps, got_steps],
        history_keys=[sorted(ref_history), sorted(got_history)],
        epochs=[len(ref_history["loss"]), len(got_history["loss"])],
        history_diff=max(
            (float(np.max(np.abs(np.subtract(ref_history[k], got_history[k]))))
             for k in ref_history if k in got_history
             and len(ref_history[k]) == len(got_history[k])), default=None),
        history_scale=max(float(np.max(np.abs(v)))
                          for v in ref_history.values()))
    if name == "tensorboard_histograms" and RANK == 0:  # the chief's log
        ref, got = (histograms(tensorboard_dir(d)) for d in (False, True))
        # Each weight's last histogram: its range (the first bucket's
        # left edge, the last's right edge) and its count.
        report[name]["histograms"] = dict(
            tags=[sorted(ref), sorted(got)],
            diff=max(float(np.max(np.abs(ref[t][[0, -1], :2]
                                         - got[t][[0, -1], :2])))
                     for t in ref if t in got),
            counts=[[float(ref[t][:, 2].sum()) for t in sorted(ref)],
                    [float(got[t][:, 2].sum()) for t in sorted(got)]],
            scale=max(float(np.max(np.abs(h[:, :2]))) for h in ref.values()))

if INFERENCE:
    for name, two_inputs in (("predict_on_batch", False),
                             ("predict_on_batch_two_inputs", True)):
        # Two inputs given as a list (tf.data reads a list as one tensor).
        x = [X[:, :5], X[:, 5:]] if two_inputs else X
        predictions = []
        for distributed in (False, True):
            model = build(distributed, two_inputs=two_inputs)
            model.fit(x, Y, batch_size=ROWS, epochs=1, verbose=0,
                      shuffle=False)
            batch = [part[:ROWS] for part in x] if two_inputs else x[:ROWS]
            predictions.append(model.predict_on_batch(batch))
        report[name] = dict(
            shapes=[list(p.shape) for p in predictions],
            diff=(float(np.max(np.abs(predictions[0] - predictions[1])))
                  if predictions[0].shape == predictions[1].shape else None),
            scale=float(np.max(np.abs(predictions[0]))))

    # `train_on_batch` (class weights) and `test_on_batch` (sample
    # weights), each process giving the same global batch: split among the
    # replicas as `fit` and `evaluate` split it, so Dropout draws the
    # whole batch's mask (Keras gave every replica the whole batch, so data
    # parallel replicas drew masks for a batch twice its size: weights
    # 0.006 and predictions 0.07 from plain Keras, by hand).
    results = []
    for distributed in (False, True):
        model = build(distributed, dropout=True)
        logs = [model.train_on_batch(X[:ROWS], Y[:ROWS],
                                     class_weight={0: 1.0, 1: 2.0, 2: 0.5}),
                model.train_on_batch(X[ROWS:2 * ROWS], Y[ROWS:2 * ROWS]),
                model.test_on_batch(XV[:ROWS], YV[:ROWS],
                                    sample_weight=np.linspace(0, 1, ROWS))]
        results.append([np.array(logs, dtype="float64"),
                        model.predict_on_batch(XV[:ROWS])]
                       + model.get_weights())
    report["on_batch"] = dict(
        shapes=[[list(np.shape(a)) for a in r] for r in results],
        diff=max(float(np.max(np.abs(a - b))) for a, b in zip(*results)),
        scale=max(float(np.max(np.abs(a))) for a in results[0]))

    # A model quantized to int8 (Keras' `quantize`) with LoRA on two
    # layers trains its biases and adapters and predicts as plain Keras'
    # (data-parallel processes failed to create
    # its int8 kernels: TensorFlow's initial-value broadcast has no int8
    # kernel).
    results = []
    for distributed in (False, True):
        model = build(distributed, quantized=True)
        model.fit(X, Y, batch_size=ROWS, epochs=1, verbose=0, shuffle=False)
        weights = model.get_weights()
        results.append(([model.predict(XV, batch_size=ROWS, verbose=0)]
                        + [w for w in weights if w.dtype != np.int8],
                        [w.tolist() for w in weights if w.dtype == np.int8]))
    (ref, ref_int8), (got, got_int8) = results
    report["quantized"] = dict(
        shapes=[[list(np.shape(a)) for a in r] for r in (ref, got)],
        # Each array's difference per unit of its magnitude (the kernels'
        # scales are in the hundreds, the predictions about 1).
        diff=max(float(np.max(np.abs(a - b))) / max(1.0, float(np.max(
            np.abs(a)))) for a, b in zip(ref, got)),
        scale=1.0,
        # The LoRA B matrices (2 x units; they start as zeros) trained.
        lora_b=max(float(np.max(np.abs(w))) for w in got if w.shape[0] == 2),
        int8_kernels=len(ref_int8), int8_equal=ref_int8 == got_int8)
    # Variables of the dtypes TensorFlow cannot broadcast start as the
    # first process's (each process's initializer gives its rank + 1).
    with strategy.scope():
        report["initial_values"] = {
            dtype: np.asarray(keras.Variable(
                np.full((3,), RANK + 1), dtype=dtype, trainable=False),
                "float64").tolist()
            for dtype in ("int8", "uint8", "int16", "bfloat16")}

    # Batches that do not divide into the microbatches (21 rows: a last batch
    # of 4, split over 2 replicas; 7 rows), which evaluate and predict pad:
    # plain Keras' results.
    results = []
    for distributed in (False, True):
        model = build(distributed)
        model.fit(X, Y, batch_size=ROWS, epochs=1, verbose=0, shuffle=False)
        results.append(
            [np.array(model.evaluate(X, Y, batch_size=21, verbose=0)),
             np.array(model.evaluate(XV, YV, batch_size=7, verbose=0)),
             model.predict(X, batch_size=21, verbose=0),
             model.predict(XV, batch_size=7, verbose=0)])
    report["partial_batches"] = dict(
        shapes=[[list(np.shape(a)) for a in r] for r in results],
        diff=max(float(np.max(np.abs(a - b))) for a, b in zip(*results)),
        scale=max(float(np.max(np.abs(a))) for a in results[0]))

    # `export` (an inference SavedModel): the served outputs of the model
    # trained under the strategy (every process calls it; rank 0 writes),
    # against plain Keras'. A `DistributedModel` is never called directly, so
    # Keras alone refused ("The model provided has never called").
    served = []
    for distributed in (False, True):
        model = build(distributed)
        model.fit(X, Y, batch_size=ROWS, epochs=1, verbose=0, shuffle=False)
        path = os.path.join(OUT, "export" if distributed else f"export{RANK}")
        model.export(path, verbose=False)
        if distributed:
            keras_smp.barrier()  # rank 0 wrote it (the others into scratch)
        loaded = tf.saved_model.load(path)  # referenced while serving
        served.append(loaded.serve(X[:ROWS]).numpy())
    report["export"] = dict(
        diff=float(np.max(np.abs(served[0] - served[1]))),
        scale=float(np.max(np.abs(served[0]))))
    # An export that fails (here: on rank 0, where Keras checks the format)
    # fails on every process instead of leaving the others waiting.
    try:
        model.export(os.path.join(OUT, "bad_export"), format="no_such_format")
        report["export_failure"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        report["export_failure"] = f"{type(e).__name__}: {e}"

    if MODE == "mp":
        # Another stage's layer holds no weights in this process: reading them
        # is a clear error (it returned empty arrays), this stage's are read.
        model = build(True)
        model.fit(X, Y, batch_size=ROWS, epochs=1, verbose=0)
        layers = {"d1": 0, "d2": 1, "d3": 1}
        read = {}
        for name, stage in layers.items():
            try:
                read[name] = [list(w.shape) for w in
                              model.inner_model.get_layer(name).get_weights()]
            except ValueError as e:
                read[name] = str(e)
        whole = [list(w.shape) for w in model.get_weights()]
        after = {}  # the gathered copies are released again
        for name in layers:
            try:
                after[name] = np.asarray(
                    model.inner_model.get_layer(name).kernel)
                after[name] = list(after[name].shape)
            except ValueError as e:
                after[name] = str(e)
        # ... and setting them too (it set nothing, silently; after a
        # gather, TensorFlow's "Shape mismatch"); this stage's are set.
        wrote = {}
        for name in layers:
            layer = model.inner_model.get_layer(name)
            try:
                layer.set_weights([np.ones(w.shape, "float32")
                                   for w in layer.weights])
                wrote[name] = float(np.asarray(layer.kernel).sum())
            except ValueError as e:
                wrote[name] = str(e)
        report["other_stage_layer"] = dict(
            read=read, after=after, whole=whole, wrote=wrote,
            own=[n for n, s in layers.items() if s == RANK])

        # A direct call `model(x)`: a clear error here (TensorFlow failed
        # inside a layer with empty weights); after `sync_weights()` the
        # whole model runs in this process, as `predict` runs it in the
        # pipeline; the next `fit` frees the copies again.
        def call_directly():
            try:
                return np.asarray(model(X[:ROWS]))
            except ValueError as e:
                return str(e)

        direct = dict(before_sync=call_directly())
        model.sync_weights()
        called = call_directly()
        predicted = model.predict(X[:ROWS], batch_size=ROWS, verbose=0)
        direct["diff"] = (float(np.max(np.abs(called - predicted)))
                          if not isinstance(called, str) else called)
        direct["scale"] = float(np.max(np.abs(predicted)))
        # `predict` keeps the copies; `fit` frees them.
        direct["after_predict"] = (
            "ran" if not isinstance(call_directly(), str) else "refused")
        # A symbolic call reads shapes only: never refused.
        direct["symbolic"] = type(model(keras.Input(X.shape[1:]))).__name__
        model.fit(X, Y, batch_size=ROWS, epochs=1, verbose=0)
        after_fit = call_directly()
        direct["after_fit"] = (after_fit if isinstance(after_fit, str)
                               else "ran")
        report["direct_call"] = direct

with open(os.path.join(OUT, f"rank{strategy.topology.rank}.json"), "w") as f:
    json.dump(report, f)
