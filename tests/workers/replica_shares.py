"""Data-parallel replicas of unequal shares vs one device (used by tests).

Two replicas on logical CPUs of this process (`SMPStrategy(local_devices=
2)`) train plain Keras models; the same model, weights and data train on
one device. Prints one JSON line per case with the largest violation of
`|got - ref| <= 1e-5 |ref|` over weights and logs (the atol needed, per
unit of the compared values' magnitude).

Cases:
- custom_loop: `model.compute_loss` in a custom `strategy.run` step on a
  batch of 27 rows (14/13): the replicas' losses, summed, are the
  batch's loss (no logging rescale outside Keras' own steps).
- super_train_step: a `train_step` override that calls Keras' own: the
  logged loss is the single-device one.
- guide_steps: `train_step` and `test_step` written as Keras' guide does
  (`compute_loss`, the loss fed to the `loss` tracker as it is), masked
  tokens with sample weights, a last batch of 14/13 rows, validation;
  own_loss_steps: the same with a loss object and metrics of its own. The
  tracked loss is the single-device one (it was divided by the replicas).
- gan: a model without a `call` whose `train_step` trains a discriminator
  and a generator with two optimizers (Keras' GAN example): `fit` failed to
  build it ("Unable to automatically build the model").
- vae: a model without a `call` whose `train_step` writes its loss by
  hand (Keras' VAE example: `ops.mean` of each row's error, the mean KL
  divergence, a `keras.random` draw), plus a Keras loss object's term and
  a weight penalty, SGD with momentum, equal shares and a last batch of
  14/13 rows: each replica's gradients count by its share of the rows
  (they were summed: twice one device's), and its draws are its rows of
  the batch's; also inside a `LossScaleOptimizer`, and Keras' guide's
  step with one.
- empty_replica: 33 samples in batches of 32 (the last, 1 row, leaves a
  replica nothing) with weight and activity regularizers: the logged loss
  keeps the weight regularizers whole.
- two_masks: two per-token outputs with different masks (the embedding's
  and a `Masking` layer's), per-output sample weights given as a dict,
  both losses means (each divides by its own mask's count): weights and
  every log.
- ignore_class: a loss masking targets out itself (`ignore_class`) under
  the embedding's mask, a last batch of 14/13 rows: weights and logs.
- own_values_mask: a loss whose `call` masks its values from its
  predictions: `{"warned": n, "fix": n}`, the warning's count.
- two_sparse_lookups: one Dense layer called on two sparse inputs, Adam:
  `{"warned": n, "fix": n}`, the warning's count.
- dice_without_axis, circle: Keras' Dice (axis=None: one ratio over the
  batch) and Circle (pairs of rows) losses: `{"warned": n, "fix": n}`.
- mean_with_sample_weight: two outputs whose losses divide by their
  sample weights' sum (`reduction="mean_with_sample_weight"`), per-token
  weights under the embedding's mask and per-row weights (each replica's
  sum differs from the others'), with validation: weights and every log.
- mean_with_sample_weight_unweighted: the same without sample weights:
  such a loss divides by its (unmasked) entries, which differ between the
  replicas in the last batch (27 rows: 14/13).
- pipelined_mean_with_sample_weight: the same as a 2-stage
  `DistributedModel` (`microbatches=1`) with 2 replicas (a process of its
  own: `local_devices=4`); its `evaluate` computes the loss on the whole
  batch.
- pipelined_m4_mean_with_sample_weight (and its `_unweighted` twin):
  the same with `microbatches=4`: each microbatch's weighted sum is
  divided by the step's weights (all microbatches', all replicas'), the
  last batch's 14/13 rows in unequal microbatches (4+4+3+3, 4+3+3+3).
  The cases of one process share one `microbatches`.
- pipelined_m4_mean_with_sample_weight_xla / _float16: the weighted case
  compiled with XLA (`jit_compile=True`, both models; op determinism is
  off in a process running it, as Keras refuses XLA with it), or under the
  `mixed_float16` policy (both models).
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Keras refuses XLA with op determinism on: off in a process running the
# _xla case.
os.environ["TF_DETERMINISTIC_OPS"] = "0" if any(
    name.endswith("_xla") for name in sys.argv[1:]) else "1"

import keras_smp  # noqa: E402
from keras_smp.runtime import keras_private  # noqa: E402

# "pipelined" cases: 2 replicas of a 2-stage pipeline (4 logical CPUs),
# "pipelined_m4_": with 4 microbatches.
PIPELINED = any(name.startswith("pipelined_") for name in sys.argv[1:])
MICROBATCHES = {4 if name.startswith("pipelined_m4_") else 1
                for name in sys.argv[1:] if name.startswith("pipelined_")}
assert len(MICROBATCHES) <= 1, "one microbatches per process"
strategy = keras_smp.SMPStrategy(
    **(dict(partitions=2, microbatches=MICROBATCHES.pop(), local_devices=4)
       if PIPELINED else dict(local_devices=2)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from custom_steps import GuideFunctional  # noqa: E402
from custom_steps import GuideSteps  # noqa: E402
from custom_steps import OwnLossSteps  # noqa: E402
from custom_steps import make_vae  # noqa: E402
from custom_steps import make_gan  # noqa: E402

rng = np.random.RandomState(0)
VOCAB, SEQ = 20, 8
X = rng.randint(1, VOCAB, size=(91, SEQ)).astype("int32")
for _i, _n in enumerate(rng.randint(1, SEQ + 1, size=len(X))):
    X[_i, _n:] = 0
Y = X % 3
# Per-token sample weights (Keras multiplies a masked loss's weights by
# its mask: they must have the mask's shape).
SW = rng.uniform(0.5, 1.5, size=X.shape).astype("float32")


def tokens_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8, mask_zero=True),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3)])


def compile_tokens(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])
    return model


class SuperStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def regularized_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh",
                           kernel_regularizer=keras.regularizers.L2(0.05),
                           activity_regularizer=keras.regularizers.L1(0.01)),
        keras.layers.Dense(2)])


def two_masks_model():
    keras.utils.set_random_seed(7)
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    a = keras.layers.Dense(3, name="a")(keras.layers.Dense(8)(h))
    # Another mask: the positions whose features are not all 0.25.
    feats = keras.Input((SEQ, 2), name="feats")
    b = keras.layers.Dense(2, name="b")(
        keras.layers.Dense(8)(keras.layers.Masking(0.25)(feats)))
    model = keras.Model({"tokens": tokens, "feats": feats},
                        {"a": a, "b": b})
    model.compile(
        optimizer=keras.optimizers.SGD(0.3, momentum=0.9),
        loss={"a": keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True),
              "b": keras.losses.MeanSquaredError()},
        loss_weights={"a": 1.0, "b": 0.1},
        metrics={"a": ["sparse_categorical_accuracy"]})
    return model


def violation(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if not a.size:
        return 0.0
    # Per unit of the compared values' magnitude (conftest.scaled_atol).
    return float(np.max(np.abs(a - b) - 1e-5 * np.abs(b))
                 / max(1.0, float(np.max(np.abs(b)))))


def compare(got, ref):
    (w1, h1), (w0, h0) = got, ref
    assert sorted(h1) == sorted(h0), (sorted(h1), sorted(h0))
    worst = max(violation(a, b) for a, b in zip(w1, w0))
    for k in h0:
        worst = max(worst, violation(h1[k], h0[k]))
    return worst


def train(build, fit, distributed):
    if distributed:
        with strategy.scope():
            model = build()
    else:
        model = build()
    history = fit(model).history
    return [w.numpy() for w in model.weights], history


def custom_loop():
    x, y = X[:27], Y[:27]
    ref = compile_tokens(tokens_model())
    want = float(ref.compute_loss(x=x, y=y, y_pred=ref(x)))
    with strategy.scope():
        model = compile_tokens(tokens_model())
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(27))))

    @tf.function
    def step(x, y):
        return model.compute_loss(x=x, y=y, y_pred=model(x))

    got = strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)
    return violation(float(got), want)


def super_train_step():
    def build():
        keras.utils.set_random_seed(7)
        model = SuperStep([
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3)])
        return compile_tokens(model)

    def fit(model):
        return model.fit(X, Y, sample_weight=SW, batch_size=32, epochs=2,
                         shuffle=False, verbose=0)

    return compare(train(build, fit, True), train(build, fit, False))


def guide_steps():
    # Masked tokens, per-token sample weights, a last batch of 27 rows
    # (14/13 over the replicas), validation: the loss it tracks is the
    # single-device loss (it was half of it, Keras' behaviour under any
    # tf.distribute strategy with 2 replicas).
    # Its accuracy too (Keras logged the mean of the replicas' own
    # accuracies, off where their unmasked tokens differ: 0.3515 for
    # 0.3498).
    def build():
        keras.utils.set_random_seed(7)
        return compile_tokens(GuideSteps([
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3)]))

    def fit(model):
        return model.fit(X, Y, sample_weight=SW, batch_size=32, epochs=2,
                         shuffle=False, verbose=0, validation_data=(X, Y, SW))

    return compare(train(build, fit, True), train(build, fit, False))


def guide_steps_two_losses():
    # Two outputs: a masked per-token loss reduced by "sum" (Keras never
    # scales a sum: each replica's is its part) and a loss divided by its
    # per-row sample weights ("mean_with_sample_weight", each replica's
    # part divided by all replicas' weights); a last batch of 14/13 rows.
    # The step's total and the per-output losses Keras logs: one device's.
    rows = rng.uniform(0.1, 3.0, size=len(X)).astype("float32")
    targets = {"a": Y, "b": rng.randn(len(X), 2).astype("float32")}
    weights = {"a": SW, "b": rows}

    def build():
        keras.utils.set_random_seed(7)
        tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
        a = keras.layers.Dense(3, name="a")(keras.layers.Dense(8)(h))
        b = keras.layers.Dense(2, name="b")(
            keras.layers.GlobalAveragePooling1D()(h))
        model = GuideFunctional(tokens, {"a": a, "b": b})
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss={"a": keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction="sum"),
                  "b": keras.losses.MeanSquaredError(
                      reduction="mean_with_sample_weight")},
            loss_weights={"a": 0.1, "b": 1.0})
        return model

    def fit(model):
        return model.fit(X, targets, sample_weight=weights, batch_size=32,
                         epochs=2, shuffle=False, verbose=0,
                         validation_data=(X, targets, weights))

    return compare(train(build, fit, True), train(build, fit, False))


def own_loss_steps():
    # Equal shares (96 rows in batches of 32): a loss object's mean on
    # each replica.
    x = rng.randn(96, 8).astype("float32")
    y = rng.randn(96, 1).astype("float32")

    def build():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((8,))
        model = OwnLossSteps(inputs, keras.layers.Dense(1)(
            keras.layers.Dense(16, activation="tanh")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        return model

    def fit(model):
        return model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                         verbose=0, validation_data=(x, y))

    return compare(train(build, fit, True), train(build, fit, False))


def gan():
    # Under any tf.distribute strategy Keras' fit first builds the model
    # by calling it ("Unable to automatically build the model": it has no
    # call); now built as its step is traced, as without a strategy.
    real = rng.randn(128, 6).astype("float32")

    def build():
        keras.utils.set_random_seed(7)
        return make_gan()

    def fit(model):
        return model.fit(real, batch_size=32, epochs=2, shuffle=False,
                         verbose=0)

    return compare(train(build, fit, True), train(build, fit, False))


def vae():
    # A loss written by hand in the step (Keras' VAE example), with a Keras
    # loss object's term and a weight penalty. Its gradients were summed
    # over the replicas (twice one device's). 96 rows in batches of 32:
    # weights and logs. 91 rows: the last batch (27 rows) splits 14/13,
    # each replica's gradients weighed by its share of the rows, and its
    # `Sampling` drawing from its share's first row (it drew from
    # `index * rows`): weights only (the step's `Mean` trackers average
    # the replicas' values unweighted, as Keras does under any strategy).
    # 96 rows with a LossScaleOptimizer (whose inner optimizer applies in
    # other threads under a strategy: a share set in the step's thread
    # did not reach it).
    worst = 0.0
    for rows, loss_scale in ((96, False), (91, False), (96, True)):
        data = rng.randn(rows, 6).astype("float32")

        def build(loss_scale=loss_scale):
            keras.utils.set_random_seed(7)
            return make_vae(loss_scale=loss_scale)

        def fit(model, data=data):
            return model.fit(data, batch_size=32, epochs=2, shuffle=False,
                             verbose=0)

        (w1, h1), (w0, h0) = train(build, fit, True), train(build, fit, False)
        worst = max(worst, compare((w1, h1 if rows == 96 else {}),
                                   (w0, h0 if rows == 96 else {})))
    # Keras' guide's step (`compute_loss`) with a LossScaleOptimizer.
    x = rng.randn(96, 8).astype("float32")
    y = rng.randn(96, 1).astype("float32")

    def guide():
        keras.utils.set_random_seed(7)
        model = GuideSteps([keras.Input((8,)),
                            keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
        return model

    def fit_guide(model):
        return model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                         verbose=0)

    worst = max(worst, compare(train(guide, fit_guide, True),
                               train(guide, fit_guide, False)))
    return worst


def empty_replica():
    x = rng.randn(33, 4).astype("float32")
    y = rng.randn(33, 2).astype("float32")

    def build():
        model = regularized_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    def fit(model):
        return model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                         verbose=0)

    return compare(train(build, fit, True), train(build, fit, False))


def two_masks():
    feats = rng.randn(len(X), SEQ, 2).astype("float32")
    masked = rng.rand(len(X), SEQ) < 0.3
    feats[masked] = 0.25  # both features: Masking masks these positions
    data = {"tokens": X, "feats": feats}
    targets = {"a": Y, "b": rng.randn(len(X), SEQ, 2).astype("float32")}
    weights = {"a": SW, "b": np.ones(X.shape, "float32")}

    def fit(model):
        return model.fit(data, targets, sample_weight=weights, batch_size=32,
                         epochs=2, shuffle=False, verbose=0,
                         validation_data=(data, targets))

    return compare(train(two_masks_model, fit, True),
                   train(two_masks_model, fit, False))


def ignore_class():
    # The loss masks targets out itself (ignore_class=2), and'ed with the
    # embedding's mask: each replica counts by its share of the targets
    # left, also in the 14/13 last batch (they counted by the Keras mask
    # alone).
    targets = Y.copy()
    targets[rng.rand(*Y.shape) < 0.3] = 2

    def build():
        model = tokens_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=2),
            metrics=["sparse_categorical_accuracy"])
        return model

    def fit(model):
        return model.fit(X, targets, batch_size=32, epochs=2, shuffle=False,
                         verbose=0, validation_data=(X[:40], targets[:40]))

    return compare(train(build, fit, True), train(build, fit, False))


class OwnMask(keras.losses.Loss):
    """Masks its values itself from its predictions (not its targets)."""

    def call(self, y_true, y_pred):
        values = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True)
        keras_private.set_keras_mask(values, y_pred[..., 0] > 0.0)
        return values


def own_values_mask():
    # A loss whose `call` masks its values from more than its targets:
    # the parts cannot know the batch's unmasked count, so a warning (once)
    # names the loss and the fix; training runs.
    def build():
        model = tokens_model()
        model.compile(optimizer="sgd", loss=OwnMask(name="own_mask"))
        return model

    return warned(build, lambda model: model.fit(
        X, Y, batch_size=32, epochs=2, verbose=0),
        "the loss 'own_mask' attaches a Keras mask to its values",
        "reduction='mean_with_sample_weight'")


def coupled_rows(loss, warning, fix):
    # A loss making one value of several rows together (Dice without
    # `axis`: one ratio of sums over the batch; Circle: pairs of rows):
    # no parts add up to it, so a warning (once) names the loss and the
    # fix; training runs.
    def build():
        model = keras.Sequential([
            keras.Input((SEQ,)), keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3, activation="sigmoid")])
        model.compile(optimizer="sgd", loss=loss())
        return model

    targets = keras.utils.to_categorical(Y[:, 0], 3)
    return warned(build, lambda model: model.fit(
        X.astype("float32"), targets if "dice" in warning else Y[:, 0],
        batch_size=32, epochs=2, verbose=0, shuffle=False), warning, fix)


def warned(build, fit, warning, fix):
    """`{"warned": n, "fix": n}`: how many warnings holding `warning`,
    and `fix`, training `build()` with `fit` on the replicas gave (its
    weights finite)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = train(build, fit, True)
    messages = [str(w.message) for w in seen]
    assert all(np.all(np.isfinite(w)) for w in got[0])
    return {"warned": sum(warning in m for m in messages),
            "fix": sum(fix in m for m in messages)}


