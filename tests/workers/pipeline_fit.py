"""Pipelined Keras training vs plain single-device training (used by tests).

Runs several cases in one process (TensorFlow starts once) and prints one
JSON line per case with the largest differences from the reference:
the same model, same initial weights and data, trained by plain Keras on
one device with the same global batch.

Usage: pipeline_fit.py CASE [CASE ...], CASE = JSON object with keys model
(mlp|cnn|skip|manual|penalized|penalized_ops|penalized_helper: losses added
from a helper function|nested: nested models|subclassed: a subclassed
keras.Model wrapped unbuilt|mlp_unbuilt: the mlp as a Sequential without
an Input|autoencoder: compiled without a loss|two_heads:
a loss on one of two outputs, weight decay|mixed: a mean loss and a "mean_with_sample_weight" one, an activity regularizer|tokens:
padded token sequences, a loss per token under the embedding's mask|noisy:
random layers on every stage|dropouts: its uniform-drawing ones only|
untold: a subclassed model whose call takes no training),
partitions, microbatches, pipeline, optimizer (sgd|adam), devices (logical
CPUs, default = partitions), virtual_stages (model stages per rank, for
interleaved_1f1b), recompute (activation_checkpointing), reduction (of the
loss, default sum_over_batch_size; "sum": microbatch losses add up), partial
(the data's last batch has 26 rows: unequal microbatches; "odd": 27 rows,
unequal replicas too; "thirds": 70 rows in batches of 30, the last split 4/4/2
over 3 replicas; "static": batches of 30 rows of a known size), xla (compile
both models with jit_compile=True; needs TF_DETERMINISTIC_OPS=0, which Keras
requires for XLA).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

CASES = [json.loads(a) for a in sys.argv[1:]]
MAX_DEVICES = max(c.get("devices", c["partitions"]) for c in CASES)

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * MAX_DEVICES)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402
from added_losses import HelperPenalty  # noqa: E402
from added_losses import Penalty  # noqa: E402
from added_losses import Reconstruction  # noqa: E402

GLOBAL_BATCH, STEPS = 32, 3
rng = np.random.RandomState(0)
N = GLOBAL_BATCH * STEPS
X_FLAT = rng.randn(N, 8).astype("float32")
X_IMG = rng.randn(N, 8, 8, 1).astype("float32")
Y = rng.randint(0, 3, size=N)
SW = rng.uniform(0.2, 2.0, size=N).astype("float32")
VOCAB, SEQ = 20, 8
X_TOK = rng.randint(1, VOCAB, size=(N, SEQ)).astype("int32")
for _i, _n in enumerate(rng.randint(1, SEQ + 1, size=N)):  # uneven padding
    X_TOK[_i, _n:] = 0
Y_TOK = X_TOK % 5
Y_AUX = rng.randn(N, 4).astype("float32")


def mlp(with_input=True):
    return keras.Sequential([keras.Input((8,))] * with_input + [
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def mlp_unbuilt():
    """The mlp without an `Input`: built from the data at the first step."""
    return mlp(with_input=False)


def cnn():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Conv2D(8, 3, activation="tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def skip():
    inputs = keras.Input((8,))
    h1 = keras.layers.Dense(16, activation="tanh", name="d1")(inputs)
    h2 = keras.layers.Dense(16, activation="tanh", name="d2")(h1)
    h3 = keras.layers.Dense(16, activation="tanh", name="d3")(h2)
    h4 = keras.layers.Dense(16, activation="tanh", name="d4")(h3)
    merged = keras.layers.Add(name="skip_add")([h1, h4])  # skips d2..d4
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(merged))


def penalized():
    """The skip model with losses added in `call` on every stage: activity
    regularizers (L1, L2; on the last layer too) and a custom layer's."""
    reg = keras.regularizers
    inputs = keras.Input((8,))
    h1 = keras.layers.Dense(16, activation="tanh", name="d1",
                            activity_regularizer=reg.L1(1e-2))(inputs)
    h2 = Penalty(name="penalty")(
        keras.layers.Dense(16, activation="tanh", name="d2")(h1))
    h3 = keras.layers.Dense(16, activation="tanh", name="d3",
                            activity_regularizer=reg.L2(1e-2))(h2)
    h4 = keras.layers.Dense(16, activation="tanh", name="d4")(h3)
    merged = keras.layers.Add(name="skip_add")([h1, h4])
    return keras.Model(inputs, keras.layers.Dense(
        3, name="out", activity_regularizer=reg.L2(1e-3))(merged))


