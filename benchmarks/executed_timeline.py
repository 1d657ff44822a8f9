"""Planned vs executed pipeline timelines, side by side.

For GPipe and 1F1B on 2 stages, measures one batch with
`DistributedModel.executed_timeline` and prints the planned (simulated)
bubble next to the executed one, then draws the executed 1F1B timeline.

Two layouts:

- default: both stages as logical CPU devices of this process (the picture
  in docs/schedules.md; on CPU they share one thread pool and do not
  overlap);
- `--processes 2`: one stage per worker process (`keras-smp launch -n 2`),
  every process a serial device (1 intra-op and 1 inter-op thread), on
  `benchmarks/pipeline_cpu.py`'s model (8 x Dense(1024), batch 1024; add
  `--xla` to compile the stages): the layout that overlaps on CPU. The
  executed timeline then shows where a step's time goes beside the plan:
  per-stage busy time, the executed bubble, and the gap between one
  stage's action and the neighbour's action that waits for it (transfer
  latency).

    python benchmarks/executed_timeline.py [--microbatches 4] [--out docs/img]
    python benchmarks/executed_timeline.py --processes 2 --microbatches 8 --xla
"""

import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..",
                                             "docs", "img"))
p.add_argument("--processes", type=int, default=1, choices=(1, 2))
p.add_argument("--xla", action="store_true")
p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if args.processes == 2 and not args.worker:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from measure import cpu_model
    from measure import launch_workers

    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; 2 stage processes, "
          "each 1 intra-op and 1 inter-op thread")
    out = launch_workers(ROOT, __file__, sys.argv[1:])
    lines = [l.split("] ", 1)[1] for l in out.stdout.splitlines()
             if l.startswith("[0] ")]
    if out.returncode:
        raise SystemExit(f"workers failed:\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    print("\n".join(lines))
    raise SystemExit(0)

import keras_smp  # noqa: E402

m = args.microbatches
if args.processes == 2:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    width, depth, batch = 1024, 8, 1024
else:
    width, depth, batch = 512, 4, 512
strategies = {name: keras_smp.SMPStrategy(
    partitions=2, microbatches=m, pipeline=name)
    for name in ("gpipe", "1f1b", "1f1b_split", "zb_h1")}

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_smp.pipeline.schedule import get_schedule  # noqa: E402
from keras_smp.pipeline.schedule import simulate  # noqa: E402

rng = np.random.RandomState(0)
inputs = 256 if args.processes == 1 else width
outputs = 10 if args.processes == 1 else width
x = rng.randn(batch, inputs).astype("float32")
y = rng.randn(batch, outputs).astype("float32")
where = ("2 logical CPU devices of one process" if args.processes == 1
         else "2 stage processes")
print(f"2 stages ({where}), {m} microbatches, batch {batch}, MLP "
      f"{inputs}-{width}x{depth}-{outputs}, XLA {'on' if args.xla else 'off'}"
      f", {os.cpu_count()} CPU cores")
print(f"{'schedule':10s} {'planned bubble':>15s} {'executed bubble':>16s} "
      f"{'makespan ms':>12s}  busy ms per stage, mean wait for a neighbour")
for name, strategy in strategies.items():
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((inputs,))]
            + [keras.layers.Dense(width, activation="relu")
               for _ in range(depth)]
            + ([keras.layers.Dense(outputs)] if args.processes == 1 else [])))
        model.compile(optimizer="sgd", loss="mse", jit_compile=args.xla)
    planned = simulate(get_schedule(name, 2, m), 1.0, 2.0)
    executed = model.executed_timeline(x, y, runs=5)
    busy = [executed.busy_time(s) for s in range(2)]
    # Transfer latency as executed: from the end of the action whose output
    # a neighbour needs to the start of the neighbour's action using it,
    # when the neighbour was idle waiting for it.
    spans = executed.spans
    waits = []
    for a, (start, _) in spans.items():
        if a.kind == "W":
            continue  # waits only for its own stage's I
        prev = [b for b in spans if b.microbatch == a.microbatch
                and b.kind in (("F",) if a.kind == "F" else ("B", "I"))
                and b.stage == a.stage + (-1 if a.kind == "F" else 1)]
        if prev:
            waits.append(start - spans[prev[0]][1])
    wait = f"{np.mean(waits):.1f}" if waits else "-"
    print(f"{name:10s} {planned.bubble_fraction():15.1%} "
          f"{executed.bubble_fraction():16.1%} {executed.makespan:12.1f}  "
          f"{busy[0]:.0f} / {busy[1]:.0f}, {wait} ms", flush=True)
    if name in ("1f1b", "zb_h1") and keras_smp.rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.processes == 1 else "_2proc"
        path = os.path.join(args.out, f"executed_{name}_p2_m{m}{suffix}.png")
        executed.draw(path, title=f"executed {name}, 2 stages, {m} microbatches "
                                  f"({where}, "
                                  f"bubble {executed.bubble_fraction():.0%})")
        print("wrote", path)
