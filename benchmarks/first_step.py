"""Time to the first step: a pipelined model against plain Keras.

    python benchmarks/first_step.py [--quick] [--layers 12] [--out FILE]

Each row is a fresh process (TensorFlow's import is not timed). It builds
a model of `--layers` blocks (Dense(64) + LayerNormalization, then a
Dense(10) head), compiles it with Adam, and times its first `fit` of one
batch of 64 rows (Python tracing, TensorFlow's graph optimisation, the
first run), then the median of 8 later steps, and reads the process's
peak resident memory. Rows:

- plain Keras, one device;
- a 2-stage 1F1B pipeline in one process (2 logical CPUs), m microbatches,
  each stage's forward traced once and called per microbatch (keras-smp's
  default);
- the same with every microbatch's forward built inline (`inline`: how
  keras-smp built pipelined steps before; `tracing.TRACE_ONCE = False`).

Every process runs with 1 intra-op and 1 inter-op thread. The CPU's name
is printed: figures hold for that CPU only.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64


def worker(mode, m, layers):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    import keras_smp
    from keras_smp.runtime import tracing
    from measure import peak_mb
    from measure import timed_fit

    tracing.TRACE_ONCE = mode != "inline"

    def build():
        keras.utils.set_random_seed(0)
        blocks = [keras.Input((64,))]
        for _ in range(layers):
            blocks += [keras.layers.Dense(64, activation="relu"),
                       keras.layers.LayerNormalization()]
        return keras.Sequential(blocks + [keras.layers.Dense(10)])

    rng = np.random.RandomState(0)
    x = rng.randn(BATCH * 9, 64).astype("float32")
    y = rng.randint(0, 10, BATCH * 9)

    def measure(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        start = time.perf_counter()
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
        first = time.perf_counter() - start
        later = tf.data.Dataset.from_tensor_slices(
            (x[BATCH:], y[BATCH:])).batch(BATCH).repeat()
        step_ms, _ = timed_fit(model, later, steps=8, warmup=0)
        return first, step_ms / 1e3

    if mode == "plain":
        first, step = measure(build())
    else:
        strategy = keras_smp.SMPStrategy(partitions=2, microbatches=m,
                                         pipeline="1f1b")
        with strategy.scope():
            first, step = measure(keras_smp.DistributedModel(build()))
    print(json.dumps({"first_s": first, "step_ms": step * 1e3,
                      "peak_mb": peak_mb()}), flush=True)


def run(mode, m, layers):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", mode,
         str(m), "--layers", str(layers)], env=env, capture_output=True,
        text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} m={m} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "M"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--quick", action="store_true",
                        help="m = 1 and 8 only")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.layers)
        return
    from measure import cpu_model

    counts = (1, 8) if args.quick else (1, 4, 8, 16)
    lines = [f"CPU: {cpu_model()}; 1 intra-op + 1 inter-op thread per "
             f"process; {args.layers} x (Dense(64) + LayerNormalization) + "
             f"Dense(10), batch {BATCH}, Adam; 2 stages (1F1B) on 2 logical "
             "CPUs of one process",
             f"{'run':<28} {'first step':>11} {'vs plain':>9} "
             f"{'later step':>11} {'peak RSS':>9}"]
    plain = run("plain", 1, args.layers)

    def row(label, r):
        lines.append(f"{label:<28} {r['first_s']:>10.2f}s "
                     f"{r['first_s'] / plain['first_s']:>8.2f}x "
                     f"{r['step_ms']:>9.1f}ms {r['peak_mb']:>7.0f}MB")
        print(lines[-1], flush=True)

    print("\n".join(lines), flush=True)
    row("plain Keras", plain)
    for m in counts:
        row(f"pipeline m={m}, traced once", run("once", m, args.layers))
        row(f"pipeline m={m}, inline", run("inline", m, args.layers))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