def penalized_helper():
    """Layers adding losses from a helper function (not seen in their
    class's code), on both stages; no activity regularizer, no state."""
    inputs = keras.Input((8,))
    h = HelperPenalty(name="p1")(
        keras.layers.Dense(16, activation="tanh", name="d1")(inputs))
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    h = HelperPenalty(name="p2")(
        keras.layers.Dense(16, activation="tanh", name="d3")(h))
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def penalized_ops():
    """Activity regularizers; with 2 stages the second starts with a
    `keras.ops` node (not a layer), then a regularized layer."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d1",
                           activity_regularizer="l2")(inputs)
    h = keras.ops.tanh(keras.layers.Dense(16, name="d2")(h) * 0.5)
    h = keras.layers.Dense(16, activation="tanh", name="d3",
                           activity_regularizer="l1")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def autoencoder():
    """Compiled without a loss: its loss is what its layers add (an
    activity regularizer on the code, the reconstruction error)."""
    inputs = keras.Input((8,))
    code = keras.layers.Dense(4, activation="tanh", name="enc",
                              activity_regularizer="l2")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="dec1")(code)
    h = keras.layers.Dense(8, name="dec2")(h)
    return keras.Model(inputs, Reconstruction(name="recon")([inputs, h]))


def two_heads():
    """Two outputs, compiled with a loss on "cls" only: the "aux" head's
    weights have no gradient, so Keras leaves them alone (no weight decay,
    no constraint) while the trunk and "cls" train with weight decay."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    aux = keras.layers.Dense(
        4, name="aux", kernel_constraint=keras.constraints.UnitNorm())(h)
    h = keras.layers.Dense(16, activation="tanh", name="d3")(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    return keras.Model(inputs, {"cls": cls, "aux": aux})


def mixed():
    """Two outputs: "cls" with a mean loss, "aux" with a
    `"mean_with_sample_weight"` one (without sample weights: divided by
    the step's entries, each microbatch's and replica's sum by all of
    theirs), and an activity regularizer. A batch of unknown size may be
    split unevenly, into microbatches and over the replicas: "cls" and
    the regularizer count by each part's share of the rows."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d1",
                           activity_regularizer="l2")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    aux = keras.layers.Dense(4, name="aux")(h)
    h = keras.layers.Dense(16, activation="tanh", name="d3")(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    return keras.Model(inputs, {"cls": cls, "aux": aux})


def nested(bn=False):
    """Nested models: a backbone model (called with training=False, as for
    fine-tuning) holding a Sequential block and returning two outputs, and
    an encoder model applied to both (its weights shared by the two
    calls). Their layers are placed one by one (`expanded`). `bn`: a
    BatchNormalization in the block, which must see the step's `training`
    (True in fit: Keras' functional call overrides the backbone's False)."""
    norm = [keras.layers.BatchNormalization(name="bn")] if bn else []
    block = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(16, activation="tanh", name="b1"),
    ] + norm + [
        keras.layers.Dense(16, activation="tanh", name="b2"),
    ], name="block")
    b_in = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="stem")(b_in)
    backbone = keras.Model(b_in, [block(h), h], name="backbone")
    e_in = keras.Input((16,))
    encoder = keras.Model(
        e_in, keras.layers.Dense(8, activation="tanh", name="enc")(e_in),
        name="encoder")
    inputs = keras.Input((8,))
    a, b = backbone(inputs, training=False)
    h = keras.layers.Add(name="add")([encoder(a), encoder(b)])
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def tokens():
    """A loss per token of padded sequences: the embedding's mask must
    cross every stage boundary to reach the loss and the metric, and each
    microbatch's loss counts by its share of the batch's real tokens."""
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, mask_zero=True, name="emb")(inputs)
    for i in range(3):
        h = keras.layers.Dense(16, activation="tanh", name=f"d{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(5, name="out")(h))


class Sampling(keras.layers.Layer):
    """Noise drawn in training and inference alike (a VAE's
    reparameterisation), from the layer's own seed generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x + 0.1 * keras.random.normal(keras.ops.shape(x),
                                             seed=self.seed_generator)


