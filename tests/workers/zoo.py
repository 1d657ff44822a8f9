"""A zoo of representative Keras models, with their compile/fit settings.

Used by tests/workers/zoo_fit.py (and so by tests/test_model_zoo.py). Each
entry builds, from a fixed seed, a plain Keras model, its `compile`
arguments, its data (numpy, global batch `BATCH`) and its `fit` arguments.
The same entry is trained on one device (the reference) and in every
keras-smp mode; nothing here imports keras_smp.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

from added_losses import Penalty

BATCH = 16          # global batch (multiple of microbatches x replicas)
SAMPLES = 64        # 4 steps per epoch
EPOCHS = 2
VOCAB, SEQ, WIDTH = 32, 8, 16
BIG_VOCAB = 4096    # rows gathered per step (<= 2 x 64) << rows


def _tokens(rng, n=SAMPLES):
    return rng.randint(1, VOCAB, size=(n, SEQ)).astype("int32")


def _flat(rng, n=SAMPLES, d=8):
    return rng.randn(n, d).astype("float32")


def _classes(x, k, rng):
    w = rng.randn(x.shape[-1], k).astype("float32")
    return np.argmax(x @ w + 0.1 * rng.randn(len(x), k), axis=1)


def _classifier_compile(optimizer):
    return dict(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])


@keras.saving.register_keras_serializable(package="zoo")
class PositionEmbedding(layers.Layer):
    """Adds a learned position embedding (SEQ x WIDTH) to its input."""

    def build(self, shape):
        self.pos = self.add_weight(shape=(shape[1], shape[2]),
                                   initializer="glorot_uniform", name="pos")

    def call(self, x):
        return x + self.pos


@keras.saving.register_keras_serializable(package="zoo")
class TiedOutput(layers.Layer):
    """Logits = h @ embeddings^T: the output projection tied to the input
    embedding (GPT-2 style); with 2 stages the embedding is used by both."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def _encoder_block(h, causal, name):
    a = layers.MultiHeadAttention(2, WIDTH // 2, name=f"{name}_mha")(
        h, h, use_causal_mask=causal)
    h = layers.LayerNormalization(name=f"{name}_ln1")(h + a)
    f = layers.Dense(2 * WIDTH, activation="gelu", name=f"{name}_ff1")(h)
    f = layers.Dense(WIDTH, name=f"{name}_ff2")(f)
    return layers.LayerNormalization(name=f"{name}_ln2")(h + f)


def transformer_lm(rng):
    tokens = keras.Input((SEQ,), dtype="int32")
    emb = layers.Embedding(VOCAB, WIDTH, name="tok_emb")
    h = PositionEmbedding(name="pos_emb")(emb(tokens))
    h = _encoder_block(h, True, "blk0")
    h = _encoder_block(h, True, "blk1")
    logits = TiedOutput(emb, name="lm_head")(h)
    model = keras.Model(tokens, logits)
    x = _tokens(rng)
    y = np.roll(x, -1, axis=1)
    # global_clipnorm clips (the gradient norm is ~2): the norm counts the
    # tied embedding once, though two stages hold it.
    compile_args = dict(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.9,
                                       global_clipnorm=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])
    return model, compile_args, (x, y, None), {}


def bert_classifier(rng):
    # A large vocabulary: the embedding's sparse gradient stays sparse
    # across replicas (fusion.sum_sparse_as_dense) and its repeated rows
    # count once each in global_clipnorm's norm.
    tokens = keras.Input((SEQ,), dtype="int32")
    h = layers.Embedding(BIG_VOCAB, WIDTH, name="tok_emb")(tokens)
    h = PositionEmbedding(name="pos_emb")(h)
    h = _encoder_block(h, False, "enc0")
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dense(WIDTH, activation="tanh", name="pooler")(h)
    model = keras.Model(tokens, layers.Dense(2, name="cls")(h))
    x = _tokens(rng)
    x[:, 1:4] = rng.randint(VOCAB, BIG_VOCAB, size=(SAMPLES, 3))
    y = (x[:, 0] > VOCAB // 2).astype("int32")
    # SGD, not Adam: attention's key bias has an exactly zero gradient
    # (softmax ignores a constant shift), so its computed gradient is pure
    # rounding noise, which Adam normalises into steps of up to lr: a
    # comparison of such weights measures noise, not fidelity.
    compile_args = _classifier_compile(keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.1))
    return model, compile_args, (x, y, None), {}