def two_sparse_lookups():
    # One Dense layer called on two sparse inputs: its gradient holds each
    # id once per lookup on one device; the replicas' parts cannot be
    # summed back into that (the lookups' rows are not told apart), so a
    # warning (once) names the weight and the fix; training runs.
    a = ((rng.rand(64, 20) < 0.2) * rng.rand(64, 20)).astype("float32")
    b = ((rng.rand(64, 20) < 0.2) * rng.rand(64, 20)).astype("float32")
    targets = rng.randint(0, 3, 64).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((
        {"a": tf.sparse.from_dense(a), "b": tf.sparse.from_dense(b)},
        targets)).batch(32)

    def build():
        keras.utils.set_random_seed(7)
        ia = keras.Input((20,), sparse=True, name="a")
        ib = keras.Input((20,), sparse=True, name="b")
        shared = keras.layers.Dense(4, name="shared")
        out = keras.layers.Dense(3)(keras.layers.Concatenate()(
            [shared(ia), shared(ib)]))
        model = keras.Model({"a": ia, "b": ib}, out)
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        return model

    return warned(build, lambda model: model.fit(data, epochs=1, verbose=0),
                  "the weight 'shared/kernel' is read by 2 lookups of "
                  "distinct ids", "Give each sparse input a layer of its own")


