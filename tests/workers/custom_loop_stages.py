"""SMP custom loop with one pipeline stage per process (`local_devices=1`).

Run with `keras-smp launch -n N` (N = 2 stages x replicas), or alone with
`--reference` (plain Keras, one process, the whole global batch).

The model: a token `Embedding` (ids repeat: sparse gradients, which Adam
applies row by row) averaged over the sequence, two `Dense` layers;
seeded initializers, so every run starts from the same weights. Adam with
`global_clipnorm`, 3 steps on a fixed global batch of 32 rows (each
replica its contiguous share), 4 microbatches; then a forward-only step
(no gradients) and Keras' `evaluate` after `compile`.

    --grads get_gradients|tape   how the step takes its gradients
    --out DIR                    rank{R}.json (or reference.json)
    --ckpt DIR                   smp.CheckpointManager's directory: restored
                                 before the first step (the model has no
                                 weights yet) when it holds a checkpoint
    --stop-at K                  save a checkpoint after step K and exit
    --save-model DIR             model.save_model(DIR) after those
    --keras-fit                  then one step of Keras' `fit` (the same
                                 optimizer) on a batch of its own
    --regularized                an activity regularizer on the embedding
                                 (stage 0) and a kernel regularizer on the
                                 hidden layer (stage 1): the step adds
                                 `model.losses` to its loss
    --other-data                 processes of later stages pass other
                                 batches to the step (as a dataset shuffled
                                 with seed=smp.rank() would): the first
                                 stage's are used
    --frozen-embedding           the embedding (stage 0) is frozen: its
                                 process trains nothing, builds no backward
                                 and still takes part in the global norm
    --frozen-head                the Dense layers (stage 1) are frozen, the
                                 embedding trains: the step is refused (its
                                 process would relay gradients), REFUSED
    --loss-scale                 mixed_float16 and a LossScaleOptimizer
                                 (the step scales its loss); an `Amplify`
                                 layer ends the first stage (manual
                                 partitions), whose gradient overflows at
                                 step 1's scale while the second stage's
                                 does not: every stage must skip it. The
                                 reference records where its gradients
                                 are finite ("finite"); every run, the
                                 scale after each step ("scales")
    --scale-once                 with --loss-scale: step 2 keeps the
                                 scale step 1's skip left (2^15: skipped
                                 too), so a run resumed from a checkpoint
                                 saved after step 1 (`--stop-at 2`)
                                 trains on the restored scale
    --subset                     the step differentiates the Dense
                                 layers' weights only (stage 1), leaving
                                 the embedding (stage 0) out: refused on
                                 every rank (REFUSED)
    --dropout                    a Dropout (stage 0) and a GaussianNoise
                                 (stage 1) layer, seeded (manual
                                 partitions)
    --shared                     a Dense layer called in both stages
                                 (manual partitions): each stage process
                                 holds a copy of its weights, the
                                 optimizer sums their gradient's parts
    --tied                       Keras' ReversibleEmbedding with tied
                                 weights (as a GPT's token embedding): the
                                 lookup in stage 0, the projection to the
                                 vocabulary in stage 1 (a sparse part and
                                 a dense part of one gradient); trained
                                 by a LossScaleOptimizer around a
                                 MultiOptimizer (Adam for each group)
    --shared-lookup              the Embedding looked up in both stages
                                 (as an encoder-decoder's shared token
                                 embedding): two sparse parts, whose rows
                                 are gathered; stage 1 also reads the
                                 token ids and a float tensor stage 0
                                 makes from them without weights
    --shared-bn                  a BatchNormalization called in both
                                 stages: its moving statistics would be
                                 updated per process, the step is refused
                                 (prints REFUSED and the error, every rank)
"""

import argparse
import contextlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

parser = argparse.ArgumentParser()
parser.add_argument("--grads", default="get_gradients")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--out", required=True)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--save-model", default=None)
parser.add_argument("--regularized", action="store_true")
parser.add_argument("--shared", action="store_true")
parser.add_argument("--tied", action="store_true")
parser.add_argument("--shared-lookup", action="store_true")
parser.add_argument("--shared-bn", action="store_true")
parser.add_argument("--dropout", action="store_true")
parser.add_argument("--subset", action="store_true")
parser.add_argument("--other-data", action="store_true")
parser.add_argument("--frozen-embedding", action="store_true")
parser.add_argument("--frozen-head", action="store_true")
# At the end, one step of Keras' own `fit` (compiled with the same optimizer).
parser.add_argument("--keras-fit", action="store_true")
parser.add_argument("--loss-scale", action="store_true")
# (with --loss-scale: the scale is set before step 1 only)
parser.add_argument("--scale-once", action="store_true")
args = parser.parse_args()

