"""Trains a small transformer LM with tensor parallelism; dumps results.

Usage: tensor_fit.py --out DIR --tp T [--variant NAME] [--load CKPT]

`--tp 0`: the reference, plain Keras on one device (no keras_smp
strategy). Otherwise an `SMPStrategy(tensor_parallel_degree=T)` (run under
`keras-smp launch -n N`; N / T data-parallel replicas), the model built
inside `keras_smp.tensor_parallelism()`.

Model: token embedding (vocabulary-parallel ReversibleEmbedding), a learned
position embedding (replicated), two causal attention blocks (heads
split, output projection by rows) with an MLP (Dense pair: columns then
rows) and LayerNormalization (replicated), a lone EinsumDense and a lone
Dense (columns, gathered), logits from the tied embedding
(vocabulary-parallel, gathered).

Writes DIR/rankR.npz: the final whole weights (w0, w1, ... of a plain
Keras model that loaded the run's `save_weights` file: so the file holds
whole weights and plain Keras reads it) and optimizer variables (o0, ...:
the slots of split weights saved whole too), losses, evaluate, predict,
and DIR/model.weights.h5 (rank 0). With --load, the weights of CKPT are
loaded before training (a checkpoint of another tensor_parallel_degree).
"""

import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--tp", type=int, required=True)
p.add_argument("--variant", default="sgd_global_clipnorm",
               choices=["sgd_global_clipnorm", "adam_clipnorm",
                        "mixed_float16", "vocab_parallel"])
p.add_argument("--load", default=None)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--partitions", type=int, default=1,
               help="pipeline stages (DistributedModel, one per process)")
p.add_argument("--microbatches", type=int, default=2)
p.add_argument("--local", action="store_true",
               help="one process: the ranks are its local devices "
                    "(local_devices=T)")
p.add_argument("--jit", action="store_true",
               help="compile(jit_compile=True): split layers run uncompiled")
args = p.parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_smp  # noqa: E402

VOCAB, SEQ, WIDTH, HEADS = 64, 8, 32, 4
BATCH, SAMPLES = 16, 64

strategy = None
if args.tp:
    strategy = keras_smp.SMPStrategy(
        tensor_parallel_degree=args.tp, collective_timeout_seconds=int(os.environ.get("TP_TIMEOUT", "120")),
        partitions=args.partitions, microbatches=args.microbatches,
        local_devices=args.tp if args.local else None)


@keras.saving.register_keras_serializable(package="tensor_fit")
class Positions(keras.layers.Layer):
    def build(self, shape):
        self.pos = self.add_weight(shape=(shape[1], shape[2]),
                                   initializer="glorot_uniform", name="pos")

    def call(self, x):
        return x + self.pos


