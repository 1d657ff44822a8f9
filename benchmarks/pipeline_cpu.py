"""Pipeline speed on CPU: 2 stages in 2 serial worker processes vs 1.

An 8-layer, 1024-wide ReLU MLP, global batch 1024, SGD. Every process is a
"serial device": 1 intra-op and 1 inter-op thread (logical CPUs of one
process share a thread pool and would not measure pipelining, see
tf-keras-facts.md). Measured side by side in one run:

- baseline: the whole model, plain Keras, in 1 serial process;
- pipelined: `keras_smp.DistributedModel`, partitions=2, one stage per
  serial process (`keras-smp launch -n 2`), microbatches 1, 2, 4, 8, 16,
  schedules gpipe, 1f1b, 1f1b_split, zb_h1, interleaved_1f1b (2 virtual
  stages per process) and zb_v (2 per process, in a V);
- data parallel: the plain model under `SMPStrategy()` in 2 serial
  processes, the same global batch.

With `--xla` every run (the baseline too) compiles with
`jit_compile=True`: plain Keras compiles its whole step, keras-smp each
stage's forward and backward (or, data parallel, the model's call).

Prints the median ms/step, the speedup over the baseline beside the
schedule's ideal (simulated, m*p/(m+p-1) for GPipe and 1F1B) and beside the
bound of this CPU (the same pipelined step run serially in 1 process,
ideally overlapped: small microbatches make slower matmuls), the planned
bubble fraction, and each process's measured step memory: TensorFlow's
allocator peak during a step above what lives between steps (every run
uses the BFC allocator, `TF_CPU_ALLOCATOR_USE_BFC=true`, whose statistics
`tf.config.experimental.get_memory_info` reads), beside the schedule's
planned peak of microbatches in flight. Then each schedule's speed against
1F1B's at the same m. Target: >= 1.6x at m = 8 (ideal 1.78x). Results of
the last run on the CI machine: benchmarks/results_pipeline_cpu.txt.

    python benchmarks/pipeline_cpu.py            # ~30 minutes on 2 cores
    python benchmarks/pipeline_cpu.py --quick    # m = 1, 4, 8 only
    python benchmarks/pipeline_cpu.py --xla --dp-only   # data parallel:
        # buckets whole and in 4 pieces, gradients sent as bfloat16 and
        # float16 (allreduce_compression)
    python benchmarks/pipeline_cpu.py --schedules 1f1b zb_h1 \
        interleaved_1f1b zb_v --microbatch-counts 2 4 8

Rows beside keras-smp's, when their environments exist (each skipped with
a printed reason otherwise; neither is a dependency of keras-smp):

- Horovod data parallel (`allreduce="horovod"`, Gloo) in the Horovod lane
  (`.venv-hvd`, TF 2.15.1: built by `make test` or
  `scripts/horovod-env.sh`), beside that lane's own 1-process baseline
  (another TensorFlow release: its ratio is to its own baseline);
- PyTorch's `torch.distributed.pipelining` (GPipe, 1F1B) and DDP on the same
  workload (`../shared/peers/`, a venv with torch, `--peer-python`), beside
  PyTorch's own 1-process baseline.

The baseline is measured three times (start, middle, end of the run): on a
shared host the machine's speed drifts by 10-20% over a run of minutes. The
table, printed as the runs go, uses the first (as does the serial "bound",
measured right after it); the summary lines after it use the median of the
three. The Horovod and PyTorch rows measure their own baselines before and
after their runs and use the mean.

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
# 1f1b_split and zb_h1 split each backward into I and W (docs/schedules.md);
# with --xla their stages cannot split (each stage is one compiled
# function) and they run as 1F1B does, with a warning.
# interleaved_1f1b (v = 2) and zb_v run 2 model stages of 2 layers per
# process: stages 0, 2 / 1, 3 and 0, 3 / 1, 2.
SCHEDULES = ("gpipe", "1f1b", "1f1b_split", "zb_h1", "interleaved_1f1b",
             "zb_v")


def worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = None
    if args.mode == "dp":
        import keras_smp

        extra = ({} if args.allreduce_pieces is None
                 else {"allreduce_pieces": args.allreduce_pieces})
        if args.allreduce_compression:
            extra["allreduce_compression"] = args.allreduce_compression
        strategy = keras_smp.SMPStrategy(collective_timeout_seconds=300,
                                         allreduce=args.allreduce, **extra)
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

    batch = BATCH if args.batch is None else args.batch
    x = np.random.RandomState(0).randn(batch * 4, WIDTH).astype("float32")
    y = np.random.RandomState(1).randn(batch * 4, WIDTH).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).repeat()

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
    memory = tf.config.experimental

    # Memory: TensorFlow's allocator statistics (the BFC allocator on CPU,
    # TF_CPU_ALLOCATOR_USE_BFC=true, set by `run`): the peak of live
    # tensors during each step above what lived when it began (weights,
    # optimizer state, the data pipeline): activations, gradient buffers,
    # transfers. Measured, per process; the largest over the steps.

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.last, self.peaks = [], None, []

        def on_train_batch_begin(self, batch, logs=None):
            memory.reset_memory_stats("CPU:0")
            self.rest = memory.get_memory_info("CPU:0")["current"]

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self.peaks.append(memory.get_memory_info("CPU:0")["peak"]
                              - self.rest)
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    timer = StepTimes()
    model.fit(ds, steps_per_epoch=args.steps + 1, epochs=1, verbose=0,
              callbacks=[timer])
    # Median step time: robust to a noisy neighbour on a shared host.
    ms = float(np.median(timer.times)) * 1000
    rank = strategy.topology.rank if strategy is not None else 0
    print("RESULT " + json.dumps({"ms_per_step": ms, "rank": rank,
                                  "step_mb": max(timer.peaks) / 2**20}),
          flush=True)


def run(cmd, timeout=900, root=ROOT, memory=False):
    """Median ms/step of the chief; with `memory`, also each process's
    peak step memory (MB, in rank order)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_CPU_ALLOCATOR_USE_BFC="true",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True,
                         text=True, timeout=timeout)
    results = sorted((json.loads(line.split("RESULT ", 1)[1])
                      for line in out.stdout.splitlines()
                      if "RESULT " in line), key=lambda r: r.get("rank", 0))
    if out.returncode == 0 and results:
        ms = results[0]["ms_per_step"]
        return (ms, [r.get("step_mb") for r in results]) if memory else ms
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n"
                       f"{out.stderr[-3000:]}")