def rnn_text(rng):
    # Padded sequences: the embedding's mask (mask_zero) crosses the stage
    # boundary with the LSTM's outputs.
    model = keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        layers.Embedding(VOCAB, WIDTH, mask_zero=True),
        layers.LSTM(WIDTH, return_sequences=True),
        layers.GRU(WIDTH),
        layers.Dense(1, activation="sigmoid"),
    ])
    x = _tokens(rng)
    for i in range(len(x)):
        x[i, SEQ - 1 - i % 4:] = 0  # 1 to 4 padding tokens
    y = (x.sum(axis=1) > x.sum(axis=1).mean()).astype("float32")[:, None]
    compile_args = dict(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss="binary_crossentropy",
        metrics=["binary_accuracy", keras.metrics.AUC(name="auc")])
    return model, compile_args, (x, y, None), {}


def token_tagger(rng):
    # Padded sequences of uneven lengths, a loss per token: the tag
    # output's Keras mask (the embedding's mask_zero) must reach the loss
    # and the metrics across stage boundaries, and each microbatch's share
    # of the batch's real tokens weights its loss (Keras divides by the
    # real tokens of the whole batch). The sequence head pools with the
    # mask; its output has none.
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="tok_emb")(tokens)
    h = layers.Dense(WIDTH, activation="tanh", name="tok_h1")(h)
    h = layers.Dense(WIDTH, activation="tanh", name="tok_h2")(h)
    tag = layers.Dense(5, name="tag")(
        layers.Dense(WIDTH, activation="tanh", name="tag_h")(h))
    cls = layers.Dense(2, name="cls")(layers.GlobalAveragePooling1D()(h))
    model = keras.Model(tokens, {"tag": tag, "cls": cls})
    x = _tokens(rng)
    lengths = rng.randint(2, SEQ + 1, size=SAMPLES)
    for i, n in enumerate(lengths):
        x[i, n:] = 0
    y = {"tag": (x % 5).astype("int32"),
         "cls": (lengths > SEQ // 2 + 1).astype("int32")}
    compile_args = dict(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
        loss={"tag": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True),
            "cls": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True)},
        loss_weights={"tag": 1.0, "cls": 0.5},
        metrics={"tag": ["sparse_categorical_accuracy"],
                 "cls": ["sparse_categorical_accuracy"]})
    return model, compile_args, (x, y, None), {}


def ignore_class(rng):
    # Targets the loss masks out itself (SparseCategoricalCrossentropy's
    # ignore_class): Keras divides by the targets left, and'ed with the
    # output's Keras mask, so each microbatch and replica counts by its
    # share of them (they counted by their rows or by the Keras mask
    # alone). "tag": ignore_class=-1 under the embedding's mask (void
    # targets inside and beyond each sequence); "seg": no Keras mask,
    # ignore_class=3 and reduction="mean_with_sample_weight" (divided by
    # the weights of the targets left), targets of shape (batch, SEQ, 1).
    # Per-token sample weights on both.
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="ic_emb")(tokens)
    h = layers.Dense(WIDTH, activation="tanh", name="ic_h")(h)
    tag = layers.Dense(5, name="tag")(
        layers.Dense(WIDTH, activation="tanh", name="ic_tag_h")(h))
    g = layers.Embedding(VOCAB, WIDTH, name="ic_emb2")(tokens)
    seg = layers.Dense(4, name="seg")(
        layers.Dense(WIDTH, activation="tanh", name="ic_seg_h")(g))
    model = keras.Model(tokens, {"tag": tag, "seg": seg})
    x = _tokens(rng)
    for i, n in enumerate(rng.randint(2, SEQ + 1, size=SAMPLES)):
        x[i, n:] = 0
    tag = (x % 5).astype("int32")
    tag[rng.rand(*x.shape) < 0.3] = -1
    # 3: void; targets of shape (batch, SEQ, 1), as Keras squeezes them
    y = {"tag": tag, "seg": (x % 4).astype("int32")[..., None]}
    sw = {"tag": rng.uniform(0.5, 1.5, size=x.shape).astype("float32"),
          "seg": rng.uniform(0.5, 1.5, size=x.shape).astype("float32")}
    compile_args = dict(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
        loss={"tag": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=-1),
            "seg": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=3,
                reduction="mean_with_sample_weight")},
        metrics={"tag": ["sparse_categorical_accuracy"]})
    return model, compile_args, (x, y, sw), {}


