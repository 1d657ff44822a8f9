"""Planned vs executed pipeline timelines, side by side.

For GPipe and 1F1B on 2 stages (2 logical CPU devices of this process),
measures one batch with `DistributedModel.executed_timeline` and prints the
planned (simulated) bubble next to the executed one, then draws the executed
1F1B timeline (the picture in docs/schedules.md).

    python benchmarks/executed_timeline.py [--microbatches 4] [--out docs/img]
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..",
                                             "docs", "img"))
args = p.parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp  # noqa: E402

strategies = {name: keras_smp.SMPStrategy(
    partitions=2, microbatches=args.microbatches, pipeline=name)
    for name in ("gpipe", "1f1b")}

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_smp.pipeline.schedule import get_schedule  # noqa: E402
from keras_smp.pipeline.schedule import simulate  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(512, 256).astype("float32")
y = rng.randn(512, 10).astype("float32")
m = args.microbatches
print(f"2 stages, {m} microbatches, batch 512, MLP 256-512x4-10, "
      f"{os.cpu_count()} CPU cores")
print(f"{'schedule':10s} {'planned bubble':>15s} {'executed bubble':>16s} "
      f"{'makespan ms':>12s}")
for name, strategy in strategies.items():
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((256,))]
            + [keras.layers.Dense(512, activation="relu") for _ in range(4)]
            + [keras.layers.Dense(10)]))
        model.compile(optimizer="sgd", loss="mse")
    planned = simulate(get_schedule(name, 2, m), 1.0, 2.0)
    executed = model.executed_timeline(x, y, runs=5)
    print(f"{name:10s} {planned.bubble_fraction():15.1%} "
          f"{executed.bubble_fraction():16.1%} {executed.makespan:12.1f}")
    if name == "1f1b":
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"executed_1f1b_p2_m{m}.png")
        executed.draw(path, title=f"executed 1F1B, 2 stages, {m} microbatches "
                                  f"(2 logical CPU devices, "
                                  f"bubble {executed.bubble_fraction():.0%})")
        print("wrote", path)