def mean_with_sample_weight(pipelined=False, weighted=True, xla=False,
                            policy=None):
    rows = rng.uniform(0.1, 3.0, size=len(X)).astype("float32")
    targets = {"a": Y, "b": rng.randn(len(X), 2).astype("float32")}
    weights = {"a": SW, "b": rows} if weighted else None

    def build():
        keras.utils.set_random_seed(7)
        if policy:
            keras.mixed_precision.set_global_policy(policy)
        tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
        h = keras.layers.Dense(8, activation="tanh", name="h")(
            keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens))
        a = keras.layers.Dense(3, name="a")(h)
        b = keras.layers.Dense(2, name="b")(
            keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(tokens, {"a": a, "b": b})
        if pipelined and tf.distribute.has_strategy():
            model = keras_smp.DistributedModel(model, split_points=["h"])
        model.compile(
            optimizer=keras.optimizers.SGD(0.3, momentum=0.9),
            loss={"a": keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction="mean_with_sample_weight"),
                  "b": keras.losses.MeanSquaredError(
                      reduction="mean_with_sample_weight")},
            loss_weights={"a": 1.0, "b": 0.5}, jit_compile=xla)
        if xla:  # Keras would fall back without XLA (and say so)
            assert model.jit_compile is True, type(model).__name__
        return model

    kinds = []

    def fit(model):
        kinds.append(type(model).__name__)
        return model.fit(X, targets, sample_weight=weights, batch_size=32,
                         epochs=2, shuffle=False, verbose=0,
                         validation_data=(X, targets, weights)
                         if weighted else (X, targets))

    try:
        with warnings.catch_warnings():
            if xla:  # no stage may fall back without XLA
                warnings.filterwarnings("error", message=".*jit_compile")
            worst = compare(train(build, fit, True),
                            train(build, fit, False))
    finally:
        if policy:
            keras.mixed_precision.set_global_policy("float32")
    want = "DistributedModel" if pipelined else "Functional"
    assert kinds == [want, "Functional"], kinds
    return worst


