"""Trains a small Keras model and dumps its final state (used by tests).

--mode reference: plain Keras on one device, no strategy.
--mode strategy:  the same under keras_smp.SMPStrategy (one process or one of
                  the workers started by `keras-smp launch`).
Writes OUT/rank{R}.npz with weights, history, evaluate and predict results.
"""

import argparse
import functools
import json
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["reference", "strategy"], default="strategy")
p.add_argument("--local-devices", type=int, default=None)
p.add_argument("--global-batch", type=int, default=32)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=256)
p.add_argument("--optimizer", default="sgd")
p.add_argument("--callbacks", action="store_true")
p.add_argument("--fail-at-epoch", type=int, default=None,
               help="rank 1 raises at the start of this epoch")
p.add_argument("--kill-at-epoch", type=int, default=None,
               help="rank 1 SIGKILLs itself in the middle of this epoch")
p.add_argument("--config", default="{}", help="JSON options for SMPStrategy")
p.add_argument("--save-weights", default=None,
               help="model.save_weights(PATH) after training")
p.add_argument("--load-weights", default=None,
               help="model.load_weights(PATH) instead of training")
p.add_argument("--partial", action="store_true",
               help="keep the data's last, partial batch (no drop_remainder)")
p.add_argument("--model",
               choices=["mlp", "tied", "manual", "deep", "tokens", "wide",
                        "nested", "subclassed", "reversible",
                        "reversible_tied", "reversible_frozen",
                        "shared_lookup", "positions", "loops"],
               default="mlp",
               help="manual: the mlp as a subclassed DistributedModel with "
               "partition scopes when pipelined (plain mlp otherwise); "
               "nested: the mlp's layers in a backbone model (called with "
               "training=False) holding a Sequential block; "
               "subclassed: the mlp as a subclassed keras.Model (its own "
               "call, no partition scopes), wrapped when pipelined; "
               "reversible(_tied, _frozen): tokens through a "
               "ReversibleEmbedding called again at the end as the output "
               "projection (its own weight, the embeddings transposed, or "
               "frozen); shared_lookup: one Embedding looked up in both "
               "stages; positions: tokens plus a position embedding "
               "looked up at ops.arange(length) (keras.io's "
               "TokenAndPositionEmbedding); "
               "wide: a 1024 x 1024 kernel (4 MB of gradients: a bucket "
               "the ring all-reduce cuts into pieces on CPU)")
p.add_argument("--no-metrics", action="store_true",
               help="compile with the loss only (steps use no y_pred)")
p.add_argument("--split-fit", action="store_true",
               help="train with two fit() calls (first epoch, then the rest)")
p.add_argument("--seed-by-rank", action="store_true",
               help="each rank initialises the model from its own seed; the "
               "strategy must broadcast rank 0's initial weights")
p.add_argument("--pipelined", action="store_true",
               help="wrap the model in keras_smp.DistributedModel")
p.add_argument("--reduction", default="sum_over_batch_size",
               help="the loss's reduction (mean_with_sample_weight: divided "
               "by the batch's sample weights)")
p.add_argument("--batch-loss", action="store_true",
               help="the loss is a function returning the batch's mean "
               "(one scalar: it reduces over the rows itself)")
p.add_argument("--unweighted", action="store_true",
               help="the data without sample weights")
p.add_argument("--xla", action="store_true",
               help="compile(jit_compile=True) (op determinism off: Keras "
               "refuses XLA with it)")
args = p.parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_DETERMINISTIC_OPS"] = "0" if args.xla else "1"

strategy = None
if args.mode == "strategy":
    import keras_smp

    strategy = keras_smp.SMPStrategy(
        json.loads(args.config), local_devices=args.local_devices)
    from compiled import count as compiled_calls  # counts XLA calls traced

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(args.samples, 8).astype("float32")
w_true = rng.randn(8, 3).astype("float32")
y = np.argmax(x @ w_true + 0.1 * rng.randn(args.samples, 3), axis=1)
sw = rng.uniform(0.5, 1.5, size=args.samples).astype("float32")
if args.model in ("tokens", "reversible", "reversible_tied",
                  "reversible_frozen", "shared_lookup", "positions"):
    # Padded token sequences of uneven lengths, a loss per token (under the
    # embedding's mask for "tokens": replicas hold different numbers of
    # real tokens).
    x = rng.randint(1, 20, size=(args.samples, 8)).astype("int32")
    for i, n in enumerate(rng.randint(1, 9, size=args.samples)):
        x[i, n:] = 0
    y = x % 3
    # Per-token sample weights (Keras multiplies them by the mask).
    sw = rng.uniform(0.5, 1.5, size=x.shape).astype("float32")
