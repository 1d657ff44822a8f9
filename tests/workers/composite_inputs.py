"""Sparse and ragged model inputs (`keras.Input(sparse=True)`,
`keras.Input(ragged=True)`), trained, evaluated and run through `predict`
under an SMPStrategy against plain Keras on one device (same seeds):

- `sparse`: a `tf.SparseTensor` of 30 features, 10% of them set, into a
  `Dense` layer;
- `ragged`: token ids of 1 to 5 per sample (a `tf.RaggedTensor`) looked up
  in an `Embedding` and averaged;
- `ints`: ids a `Lambda` computes on the first stage (`ops.argmax`: int32,
  where Keras' graph says float32), reshaped by a `Reshape` (which hands
  the graph's float32 on), looked up on the second (with one
  stage per process the ranks' collectives disagreed on the dtype); with
  pipelines also `int_output`, such ids as a model output (`predict`).

63 samples in batches of 16 from a tf.data dataset (a last batch of 15:
unequal microbatches in training, padded ones in evaluate and predict).
Before: a data-parallel model failed to build (TensorFlow's reduction of
a sample batch has no sparse or ragged kernel) and a pipeline failed to
split the batch (`tf.convert_to_tensor` of a sparse tensor).

    composite_inputs.py MODE OUT

MODE: `dp` (a plain model, `local_devices=2`), `pp_dp` (a
`DistributedModel`, `partitions=2, local_devices=4`: 2 pipelines of 2
stages in one process), `mp` (one stage per process, under `keras-smp
launch -n 2`), `custom_loop` (SMP's `@smp.step`, 2 stages in one process,
against a tape; equal batches). Writes OUT/rank{R}.json: per input kind, the largest
difference of the weights, the history, the evaluation and the
predictions, and their magnitudes.
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras_smp  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
CONFIGS = {"dp": dict(local_devices=2),
           "pp_dp": dict(partitions=2, microbatches=2, local_devices=4),
           "mp": dict(partitions=2, microbatches=2)}
if MODE == "custom_loop":  # SMP's API: @smp.step, 2 stages, 2 microbatches
    keras_smp.init({"partitions": 2, "microbatches": 2})
else:
    strategy = keras_smp.SMPStrategy(**CONFIGS[MODE])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SAMPLES, FEATURES, VOCAB = 63, 30, 10
rng = np.random.RandomState(0)
DENSE = ((rng.rand(SAMPLES, FEATURES) < 0.1)
         * rng.randn(SAMPLES, FEATURES)).astype("float32")
LENGTHS = rng.randint(1, 6, SAMPLES)
IDS = rng.randint(0, VOCAB, LENGTHS.sum()).astype("int32")
Y = rng.randint(0, 3, SAMPLES)
INTS_X = np.random.RandomState(1).randn(SAMPLES, 8).astype("float32")


def inputs(kind):
    if kind == "sparse":
        return tf.sparse.from_dense(DENSE)
    if kind == "ints":
        return INTS_X
    return tf.RaggedTensor.from_row_lengths(IDS, LENGTHS)


def build(kind, distributed):
    keras.utils.set_random_seed(1)

    def layers():
        if kind == "ints":
            # A `Lambda` returning int32 (Keras' graph says float32),
            # looked up on the second stage.
            x = keras.Input((8,))
            h = keras.layers.Dense(16, activation="tanh", name="d1")(x)
            ids = keras.layers.Lambda(
                lambda t: keras.ops.argmax(t, axis=-1), name="ids")(h)
            # (a Keras layer handing on the Lambda's graph dtype: the
            # tensor crossing the boundary is a Reshape's)
            ids = keras.layers.Reshape((1,), name="column")(ids)
            h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
            h = keras.layers.Add()([h, keras.layers.Flatten()(
                keras.layers.Embedding(16, 16, name="emb")(ids))])
            return keras.Model(x, keras.layers.Dense(3, name="d3")(h))
        if kind == "sparse":
            x = keras.Input((FEATURES,), sparse=True)
            h = keras.layers.Dense(16, activation="tanh", name="d1")(x)
        else:
            x = keras.Input((None,), ragged=True, dtype="int32")
            h = keras.layers.Embedding(VOCAB, 8, name="emb")(x)
            h = keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1),
                                    output_shape=(8,))(h)
            h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
        h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
        return keras.Model(x, keras.layers.Dense(3, name="d3")(h))

    def compile_(model):
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), metrics=["accuracy"])
        return model

    if not distributed:
        return compile_(layers())
    with strategy.scope():
        model = layers()
        if MODE != "dp":
            model = keras_smp.DistributedModel(model, split_points=["d2"])
        return compile_(model)


def custom_loop(kind):
    """Plain Keras with a tape, then a `DistributedModel` of the same
    layers trained by `@smp.step` (each argument split into microbatches
    along its rows): each step's loss, the last step's predictions and the
    weights, as `compared`'s lists of arrays."""
    runs = []
    for distributed in (False, True):
        base = build(kind, False)  # seeded; its layers, not compiled
        model = keras_smp.DistributedModel(base) if distributed else base
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def plain_step(x, y):
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = loss_fn(y, predictions)
            optimizer.apply_gradients(zip(tape.gradient(
                loss, model.trainable_variables), model.trainable_variables))
            return loss, predictions

        @keras_smp.step
        def grads(x, y):
            predictions = model(x, training=True)
            loss = loss_fn(y, predictions)
            return (optimizer.get_gradients(loss, model.trainable_variables),
                    loss, predictions)

        @tf.function
        def smp_step(x, y):
            gradients, loss, predictions = grads(x, y)
            optimizer.apply_gradients(zip([g.accumulate() for g in gradients],
                                          model.trainable_variables))
            return loss.reduce_mean(), predictions.merge()

        data = tf.data.Dataset.from_tensor_slices((inputs(kind), Y)).batch(
            16, drop_remainder=True)  # (@smp.step: equal microbatches)
        losses = []
        for x, y in data:
            loss, predictions = (smp_step if distributed else plain_step)(
                x, y)
            losses.append(float(loss))
        runs.append(dict(weights=model.get_weights(),
                         history=[np.array(losses)],
                         predictions=[np.asarray(predictions)]))
    return runs