def sparse_input(rng):
    # A bag-of-words input (`keras.Input(sparse=True)`, a SciPy CSR
    # matrix) into a Dense layer, and sparse ids into an Embedding, beside
    # a dense input, with Adam and clipnorm: Keras looks up each word (and
    # each id) once for the batch (`tf.nn.embedding_lookup_sparse`, a
    # sparse segment reduction), so one device's sparse gradient holds
    # each id of the batch once, its row summed over the batch. The
    # microbatches' and replicas' gradients, put together, held an id once
    # per part, which Adam applies row by row (predictions 0.03 from one
    # device in every mode). Adam's epsilon 1e-4: float32 rounding of a
    # gradient summed in another order that cancels to about 1e-7 is not
    # magnified into the weights (1.3 atol with epsilon 1e-7).
    import scipy.sparse

    # The words' layer outweighs the rest: the automatic partition keeps
    # both sparse inputs' layers on the first stage all the same (a stage
    # boundary carries dense tensors only: it refused the ids' lookup on
    # the second stage).
    bow = keras.Input((BIG_VOCAB,), sparse=True, name="bow")
    ids = keras.Input((SEQ,), sparse=True, dtype="int64", name="ids")
    dense = keras.Input((4,), name="f")
    h = layers.Dense(WIDTH, activation="relu", name="bow_dense")(bow)
    # (Keras' symbolic shape of the lookup keeps the ids' axis)
    e = layers.Flatten()(layers.Embedding(VOCAB, 4, name="ids_emb")(ids))
    h = layers.Dense(WIDTH, activation="tanh", name="sp_h")(
        layers.Concatenate()([h, e, dense]))
    out = layers.Dense(3, name="sp_out")(h)
    model = keras.Model({"bow": bow, "ids": ids, "f": dense}, out)
    # A few hundred words, most in several rows of a batch.
    words = (rng.rand(SAMPLES, 300) < 0.08) * rng.rand(SAMPLES, 300)
    counts = np.zeros((SAMPLES, BIG_VOCAB), "float32")
    counts[:, 1000:1300] = words
    tokens = _tokens(rng) * (rng.rand(SAMPLES, SEQ) < 0.5)
    x = {"bow": scipy.sparse.csr_matrix(counts),
         "ids": scipy.sparse.csr_matrix(tokens.astype("int64")),
         "f": _flat(rng, d=4)}
    y = _classes(np.concatenate([words, x["f"]], 1), 3, rng)
    compile_args = dict(
        optimizer=keras.optimizers.Adam(0.01, epsilon=1e-4, clipnorm=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])
    return model, compile_args, (x, y, None), {}


