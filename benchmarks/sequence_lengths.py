"""What batches of several lengths cost with one stage per process.

    python benchmarks/sequence_lengths.py [--steps 20] [--out FILE]

A token tagger on `keras.Input((None,))` (Embedding(1000, 128,
mask_zero=True), 4 x Dense(512, relu), Dense(32) per token; SGD), batches
of 64 sequences, split after the second Dense: 2 stages in 2 serial worker
processes (`keras-smp launch -n 2`, 1 intra-op and 1 inter-op thread
each), 4 microbatches, 1F1B. Measured side by side in one run, each the
median ms per step:

- `declared`: the model declared on `keras.Input((128,))`, arrays of 128
  tokens: every transfer is one collective of a known shape;
- `fixed`: the model on `keras.Input((None,))`, the same arrays: every
  tensor crossing processes goes as a shape header, then its values padded
  to a size bucket (`transport.Dynamic`), whatever the batch; the ratio
  to `declared` is what that costs (the same compute);
- `padded`: the same sequences through `padded_batch` (every batch again
  128 tokens, but the step's trace leaves the length unknown too);
- `varying`: sequences of 16 to 128 tokens through `padded_batch`
  (informative: each batch is padded to its longest, about 126 tokens,
  so about the same compute).

The same four in plain Keras, in 1 serial process, for comparison (the
unknown length costs plain Keras too). The CPU's name is printed: figures
hold for that CPU only. Last run: benchmarks/results_sequence_lengths.txt
(about 4 minutes on 2 cores).
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

BATCH, LENGTH, VOCAB, TAGS = 64, 128, 1000, 32


def worker(mode, pipelined, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import contextlib

    import keras
    import numpy as np

    from measure import timed_fit

    strategy = None
    if pipelined:
        import keras_smp

        strategy = keras_smp.SMPStrategy(partitions=2, microbatches=4,
                                         pipeline="1f1b")
    rng = np.random.RandomState(0)
    rows = BATCH * 4
    lengths = (np.full(rows, LENGTH) if mode != "varying"
               else rng.randint(16, LENGTH + 1, size=rows))
    seqs = [rng.randint(1, VOCAB, size=n).astype("int32") for n in lengths]
    tags = [rng.randint(0, TAGS, size=n).astype("int32") for n in lengths]
    if mode in ("declared", "fixed"):
        ds = tf.data.Dataset.from_tensor_slices(
            (np.stack(seqs), np.stack(tags))).batch(BATCH)
    else:
        ds = tf.data.Dataset.from_generator(
            lambda: zip(seqs, tags), output_signature=(
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.int32))).padded_batch(BATCH)
    ds = ds.cache().repeat()

    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        inputs = keras.Input((LENGTH if mode == "declared" else None,),
                             dtype="int32")
        h = keras.layers.Embedding(VOCAB, 128, mask_zero=True)(inputs)
        for i in range(4):
            h = keras.layers.Dense(512, activation="relu", name=f"d{i}")(h)
        outputs = keras.layers.Dense(TAGS, name="head")(h)
        model = keras.Model(inputs, outputs)
        if strategy:
            model = keras_smp.DistributedModel(model, split_points=["d2"])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    ms, _ = timed_fit(model, ds, steps, warmup=3)
    print("RESULT " + json.dumps({"mode": mode, "ms": ms}), flush=True)


def run(mode, pipelined, steps):
    from measure import launch_workers

    args = [mode, str(int(pipelined)), str(steps)]
    if pipelined:
        proc = launch_workers(ROOT, __file__, args, n=2)
    else:
        import subprocess

        proc = subprocess.run(
            [sys.executable, __file__, "--worker", *args], cwd=ROOT,
            capture_output=True, text=True, timeout=900,
            env=dict(os.environ, PYTHONPATH=ROOT))
    rows = [json.loads(line.split("RESULT ", 1)[1])
            for line in proc.stdout.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout}\n{proc.stderr}")
    return max(r["ms"] for r in rows)  # the slower stage process


def main():
    if "--worker" in sys.argv:
        mode, pipelined, steps = sys.argv[sys.argv.index("--worker") + 1:]
        return worker(mode, pipelined == "1", int(steps))
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args()
    from measure import cpu_model

    lines = [f"CPU: {cpu_model()}; 1 intra-op + 1 inter-op thread per "
             f"process; batch {BATCH}, {LENGTH} tokens (varying: 16-128), "
             f"median of {args.steps} steps",
             f"{'run':<36}{'declared':>10}{'fixed':>10}{'padded':>10}"
             f"{'varying':>10}{'fixed/decl.':>13}{'padded/decl.':>14}"]
    for pipelined, label in ((False, "plain Keras, 1 process"),
                             (True, "keras-smp, 2 stage procs, m=4")):
        ms = {mode: run(mode, pipelined, args.steps)
              for mode in ("declared", "fixed", "padded", "varying")}
        lines.append(f"{label:<36}" + "".join(
            f"{ms[k]:>8.1f}ms" for k in ("declared", "fixed", "padded",
                                         "varying"))
            + f"{ms['fixed'] / ms['declared']:>12.2f}x"
            + f"{ms['padded'] / ms['declared']:>13.2f}x")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
