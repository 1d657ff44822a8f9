"""Peak resident memory per process: one stage per process, P = 1, 2, 4.

A model whose training state dominates: 8 x Dense(4096) (512 MB of float32
weights), Adam (2 slots per weight: 1 GB), batch 32, one `fit` epoch of 2
steps. Measured side by side in one run, each in fresh processes:

- tiny: the same 8 layers 16 wide, plain Keras, 1 process: what TensorFlow,
  Keras and the data cost before any model state (the baseline);
- plain: the whole model, plain Keras, 1 process;
- P stages: `keras_smp.DistributedModel`, partitions=P, one stage per
  worker process (`keras-smp launch -n P`), microbatches 2.

Memory is each process's measured peak resident set (VmHWM of
/proc/self/status, read by the process itself at the end: peak over its
whole life, model building, compile, fit and the checkpoint included), not
a number computed from shapes. The "state" column is peak minus the tiny
baseline; the target (issue 17) is state per process <= 1.15 x plain's
state / P.

    python benchmarks/memory_scaling.py            # ~4 minutes on 2 cores
    python benchmarks/memory_scaling.py --stages 2 --width 2048

With `--checkpoint`, every run also writes a checkpoint at the end
(`model.save_weights`: sharded per stage with one stage per process) and
the peak includes it.

With `--custom-loop`, the same model trains in SMP custom loops instead of
`fit` (same steps and batch): plain = a `tf.GradientTape` loop in 1
process; P stages = `smp.init(local_devices=1)` and `@smp.step`, one stage
per process; "P, 1 proc" = `smp.init`'s default layout (each process a
whole replica, its P stages on logical devices), in one process; "P, kept"
= P stages with `@smp.step(sum_gradients=False)`, every microbatch's
gradients returned by the step (what keras-smp did before it summed them
inside the step):

    python benchmarks/memory_scaling.py --custom-loop --stages 2 4

With `--nested`, the first 7 layers form a nested `keras.Sequential`
("backbone") under the last ("head"), the shape of a fine-tuned backbone;
each P also runs with the backbone placed whole on stage 0 (`split_points=
["head"]`: what automatic partitioning did before it placed nested models'
layers one by one), to show what splitting the backbone saves:

    python benchmarks/memory_scaling.py --nested --stages 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_model  # noqa: E402
from measure import peak_mb  # noqa: E402
LAYERS, BATCH, STEPS = 8, 32, 2


def worker(args):
    if args.custom_loop:
        return custom_loop_worker(args)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = None
    if args.mode == "stages":
        import keras_smp

        strategy = keras_smp.SMPStrategy(
            partitions=args.stages, microbatches=args.microbatches,
            collective_timeout_seconds=600)
    import keras
    import numpy as np

    width = 16 if args.tiny else args.width
    layers = LAYERS
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(BATCH * STEPS, width).astype("float32")
    y = np.random.RandomState(1).randn(BATCH * STEPS, width).astype("float32")

    def build():
        dense = [keras.layers.Dense(
            width, activation="relu",
            name="head" if args.nested and i == layers - 1 else None)
            for i in range(layers)]
        if args.nested:
            dense = [keras.Sequential([keras.Input((width,))] + dense[:-1],
                                      name="backbone"), dense[-1]]
        model = keras.Sequential([keras.Input((width,))] + dense)
        if strategy is not None:
            model = keras_smp.DistributedModel(
                model, split_points=["head"] if args.whole else None)
        model.compile(optimizer="adam", loss="mse")
        return model

    if strategy is not None:
        with strategy.scope():
            model = build()
    else:
        model = build()
    built = peak_mb()
    callbacks = []
    if os.environ.get("MEMORY_PHASES"):
        class Steps(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                print("begin", batch, peak_mb(), flush=True)

            def on_train_batch_end(self, batch, logs=None):
                print("end", batch, peak_mb(), flush=True)

        callbacks.append(Steps())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=callbacks)
    trained = peak_mb()
    if args.checkpoint:
        model.save_weights(os.path.join(args.checkpoint, "ckpt.weights.h5"))
    rank = strategy.topology.rank if strategy is not None else 0
    print("RESULT " + json.dumps({"rank": rank, "peak_mb": peak_mb(),
                                  "built_mb": built, "trained_mb": trained}),
          flush=True)


def custom_loop_worker(args):
    """The same model and steps in an SMP custom loop (`@smp.step`,
    `optimizer.get_gradients`, `accumulate`, `apply_gradients`), or, for
    `--mode plain`, a plain Keras custom loop (`tf.GradientTape`)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    smp = None
    if args.mode in ("stages", "replicas"):
        import keras_smp as smp

        smp.init({"partitions": args.stages,
                  "microbatches": args.microbatches,
                  "collective_timeout_seconds": 600,
                  # one stage per process; "replicas": whole replicas,
                  # the stages on logical devices of each process
                  **({"local_devices": 1} if args.mode == "stages" else {})})
    import keras
    import numpy as np

    width = 16 if args.tiny else args.width
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(BATCH * STEPS, width).astype("float32")
    y = np.random.RandomState(1).randn(BATCH * STEPS, width).astype("float32")
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu")
           for _ in range(LAYERS)])
    if smp is not None:
        model = smp.DistributedModel(model)
    opt = keras.optimizers.Adam()
    mse = keras.losses.MeanSquaredError()
    built = peak_mb()

    if smp is None:
        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
    else:
        @smp.step(sum_gradients=not args.keep)
        def get_grads(xb, yb):
            loss = mse(yb, model(xb, training=True))
            return opt.get_gradients(loss, model.trainable_variables), loss

        @tf.function
        def train_step(xb, yb):
            grads, loss = get_grads(xb, yb)
            grads = [g.accumulate() for g in grads]
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss.reduce_mean()

    for i in range(STEPS):
        train_step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    trained = peak_mb()
    rank = smp.rank() if smp is not None else 0
    print("RESULT " + json.dumps({"rank": rank, "peak_mb": peak_mb(),
                                  "built_mb": built, "trained_mb": trained}),
          flush=True)