def masked_attention(rng):
    # Self-attention over padded sequences (the embedding's mask_zero)
    # with a residual: MultiHeadAttention clears its inputs' masks when it
    # runs, so the residual sum and the per-token output hold none, and
    # Keras' loss counts every token; in the symbolic graph they have
    # one. The pipeline follows what runs.
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="tok_emb")(tokens)
    h = layers.Dense(WIDTH, activation="tanh", name="proj")(h)
    a = layers.MultiHeadAttention(2, WIDTH // 2, name="mha")(h, h)
    h = layers.LayerNormalization(name="ln")(layers.Add(name="res")([h, a]))
    h = layers.Dense(WIDTH, activation="tanh", name="ff")(h)
    model = keras.Model(tokens, layers.Dense(5, name="tag")(h))
    x = _tokens(rng)
    for i, n in enumerate(rng.randint(2, SEQ + 1, size=SAMPLES)):
        x[i, n:] = 0
    compile_args = _classifier_compile(keras.optimizers.SGD(0.1,
                                                            momentum=0.9))
    return model, compile_args, (x, (x % 5).astype("int32"), None), {}


def _image_classifier(model, rng):
    """8x8 images, 3 classes, SGD with momentum."""
    x = rng.randn(SAMPLES, 8, 8, 1).astype("float32")
    y = _classes(x.reshape(SAMPLES, -1), 3, rng)
    return (model, _classifier_compile(keras.optimizers.SGD(0.05,
                                                            momentum=0.9)),
            (x, y, None), {})


def _conv_bn(rng, blocks, synchronized=False):
    """`blocks` x (Conv2D, BatchNormalization, relu), pooling, 3 logits."""
    body = []
    for _ in range(blocks):
        body += [layers.Conv2D(8, 3, padding="same"),
                 layers.BatchNormalization(synchronized=synchronized),
                 layers.Activation("relu")]
    model = keras.Sequential([keras.Input((8, 8, 1))] + body + [
        layers.GlobalAveragePooling2D(), layers.Dense(3)])
    return _image_classifier(model, rng)


def cnn_bn(rng):
    return _conv_bn(rng, blocks=2)


def cnn_sync_bn(rng):
    # BatchNormalization(synchronized=True): statistics over the global
    # batch across data-parallel replicas.
    return _conv_bn(rng, blocks=1, synchronized=True)


def dropout(rng):
    # Random layers (a Dropout mask, Gaussian noise): each microbatch and
    # each replica draws its rows of what one device draws for the whole
    # batch (keras_smp.runtime.split_draws), so training equals it.
    model = keras.Sequential([
        keras.Input((8,)), layers.Dense(32, activation="relu"),
        layers.Dropout(0.3), layers.Dense(16, activation="tanh"),
        layers.GaussianNoise(0.2), layers.Dense(3)])
    x = _flat(rng)
    return (model, _classifier_compile(keras.optimizers.SGD(0.1)),
            (x, _classes(x, 3, rng), None), {})


def resnet(rng):
    # Augmented in the model, as Keras' image classification examples do:
    # random flips and rotations (their draws split as Dropout's).
    inputs = keras.Input((8, 8, 1))
    h = layers.RandomFlip("horizontal", seed=1, name="flip")(inputs)
    h = layers.RandomRotation(0.1, seed=2, name="rotate")(h)
    stem = layers.Conv2D(8, 3, padding="same", activation="relu",
                         name="stem")(h)
    h = layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(stem)
    h = layers.Conv2D(8, 3, padding="same", name="c2")(h)
    h = layers.Activation("relu")(layers.Add(name="skip")([stem, h]))
    h = layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, layers.Dense(3, name="out")(h))
    return _image_classifier(model, rng)


@keras.saving.register_keras_serializable(package="zoo")
class FarOff(keras.metrics.Metric):
    """Counts predictions more than 0.5 off; `result()` returns its state
    variable, as Keras' custom-metric guide writes one (with several
    processes TensorFlow's reduction of the step's logs failed on it)."""

    def __init__(self, name="far_off", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros",
                                       name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        far = ops.cast(ops.abs(y_true - y_pred) > 0.5, self.dtype)
        self.count.assign_add(ops.sum(far))

    def result(self):
        return self.count

    def reset_state(self):
        self.count.assign(0.0)


def multi_io(rng):
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    h = layers.Dense(16, activation="tanh", name="ha")(a)
    g = layers.Dense(16, activation="tanh", name="hb")(b)
    h = layers.Concatenate(name="cat")([h, g])
    h = layers.Dense(16, activation="relu", name="trunk")(h)
    cls = layers.Dense(3, name="cls")(h)
    reg = layers.Dense(1, name="reg")(layers.Dense(8, activation="tanh",
                                                   name="reg_h")(h))
    model = keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg})
    xa, xb = _flat(rng), _flat(rng, d=4)
    y = {"cls": _classes(xa, 3, rng),
         "reg": (xb.sum(axis=1, keepdims=True) * 0.5).astype("float32")}
    sw = rng.uniform(0.5, 1.5, size=SAMPLES).astype("float32")
    compile_args = dict(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        # Mixed reductions: the regression loss sums over the batch
        # (each microbatch's sum adds up, its logged "reg_loss" too).
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True),
            "reg": keras.losses.MeanSquaredError(reduction="sum")},
        loss_weights={"cls": 1.0, "reg": 0.05},
        metrics={"cls": ["sparse_categorical_accuracy"],
                 "reg": ["mae", FarOff()]},
        weighted_metrics={"reg": ["mse"]})
    return model, compile_args, ({"a": xa, "b": xb}, y, sw), {}


def _mlp(rng, frozen=False):
    dense = [layers.Dense(32, activation="tanh"),
             layers.Dense(32, activation="tanh"),
             layers.Dense(16, activation="relu"),
             layers.Dense(3)]
    if frozen:
        dense[1].trainable = False
    model = keras.Sequential([keras.Input((8,))] + dense)
    x = _flat(rng)
    return model, (x, _classes(x, 3, rng), None)