CASES = {"custom_loop": custom_loop, "super_train_step": super_train_step,
         "guide_steps": guide_steps, "own_loss_steps": own_loss_steps,
         "guide_steps_two_losses": guide_steps_two_losses,
         "gan": gan, "vae": vae,
         "empty_replica": empty_replica, "two_masks": two_masks,
         "ignore_class": ignore_class, "own_values_mask": own_values_mask,
         "two_sparse_lookups": two_sparse_lookups,
         "dice_without_axis": lambda: coupled_rows(
             keras.losses.Dice, "the loss 'dice' computes one ratio of sums",
             "give it `axis`"),
         "circle": lambda: coupled_rows(  # (by name: Keras wraps it)
             lambda: "circle", "the loss 'circle' computes a score over "
             "pairs", "use microbatches=1 with one replica"),
         "mean_with_sample_weight": mean_with_sample_weight,
         "mean_with_sample_weight_unweighted":
             lambda: mean_with_sample_weight(weighted=False),
         "pipelined_mean_with_sample_weight":
             lambda: mean_with_sample_weight(pipelined=True),
         "pipelined_m4_mean_with_sample_weight":
             lambda: mean_with_sample_weight(pipelined=True),
         "pipelined_m4_mean_with_sample_weight_unweighted":
             lambda: mean_with_sample_weight(pipelined=True,
                                             weighted=False),
         "pipelined_m4_mean_with_sample_weight_xla":
             lambda: mean_with_sample_weight(pipelined=True, xla=True),
         "pipelined_m4_mean_with_sample_weight_float16":
             lambda: mean_with_sample_weight(pipelined=True,
                                             policy="mixed_float16")}
for name in sys.argv[1:] or [c for c in CASES
                             if not c.startswith("pipelined_")]:
    print(json.dumps({"case": name, "atol": CASES[name]()}), flush=True)