def run_peer(python, script, *args, timeout=900):
    """A `../shared/peers` script's median ms/step ("RESULT ... <ms>")."""
    out = subprocess.run([python, script, *args], capture_output=True,
                         text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(line.split()[-1])
    raise RuntimeError(f"{script} {' '.join(args)} failed:\n"
                       f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def horovod_rows(python, me_args, base):
    """Horovod data parallel (Gloo) in the Horovod lane, beside that lane's
    own 1-process baseline; prints its rows or why they are skipped."""
    if not python or not os.path.exists(python):
        print(f"horovod data parallel: skipped (no Horovod lane at {python}; "
              "`make test` or scripts/horovod-env.sh builds .venv-hvd)")
        return
    me = [python, os.path.abspath(__file__)] + me_args
    try:
        before = run(me + ["--mode", "single"])
        hvd = run([python, "-m", "keras_smp.launch", "--horovod", "-n", "2",
                   "--timeout", "800", "--"] + me
                  + ["--mode", "dp", "--allreduce", "horovod"])
        hvd_base = (before + run(me + ["--mode", "single"])) / 2
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"horovod data parallel: failed: {str(e)[-400:]}")
        return
    print(f"data parallel, allreduce='horovod' (Gloo; the Horovod lane's "
          f"TensorFlow): {hvd:.0f} ms/step, {hvd_base / hvd:.2f}x its own "
          f"1-process baseline ({hvd_base:.0f} ms; this lane's baseline "
          f"{base:.0f} ms)")


def peer_rows(python, peers, ms_list, keras_rows):
    """PyTorch's pipelining and DDP on the same workload; prints ratios to
    PyTorch's own baseline and keras-smp's ratio to the peer's."""
    if not python or not os.path.exists(python) or not os.path.isdir(peers):
        print(f"peer (PyTorch): skipped (needs a Python with torch, "
              f"--peer-python, found {python!r}, and the peer scripts, "
              f"--peers, found {peers!r}; see ../shared/peers/README.md)")
        return
    pipe = os.path.join(peers, "torch_pipeline_bench.py")
    ddp = os.path.join(peers, "torch_ddp_bench.py")
    try:
        # Its baseline before and after its runs (the mean; see above).
        first = run_peer(python, pipe, "single")
        rows = []
        for schedule in ("gpipe", "1f1b"):
            for m in ms_list:
                if schedule == "1f1b" and m < STAGES:
                    print(f"  torch pipelining  1f1b m={m:>2}: not run (its "
                          f"Schedule1F1B needs m >= {STAGES} stages)")
                    continue
                try:
                    rows.append((f"torch pipelining {schedule:>5} m={m:>2}",
                                 (schedule, m),
                                 run_peer(python, pipe, "pipe", schedule,
                                          str(m))))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"  torch pipelining {schedule:>5} m={m:>2}: "
                          f"failed: {str(e)[-300:]}")
        rows.append(("torch DDP, 2 processes", ("dp", 0),
                     run_peer(python, ddp, "ddp")))
        last = run_peer(python, pipe, "single")
        single = (first + last) / 2
        print(f"peer (PyTorch {_torch_version(python)}): 1 serial process "
              f"{first:.0f} and {last:.0f} ms/step (mean {single:.0f})")
        for name, key, ms in rows:
            line = f"  {name}: {ms:.0f} ms/step, {single / ms:.2f}x"
            if key in keras_rows:
                line += (f"; keras-smp's speedup / the peer's: "
                         f"{keras_rows[key] / (single / ms):.2f}")
            print(line, flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"peer (PyTorch): failed: {str(e)[-400:]}")