def build_model():
    keras.utils.set_random_seed(7)
    tokens = keras.Input((SEQ,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(VOCAB, WIDTH, name="tok_emb")
    h = Positions(name="pos")(emb(tokens))
    for i in range(2):
        a = keras.layers.MultiHeadAttention(
            HEADS, WIDTH // HEADS, name=f"mha{i}")(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization(name=f"ln{i}a")(h + a)
        f = keras.layers.Dense(4 * WIDTH, activation="gelu", name=f"ff{i}a")(h)
        f = keras.layers.Dense(WIDTH, name=f"ff{i}b")(f)
        h = keras.layers.LayerNormalization(name=f"ln{i}b")(h + f)
    # Lone projections: split by output columns, then gathered.
    h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(SEQ, WIDTH),
                                 bias_axes="d", name="proj")(h)
    # softmax sees every unit: the split output is gathered first.
    h = keras.layers.Dense(WIDTH, activation="softmax", name="proj2")(h)
    logits = emb(h, reverse=True)
    return keras.Model(tokens, logits)


# Widths of the logits the vocabulary-parallel loss saw (at trace time).
SEEN = set()


class ProbedLoss(keras_smp.VocabParallelSparseCategoricalCrossentropy):
    def call(self, y_true, y_pred):
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope

        if not in_symbolic_scope():  # not Keras' shape-only build
            SEEN.add(y_pred.shape[-1])
        return super().call(y_true, y_pred)


def compile_args():
    if args.variant == "adam_clipnorm":
        opt = keras.optimizers.Adam(1e-2, clipnorm=0.05)
    else:
        opt = keras.optimizers.SGD(0.2, momentum=0.9, global_clipnorm=0.5)
    if args.variant == "vocab_parallel":
        # The logits stay split in fit and evaluate (Keras' own loss and
        # accuracy without tensor parallelism: the reference).
        return dict(
            optimizer=opt, jit_compile=True if args.jit else "auto",
            loss=ProbedLoss(),
            metrics=[keras_smp.VocabParallelSparseCategoricalAccuracy()])
    return dict(optimizer=opt, jit_compile=True if args.jit else "auto",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                metrics=["sparse_categorical_accuracy"])


if args.variant == "mixed_float16":
    keras.config.set_dtype_policy("mixed_float16")

rng = np.random.RandomState(0)
x = rng.randint(1, VOCAB, size=(SAMPLES, SEQ)).astype("int32")
y = np.roll(x, -1, axis=1)
# 40 rows: the last evaluate/predict batch has 8 (a second batch size).
vx = rng.randint(1, VOCAB, size=(40, SEQ)).astype("int32")
vy = np.roll(vx, -1, axis=1)

def check_local_shards(model):
    """Ranks on the local devices of one process: each device holds its
    own shard of every split weight and of its optimizer slots, 1/T of
    the whole, measured on the variables' device copies."""
    from keras_smp.runtime.patches import whole_value

    devices = strategy.extended.worker_devices
    assert len(devices) == args.tp, devices
    # SMP's rank helpers: the degree, and each replica's rank in its step.
    assert keras_smp.tp_size() == args.tp and keras_smp.tp_rank() == 0
    ranks = strategy.run(lambda: keras.ops.convert_to_tensor(
        keras_smp.tp_rank()))
    assert [int(r) for r in ranks.values] == list(range(args.tp)), ranks
    assert strategy.num_replicas_in_sync == 1  # one model, T ranks
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    split = [v for v in model.trainable_variables
             if getattr(v, "_smp_tp_axis", None) is not None]
    slots = [v for v in model.optimizer.variables
             if getattr(v, "_smp_tp_axis", None) is not None]
    # SGD with momentum: one momentum slot per split weight.
    assert len(split) > 10 and len(slots) == len(split), (len(split),
                                                          len(slots))
    # The whole sizes, from a plain Keras model of the same architecture.
    plain_shapes = {w.path: tuple(w.shape) for w in build_model().weights}
    split_ids = {id(v) for v in split}
    per_device = {d: 0 for d in devices}
    whole_bytes = 0
    for v in split + slots:
        copies = strategy.experimental_local_results(v.value)
        assert [c.device for c in copies] == list(devices), (v.path, copies)
        whole = whole_value(v)
        axis = v._smp_tp_axis
        assert whole.shape[axis] == v.shape[axis] * args.tp, v.path
        if id(v) in split_ids:
            assert whole.shape == plain_shapes[v.path], (v.path, whole.shape)
        for r, c in enumerate(copies):
            assert tuple(c.shape) == tuple(v.shape), (v.path, c.shape)
            np.testing.assert_array_equal(
                c.numpy(), np.split(whole, args.tp, axis=axis)[r])
            per_device[c.device] += c.numpy().nbytes
        whole_bytes += whole.nbytes
    assert set(per_device.values()) == {whole_bytes // args.tp}, (
        per_device, whole_bytes)
    print(f"split weights and slots: {whole_bytes} bytes whole, "
          f"{whole_bytes // args.tp} per device", flush=True)


rank = strategy.topology.rank if strategy is not None else 0
if strategy is not None:
    with strategy.scope():
        with keras_smp.tensor_parallelism():
            model = build_model()
        if args.partitions > 1:
            model = keras_smp.DistributedModel(model)
        model.compile(**compile_args())
    layout = keras_smp.tensor_parallel_layers(model)
    if args.partitions > 1:
        summary = model.partition_summary()
        print(summary, flush=True)
        assert "Tensor parallel (tp=2" in summary, summary
        assert "ff0a [column], ff0b [row]" in summary, summary
    expected = {"tok_emb": "vocab", "mha0": "heads", "mha1": "heads",
                "ff0a": "column", "ff0b": "row", "ff1a": "column",
                "ff1b": "row", "proj": "gather", "proj2": "gather"}
    assert layout == expected, layout
    # Each rank holds 1/T of the split weights.
    shapes = {w.path: tuple(w.shape) for w in model.weights}
    assert shapes["tok_emb/embeddings"] == (VOCAB // args.tp, WIDTH), shapes
    assert shapes["ff0a/kernel"] == (WIDTH, 4 * WIDTH // args.tp), shapes
    assert shapes["ff0b/kernel"] == (4 * WIDTH // args.tp, WIDTH), shapes
    assert shapes["ff0b/bias"] == (WIDTH,), shapes
    assert shapes["proj/kernel"] == (WIDTH, WIDTH // args.tp), shapes
    assert shapes["proj2/bias"] == (WIDTH // args.tp,), shapes
    if args.local:
        check_local_shards(model)
else:
    model = build_model()
    model.compile(**compile_args())

if args.load:
    model.load_weights(args.load)

# Keras' shuffle seeded differently in each process of a replica (tensor-
# parallel rank t, pipeline rank s: 100 + t + 10 s; the reference and the
# data-parallel replicas alike: 100), as processes left unseeded are: the
# ranks of a tensor-parallel group compute on their rank 0's batch
# (`TensorGroup.from_first`), a pipeline's stages on its first stage's.
# Before, each rank trained on its own order (the losses differed by rank).
seed = 100
if strategy is not None and not args.local:
    seed += strategy.topology.tp_rank + 10 * strategy.topology.pp_rank
keras.utils.set_random_seed(seed)
history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, verbose=0,
                    shuffle=True)
evaluation = model.evaluate(vx, vy, batch_size=BATCH, verbose=0,
                            return_dict=True)
predictions = model.predict(vx, batch_size=BATCH, verbose=0)

path = os.path.join(args.out, "model.weights.h5")
model.save_weights(path)  # every rank takes part; the chief writes
# get_weights gives whole weights too (every rank of the group calls it).
whole = model.get_weights()
out = {}
if rank == 0:
    # A plain Keras model (no strategy, no tensor parallelism) reads it.
    plain = build_model()
    plain.compile(**compile_args())
    plain.optimizer.build(plain.trainable_variables)
    if args.partitions > 1:
        # A sharded checkpoint (a shard per stage), made one plain file.
        whole_file = os.path.join(args.out, "whole.weights.h5")
        keras_smp.assemble_checkpoint(path, whole_file)
        plain.load_weights(whole_file)
    else:
        plain.load_weights(path)
    out = {f"w{i}": w for i, w in enumerate(plain.get_weights())}
    out.update({f"o{i}": v.numpy() for i, v in
                enumerate(plain.optimizer.variables) if len(v.shape)})
    for i, w in enumerate(whole):
        np.testing.assert_array_equal(w, out[f"w{i}"])
if strategy is not None:
    # set_weights takes whole weights and keeps this rank's shard.
    model.set_weights([w * 2 for w in whole])
    for a, b in zip(model.get_weights(), whole):
        np.testing.assert_array_equal(a, b * 2)
    try:
        model.set_weights([w[:1] for w in whole])
        raise SystemExit("set_weights accepted a wrong shape")
    except ValueError as e:
        assert "not compatible" in str(e), e
if args.variant == "vocab_parallel":
    # fit and evaluate never gathered the logits; predict returns them
    # whole (checked against the reference by the test).
    # (Only the last pipeline stage computes the loss.)
    last = args.tp == 0 or keras_smp.pp_rank() == args.partitions - 1
    assert SEEN == ({VOCAB // max(args.tp, 1)} if last else set()), SEEN
out["loss"] = np.array(history.history["loss"], dtype="float64")
out["evaluate"] = np.array([evaluation["loss"],
                            evaluation["sparse_categorical_accuracy"]])
out["predict"] = np.asarray(predictions, dtype="float64")
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **out)
# The last collectives above ran per tensor-parallel group, and task 0
# hosts TensorFlow's coordination service: keras-smp keeps task 0's process
# until the other groups are done (keras_smp.runtime.shutdown), with no
# barrier here.
print(f"rank {rank}: ok", flush=True)
