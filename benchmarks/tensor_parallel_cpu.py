"""Tensor-parallel speed and memory on CPU: tp=2 in 2 serial processes vs 1.

A transformer block (hidden 2048, 16 heads, MLP 8192; self-attention,
LayerNormalization, a Dense pair), input (batch 4, 64 tokens, 2048),
mean-squared error, SGD with momentum. Every process is a "serial
device": 1 intra-op and 1 inter-op thread. Measured side by side in one
run:

- baseline: the block, plain Keras, in 1 serial process;
- tensor parallel: the same block built inside
  `keras_smp.tensor_parallelism()` under
  `SMPStrategy(tensor_parallel_degree=2)` in 2 serial processes
  (`keras-smp launch -n 2`): heads split, the MLP split by columns then
  rows, one all-reduce per sub-block each way.

Prints the CPU model, the median ms/step of each and the speedup; the
all-reduce time share (the step's 6 all-reduces of (4, 64, 2048) float32
activations, timed alone in the same processes, over the tensor-parallel
step); the weights + optimizer slots each process holds (bytes of its
variables, by the layers split and the rest); and each process's peak
resident memory (VmHWM). Target: >= 1.5x. Results of the last run:
benchmarks/results_tensor_parallel_cpu.txt.

    python benchmarks/tensor_parallel_cpu.py            # ~3 minutes
    python benchmarks/tensor_parallel_cpu.py --steps 5  # quicker
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from measure import cpu_model  # noqa: E402
from measure import peak_mb  # noqa: E402
from measure import timed_fit  # noqa: E402

HIDDEN, HEADS, MLP, BATCH, TOKENS = 2048, 16, 8192, 4, 64
# The block's all-reduces per step: forward after the attention output and
# the MLP's second Dense; backward before the query, key and value
# projections and the MLP's first Dense.
ALL_REDUCES = 6
SPLIT = ("attention/", "mlp_in/", "mlp_out/")


def worker(args):
    import time

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import keras_smp

    strategy = None
    if args.tp > 1:
        strategy = keras_smp.SMPStrategy(tensor_parallel_degree=args.tp)

    def block():
        keras.utils.set_random_seed(0)
        x = keras.Input((TOKENS, HIDDEN))
        a = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS,
                                            name="attention")(x, x)
        h = keras.layers.LayerNormalization(name="ln1")(x + a)
        f = keras.layers.Dense(MLP, activation="gelu", name="mlp_in")(h)
        f = keras.layers.Dense(HIDDEN, name="mlp_out")(f)
        y = keras.layers.LayerNormalization(name="ln2")(h + f)
        model = keras.Model(x, y)
        model.compile(optimizer=keras.optimizers.SGD(1e-3, momentum=0.9),
                      loss="mse")
        return model

    if strategy is not None:
        with strategy.scope():
            with keras_smp.tensor_parallelism():
                model = block()
    else:
        model = block()
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, TOKENS, HIDDEN).astype("float32")
    y = rng.randn(BATCH, TOKENS, HIDDEN).astype("float32")
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    ms, _ = timed_fit(model, ds, args.steps)

    def nbytes(variables):
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                   for v in variables)

    def is_split(v):  # a weight, or its optimizer slot, of a split layer
        name = v.path.split("/")[-1] if "/" in v.path else v.path
        return v.path.startswith(SPLIT) or name.startswith(
            tuple(s.rstrip("/") + "_" for s in SPLIT))

    variables = list(model.weights) + [
        v for v in model.optimizer.variables if len(v.shape) > 0]
    split = [v for v in variables if is_split(v)]
    rest = [v for v in variables if not is_split(v)]
    result = {"ms": ms, "split_mb": nbytes(split) / 2**20,
              "rest_mb": nbytes(rest) / 2**20,
              "peak_mb": peak_mb(),
              "rank": strategy.topology.rank if strategy else 0}
    if strategy is not None:
        group = strategy.tensor_group
        act = tf.constant(x)

        @tf.function
        def reduces():
            out = act
            for _ in range(ALL_REDUCES):
                out = group.sum(out) * 0.5
            return out

        reduces()
        comm = []
        for _ in range(args.steps):
            start = time.perf_counter()
            reduces().numpy()
            comm.append(time.perf_counter() - start)
        result["allreduce_ms"] = float(np.median(comm)) * 1000
    print("RESULT " + json.dumps(result), flush=True)


def run(cmd, timeout=1200):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    results = sorted((json.loads(line.split("RESULT ", 1)[1])
                      for line in out.stdout.splitlines()
                      if "RESULT " in line), key=lambda r: r["rank"])
    if out.returncode or not results:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--steps", str(args.steps)]
    print(f"CPU: {cpu_model()}; every process 1 intra-op and 1 inter-op "
          "thread")
    print(f"transformer block: hidden {HIDDEN}, {HEADS} heads, MLP {MLP}, "
          f"input ({BATCH}, {TOKENS}, {HIDDEN}), SGD momentum; median of "
          f"{args.steps} steps")
    base = run(me + ["--tp", "1"])[0]
    tp = run([sys.executable, "-m", "keras_smp.launch", "-n", "2",
              "--timeout", "1100", "--"] + me + ["--tp", "2"])
    after = run(me + ["--tp", "1"])[0]
    print(f"\n{'run':<32}{'ms/step':>9}{'speedup':>9}")
    print(f"{'1 process (start of run)':<32}{base['ms']:>9.0f}{1:>8.2f}x")
    print(f"{'1 process (end of run)':<32}{after['ms']:>9.0f}"
          f"{base['ms'] / after['ms']:>8.2f}x")
    print(f"{'tp=2, 2 processes':<32}{tp[0]['ms']:>9.0f}"
          f"{base['ms'] / tp[0]['ms']:>8.2f}x   (target >= 1.5x, ideal 2x)")
    comm = tp[0]["allreduce_ms"]
    print(f"\nall-reduce share: {ALL_REDUCES} all-reduces of "
          f"{BATCH * TOKENS * HIDDEN * 4 / 2**20:.0f} MB take {comm:.0f} ms "
          f"alone, {100 * comm / tp[0]['ms']:.0f}% of the tp=2 step")
    print(f"\n{'memory per process (MB)':<32}{'split layers':>14}"
          f"{'other':>8}{'peak RSS':>10}")
    print(f"{'1 process':<32}{base['split_mb']:>14.0f}{base['rest_mb']:>8.1f}"
          f"{base['peak_mb']:>10.0f}")
    for r in tp:
        print(f"{'tp=2, rank ' + str(r['rank']):<32}{r['split_mb']:>14.0f}"
              f"{r['rest_mb']:>8.1f}{r['peak_mb']:>10.0f}")
    print("split layers: weights + optimizer slots of the attention and MLP "
          f"(tp=2 ranks hold {tp[0]['split_mb'] / base['split_mb']:.2f} of "
          "the whole); peak RSS includes TensorFlow itself (~"
          "the same in every process) and the step's activations")


if __name__ == "__main__":
    main()