def noisy(normal=True):
    """The skip model with random layers on every stage: Dropout, one
    whose mask is broadcast over the batch (`noise_shape`), AlphaDropout,
    and with `normal`, GaussianNoise, GaussianDropout and a layer drawing
    noise in inference too (`Sampling`)."""
    layers = keras.layers
    inputs = keras.Input((8,))
    h1 = layers.Dense(16, activation="tanh", name="d1")(inputs)
    h1 = layers.Dropout(0.3, name="drop")(h1)
    h2 = layers.Dense(16, activation="tanh", name="d2")(h1)
    h2 = (layers.GaussianNoise(0.2, name="noise")(h2) if normal
          else layers.Dropout(0.2, noise_shape=(1, 16), name="shared")(h2))
    h3 = layers.Dense(16, activation="tanh", name="d3")(h2)
    if normal:
        h3 = Sampling(name="sampling")(
            layers.GaussianDropout(0.2, name="gdrop")(h3))
    h4 = layers.Dense(16, activation="tanh", name="d4")(h3)
    h4 = layers.AlphaDropout(0.1, name="adrop")(h4)
    merged = layers.Add(name="skip_add")([h1, h4])
    return keras.Model(inputs, layers.Dense(3, name="out")(merged))


class Manual(keras.Model):
    """Subclassed skip model; partition scopes when pipelined."""

    def __init__(self, partitions=1, **kwargs):
        super().__init__(**kwargs)
        self.p = partitions
        self.d = [keras.layers.Dense(16, activation="tanh") for _ in range(4)]
        self.out = keras.layers.Dense(3)

    def call(self, x):
        stage = [min(i * self.p // 5, self.p - 1) for i in range(5)]
        with keras_smp.partition(stage[0]):
            h1 = self.d[0](x)
        h = h1
        for i in range(1, 4):
            with keras_smp.partition(stage[i]):
                h = self.d[i](h)
        with keras_smp.partition(stage[4]):
            return self.out(h + h1)


class ManualPipelined(Manual, keras_smp.DistributedModel):
    pass


class Subclassed(keras.Model):
    """A subclassed model (its own call, no partition scopes): a skip
    connection with a `keras.ops` call, a nested Sequential block given
    `training`, a BatchNormalization and a nested block holding one given
    `training=False` (a frozen part: inference mode in fit too, as in
    Keras); wrapped unbuilt in a DistributedModel (traced at the first
    step), automatic partitioning."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, activation="tanh")
        self.bn = keras.layers.BatchNormalization(
            moving_mean_initializer="random_normal")
        self.block = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="tanh"),
        ], name="sub_block")
        self.frozen = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(
                moving_variance_initializer=keras.initializers.RandomUniform(
                    0.5, 1.5)),
        ], name="frozen_block")
        self.last = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=None):
        h = self.bn(self.first(x), training=False)
        h = self.block(h, training=training) + keras.ops.tanh(h)
        h = self.frozen(h, training=False)
        return self.out(self.last(h))


class Untold(keras.Model):
    """A subclassed model whose `call` takes no `training`: Keras' `fit`
    calls it as `model(x)`, so its Dropout and BatchNormalization infer
    (no masks, the moving statistics normalise and stay as they are)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, activation="tanh")
        self.drop = keras.layers.Dropout(0.4)
        self.bn = keras.layers.BatchNormalization(
            moving_mean_initializer="random_normal")
        self.mid = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.mid(self.bn(self.drop(self.first(x)))))


