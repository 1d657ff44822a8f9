"""Ranks 2 and 3 keep talking after ranks 0 and 1 are done.

4 processes, `SMPStrategy(partitions=2)`: pipeline groups {0, 1} and
{2, 3}. Ranks 0 and 1 end their script at once; ranks 2 and 3 wait
`--late` seconds (longer than TensorFlow takes to call a task that
stopped sending heartbeats crashed), then talk in their own group. Each rank prints
`EXIT {"rank", "ended"}` when its script ends and ranks 2 and 3 print
`GROUP {"rank", "started", "got", "summed"}` (an all-gather and a barrier
through the coordination service, then a TensorFlow all-reduce of the
group). `--fail-rank R` makes rank R raise
when its script ends (after its group calls).
"""

import argparse
import json
import time

import keras_smp as smp

p = argparse.ArgumentParser()
p.add_argument("--late", type=float, default=3.0)
p.add_argument("--timeout", type=float, default=120.0)
p.add_argument("--fail-rank", type=int, default=-1)
args = p.parse_args()

smp.SMPStrategy(partitions=2, collective_timeout_seconds=args.timeout)
rank = smp.rank()
if rank >= 2:
    time.sleep(args.late)
    started = time.time()
    got = smp.allgather(rank, smp.MP_GROUP)
    smp.mp_barrier()
    # A TensorFlow collective of this group alone (what a tensor-parallel
    # group's save_weights runs): TensorFlow aborts every collective once
    # the coordination service reports a task crashed.
    import tensorflow as tf

    summed = tf.raw_ops.CollectiveReduceV2(
        input=tf.constant([float(rank)]), group_size=2, group_key=1001,
        instance_key=1, ordering_token=[], merge_op="Add", final_op="Id",
        communication_hint="ring", timeout_seconds=args.timeout)
    print("GROUP " + json.dumps({"rank": rank, "started": started,
                                 "got": got,
                                 "summed": float(summed.numpy()[0])}),
          flush=True)
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
print("EXIT " + json.dumps({"rank": rank, "ended": time.time()}), flush=True)