def regularized(rng):
    # L2 weight regularizers on layers of both stages (counted once in the
    # loss, differentiated on the stage holding the weight); clipvalue.
    # Losses added in `call` on both stages: activity regularizers (L1,
    # L2) and a custom layer's add_loss (each stage differentiates its
    # own; the logged loss sums them). Weight constraints (applied by each
    # stage's optimizer to its weights) and a learning-rate schedule. A
    # SpectralNormalization on each stage: its training call normalises
    # its kernel in place once per step on one device (every microbatch
    # normalised it again).
    reg = keras.regularizers.L2(1e-2)
    model = keras.Sequential([
        keras.Input((8,)),
        layers.Dense(32, activation="tanh", kernel_regularizer=reg,
                     activity_regularizer=keras.regularizers.L1(1e-3),
                     kernel_constraint=keras.constraints.MaxNorm(0.5)),
        layers.SpectralNormalization(layers.Dense(16, activation="tanh")),
        layers.Dense(16, activation="tanh",
                     kernel_constraint=keras.constraints.NonNeg()),
        Penalty(name="penalty"),
        layers.SpectralNormalization(layers.Dense(16, activation="tanh"),
                                     power_iterations=2),
        layers.Dense(3, kernel_regularizer=reg, bias_regularizer=reg,
                     activity_regularizer=keras.regularizers.L2(1e-3),
                     bias_constraint=keras.constraints.UnitNorm(axis=0))])
    x = _flat(rng)
    return (model, _classifier_compile(keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5),
        clipvalue=0.01)),
        (x, _classes(x, 3, rng), None), {})


def frozen(rng):
    # A frozen layer; Adam with clipnorm (per-variable clipping of the
    # synced gradient).
    model, data = _mlp(rng, frozen=True)
    return (model, _classifier_compile(
        keras.optimizers.Adam(1e-2, clipnorm=0.02)), data, {})


def mixed_bfloat16(rng):
    # The global policy, as users set it (zoo_fit restores it afterwards).
    keras.config.set_dtype_policy("mixed_bfloat16")
    model, data = _mlp(rng)
    return (model, _classifier_compile(keras.optimizers.SGD(0.1)), data, {})


def mixed_float16(rng):
    # With the global mixed_float16 policy, compile() wraps the optimizer
    # in a LossScaleOptimizer (dynamic loss scale), the model's and
    # DistributedModel's alike.
    keras.config.set_dtype_policy("mixed_float16")
    model, data = _mlp(rng)
    return (model, _classifier_compile(keras.optimizers.SGD(0.1)), data, {})


def float64(rng):
    # A float64 model (`keras.config.set_floatx`; zoo_fit restores it):
    # Dropout, a weight regularizer and `global_clipnorm` on both stages,
    # and a partial last batch (59 rows: 11 in the last, split 6 and 5
    # over replicas). Compared to float64 rounding: the norm over the
    # stages, the regularizers' sum and the shared loss were float32.
    keras.config.set_floatx("float64")
    # (and the global policy, which keeps the floatx it was first read
    # with: zoo_fit reads it to restore it)
    keras.config.set_dtype_policy("float64")
    model = keras.Sequential([
        keras.Input((8,)),
        layers.Dense(32, activation="tanh",
                     kernel_regularizer=keras.regularizers.L2(1e-2)),
        layers.Dropout(0.2, seed=4),
        layers.Dense(16, activation="relu",
                     kernel_regularizer=keras.regularizers.L2(1e-2)),
        layers.Dense(3)])
    x = _flat(rng, SAMPLES - 5).astype("float64")
    return (model, _classifier_compile(
        keras.optimizers.Adam(1e-2, global_clipnorm=0.5)),
        (x, _classes(x, 3, rng), None), {})