def build(case, pipelined):
    keras.utils.set_random_seed(1234)
    kind = case["model"]
    if kind == "manual":
        stages = case["partitions"] * (case.get("virtual_stages") or (
            2 if case["pipeline"] in ("interleaved_1f1b", "zb_v") else 1))
        model = (ManualPipelined(partitions=stages) if pipelined
                 else Manual())
        model(np.zeros((1, 8), "float32"))  # builds (pipelined: traces)
    else:
        model = {"mlp": mlp, "cnn": cnn, "skip": skip,
                 "penalized": penalized,
                 "penalized_ops": penalized_ops,
                 "penalized_helper": penalized_helper,
                 "autoencoder": autoencoder,
                 "two_heads": two_heads,
                 "mixed": mixed,
                 "nested": nested,
                 "nested_bn": lambda: nested(bn=True),
                 "subclassed": Subclassed,
                 "untold": Untold,
                 "mlp_unbuilt": mlp_unbuilt,
                 "tokens": tokens,
                 "noisy": noisy,
                 "dropouts": lambda: noisy(normal=False)}[kind]()
        if kind in ("mlp_unbuilt", "subclassed", "untold") and (
                not pipelined):
            # (Keras would build them in the traced step, after the
            # callbacks' on_train_begin reads the initial weights)
            model(X_FLAT[:1])
        if pipelined:
            if case.get("recompute_layers"):  # by layer index
                keras_smp.set_activation_checkpointing(
                    [model.layers[i] for i in case["recompute_layers"]])
            model = keras_smp.DistributedModel(model)
    decay = 0.05 if kind == "two_heads" else None
    opt = (keras.optimizers.SGD(learning_rate=0.1, momentum=0.9,
                                weight_decay=decay)
           if case["optimizer"] == "sgd"
           else keras.optimizers.Adam(learning_rate=1e-3,
                                      weight_decay=decay))
    if kind == "autoencoder":  # no compiled loss, no labels
        model.compile(optimizer=opt, jit_compile=case.get("xla", False))
        return model
    if kind == "two_heads":  # no loss (and no target) for "aux"
        model.compile(
            optimizer=opt, jit_compile=case.get("xla", False),
            loss={"cls": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True)})
        return model
    if kind == "mixed":
        model.compile(
            optimizer=opt, jit_compile=case.get("xla", False),
            loss={"cls": keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  "aux": keras.losses.MeanSquaredError(
                      reduction="mean_with_sample_weight")},
            loss_weights={"cls": 1.0, "aux": 0.5})
        return model
    model.compile(
        optimizer=opt, jit_compile=case.get("xla", False),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True,
            reduction=case.get("reduction", "sum_over_batch_size")),
        metrics=["sparse_categorical_accuracy"])
    return model


def run(case, pipelined):
    model = build(case, pipelined)
    x = X_IMG if case["model"] == "cnn" else X_FLAT
    sw = SW if case["model"] in ("skip", "manual", "penalized",
                                 "noisy") else None
    data = (x, Y) if sw is None else (x, Y, sw)
    if case["model"] == "autoencoder":
        data = (x,)
    if case["model"] == "two_heads":
        data = (x, {"cls": Y})
    if case["model"] == "mixed":
        data = (x, {"cls": Y, "aux": Y_AUX})
    if case["model"] == "tokens":
        x = X_TOK
        data = (x, Y_TOK)
    batch = GLOBAL_BATCH
    if case.get("partial") == "thirds":  # 70 rows in batches of 30: the
        batch, cut = 30, 70  # last, 10, split 4/4/2 over 3 replicas
    elif case.get("partial"):  # a last batch of 26 rows (7+7+6+6 for m=4)
        # ("odd": 27 rows, split 14/13 over 2 replicas)
        cut = N - (5 if case["partial"] == "odd" else 6)
    if case.get("partial"):
        data = tuple(keras.tree.map_structure(lambda t: t[:cut], d)
                     for d in data)
        x = data[0]
    ds = tf.data.Dataset.from_tensor_slices(data).batch(batch)
    if case.get("partial") == "static":  # batches of 30 rows, shape known
        ds = tf.data.Dataset.from_tensor_slices(data).batch(
            GLOBAL_BATCH - 2, drop_remainder=True)
    initial = []

    class Initial(keras.callbacks.Callback):
        """The weights training starts from (a model without an Input is
        built by fit, before this)."""

        def on_train_begin(self, logs=None):
            initial[:] = [w.numpy() for w in model.weights
                          if "seed" not in w.path]

    hist = model.fit(ds, epochs=1, verbose=0, callbacks=[Initial()])
    kept = [w for w in model.weights if "seed" not in w.path]
    ev = model.evaluate(ds, verbose=0, return_dict=True)
    pred = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    if isinstance(pred, dict):  # every output, side by side
        pred = np.concatenate([pred[k] for k in sorted(pred)], axis=1)
    weights = [w.numpy() for w in kept]  # (the call below updates
    # BatchNormalization's moving statistics)
    seeds = [w.numpy().tolist() for w in model.variables if "seed" in w.path]
    added = noise = 0.0
    if not pipelined:  # the losses layers add in call (guard: they count)
        model(x[:GLOBAL_BATCH], training=True)
        added = sum(float(l) for l in model.losses)
        # (guard: the random layers change what training computes)
        noise = max(float(np.abs(a - b).max()) for a, b in zip(
            keras.tree.flatten(model(x[:GLOBAL_BATCH], training=True)),
            keras.tree.flatten(model(x[:GLOBAL_BATCH], training=False))))
    return model, {
        "added": added,
        "noise": noise,
        "seeds": seeds,
        "weights": weights,
        "loss": np.array(hist.history["loss"]),
        "evaluate": np.array([ev["loss"],
                              ev.get("sparse_categorical_accuracy", 0.0)]),
        "predict": pred,
        "moved": max(float(np.abs(w - w0).max())
                     for w, w0 in zip(weights, initial)),
        # The largest change of a weight the loss does not depend on.
        "unused_moved": max([float(np.abs(w.numpy() - w0).max())
                             for w, w0 in zip(kept, initial)
                             if w.path.startswith("aux/")], default=None),
    }