ds = tf.data.Dataset.from_tensor_slices(
    (x, y) if args.unweighted else (x, y, sw)).batch(
        args.global_batch, drop_remainder=not args.partial)


if args.pipelined:
    class Manual(keras_smp.DistributedModel):
        """The mlp, placed by hand (needs auto_partition=False)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1 = keras.layers.Dense(32, activation="tanh")
            self.d2 = keras.layers.Dense(16, activation="relu")
            self.d3 = keras.layers.Dense(3)

        def call(self, x):
            with keras_smp.partition(0):
                h = self.d1(x)
            with keras_smp.partition(1):
                return self.d3(self.d2(h))


class TokenAndPosition(keras.layers.Layer):
    """keras.io's TokenAndPositionEmbedding: token ids looked up, plus a
    position embedding looked up at `ops.arange(length)` (ids that neither
    come from the data nor grow with the batch: one device's gradient
    holds each position once, its rows summed over the batch); also a
    table looked up at `arange(length) // 2` (each id twice, still the
    same ids for any batch) and one at the positions broadcast over the
    batch (a row per sample and position, as token ids give)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(20, 8, mask_zero=True)
        self.positions = keras.layers.Embedding(8, 8)
        self.pairs = keras.layers.Embedding(4, 8)
        self.slots = keras.layers.Embedding(8, 8)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1])
        slots = keras.ops.broadcast_to(positions[None, :], keras.ops.shape(x))
        return (self.tokens(x) + self.positions(positions)
                + self.pairs(positions // 2) + self.slots(slots))

    def compute_mask(self, x, mask=None):
        return keras.ops.not_equal(x, 0)


class MinimalCell(keras.layers.Layer):
    """Keras' guide's minimal RNN cell: weights, no state of its own (no
    seed generator, unlike LSTM's and GRU's cells)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = self.state_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units),
                                      name="kernel")
        self.recurrent = self.add_weight(shape=(self.units, self.units),
                                         name="recurrent")

    def call(self, inputs, states):
        h = keras.ops.tanh(keras.ops.matmul(inputs, self.kernel)
                           + keras.ops.matmul(states[0], self.recurrent))
        return h, [h]


def build():
    keras.utils.set_random_seed(
        1234 + (strategy.topology.rank if args.seed_by_rank else 0))
    split = None
    if args.model == "tied":
        # One Dense layer applied at both ends: with 2 stages its weights
        # are used (tied) by both.
        tied = keras.layers.Dense(8, activation="tanh", name="tied")
        inputs = keras.Input((8,))
        h = keras.layers.Dense(32, activation="tanh", name="d1")(tied(inputs))
        h = tied(keras.layers.Dense(8, activation="tanh", name="d2")(h))
        model = keras.Model(inputs, keras.layers.Dense(3, name="out")(h))
        # 2 stages: split before d2; with virtual stages (4 model stages)
        # the automatic plan puts the tied layer's two calls in stages 0
        # and 3 (rank 0 for zb_v, ranks 0 and 1 for interleaved_1f1b).
        virtual = json.loads(args.config).get("pipeline") in (
            "interleaved_1f1b", "zb_v")
        split = None if virtual else ["d2"]
    elif args.model.startswith("reversible"):
        # Keras' ReversibleEmbedding (as keras_hub's): a lookup in the first
        # stage, the projection to the vocabulary in the last. Untied, each
        # call reads one of its two weights; tied, both read the
        # embeddings (a sparse gradient part and a dense one); frozen
        # (untied), its weights are state, not trained.
        emb = keras.layers.ReversibleEmbedding(
            20, 8, tie_weights=args.model == "reversible_tied", name="emb")
        if args.model == "reversible_frozen":
            emb.trainable = False
        inputs = keras.Input((8,), dtype="int32")
        h = keras.layers.Dense(16, activation="tanh", name="d1")(emb(inputs))
        h = keras.layers.Dense(8, activation="tanh", name="d2")(h)
        model = keras.Model(inputs, emb(h, reverse=True))
        split = ["d2"]
    elif args.model == "shared_lookup":
        # As an encoder-decoder's shared token embedding: one Embedding
        # looked up in both stages (two sparse gradient parts).
        emb = keras.layers.Embedding(20, 8, name="emb")
        inputs = keras.Input((8,), dtype="int32")
        h = keras.layers.Dense(16, activation="tanh", name="d1")(emb(inputs))
        h = keras.layers.Dense(8, activation="tanh", name="d2")(h)
        # The second lookup takes 5 of the 8 tokens: each stage has its
        # own number of rows to gather.
        first = emb(keras.ops.slice(inputs, (0, 0), (-1, 5)))
        h = keras.layers.Add(name="add")(
            [h, keras.ops.mean(first, axis=1, keepdims=True)])
        model = keras.Model(inputs, keras.layers.Dense(20, name="out")(h))
        split = ["d2"]
    elif args.model == "loops":
        # While loops: with 3 stages, an LSTM in the first, an unrolled GRU
        # (no loop) in the second, an RNN of a cell without state of its
        # own in the third.
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Reshape((4, 2)),
            keras.layers.LSTM(8, return_sequences=True, name="d1"),
            keras.layers.GRU(8, unroll=True, return_sequences=True,
                             name="d2"),
            keras.layers.RNN(MinimalCell(8), name="d3"),
            keras.layers.Dense(3),
        ])
        split = ["d2", "d3"]
    elif args.model == "tokens":
        model = keras.Sequential([
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ])
    elif args.model == "positions":
        model = keras.Sequential([
            keras.Input((8,), dtype="int32"),
            TokenAndPosition(name="tok_pos"),
            keras.layers.Dense(16, activation="tanh", name="d1"),
            keras.layers.Dense(3, name="out"),
        ])
    elif args.model == "wide":
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(1024, activation="tanh"),
            keras.layers.Dense(1024, activation="tanh"),
            keras.layers.Dense(3),
        ])
    elif args.model == "nested":
        block = keras.Sequential([
            keras.Input((32,)),
            keras.layers.Dense(16, activation="relu", name="d2"),
        ], name="block")
        b_in = keras.Input((8,))
        backbone = keras.Model(b_in, block(keras.layers.Dense(
            32, activation="tanh", name="d1")(b_in)), name="backbone")
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(3, name="out")(
            backbone(inputs, training=False)))
    elif args.model == "subclassed":
        # The mlp's layers, made in the same order (the same initial
        # weights), called by the model's own `call`; unbuilt: traced when
        # the first step builds it.
        class Subclassed(keras.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.d1 = keras.layers.Dense(32, activation="tanh",
                                             name="d1")
                self.d2 = keras.layers.Dense(16, activation="relu",
                                             name="d2")
                self.head = keras.layers.Dense(3, name="head")

            def call(self, inputs, training=None):
                return self.head(self.d2(self.d1(inputs)))

        model = Subclassed()
    elif args.model == "deep":
        model = keras.Sequential([keras.Input((8,))] + [
            keras.layers.Dense(n, activation="tanh") for n in (32, 32, 16, 16)
        ] + [keras.layers.Dense(3)])
    else:
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ])
    if args.pipelined and args.model == "manual":
        initial = model.get_weights()  # the seeded mlp's
        model = Manual()
        model.build((None, 8))
        model.set_weights(initial)
    elif args.pipelined:
        model = keras_smp.DistributedModel(model, split_points=split)
    if args.optimizer == "sgd":
        opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    elif args.optimizer == "adam_clipnorm":  # each gradient's norm at most 1
        opt = keras.optimizers.Adam(learning_rate=1e-2, clipnorm=1.0)
    elif args.optimizer == "adam_loss_scale":  # as mixed precision's
        opt = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(learning_rate=1e-2))
    else:
        opt = keras.optimizers.Adam(learning_rate=1e-2)
    model.compile(
        optimizer=opt, jit_compile=args.xla,
        loss=batch_loss if args.batch_loss else
        keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=args.reduction),
        metrics=[] if args.no_metrics else ["sparse_categorical_accuracy"])
    return model


def batch_loss(y_true, y_pred):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True))


if strategy is not None:
    with strategy.scope():
        model = build()
    rank = strategy.topology.rank
else:
    model = build()
    rank = 0
# Under `keras-smp launch --max-restarts`: which run of the job this is.
restart_count = int(os.environ.get("SMP_RESTART_COUNT", "0"))
if args.kill_at_epoch is not None:
    print(f"rank {rank}: run {restart_count}", flush=True)

callbacks = []
if args.callbacks:
    d = os.path.join(args.out, "files")
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(d, "ckpt.keras")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(d, "best.weights.h5"), save_weights_only=True,
            monitor="loss", save_best_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(d, "backup")),
        keras.callbacks.EarlyStopping(monitor="loss", patience=50),
        keras.callbacks.TensorBoard(os.path.join(d, "tb")),
        # Appending (resuming after a failure adds the later epochs).
        keras.callbacks.CSVLogger(os.path.join(d, "log.csv"), append=True),
    ]
if args.fail_at_epoch is not None:
    class Fail(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == args.fail_at_epoch and rank == 1:
                raise RuntimeError(f"worker {rank} fails on purpose")
    callbacks.append(Fail())

if args.kill_at_epoch is not None:
    import signal

    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            # Only in the job's first run (a restart resumes and finishes).
            if (self.epoch == args.kill_at_epoch and batch == 2 and rank == 1
                    and restart_count == 0):
                print(f"rank {rank}: SIGKILL in epoch {self.epoch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    callbacks.append(Kill())

if args.load_weights:
    model.load_weights(args.load_weights)
    history = keras.callbacks.History()
    history.history = {"loss": []}
elif args.split_fit:
    first = model.fit(ds, epochs=1, verbose=2, callbacks=callbacks)
    history = model.fit(ds, epochs=args.epochs, initial_epoch=1, verbose=2,
                        callbacks=callbacks)
    history.history["loss"] = first.history["loss"] + history.history["loss"]
else:
    history = model.fit(ds, epochs=args.epochs, verbose=2,
                        callbacks=callbacks)
if args.callbacks:
    board = next(c for c in callbacks
                 if isinstance(c, keras.callbacks.TensorBoard))
    print(f"rank {rank}: tensorboard log_dir {board.log_dir}", flush=True)
    if not args.pipelined:
        # Keras' saving functions, each rank naming its own file: only the
        # chief's is written (every rank wrote the same file at once).
        for fn, suffix in ((keras.saving.save_model, "saving.keras"),
                           (keras.models.save_model, "models.keras"),
                           (keras.saving.save_weights, "saving.weights.h5"),
                           # Keras' own keyword (not model.save_weights'):
                           # Keras' function itself, on the chief only.
                           (functools.partial(keras.saving.save_weights,
                                              objects_to_skip=[model.layers[0]]),
                            "skip.weights.h5")):
            fn(model, os.path.join(d, f"rank{rank}_{suffix}"))
if args.save_weights:
    model.save_weights(args.save_weights)
eval_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
    args.global_batch, drop_remainder=not args.partial)
evaluation = model.evaluate(eval_ds, verbose=0)
predictions = model.predict(eval_ds, verbose=0)

result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
result["loss"] = np.array(history.history["loss"])
result["evaluate"] = np.array(evaluation)
result["predict"] = predictions
# Elements this process holds in memory (model weights and optimizer
# variables) vs the whole model's: one stage per process keeps only its own.
held = [v for v in model.weights + model.optimizer.variables]
result["held_elements"] = np.array(
    sum(int(np.prod(v.value.shape)) for v in held))
result["full_elements"] = np.array(sum(int(np.prod(v.shape)) for v in held))
if strategy is not None:
    result["replicas"] = np.array(strategy.num_replicas_in_sync)
    result["buckets_traced"] = np.array(strategy.gradient_sync.buckets_traced)
    result["pieces_traced"] = np.array(strategy.gradient_sync.pieces_traced)
    result["algorithm"] = np.array(strategy.allreduce_algorithm)
    result["compiled_calls"] = np.array(compiled_calls[0])
    result["jit_compile"] = np.array(bool(model.jit_compile))
if args.pipelined:
    graph = model.staged_graph
    result["expanded"] = np.array(graph.expanded, dtype=str)
    result["summary"] = np.array(model.partition_summary())
    inner = getattr(model, "inner_model", None)
    if inner is not None:  # the wrapped model's layers, by name
        result["get_layer"] = np.array(
            [model.get_layer(layer.name) is layer for layer in inner.layers])
        # Its one layer (what `summary()` lists) is the wrapped model (a
        # Sequential's graph, a second model, was listed too).
        result["layers"] = np.array([layer.name for layer in model.layers]
                                    + ["|" + inner.name])
    result["stage_layers"] = np.array(
        [" ".join(graph.names[id(n)] for n in graph.stage_nodes(s))
         for s in range(graph.num_stages)], dtype=str)
os.makedirs(args.out, exist_ok=True)
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **result)
print(f"rank {rank} done", flush=True)
sys.exit(0)