import numpy as np  # noqa: E402

if not args.reference:
    import keras_smp as smp

    smp.init({"partitions": 2, "microbatches": 4, "local_devices": 1,
              "auto_partition": not (args.shared or args.shared_bn
                                     or args.tied or args.shared_lookup
                                     or args.loss_scale or args.dropout)})

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

if args.loss_scale:
    keras.mixed_precision.set_global_policy("mixed_float16")

GLOBAL, STEPS = 32, 3
AMP = 256.0


class Amplify(keras.layers.Layer):
    """The identity, whose backward multiplies the gradient by AMP in the
    layer's compute dtype (float16 under mixed_float16): a gradient above
    65504 / AMP overflows there, in the first stage only."""

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), lambda g: g * tf.cast(AMP, g.dtype)
        return identity(x)


def batch(step):
    if args.other_data and not args.reference and smp.pp_rank() > 0:
        step += 100 * smp.pp_rank()
    rng = np.random.RandomState(7 + step)
    return (rng.randint(0, 20, (GLOBAL, 6)).astype("int32"),
            rng.randint(0, 3, GLOBAL).astype("int32"))


def layers():
    return (keras.layers.Embedding(
                20, 8, embeddings_initializer=keras.initializers.RandomUniform(
                    -0.5, 0.5, seed=1),
                activity_regularizer=keras.regularizers.L2(0.01)
                if args.regularized else None),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(16, activation="tanh",
                               kernel_initializer=keras.initializers.
                               GlorotUniform(seed=2),
                               kernel_regularizer=keras.regularizers.L2(
                                   0.01) if args.regularized else None),
            keras.layers.Dense(3, kernel_initializer=keras.initializers.
                               GlorotUniform(seed=3)))


Base = keras.Model if args.reference else smp.DistributedModel
partition = (lambda i: contextlib.nullcontext()) if args.reference else (
    lambda i: smp.partition(i))


class Model(Base):
    def __init__(self):
        super().__init__()
        self.embed, self.pool, self.hidden, self.head = layers()
        if args.shared:
            self.mid = keras.layers.Dense(
                16, kernel_initializer=keras.initializers.GlorotUniform(
                    seed=4))
        if args.shared_bn:
            self.norm = keras.layers.BatchNormalization()
        if args.tied:
            self.embed = keras.layers.ReversibleEmbedding(
                20, 8, tie_weights=True,
                embeddings_initializer=keras.initializers.RandomUniform(
                    -0.5, 0.5, seed=1))
            self.hidden = keras.layers.Dense(
                8, activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(seed=2))
        if args.loss_scale:
            self.amplify = Amplify()
        if args.dropout:
            self.drop = keras.layers.Dropout(0.3, seed=5)
            self.noise = keras.layers.GaussianNoise(0.3, seed=6)
        self.embed.trainable = not args.frozen_embedding
        self.hidden.trainable = self.head.trainable = not args.frozen_head

    def call(self, ids):
        if args.shared:  # self.mid, a Dense(16), called in both stages
            with partition(0):
                h = self.mid(self.hidden(self.pool(self.embed(ids))))
            with partition(1):
                return self.head(self.mid(h))
        if args.shared_bn:
            with partition(0):
                h = self.norm(self.hidden(self.pool(self.embed(ids))))
            with partition(1):
                return self.head(self.norm(h))
        if args.shared_lookup:  # the embedding again, on 3 of 6 tokens
            with partition(0):
                h = self.hidden(self.pool(self.embed(ids)))
                # (its gradient, sent back, is no weight's)
                share = keras.ops.mean(keras.ops.cast(ids, "float32"),
                                       axis=1, keepdims=True) / 20.0
            with partition(1):
                again = self.pool(self.embed(keras.ops.slice(
                    ids, (0, 0), (-1, 3))))
                return self.head(keras.ops.concatenate(
                    [h, again * share], -1))
        if args.tied:  # logits over the 20 tokens (labels are 0-2)
            with partition(0):
                h = self.hidden(self.pool(self.embed(ids)))
            with partition(1):
                return self.embed(h, reverse=True)
        if args.loss_scale:  # the amplifier in stage 0
            with partition(0):
                h = self.amplify(self.pool(self.embed(ids)))
            with partition(1):
                return self.head(self.hidden(h))
        if args.dropout:  # random layers on both stages
            with partition(0):
                h = self.hidden(self.drop(self.pool(self.embed(ids))))
            with partition(1):
                return self.head(self.noise(h))
        return self.head(self.hidden(self.pool(self.embed(ids))))