@keras.saving.register_keras_serializable(package="zoo")
class SqrtGate(layers.Layer):
    """Replaces feature 0 by sqrt(x0^2 w): the gradient of `w` is NaN for a
    sample with x0 = 0 (0 / 0), while the forward pass stays finite."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return ops.concatenate(
            [ops.sqrt(ops.square(x[:, :1]) * self.w), x[:, 1:]], axis=1)


def loss_scale_skip(rng):
    # A LossScaleOptimizer whose first step of each epoch has a non-finite
    # gradient on the first stage only (sample 3: x0 = 0) and in one
    # data-parallel replica's half of the batch only: single-device
    # training skips the step and halves the scale; so must every stage
    # and replica, together.
    model = keras.Sequential([
        keras.Input((8,)), SqrtGate(name="gate"),
        layers.Dense(32, activation="tanh"),
        layers.Dense(16, activation="relu"), layers.Dense(3)])
    x = _flat(rng)
    y = _classes(x, 3, rng)
    x[:, 0] = np.abs(x[:, 0]) + 0.1
    x[3, 0] = 0.0
    return (model, _classifier_compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1))), (x, y, None), {})


def frozen_stage_loss_scale(rng):
    # Fine-tuning: the first stage (two frozen layers, split at "gate")
    # has nothing to train. A LossScaleOptimizer with global_clipnorm;
    # sample 3 is all zeros, so the frozen layers give it a zero feature
    # 0 and the gate's gradient is NaN on the second stage: single-device
    # training skips those steps and halves the scale. The frozen stage
    # takes part in every decision and keeps its scale in step. Used with
    # one stage per process (test_model_zoo).
    model = keras.Sequential([
        keras.Input((8,)),
        layers.Dense(32, activation="tanh", trainable=False, name="f1"),
        layers.Dense(16, activation="tanh", trainable=False, name="f2"),
        SqrtGate(name="gate"),
        layers.Dense(16, activation="relu", name="t1"),
        layers.Dense(3, name="t2")])
    x = _flat(rng)
    y = _classes(x, 3, rng)
    x[3] = 0.0
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, global_clipnorm=0.5))
    return model, _classifier_compile(optimizer), (x, y, None), {}


def class_weight_lr(rng):
    # class_weight, a learning-rate schedule callback, ReduceLROnPlateau
    # on a validation metric, steps_per_execution=2, initial_epoch,
    # validation_split.
    model, data = _mlp(rng)
    compile_args = _classifier_compile(keras.optimizers.SGD(0.1))
    compile_args["steps_per_execution"] = 2
    # validation_split: the last quarter (16 samples) validates, the rest
    # trains (3 steps: one full steps_per_execution group and one partial).
    # evaluate() and predict() run 3 batches too (with one stage per
    # process, predict's steps in one execution reused each other's
    # transfer keys: "BufRendezvous::ProvideBuf already called").
    fit = dict(eval_batches=3, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, initial_epoch=1,
               validation_split=0.25, epochs=EPOCHS + 1, callbacks=[
                   keras.callbacks.LearningRateScheduler(
                       lambda epoch, lr: lr * 0.5),
                   keras.callbacks.ReduceLROnPlateau(
                       monitor="val_loss", factor=0.5, patience=0,
                       min_delta=10.0)])
    return model, compile_args, data, fit


ZOO = {f.__name__: f for f in (
    transformer_lm, bert_classifier, rnn_text, token_tagger,
    ignore_class, sparse_input, masked_attention, cnn_bn,
    cnn_sync_bn, dropout, resnet, multi_io, regularized,
    frozen, mixed_bfloat16, mixed_float16, loss_scale_skip,
    frozen_stage_loss_scale, class_weight_lr, float64)}


def build(name):
    """(model, compile_args, (x, y, sample_weight), fit_args) for `name`.

    Seeded: the same weights and data in every process and mode.
    """
    keras.utils.set_random_seed(1234)
    rng = np.random.RandomState(0)
    model, compile_args, data, fit_args = ZOO[name](rng)
    x, y, sw = data
    n_val = BATCH
    vrng = np.random.RandomState(1)
    # Validation data: the first batch, permuted (so it differs from
    # training batches but has the same distribution).
    perm = vrng.permutation(keras.tree.flatten(x)[0].shape[0])[:n_val]
    take = lambda t: ({k: v[perm] for k, v in t.items()}  # noqa: E731
                      if isinstance(t, dict) else t[perm])
    fit_args = dict(fit_args)
    fit_args.setdefault("epochs", EPOCHS)
    if "validation_split" not in fit_args:
        fit_args["validation_data"] = (take(x), take(y))
    # What evaluate() and predict() run on afterwards (the validation
    # batch, or the first `eval_batches` batches of the training data).
    rows = fit_args.pop("eval_batches", 1) * BATCH
    first = lambda t: ({k: v[:rows] for k, v in t.items()}  # noqa: E731
                       if isinstance(t, dict) else t[:rows])
    fit_args["eval_data"] = ((take(x), take(y)) if rows == BATCH
                             else (first(x), first(y)))
    return model, compile_args, (x, y, sw), fit_args
