"""Trains a model whose training state dominates, each stage process under a
memory limit (issue 17: a model too big for one process).

    --out DIR          results: reference.npz (whole model) or
                       stage{S}.npz (the weights stage S owns, by their
                       index in `model.weights`), and peak memory
    --mode reference   plain Keras, one process, no limit
    --mode stages      `DistributedModel`, one stage per process
                       (`keras-smp launch -n P`)
    --mode custom_loop an SMP custom loop (`smp.init` with local_devices=1,
                       `@smp.step`), one stage per process, the same
                       steps as `fit`'s; writes what `stages` writes
    --mode tensor      tensor parallelism, `--stages` processes splitting
                       every layer (consecutive Dense layers pair: columns,
                       then rows); writes tensor{R}.npz, this rank's
                       shard of each weight, and the axis it is cut on
    --cgroup DIR       a memory cgroup directory (v1 or v2) made by the
                       test: this process makes DIR/rank{R} with
                       --limit-mb and moves itself into it before
                       TensorFlow starts, so exceeding it kills it
    --limit-mb N       the limit
    --outside-scope    build the Keras model before entering the
                       strategy's scope (wrap it inside)
    --seed-by-rank     seed each process differently (initial values must
                       come from each stage's first replica)
    --checkpoint       stages: `ModelCheckpoint(OUT/ckpt.weights.h5,
                       save_weights_only=True)` every epoch (sharded: no
                       process gathers the whole model)
    --keras-file       stages: also `model.save(OUT/model.keras)` at the end
                       (streamed from the stages, under the limit)
    --mode load --load PATH
                       plain Keras, one process: builds the model, its
                       optimizer, loads PATH (a sharded checkpoint's
                       .weights.json), writes loaded.npz; a PATH ending in
                       .keras is loaded whole (`keras.models.load_model`)

Data and initial weights are seeded; Adam, 2 epochs of 2 steps.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=("reference", "stages", "load",
                                       "tensor", "custom_loop"),
                    required=True)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--load", default=None)
parser.add_argument("--keras-file", action="store_true")
parser.add_argument("--stages", type=int, default=4)
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--cgroup", default=None)
parser.add_argument("--limit-mb", type=int, default=0)
parser.add_argument("--outside-scope", action="store_true")
parser.add_argument("--seed-by-rank", action="store_true")
args = parser.parse_args()

BATCH, STEPS = 32, 2


def join_cgroup(root, name, limit_mb):
    """Moves this process into a new memory cgroup ROOT/NAME of LIMIT_MB."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    limit = str(limit_mb * 2**20)
    if os.path.exists(os.path.join(path, "memory.max")):  # cgroup v2
        files = [("memory.max", limit), ("memory.swap.max", "0")]
    else:  # cgroup v1: memory and memory+swap (no escape into swap)
        files = [("memory.limit_in_bytes", limit),
                 ("memory.memsw.limit_in_bytes", limit)]
    for name, value in files:
        target = os.path.join(path, name)
        if os.path.exists(target):
            with open(target, "w") as f:
                f.write(value)
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _cgroup_read(*names):
    """The first of this process's cgroup files `names` that exists, as an
    integer, or None."""
    path = os.path.join(args.cgroup, f"rank{rank}")
    for name in names:
        try:
            with open(os.path.join(path, name)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def cgroup_report():
    """What the kernel recorded for this process's cgroup: the limit in
    force (MiB) and the peak it charged (what the limit bounds: anonymous
    memory and the page cache this process touched first; shared library
    pages another process mapped first are not in it; None where the
    kernel keeps no peak: cgroup v2 before Linux 5.19)."""
    if not args.cgroup:
        return {}
    limit = _cgroup_read("memory.max", "memory.limit_in_bytes")
    peak = _cgroup_read("memory.peak", "memory.max_usage_in_bytes")
    return {"cgroup_limit_mb": None if limit is None else limit / 2**20,
            "cgroup_peak_mb": None if peak is None else peak / 2**20}


def peak_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


rank = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))[
    "task"]["index"]
if args.cgroup:
    join_cgroup(args.cgroup, f"rank{rank}", args.limit_mb)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
strategy = None
if args.mode == "stages":
    import keras_smp  # noqa: E402

    strategy = keras_smp.SMPStrategy(partitions=args.stages, microbatches=2,
                                     collective_timeout_seconds=300)
elif args.mode == "tensor":
    import keras_smp  # noqa: E402

    strategy = keras_smp.SMPStrategy(tensor_parallel_degree=args.stages,
                                     collective_timeout_seconds=300)
elif args.mode == "custom_loop":
    import keras_smp as smp  # noqa: E402

    smp.init({"partitions": args.stages, "microbatches": 2,
              "local_devices": 1, "collective_timeout_seconds": 300})
    strategy = tf.distribute.get_strategy()  # smp.init's SMPStrategy
import keras  # noqa: E402

keras.utils.set_random_seed(rank if args.seed_by_rank else 0)
x = np.random.RandomState(0).randn(BATCH * STEPS, args.width).astype("float32")
y = np.random.RandomState(1).randn(BATCH * STEPS, args.width).astype("float32")
x *= 0.1


