"""Planned vs executed pipeline timelines, side by side.

For every schedule on 2 pipeline ranks (GPipe, 1F1B, 1f1b_split, ZB-H1,
interleaved 1F1B with 2 virtual stages per rank, ZB-V), measures one batch
with `DistributedModel.executed_timeline` and prints the planned
(simulated) bubble next to the executed one, then draws the executed
timelines. Two plans: with the textbook costs (F = 1, B = 2, free
transfers), and with this run's own measured costs (the mean F, B, I and
W durations and the median transfer gap, fed to `simulate`): the second
is the simulator's prediction for this machine, which the executed bubble
should match within a few points (stated in docs/schedules.md).

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
    for name in ("gpipe", "1f1b", "1f1b_split", "zb_h1", "interleaved_1f1b",
                 "zb_v")}

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
print(f"{'schedule':16s} {'planned':>8s} {'predicted':>10s} {'executed':>9s} "
      f"{'makespan ms':>12s} {'predicted':>9s}  busy ms per rank, median "
      "wait for a neighbour")
for name, strategy in strategies.items():
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((inputs,))]
            + [keras.layers.Dense(width, activation="relu")
               for _ in range(depth)]
            + ([keras.layers.Dense(outputs)] if args.processes == 1 else [])))
        model.compile(optimizer="sgd", loss="mse", jit_compile=args.xla)
    schedule = get_schedule(name, 2, m)
    v = schedule.virtual_stages
    planned = simulate(schedule, 1.0 / v, 2.0 / v)
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
                and b.stage == a.stage + (-1 if a.kind == "F" else 1)
                and schedule.rank_of(b.stage) != schedule.rank_of(a.stage)]
        if prev:
            waits.append(start - spans[prev[0]][1])
    # The simulator fed with this run's costs: mean durations per kind, the
    # median transfer gap (>= 0) as the transfer cost.
    def mean(kind):
        d = [e - b for a, (b, e) in spans.items() if a.kind == kind]
        return float(np.mean(d)) if d else None
    f, b, i, w = mean("F"), mean("B"), mean("I"), mean("W")
    comm = max(0.0, float(np.median(waits))) if waits else 0.0
    if i is not None:  # split backwards: B = I + W
        predicted = simulate(schedule, f, i + w, comm, weight_cost=w)
    else:
        predicted = simulate(schedule, f, b, comm)
    wait = f"{np.median(waits):.1f}" if waits else "-"
    print(f"{name:16s} {planned.bubble_fraction():8.1%} "
          f"{predicted.bubble_fraction():10.1%} "
          f"{executed.bubble_fraction():9.1%} {executed.makespan:12.1f} "
          f"{predicted.makespan:9.1f}  "
          f"{busy[0]:.0f} / {busy[1]:.0f}, {wait} ms", flush=True)
    if keras_smp.rank() == 0 and (args.processes == 2 or name == "1f1b"):
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.processes == 1 else "_2proc"
        path = os.path.join(args.out, f"executed_{name}_p2_m{m}{suffix}.png")
        executed.draw(path, title=f"executed {name}, 2 ranks, {m} microbatches "
                                  f"({where}, "
                                  f"bubble {executed.bubble_fraction():.0%})")
        print("wrote", path)
print("planned = simulated with F = 1, B = 2 (I = W = 1), free transfers; "
      "predicted = simulated with this run's mean action durations and "
      "median transfer wait; executed = measured (busy = compute actions "
      "only)")