def keras_fit(model):
    """One step of Keras' `fit` on a global batch of its own (the same on
    every process): its loss and the weights this process holds after."""
    rng = np.random.RandomState(1000)
    x, y = (rng.randint(0, 20, (GLOBAL, 6)).astype("int32"),
            rng.randint(0, 3, GLOBAL).astype("int32"))
    seeds = {v.path: v.numpy().tolist() for v in model.variables
             if "seed" in v.path and v.value.shape.num_elements()}
    model.compile(optimizer=opt, loss=loss_fn)
    history = model.fit(x, y, batch_size=GLOBAL, epochs=1, shuffle=False,
                        verbose=0)
    return dict(fit_loss=history.history["loss"][0],
                seeds_before_fit=seeds,
                seeds_after_fit={
                    v.path: v.numpy().tolist() for v in model.variables
                    if "seed" in v.path and v.value.shape.num_elements()},
                held_after_fit={v.path: v.numpy().tolist()
                                for v in model.weights
                                if v.value.shape.num_elements()})


def added(model):
    """The losses the layers added in the model's last call (and the
    weight regularizers'), as a Keras custom loop adds them."""
    return tf.add_n(model.losses) if model.losses else 0.0


model = Model()
# The global norm spans both stages' gradients (clipped at step 1 at
# least: its norm is 0.5-1).
opt = keras.optimizers.Adam(0.05, global_clipnorm=0.3)
if args.shared:
    # SGD: with Adam one element of the hidden kernel (not the shared
    # layer's), whose gradient nearly cancels over the batch, moved 1.7e-5
    # from the reference (Adam divides by the gradient's own size): the
    # summation order of the microbatches, not the shared layer's sum.
    opt = keras.optimizers.SGD(0.5, global_clipnorm=0.3)
if args.tied:
    # Nested optimizers: the tied weight's parts are summed once (by the
    # outer one), not again by the sub-optimizer applying it.
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(keras.optimizers.Adam(0.05), {
            ".*dense.*": keras.optimizers.Adam(0.05)})))
if args.loss_scale:
    # Loss scales set before steps 1 and 2 (measured in the reference,
    # which records where its gradients are finite): at 2^16 the first
    # stage's gradients overflow in `Amplify` (they did from 2^14, not at
    # 2^12) while the second stage's stay finite (they overflowed at 2^20,
    # not 2^19), so a skip that every stage must take though only the
    # first stage's gradients show it; at 2^10, 4x below either, a step
    # applied everywhere (and the scale doubled: growth after every
    # finite step). Each is 4x or more from a boundary: a microbatch's
    # per-row gradients have the batch's magnitudes.
    opt = keras.optimizers.LossScaleOptimizer(
        opt, initial_scale=2.0 ** 10, dynamic_growth_steps=1)
    SCALES = {1: 2.0 ** 16, 2: 2.0 ** 10}
    if args.scale_once:  # step 2 at the halved 2^15: skipped again
        del SCALES[2]


def scaled(loss):
    return opt.scale_loss(loss) if args.loss_scale or args.tied else loss


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
out = {"losses": []}