def diff(a, b):
    d = np.abs(a - b)
    # Largest violation of |a - b| <= atol + rtol |b|, reported as the atol
    # needed with rtol = 1e-5.
    return float(np.max(d - 1e-5 * np.abs(b))) if d.size else 0.0


from compiled import count as _compiled  # noqa: E402  (counts XLA stages)
from replays import count as _replays  # noqa: E402  (counts recomputations)
from replays import layer_count as _layer_replays  # noqa: E402
from splits import count as _splits  # noqa: E402  (split backwards traced)
from splits import fallbacks as _split_fallbacks  # noqa: E402
from traced import wrappers as _traced  # noqa: E402  (stages traced once)

references = {}
for case in CASES:
    key = (case["model"], case["optimizer"], case.get("xla", False),
           case.get("reduction"), case.get("partial"))
    if key not in references:
        references[key] = run(case, pipelined=False)[1]
    ref = references[key]
    config = dict(partitions=case["partitions"],
                  microbatches=case["microbatches"],
                  pipeline=case["pipeline"],
                  auto_partition=case["model"] != "manual",
                  local_devices=case.get("devices", case["partitions"]),
                  activation_checkpointing=case.get("recompute", False),
                  virtual_stages=case.get("virtual_stages"))
    if "break_loss_weight" in case:  # mutation check: a wrong gradient
        from keras_smp.pipeline import step as step_lib

        original = step_lib.loss_weight
        factor = case["break_loss_weight"]
        step_lib.loss_weight = (
            lambda *args: factor * original(*args))
    strategy = keras_smp.SMPStrategy(**config)
    _replays[0] = _compiled[0] = _layer_replays[0] = 0
    _splits[0] = _split_fallbacks[0] = 0
    del _traced[:]
    with strategy.scope():
        model, got = run(case, pipelined=True)
    graph = model.staged_graph
    row = dict(case)
    row.update(
        added=ref["added"],
        noise=ref["noise"],
        # the seed generators' states: equal (as many advances)
        seeds=[got["seeds"], ref["seeds"]],
        unused_moved=[got["unused_moved"], ref["unused_moved"]],
        weights=max(diff(a, b) for a, b in zip(got["weights"], ref["weights"])),
        loss=diff(got["loss"], ref["loss"]),
        evaluate=diff(got["evaluate"], ref["evaluate"]),
        predict=diff(got["predict"], ref["predict"]),
        num_weights=[len(got["weights"]), len(ref["weights"])],
        stage_layers=[len(graph.stage_nodes(s))
                      for s in range(graph.num_stages)],
        replicas=strategy.num_replicas_in_sync,
        moved=got["moved"],
        replays=_replays[0],
        layer_replays=_layer_replays[0],
        compiled=_compiled[0],
        jit_compile=model.jit_compile,
        splits=_splits[0],
        split_fallbacks=_split_fallbacks[0],
        # per stage function traced once: [pipeline calls, forward runs]
        traced=[list(c) for c in _traced],
        expanded=graph.expanded,
    )
    print(json.dumps(row), flush=True)
