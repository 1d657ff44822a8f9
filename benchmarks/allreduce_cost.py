"""What an all-reduce costs between 2 local worker processes on CPU.

TensorFlow's collective all-reduce (`CollectiveReduceV2`, ring, over its gRPC
runtime: what keras-smp's data parallelism uses on CPU) of the gradients of
`benchmarks/pipeline_cpu.py`'s model (8 x Dense(1024): 32 MB float32) and of
a quarter of it, in one piece and in 4 pieces issued together. For each:
the median wall time per all-reduce and the CPU time each process spends
on it (gRPC serialisation and copies run on the process's own threads).

On a machine whose cores are all computing (2 serial processes on 2 cores)
that CPU time cannot be hidden behind the backward pass: it bounds data
parallelism at (compute/2 + all-reduce CPU time) per step, whatever the
overlap. See docs/performance.md.

    python benchmarks/allreduce_cost.py        # ~1 minute

(Starts 2 workers with `keras-smp launch`; prints the CPU model.)
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES_MB = (8, 32)
PARTS = (1, 4)
REPEATS = 7


def worker():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_smp

    strategy = keras_smp.SMPStrategy(collective_timeout_seconds=120)
    import numpy as np
    import tensorflow as tf

    from keras_smp.runtime.keys import process_keys

    rank = strategy.topology.rank
    # Group keys from keras-smp's allocator (every rank allocates alike).
    keys = process_keys().allocate("allreduce_cost",
                                   len(SIZES_MB) * len(PARTS))
    index = 0
    device = f"/job:worker/replica:0/task:{rank}/device:CPU:0"
    for size_mb in SIZES_MB:
        n = size_mb * 2**20 // 4
        for parts in PARTS:
            group_key = keys.key(index)
            index += 1
            pieces = [tf.ones([n // parts]) for _ in range(parts)]

            @tf.function
            def all_reduce(pieces=pieces, group_key=group_key):
                return [tf.raw_ops.CollectiveReduceV2(
                    input=p, group_size=2, group_key=group_key,
                    instance_key=i + 1, ordering_token=[], merge_op="Add",
                    final_op="Id", communication_hint="ring",
                    timeout_seconds=60)[0] for i, p in enumerate(pieces)]

            with tf.device(device):
                all_reduce()
                walls, cpu0 = [], time.process_time()
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    all_reduce()
                    walls.append(time.perf_counter() - t0)
                cpu = (time.process_time() - cpu0) / REPEATS
            print(f"RESULT rank {rank} {size_mb} MB in {parts} piece(s): "
                  f"wall {np.median(walls) * 1000:.0f} ms, CPU of this "
                  f"process {cpu * 1000:.0f} ms", flush=True)


def main():
    if "--worker" in sys.argv:
        return worker()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from measure import cpu_model
    from measure import launch_workers

    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; TensorFlow "
          "collective all-reduce (ring, gRPC) between 2 local processes")
    out = launch_workers(ROOT, __file__, [], timeout=300)
    lines = [l.split("RESULT ", 1)[1] for l in out.stdout.splitlines()
             if "RESULT " in l]
    if out.returncode or not lines:
        raise SystemExit(f"workers failed:\n{out.stdout[-2000:]}\n"
                         f"{out.stderr[-2000:]}")
    for line in sorted(lines, key=lambda l: (l.split()[1],
                                             int(l.split()[2]))):
        print(line)


if __name__ == "__main__":
    main()