def build():
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="tanh",
                              kernel_initializer=keras.initializers.
                              GlorotUniform(
                                  seed=None if args.seed_by_rank else i))
           for i in range(args.layers)])
    return model


def wrap(model):
    if strategy is not None and args.mode in ("stages", "custom_loop"):
        model = keras_smp.DistributedModel(model) if args.mode == "stages" \
            else smp.DistributedModel(model)
    # Adam's memory (two slots per weight) with epsilon=1: its update is
    # then smooth in the gradient, so float32 rounding differences of the
    # gradient (microbatch sums) stay rounding-sized in the weights. With a
    # tiny epsilon a gradient element that cancels to ~0 gets an update of
    # +-learning_rate whose sign rounding decides.
    optimizer = keras.optimizers.Adam(20.0, epsilon=1.0)
    if args.mode == "custom_loop":
        optimizers.append(optimizer)  # applied by `custom_loop`
    else:
        model.compile(optimizer=optimizer, loss="mse")
    return model


optimizers = []


def custom_loop(model):
    """`fit`'s epochs and steps as an SMP custom loop; returns the epoch
    losses (means of their steps', as `fit`'s history)."""
    opt, mse = optimizers[0], keras.losses.MeanSquaredError()

    @smp.step
    def get_grads(xb, yb):
        loss = mse(yb, model(xb, training=True))
        return opt.get_gradients(loss, model.trainable_variables), loss

    @tf.function
    def train_step(xb, yb):
        grads, loss = get_grads(xb, yb)
        opt.apply_gradients(zip([g.accumulate() for g in grads],
                                model.trainable_variables))
        return loss.reduce_mean()

    losses = []
    for _ in range(2):
        steps = [float(train_step(x[i:i + BATCH], y[i:i + BATCH]))
                 for i in range(0, len(x), BATCH)]
        losses.append(float(np.mean(steps)))
    return losses


if args.mode == "load":
    if args.load.endswith(".keras"):
        import keras_smp  # noqa: E402

        keras_smp.DistributedModel  # registered for loading
        model = keras.models.load_model(args.load)
    else:
        model = wrap(build())
        model.optimizer.build(model.trainable_variables)
        model.load_weights(args.load)
    np.savez(os.path.join(args.out, "loaded.npz"),
             **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)},
             iterations=model.optimizer.iterations.numpy())
    raise SystemExit(0)
if strategy is None:
    model = wrap(build())
    initial = [w.numpy() for w in model.weights]
elif args.outside_scope:
    model = build()
    with strategy.scope():
        model = wrap(model)
elif args.mode == "tensor":
    with strategy.scope():
        with keras_smp.tensor_parallelism():
            model = build()
        model = wrap(model)
else:
    with strategy.scope():
        model = wrap(build())
callbacks = []
if args.checkpoint:
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(args.out, "ckpt.weights.h5"), save_weights_only=True))
if args.mode == "custom_loop":
    losses = custom_loop(model)
else:
    losses = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                       shuffle=False, callbacks=callbacks).history["loss"]
os.makedirs(args.out, exist_ok=True)
if args.keras_file:
    model.save(os.path.join(args.out, "model.keras"))
result = {"peak_mb": peak_mb(), "loss": losses, **cgroup_report()}
if strategy is None:
    np.savez(os.path.join(args.out, "reference.npz"),
             **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)})
    result["max_change"] = max(float(np.max(np.abs(w.numpy() - w0)))
                               for w, w0 in zip(model.weights, initial))
    name = "reference"
elif args.mode == "tensor":
    # This rank's shards only (gathering whole weights here would break
    # the limit), with the axis each is cut on (-1: whole).
    tp_rank = strategy.topology.tp_rank
    arrays = {f"w{i}": w.numpy() for i, w in enumerate(model.weights)}
    arrays.update({f"axis{i}": np.array(
        -1 if getattr(w, "_smp_tp_axis", None) is None else w._smp_tp_axis)
        for i, w in enumerate(model.weights)})
    np.savez(os.path.join(args.out, f"tensor{tp_rank}.npz"), **arrays)
    result["state_mb"] = sum(
        w.numpy().nbytes for w in model.weights + model.optimizer.variables
    ) / 2**20
    name = f"tensor{tp_rank}"
else:
    # This stage's own weights only: gathering the whole model here would
    # break the limit (that is what sharded checkpoints are for).
    stage = strategy.topology.pp_rank
    graph = model.staged_graph
    home = graph.home_stage()
    owned = {id(w) for w in graph.stage_weights(stage)
             if home[id(w)] == stage}
    np.savez(os.path.join(args.out,
                          f"stage{stage}_dp{strategy.topology.dp_rank}.npz"),
             **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)
                if id(w) in owned})
    name = f"stage{stage}_dp{strategy.topology.dp_rank}"
with open(os.path.join(args.out, f"{name}.json"), "w") as f:
    json.dump(result, f)
