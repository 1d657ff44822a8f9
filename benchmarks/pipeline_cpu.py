"""Pipeline speed on CPU: 2 stages in 2 serial worker processes vs 1.

An 8-layer, 1024-wide ReLU MLP, global batch 1024, SGD. Every process is a
"serial device": 1 intra-op and 1 inter-op thread (logical CPUs of one
process share a thread pool and would not measure pipelining, see
tf-keras-facts.md). Measured side by side in one run:

- baseline: the whole model, plain Keras, in 1 serial process;
- pipelined: `keras_smp.DistributedModel`, partitions=2, one stage per
  serial process (`keras-smp launch -n 2`), microbatches 1, 2, 4, 8, 16,
  schedules gpipe and 1f1b;
- data parallel: the plain model under `SMPStrategy()` in 2 serial
  processes, the same global batch.

With `--xla` every run (the baseline too) compiles with
`jit_compile=True`: plain Keras compiles its whole step, keras-smp each
stage's forward and backward (or, data parallel, the model's call).

Prints the median ms/step, the speedup over the baseline beside the ideal
m*p/(m+p-1) and beside the bound of this CPU (the same pipelined step run
serially in 1 process, ideally overlapped: small microbatches make slower
matmuls), and the peak activation memory per stage of each schedule (the
schedule's peak in-flight microbatches x one microbatch's stored activations
of that stage). Target: >= 1.6x at m = 8 (ideal 1.78x). Results of the last
run on the CI machine: benchmarks/results_pipeline_cpu.txt.

    python benchmarks/pipeline_cpu.py            # ~12 minutes on 2 cores
    python benchmarks/pipeline_cpu.py --quick    # m = 1, 8 only

With `--compare-tree DIR` (another checkout of keras-smp, e.g. `git worktree
add /tmp/before HEAD~3`) every pipelined configuration also runs with DIR's
code, right after this tree's, and the table shows both and their ratio:
a refactor's cost measured in the same run, on the same machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, LAYERS, BATCH, STAGES = 1024, 8, 1024, 2


def worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = None
    if args.mode == "dp":
        import keras_smp

        strategy = keras_smp.SMPStrategy(collective_timeout_seconds=300)
    if args.mode in ("pipeline", "serial"):
        import keras_smp

        # "serial": the same pipelined step (same microbatches, gradient
        # accumulation, one optimizer update) with both stages in this one
        # serial process: the work a pipeline has to overlap.
        strategy = keras_smp.SMPStrategy(
            partitions=STAGES, microbatches=args.microbatches,
            pipeline=args.schedule, collective_timeout_seconds=300,
            local_devices=STAGES if args.mode == "serial" else None)
    import keras
    import numpy as np

    x = np.random.RandomState(0).randn(BATCH * 4, WIDTH).astype("float32")
    y = np.random.RandomState(1).randn(BATCH * 4, WIDTH).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        BATCH, drop_remainder=True).repeat()

    def build():
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="relu")
               for _ in range(LAYERS)])
        if args.mode in ("pipeline", "serial"):
            model = keras_smp.DistributedModel(model)
        model.compile(optimizer="sgd", loss="mse", jit_compile=args.xla)
        return model

    if strategy is not None:
        with strategy.scope():
            model = build()
    else:
        model = build()
    model.fit(ds, steps_per_epoch=args.warmup, epochs=1, verbose=0)

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.last = [], None

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    timer = StepTimes()
    model.fit(ds, steps_per_epoch=args.steps + 1, epochs=1, verbose=0,
              callbacks=[timer])
    # Median step time: robust to a noisy neighbour on a shared host.
    ms = float(np.median(timer.times)) * 1000
    if strategy is None or strategy.is_chief:
        print("RESULT " + json.dumps({"ms_per_step": ms}), flush=True)


def run(cmd, timeout=900, root=ROOT):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True,
                         text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])["ms_per_step"]
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n"
                       f"{out.stderr[-3000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="single")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--xla", action="store_true",
                   help="compile(jit_compile=True) in every run, baseline "
                   "included")
    p.add_argument("--compare-tree", default=None,
                   help="another keras-smp checkout to time side by side")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, ROOT)
    from keras_smp.pipeline.schedule import get_schedule

    import platform

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f
                       if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"CPU: {cpu}; {os.cpu_count()} cores; every process 1 intra-op "
          "and 1 inter-op thread")
    print(f"XLA: {'on (jit_compile=True) in every run' if args.xla else 'off'}")
    xla = ["--xla"] if args.xla else []
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--steps", str(args.steps), "--warmup", str(args.warmup)] + xla
    other = None
    if args.compare_tree:
        other_root = os.path.abspath(args.compare_tree)
        other = [sys.executable,
                 os.path.join(other_root, "benchmarks", "pipeline_cpu.py"),
                 "--worker", "--steps", str(args.steps), "--warmup",
                 str(args.warmup)] + xla
    base = run(me + ["--mode", "single"])
    print(f"baseline: whole model, batch {BATCH}, 1 serial process: "
          f"{base:.0f} ms/step")
    ms_list = (1, 8) if args.quick else (1, 2, 4, 8, 16)
    # Small matmuls are less efficient than big ones: the pipelined step's
    # own work, run serially in 1 process, bounds what overlap can reach.
    serial = {m: run(me + ["--mode", "serial", "--microbatches", str(m)])
              for m in ms_list}
    # Stored activations of one stage for one microbatch: each Dense keeps
    # its input and its ReLU output (float32), LAYERS/STAGES layers a stage.
    per_sample = (LAYERS // STAGES) * 2 * WIDTH * 4
    def compare(schedule, m):
        return run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
                    "--timeout", "800", "--"] + other
                   + ["--mode", "pipeline", "--schedule", schedule,
                      "--microbatches", str(m)], root=other_root)

    print(f"{'schedule':>8} {'m':>3} {'ms/step':>8} {'speedup':>8} "
          f"{'ideal':>6} {'bound':>6}  peak activations per stage (MB)")
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in ms_list:
            ms_other = None
            if other is not None and len(rows) % 2:
                # Alternate which tree runs first (warm-up order effects).
                ms_other = compare(schedule, m)
            ms = run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
                      "--timeout", "800", "--"] + me
                     + ["--mode", "pipeline", "--schedule", schedule,
                        "--microbatches", str(m)])
            sched = get_schedule(schedule, STAGES, m)
            ideal = m * STAGES / (m + STAGES - 1)
            # Ideal overlap of the pipelined step's work (measured
            # serially in 1 process), relative to the baseline.
            bound = base / (serial[m] / STAGES * (m + STAGES - 1) / m)
            peaks = [sched.peak_in_flight(s) * (BATCH // m) * per_sample / 2**20
                     for s in range(STAGES)]
            rows.append((schedule, m, ms, base / ms, ideal, peaks))
            compared = ""
            if other is not None:
                if ms_other is None:
                    ms_other = compare(schedule, m)
                compared = (f"  | compare-tree: {ms_other:.0f} ms/step, "
                            f"this tree {ms_other / ms:.2f}x its speed")
            print(f"{schedule:>8} {m:>3} {ms:>8.0f} {base / ms:>7.2f}x "
                  f"{ideal:>5.2f}x {bound:>5.2f}x  "
                  + ", ".join(f"stage {s}: {v:.0f} ({sched.peak_in_flight(s)}"
                              f" mb)" for s, v in enumerate(peaks))
                  + compared, flush=True)
    dp = run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
              "--timeout", "800", "--"] + me + ["--mode", "dp"])
    print(f"data parallel, 2 serial processes (batch {BATCH // 2} each): "
          f"{dp:.0f} ms/step, {base / dp:.2f}x (target >= 1.6x, ideal 2x)")
    again = run(me + ["--mode", "single"])
    print(f"baseline again: {again:.0f} ms/step (noise check)")
    print("ideal = m*p/(m+p-1); bound = the same pipelined step run serially "
          "in 1 process, overlapped ideally (microbatches of BATCH/m rows "
          "make smaller, slower matmuls)")
    for m in ms_list:
        print(f"  m={m:>2}: serial pipelined step with microbatches of "
              f"{BATCH // m} rows: {serial[m]:.0f} ms "
              f"({serial[m] / base:.2f}x baseline)")
    best8 = max((r[3] for r in rows if r[1] == 8), default=0)
    print(f"best speedup at m=8: {best8:.2f}x (target >= 1.6x, ideal "
          f"{8 * STAGES / (8 + STAGES - 1):.2f}x)")


if __name__ == "__main__":
    main()
