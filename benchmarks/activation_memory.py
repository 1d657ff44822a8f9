"""Activation memory per stage process: GPipe vs 1F1B, with and without
activation checkpointing (recomputation).

A model whose activations dominate: 8 x Dense(1024, relu) (32 MB of
weights), 2 stages, one stage per worker process (`keras-smp launch -n 2`),
SGD, microbatches 8 of 2048 rows (batch 16384; input and target 16 wide,
so the data stays small), one training step. For each
schedule and checkpointing setting, two runs side by side:

- the job itself;
- its baseline: the same job (model, schedule, setting) with 8 rows per
  microbatch, so activations are negligible and everything else (runtime,
  weights, gradients, the traced step) is the same.

Activation memory of a stage = its process's peak resident memory (VmHWM,
read by the process at the end) minus the same stage's peak in the
baseline run: measured, not computed from shapes. What the schedules
predict: GPipe holds every microbatch's activations (m = 8) on every stage
before the first backward; 1F1B at most p - s microbatches on stage s
(2 on stage 0, 1 on stage 1); with recomputation a stage keeps only each
microbatch's stage inputs and recomputes one microbatch at a time. ZB-H1
holds 2 on both ranks (a split backward keeps a microbatch until its W),
interleaved 1F1B (2 virtual stages per rank) up to 5 and 3 half-stage
microbatches, ZB-V 4 on both; the "planned" column prints these in whole
stages' worth.

Per-layer recomputation (`activation_checkpointing=[layer names]`) pays
where a layer holds large activations inside it: `--model blocks` is 4
MLP blocks (each a nested `Sequential` of Dense(4096, relu) then
Dense(1024), the shape of a transformer's MLP), 2 per stage, 1F1B, with
recomputation off, of each block (`layers`), and of the whole stage
(`on`).

    python benchmarks/activation_memory.py        # ~5 minutes on 2 cores
    python benchmarks/activation_memory.py --only gpipe/off gpipe/on
    python benchmarks/activation_memory.py --model blocks   # ~4 minutes
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_model  # noqa: E402
from measure import peak_mb  # noqa: E402
sys.path.insert(0, ROOT)
from keras_smp.pipeline.schedule import get_schedule  # noqa: E402
LAYERS, WIDTH, M = 8, 1024, 8
BLOCKS = 4  # --model blocks
DATA = 16  # input and target features: the data stays small


def worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras_smp

    recompute = {"off": False, "on": True,
                 "layers": [f"block{i}" for i in range(BLOCKS)]}
    strategy = keras_smp.SMPStrategy(
        partitions=2, microbatches=M, pipeline=args.pipeline,
        activation_checkpointing=recompute[args.recompute],
        collective_timeout_seconds=600)
    import keras
    import numpy as np

    batch = M * args.rows
    x = np.random.RandomState(0).randn(batch, DATA).astype("float32")
    y = np.random.RandomState(1).randn(batch, DATA).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        if args.model == "blocks":
            layers = [keras.Sequential(
                [keras.Input((WIDTH,)),
                 keras.layers.Dense(4 * WIDTH, activation="relu"),
                 keras.layers.Dense(WIDTH)], name=f"block{i}")
                for i in range(BLOCKS)]
            layers = [keras.layers.Dense(WIDTH)] + layers
        else:
            layers = [keras.layers.Dense(WIDTH, activation="relu")
                      for _ in range(LAYERS)]
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((DATA,))] + layers + [keras.layers.Dense(DATA)]))
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    print("RESULT " + json.dumps({"stage": strategy.topology.pp_rank,
                                  "peak_mb": peak_mb()}), flush=True)


def run(me, *flags):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TF_CONFIG", "SMP_CONFIG"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "keras_smp.launch", "-n", "2", "--timeout",
           "900", "--"] + me + list(flags)
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1000)
    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or len(results) != 2:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    return [r["peak_mb"] for r in sorted(results, key=lambda r: r["stage"])]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pipeline", default="1f1b")
    p.add_argument("--recompute", default="off",
                   choices=("off", "on", "layers"), help=argparse.SUPPRESS)
    p.add_argument("--model", default="dense", choices=("dense", "blocks"),
                   help="dense: 8 x Dense(1024, relu); blocks: 4 MLP "
                        "blocks, recomputation off / per block / per stage")
    p.add_argument("--rows", type=int, default=2048,
                   help="rows per microbatch (default 2048)")
    p.add_argument("--only", nargs="*", default=None,
                   help="configurations to run, e.g. gpipe/off 1f1b/on")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    # A Dense(relu) layer keeps one tensor for its backward: its output
    # (the relu's gradient and the next layer's weight gradient use it).
    per_mb = LAYERS // 2 * args.rows * WIDTH * 4 / 2**20
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; every process 1 "
          "intra-op and 1 inter-op thread")
    if args.model == "blocks":
        # A block keeps its input, its 4x-wide hidden layer and its output
        # (the next block's input): ~6 x 8 MB per microbatch at 2048 rows.
        per_mb = BLOCKS // 2 * 6 * args.rows * WIDTH * 4 / 2**20
        print(f"model: {BLOCKS} MLP blocks (Dense({4 * WIDTH}, relu), "
              f"Dense({WIDTH})), 2 per stage, one stage per process, SGD, "
              f"{M} microbatches of {args.rows} rows; unit of the last "
              f"column: ~{per_mb:.0f} MB, one microbatch's activations of a "
              "stage without recomputation")
        configs = [("1f1b", r) for r in ("off", "layers", "on")]
    else:
        print(f"model: {LAYERS} x Dense({WIDTH}, relu), 2 stages (one per "
              f"process), SGD, {M} microbatches of {args.rows} rows; one "
              f"microbatch's stage output alone is "
              f"{args.rows * WIDTH * 4 / 2**20:.0f} MB (a stage keeps one "
              f"per layer for its backward: ~{per_mb:.0f} MB per "
              "microbatch, the unit of the last column)")
        configs = ([(p, r) for p in ("gpipe", "1f1b") for r in ("off", "on")]
                   + [(p, "off") for p in ("zb_h1", "interleaved_1f1b",
                                           "zb_v")])
    print(f"{'schedule':>16} {'recompute':>9} {'rank':>4} {'baseline':>8} "
          f"{'peak':>6} {'activations (MB)':>16} {'in microbatches':>15} "
          f"{'planned':>7}")
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--model", args.model]
    for pipeline, recompute in configs:
        if args.only and f"{pipeline}/{recompute}" not in args.only:
            continue
        flags = ["--pipeline", pipeline, "--recompute", recompute]
        base = run(me, *flags, "--rows", "8")
        peaks = run(me, *flags, "--rows", str(args.rows))
        sched = get_schedule(pipeline, 2, M)
        for stage in range(2):
            act = peaks[stage] - base[stage]
            # The schedule's peak of microbatches in flight on this rank, in
            # whole stages' worth (a virtual stage holds 1/v of the layers).
            planned = sched.peak_in_flight(stage) / sched.virtual_stages
            print(f"{pipeline:>16} {recompute:>9} {stage:>4} "
                  f"{base[stage]:>8.0f} {peaks[stage]:>6.0f} "
                  f"{act:>16.0f} {act / per_mb:>15.1f} "
                  f"{planned if recompute == 'off' else '':>7}", flush=True)


if __name__ == "__main__":
    main()