if args.reference:
    for step in range(STEPS):
        x, y = batch(step)
        if args.loss_scale and step in SCALES:
            opt.dynamic_scale.assign(SCALES[step])
        with tf.GradientTape() as tape:
            # (training: the random layers of --dropout draw, as in the
            # steps' `model(ids, training=True)`)
            loss = loss_fn(y, model(x, training=args.dropout)) + added(
                model)
            scaled_loss = scaled(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        if args.loss_scale:  # which stages' gradients are finite
            out.setdefault("finite", []).append([
                bool(all(np.isfinite(tf.convert_to_tensor(g)).all()
                         for g, v in zip(grads, model.trainable_variables)
                         if (v.path.startswith("model/embedding/"))
                         == (stage == 0)))
                for stage in (0, 1)])
        opt.apply_gradients(zip(grads, model.trainable_variables))
        out["losses"].append(float(loss))
        if args.loss_scale:
            out.setdefault("scales", []).append(
                float(opt.dynamic_scale.numpy()))
    x, y = batch(STEPS)
    logits = model(x)
    out["eval_loss"] = float(loss_fn(y, logits) + added(model))
    out["predictions"] = logits.numpy().tolist()
    out["weights"] = {v.path: v.numpy().tolist() for v in model.weights}
    out["iterations"] = int(opt.iterations.numpy())
    if args.keras_fit:
        out.update(keras_fit(model))
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/reference.json", "w") as f:
        json.dump(out, f)
    raise SystemExit(0)


def trained():
    """The weights the step differentiates (and the optimizer applies)."""
    return model.trainable_variables[1:] if args.subset else (
        model.trainable_variables)


@smp.step
def get_grads(ids, labels):
    if args.grads == "tape":
        with tf.GradientTape() as tape:
            logits = model(ids, training=True)
            loss = loss_fn(labels, logits) + added(model)
            scaled_loss = scaled(loss)
        return tape.gradient(scaled_loss, trained()), loss
    logits = model(ids, training=True)
    loss = loss_fn(labels, logits) + added(model)
    return opt.get_gradients(scaled(loss), trained()), loss


@tf.function
def train_step(ids, labels):
    grads, loss = get_grads(ids, labels)
    grads = [g.accumulate() for g in grads]
    opt.apply_gradients(zip(grads, trained()))
    return loss.reduce_mean()


@smp.step
def evaluate(ids, labels):
    logits = model(ids, training=False)
    return loss_fn(labels, logits) + added(model), logits


if args.shared_bn or args.frozen_head or args.subset:
    try:
        train_step(*batch(0))
    except (NotImplementedError, ValueError) as e:
        print(f"rank {smp.rank()} REFUSED {type(e).__name__}: {e}")
    raise SystemExit(0)

ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
manager = smp.CheckpointManager(ckpt, args.ckpt) if args.ckpt else None
start = 0
if manager is not None and manager.latest_checkpoint:
    assert not model.variables  # restored at the first step
    start = int(manager.restore().rsplit("-", 1)[1])
out["start"] = start
rows = GLOBAL // smp.dp_size()
lo = smp.dp_rank() * rows
for step in range(start, STEPS):
    x, y = batch(step)
    if args.loss_scale and step in SCALES:
        if not hasattr(opt, "dynamic_scale"):
            # Resumed: the scale variable is made (and restored from the
            # checkpoint) by the first `scale_loss`; the step makes it.
            opt.scale_loss(tf.zeros([]))
        opt.dynamic_scale.assign(SCALES[step])
    out["losses"].append(float(train_step(x[lo:lo + rows],
                                          y[lo:lo + rows])))
    if args.loss_scale:
        out.setdefault("scales", []).append(
            float(opt.dynamic_scale.numpy()))
    if step + 1 == args.stop_at:
        manager.save(checkpoint_number=step + 1)
        print(f"rank {smp.rank()}: saved at step {step + 1}, stopping")
        raise SystemExit(0)
x, y = batch(STEPS)
loss, logits = evaluate(x[lo:lo + rows], y[lo:lo + rows])
# Keras' own evaluate under smp.init's strategy: the pipeline's steps, one
# stage per process, on the whole global batch (sharded over the replicas).
model.compile(optimizer=opt, loss=loss_fn)
out["keras_evaluate"] = float(model.evaluate(x, y, batch_size=GLOBAL,
                                             verbose=0))
out.update(
    rank=smp.rank(), pp_rank=smp.pp_rank(), dp_rank=smp.dp_rank(),
    eval_loss=float(loss.reduce_mean()),
    predictions=logits.merge().numpy().tolist(),
    # What this process holds: its stage's weights (values), every
    # weight's and optimizer variable's number of elements.
    held={v.path: v.numpy().tolist() for v in model.weights
          if v.value.shape.num_elements()},
    sizes={v.path: int(v.value.shape.num_elements()) for v in model.weights},
    slots={v.path: int(v.value.shape.num_elements())
           for v in opt.variables},
    iterations=int(opt.iterations.numpy()))
if args.save_model:
    model.save_model(args.save_model)
if args.keras_fit:  # `fit` under smp.init's strategy, one stage per process
    out.update(keras_fit(model))
os.makedirs(args.out, exist_ok=True)
with open(f"{args.out}/rank{smp.rank()}.json", "w") as f:
    json.dump(out, f)
print(f"rank {smp.rank()} done")