def _torch_version(python):
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip() or "?"


def dp_only(me, repeats):
    """Data parallelism in 2 serial processes, beside the whole model in 1
    process and half the batch in 1 process (each process's share of the
    compute), in `repeats` rounds: the ring all-reduce's buckets whole
    (`allreduce_pieces=1`, the default) and in 4 pieces in flight, and
    the gradients sent as bfloat16 and as float16
    (`allreduce_compression`); the data-parallel runs take turns going
    first, round by round."""
    import statistics

    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1; received {repeats}.")
    whole, half = f"1 process, batch {BATCH}", f"1 process, batch {BATCH // 2}"
    variants = {
        "dp, allreduce_pieces=1": ["--allreduce-pieces", "1"],
        "dp, allreduce_pieces=4": ["--allreduce-pieces", "4"],
        "dp, compression=bfloat16": ["--allreduce-compression", "bfloat16"],
        "dp, compression=float16": ["--allreduce-compression", "float16"],
    }
    runs = {whole: [], half: [], **{k: [] for k in variants}}
    dp = [sys.executable, "-m", "keras_smp.launch", "-n", "2", "--timeout",
          "800", "--"] + me + ["--mode", "dp"]
    names = list(variants)
    for r in range(repeats):
        runs[whole].append(run(me + ["--mode", "single"]))
        runs[half].append(run(
            me + ["--mode", "single", "--batch", str(BATCH // 2)]))
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run(dp + variants[name]))
        print(f"round {r + 1}: " + ", ".join(
            f"{k} {v[-1]:.0f}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = med[whole]
    print(f"{'run':>26} {'median ms/step':>15} {'vs 1 process':>13}")
    for k, v in med.items():
        print(f"{k:>26} {v:>15.0f} {base / v:>12.2f}x")
    one = med["dp, allreduce_pieces=1"]
    print("dp all-reduce cost above half the compute: " + ", ".join(
        f"{k[4:]} {med[k] - med[half]:.0f} ms" for k in names))
    for k in names[1:]:
        print(f"{k[4:]} vs allreduce_pieces=1 (default): {one / med[k]:.2f}x"
              f"; rounds where it was faster: "
              + str(sum(a > b for a, b in zip(runs[names[0]], runs[k])))
              + f" of {repeats}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="single")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--schedules", nargs="*", default=None,
                   help=f"a subset of {' '.join(SCHEDULES)}")
    p.add_argument("--microbatch-counts", nargs="*", type=int, default=None,
                   help="m values (default 1 2 4 8 16; --quick 1 4 8)")
    p.add_argument("--xla", action="store_true",
                   help="compile(jit_compile=True) in every run, baseline "
                   "included")
    p.add_argument("--allreduce", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=None,
                   help=argparse.SUPPRESS)  # a worker's global batch
    p.add_argument("--allreduce-pieces", type=int, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--allreduce-compression", default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--dp-only", action="store_true",
                   help="only the baseline and data parallelism: "
                   "allreduce_pieces 1 and 4, allreduce_compression "
                   "bfloat16 and float16, taking turns, --repeats times")
    p.add_argument("--repeats", type=int, default=5,
                   help="--dp-only: rounds of (1 process with the whole and "
                   "with half the batch, the 4 data-parallel runs)")
    p.add_argument("--hvd-python",
                   default=os.path.join(ROOT, ".venv-hvd", "bin", "python"),
                   help="the Horovod lane's Python (a Horovod DP row)")
    p.add_argument("--peer-python",
                   default=os.path.join(ROOT, ".venv-torch", "bin", "python"),
                   help="a Python with torch (PyTorch peer rows)")
    p.add_argument("--peers",
                   default=os.path.join(os.path.dirname(ROOT), "shared",
                                        "peers"),
                   help="the folder of the PyTorch peer scripts")
    p.add_argument("--compare-tree", default=None,
                   help="another keras-smp checkout to time side by side")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, ROOT)
    from keras_smp.pipeline.schedule import get_schedule
    from keras_smp.pipeline.schedule import simulate

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
    if args.dp_only:
        return dp_only(me, args.repeats)
    other = None
    if args.compare_tree:
        other_root = os.path.abspath(args.compare_tree)
        other = [sys.executable,
                 os.path.join(other_root, "benchmarks", "pipeline_cpu.py"),
                 "--worker", "--steps", str(args.steps), "--warmup",
                 str(args.warmup)] + xla
    base, base_mem = run(me + ["--mode", "single"], memory=True)
    bases = [base]
    print(f"baseline: whole model, batch {BATCH}, 1 serial process: "
          f"{base:.0f} ms/step (measured again mid-run and at the end; "
          "ratios use the median of the three); step memory "
          f"{base_mem[0]:.0f} MB")
    ms_list = args.microbatch_counts or (
        (1, 4, 8) if args.quick else (1, 2, 4, 8, 16))
    schedules = args.schedules or SCHEDULES
    # Small matmuls are less efficient than big ones: the pipelined step's
    # own work, run serially in 1 process, bounds what overlap can reach.
    serial = {m: run(me + ["--mode", "serial", "--microbatches", str(m)])
              for m in ms_list}
    def compare(schedule, m):
        return run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
                    "--timeout", "800", "--"] + other
                   + ["--mode", "pipeline", "--schedule", schedule,
                      "--microbatches", str(m)], root=other_root)

    print(f"{'schedule':>16} {'m':>3} {'ms/step':>8} {'speedup':>8} "
          f"{'ideal':>6} {'bound':>6} {'bubble':>6}  step memory per process, "
          "MB (measured; planned peak in flight)")
    rows = []
    for schedule in schedules:
        if schedule == schedules[len(schedules) // 2]:
            bases.append(run(me + ["--mode", "single"]))
        for m in ms_list:
            try:
                sched = get_schedule(schedule, STAGES, m)
            except ValueError as e:
                print(f"{schedule:>16} {m:>3}  not run: {e}")
                continue
            ms_other = None
            if other is not None and len(rows) % 2:
                # Alternate which tree runs first (warm-up order effects).
                ms_other = compare(schedule, m)
            ms, mems = run([sys.executable, "-m", "keras_smp.launch", "-n",
                            "2", "--timeout", "800", "--"] + me
                           + ["--mode", "pipeline", "--schedule", schedule,
                              "--microbatches", str(m)], memory=True)
            # The schedule's own ideal: its simulated makespan with F = 1,
            # B = 2 (I = W = 1; each 1/v of that with v virtual stages) and
            # free transfers, against p stages' work done serially (m * p /
            # (m + p - 1) for GPipe and 1F1B); its bubble fraction.
            v = sched.virtual_stages
            planned = simulate(sched, 1.0 / v, 2.0 / v)
            ideal = m * STAGES * 3.0 / planned.makespan
            # Ideal overlap of the pipelined step's work (measured
            # serially in 1 process), relative to the baseline.
            bound = base / (serial[m] / STAGES * (m + STAGES - 1) / m)
            rows.append((schedule, m, ms, base / ms, ideal, mems))
            compared = ""
            if other is not None:
                if ms_other is None:
                    ms_other = compare(schedule, m)
                compared = (f"  | compare-tree: {ms_other:.0f} ms/step, "
                            f"this tree {ms_other / ms:.2f}x its speed")
            # Planned: microbatches in flight, in whole stages' worth (a
            # virtual stage's microbatch is 1/v of a rank's activations).
            print(f"{schedule:>16} {m:>3} {ms:>8.0f} {base / ms:>7.2f}x "
                  f"{ideal:>5.2f}x {bound:>5.2f}x "
                  f"{planned.bubble_fraction():>6.1%}  "
                  + ", ".join(f"rank {r}: {mb:.0f} "
                              f"({sched.peak_in_flight(r) / v:g} mb)"
                              for r, mb in enumerate(mems))
                  + compared, flush=True)
    dp = run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
              "--timeout", "800", "--"] + me + ["--mode", "dp"])
    dp_pieces = run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
                     "--timeout", "800", "--"] + me
                    + ["--mode", "dp", "--allreduce-pieces", "4"])
    bases.append(run(me + ["--mode", "single"]))
    median = sorted(bases)[1]
    print(f"baseline runs: {', '.join(f'{b:.0f}' for b in bases)} ms/step "
          f"(median {median:.0f}; the rows above used the first, "
          f"{base:.0f})")
    # Ratios against the median baseline: drift over the run cancels out.
    rows = [(sc, m, ms, median / ms, ideal, peaks)
            for sc, m, ms, _, ideal, peaks in rows]
    print("speedups over the median baseline: " + ", ".join(
        f"{sc} m={m}: {r:.2f}x" for sc, m, _, r, _, _ in rows))
    step = {(sc, m): ms for sc, m, ms, _, _, _ in rows}
    for m in ms_list:
        if ("1f1b", m) in step:
            print(f"against 1f1b at m={m} (its ms/step / theirs, > 1: "
                  "faster): " + ", ".join(
                      f"{sc} {step[('1f1b', m)] / step[(sc, m)]:.2f}"
                      for sc in schedules if sc != "1f1b"
                      and (sc, m) in step), flush=True)
    print(f"data parallel, 2 serial processes (batch {BATCH // 2} each): "
          f"{dp:.0f} ms/step, {median / dp:.2f}x (target >= 1.6x, ideal 2x); "
          f"with each gradient bucket all-reduced as 4 pieces in flight "
          f"(allreduce_pieces=4): {dp_pieces:.0f} ms/step, "
          f"{median / dp_pieces:.2f}x")
    worker_args = ["--worker", "--steps", str(args.steps), "--warmup",
                   str(args.warmup)] + xla
    horovod_rows(args.hvd_python, worker_args, median)
    keras_rows = {(sc, m): r for sc, m, _, r, _, _ in rows}
    keras_rows[("dp", 0)] = median / dp
    peer_rows(args.peer_python, args.peers, ms_list, keras_rows)
    print("ideal = the schedule's simulated speedup with F = 1, B = 2 and free "
          "transfers (m*p/(m+p-1) for gpipe and 1f1b), bubble = its idle "
          "fraction; step memory = TensorFlow's allocator peak during a "
          "step above what lives between steps (activations, gradient "
          f"buffers, transfers; the baseline's: {base_mem[0]:.0f} MB): "
          "the gradient buffers are the same for every schedule, so the "
          "differences between rows are activations; bound = the same pipelined step run serially "
          "in 1 process, overlapped ideally (microbatches of BATCH/m rows "
          "make smaller, slower matmuls; what the stage processes pay: "
          "executed_timeline.py --processes 2; see docs/performance.md)")
    for m in ms_list:
        print(f"  m={m:>2}: serial pipelined step with microbatches of "
              f"{BATCH // m} rows: {serial[m]:.0f} ms "
              f"({serial[m] / base:.2f}x baseline)")
    best8 = max((r[3] for r in rows if r[1] == 8), default=0)
    print(f"best speedup at m=8: {best8:.2f}x (target >= 1.6x, ideal "
          f"{8 * STAGES / (8 + STAGES - 1):.2f}x)")


if __name__ == "__main__":
    main()