def run(cmd, timeout=1200):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TF_CONFIG", "SMP_CONFIG"):
        env.pop(k, None)
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or not results:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    if os.environ.get("MEMORY_PHASES"):
        print(results)
    return [r["peak_mb"] for r in sorted(results, key=lambda r: r["rank"])]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stages", type=int, nargs="*", default=[2, 4])
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--checkpoint", nargs="?", const="", default=None,
                   help="also save a checkpoint at the end of each run")
    p.add_argument("--nested", action="store_true",
                   help="7 of the layers in a nested backbone model; also "
                   "run each P with the backbone whole on stage 0")
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--custom-loop", action="store_true",
                   help="SMP custom loops (smp.init, @smp.step) instead of "
                   "fit: one stage per process (local_devices=1) beside "
                   "whole replicas per process (the default layout)")
    args = p.parse_args()
    if args.worker:
        if args.mode in ("stages", "replicas"):
            args.stages = args.stages[0]
        return worker(args)

    weights_mb = LAYERS * (args.width * args.width + args.width) * 4 / 2**20
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; every process 1 "
          "intra-op and 1 inter-op thread")
    print(f"model: {LAYERS} x Dense({args.width}), {weights_mb:.0f} MB of "
          f"float32 weights, Adam, batch {BATCH}, {STEPS} steps"
          + (", checkpoint saved at the end" if args.checkpoint is not None
             else ""))
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--width", str(args.width), "--microbatches", str(args.microbatches)]
    if args.custom_loop:
        me.append("--custom-loop")
        print("custom loops: plain = tf.GradientTape; P stages = smp.init("
              "local_devices=1), @smp.step; 'P, 1 proc' = smp.init's default "
              "layout (every process a whole replica, its P stages on "
              "logical devices), in 1 process; 'P, kept' = P stages, "
              "@smp.step(sum_gradients=False): every microbatch's "
              f"gradients kept; microbatches {args.microbatches}")
    if args.nested:
        me.append("--nested")
        print("layers 1-7 in a nested Sequential (backbone), layer 8 the "
              "head")

    def flags(tmp):
        return [] if args.checkpoint is None else ["--checkpoint", tmp]

    with tempfile.TemporaryDirectory() as tmp:
        tiny = run(me + ["--mode", "plain", "--tiny"] + flags(tmp))[0]
        plain = run(me + ["--mode", "plain"] + flags(tmp))[0]
        state = plain - tiny
        print(f"{'run':>9} {'baseline':>9} {'peak per process (MB)':>27} "
              f"{'state':>6} {'vs plain':>9} {'target':>7}")
        print(f"{'plain':>9} {tiny:>9.0f} {plain:>27.0f} {state:>6.0f} "
              f"{1.0:>8.2f}x")
        for P in args.stages:
            def stages(*extra, n=P):
                return run([sys.executable, "-m", "keras_smp.launch", "-n",
                            str(n), "--timeout", "1100", "--"] + me
                           + ["--mode", "stages", "--stages", str(P)]
                           + list(extra) + flags(tmp))

            # The same job with a tiny model: TensorFlow, Keras and
            # keras-smp's runtime (server, collectives) without model state.
            base = max(stages("--tiny"))
            for label, extra, n in ([(f"{P} stages", (), P)] + (
                    [(f"{P}, whole", ("--whole",), P)]
                    if args.nested and P == 2 else []) + (
                    # (one process: P of them would all-reduce the whole
                    # model's gradients over gRPC every step)
                    [(f"{P}, 1 proc", ("--mode", "replicas"), 1),
                     (f"{P}, kept", ("--keep",), P)]
                    if args.custom_loop else [])):
                peaks = stages(*extra, n=n)
                worst = max(peaks) - base
                print(f"{label:>9} {base:>9.0f} "
                      f"{' / '.join(f'{v:.0f}' for v in peaks):>27} "
                      f"{worst:>6.0f} {worst / state:>8.2f}x "
                      f"{1.15 / P:>6.2f}x", flush=True)

if __name__ == "__main__":
    main()