def fitted(kind):
    """Plain Keras, then the same model under the strategy: `fit`,
    `evaluate` and `predict`, as `compared`'s lists of arrays."""
    runs = []
    for distributed in (False, True):
        model = build(kind, distributed)
        data = tf.data.Dataset.from_tensor_slices((inputs(kind), Y)).batch(16)
        history = model.fit(data, epochs=2, verbose=0).history
        runs.append(dict(  # each a list of arrays
            weights=model.get_weights(),
            history=[np.array(history[k]) for k in sorted(history)],
            evaluation=[np.array(model.evaluate(data, verbose=0))],
            predictions=[model.predict(data, verbose=0)]))
    return runs


def compared(runs):
    """Per quantity, the shapes, the largest difference and the plain
    run's magnitude."""
    ref, got = runs
    return {name: dict(
        shapes=[[list(a.shape) for a in r[name]] for r in runs],
        diff=max(float(np.max(np.abs(a - b)))
                 for a, b in zip(ref[name], got[name])),
        scale=max(float(np.max(np.abs(a))) for a in ref[name]))
        for name in ref}


report = {kind: compared(custom_loop(kind) if MODE == "custom_loop"
                         else fitted(kind))
          for kind in ("sparse", "ragged", "ints")}


def int_output():
    """A model whose second output is a `Lambda`'s int32 (float32 in
    Keras' graph): `predict`'s outputs of plain Keras and of the
    strategy's model (the same seed), their largest difference and
    dtypes."""
    x = inputs("ints")
    outputs = []
    for distributed in (False, True):
        keras.utils.set_random_seed(1)
        with (strategy.scope() if distributed
              else contextlib.nullcontext()):
            a = keras.Input((8,))
            h = keras.layers.Dense(16, activation="tanh", name="d1")(a)
            h = keras.layers.Dense(3, name="d2")(h)
            model = keras.Model(a, [h, keras.layers.Lambda(
                lambda t: keras.ops.argmax(t, axis=-1), name="cls")(h)])
            if distributed:
                model = keras_smp.DistributedModel(model, split_points=["d2"])
        outputs.append(model.predict(x, batch_size=16, verbose=0))
    (logits0, cls0), (logits1, cls1) = outputs
    return dict(diff=max(float(np.max(np.abs(logits0 - logits1))),
                         float(np.max(np.abs(cls0 - cls1)))),
                scale=float(np.max(np.abs(logits0))),
                dtypes=[str(cls0.dtype), str(cls1.dtype)])


def wrapping(late_input, late_layer):
    """"wrapped", or the error, of a DistributedModel of 2 stages whose
    second stage uses `late_input` (through `late_layer`)."""
    with strategy.scope():
        a = keras.Input((8,), name="a")
        h = keras.layers.Dense(16, name="d1")(a)
        h = keras.layers.Dense(16, name="d2")(h)
        h = keras.layers.Concatenate()([h, late_layer(late_input)])
        try:
            keras_smp.DistributedModel(
                keras.Model([a, late_input],
                            keras.layers.Dense(3, name="d3")(h)),
                split_points=["d2"])
            return "wrapped"
        except ValueError as e:
            return str(e)


if MODE in ("pp_dp", "mp"):
    report["int_output"] = int_output()
    # A sparse input used on the second stage: a clear error when the
    # model is wrapped (a stage boundary carries dense tensors; it failed
    # in `tf.control_dependencies`, or in the collective across processes).
    report["crossing"] = wrapping(
        keras.Input((FEATURES,), sparse=True, name="b"),
        keras.layers.Dense(4, name="late"))
    # A string input used on the second stage: in one process it is handed
    # on as any tensor; across processes a clear error (TensorFlow's
    # collectives carry numbers: it failed inside the first step).
    report["strings"] = wrapping(
        keras.Input((3,), dtype="string", name="words"),
        keras.layers.StringLookup(vocabulary=["a", "b"], name="lookup"))

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"rank{keras_smp.rank()}.json"), "w") as f:
    json.dump(report, f)
