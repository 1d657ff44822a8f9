"""Peak memory of a large-vocabulary output: logits gathered vs kept split.

A language-model head: a vocabulary-parallel `ReversibleEmbedding`
(vocabulary 32768, width 256), LayerNormalization, and its tied
`reverse=True` projection to logits, on (8, 256) tokens: the logits are
(8, 256, 32768) float32, 256 MB, the largest tensor of the step. SGD.
Every process is a "serial device" (1 intra-op and 1 inter-op thread).
Measured side by side in one run:

- 1 process, plain Keras, `SparseCategoricalCrossentropy(from_logits=True)`;
- tp=2 in 2 processes, the same loss: the tied projection gathers the
  whole logits on every rank;
- tp=2 in 2 processes, `keras_smp.VocabParallelSparseCategoricalCrossentropy`:
  each rank keeps its half of the logits; the softmax's maximum, normaliser
  and label logit are all-reduced instead.

Prints the CPU model, each run's median ms/step, its loss after the
steps (the three agree), and the peak resident memory (VmHWM) of every
process. Results of the last run: benchmarks/results_vocab_parallel_cpu.txt.

    python benchmarks/vocab_parallel_cpu.py             # ~2 minutes
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from measure import cpu_model  # noqa: E402
from measure import peak_mb  # noqa: E402
from measure import timed_fit  # noqa: E402
from tensor_parallel_cpu import run  # noqa: E402

VOCAB, WIDTH, BATCH, TOKENS = 32768, 256, 8, 256


def worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import keras_smp

    strategy = (keras_smp.SMPStrategy(tensor_parallel_degree=args.tp)
                if args.tp > 1 else None)

    def head():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((TOKENS,), dtype="int32")
        emb = keras.layers.ReversibleEmbedding(VOCAB, WIDTH)
        h = keras.layers.LayerNormalization()(emb(tokens))
        model = keras.Model(tokens, emb(h, reverse=True))
        loss = (keras_smp.VocabParallelSparseCategoricalCrossentropy()
                if args.loss == "vocab_parallel" else
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    if strategy is not None:
        with strategy.scope():
            with keras_smp.tensor_parallelism():
                model = head()
    else:
        model = head()
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(BATCH, TOKENS)).astype("int32")
    ds = tf.data.Dataset.from_tensors((x, np.roll(x, -1, 1))).repeat()
    ms, history = timed_fit(model, ds, args.steps)
    print("RESULT " + json.dumps({
        "ms": ms,
        "loss": float(history.history["loss"][-1]),
        "peak_mb": peak_mb(),
        "rank": strategy.topology.rank if strategy else 0}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--loss", default="keras", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--steps", str(args.steps)]
    print(f"CPU: {cpu_model()}; every process 1 intra-op and 1 inter-op "
          "thread")
    logits_mb = BATCH * TOKENS * VOCAB * 4 / 2**20
    print(f"LM head: vocabulary {VOCAB}, width {WIDTH}, tokens ({BATCH}, "
          f"{TOKENS}); whole logits {logits_mb:.0f} MB float32; SGD; median "
          f"of {args.steps} steps")
    launch = [sys.executable, "-m", "keras_smp.launch", "-n", "2",
              "--timeout", "1100", "--"]
    runs = [
        ("1 process, Keras loss", run(me)),
        ("tp=2, Keras loss (gathered)", run(launch + me + ["--tp", "2"])),
        ("tp=2, vocab-parallel loss", run(
            launch + me + ["--tp", "2", "--loss", "vocab_parallel"])),
    ]
    print(f"\n{'run':<32}{'ms/step':>9}{'loss':>10}"
          f"{'peak RSS per process (MB)':>30}")
    for name, results in runs:
        peaks = " / ".join(f"{r['peak_mb']:.0f}" for r in results)
        print(f"{name:<32}{results[0]['ms']:>9.0f}{results[0]['loss']:>10.4f}"
              f"{peaks:>30}")
    gathered = max(r["peak_mb"] for r in runs[1][1])
    split = max(r["peak_mb"] for r in runs[2][1])
    print(f"\nvocab-parallel vs gathered, tp=2: peak RSS {split:.0f} vs "
          f"{gathered:.0f} MB per process ({gathered - split:.0f} MB less, "
          f"{split / gathered:.2f}x); peak RSS includes TensorFlow itself")


if __name__ == "__main__":
    main()
