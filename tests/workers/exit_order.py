"""Ranks 2 and 3 keep talking after ranks 0 and 1 are done.

4 processes, `SMPStrategy(partitions=2)`: pipeline groups {0, 1} and
{2, 3}. Ranks 0 and 1 end their script at once; ranks 2 and 3 wait
`--late` seconds, then gather and meet in their own group (through the
coordination service, which rank 0's process hosts). Each rank prints
`EXIT {"rank", "ended"}` when its script ends and ranks 2 and 3 print
`GROUP {"rank", "started", "got"}`. `--fail-rank R` makes rank R raise
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
    print("GROUP " + json.dumps({"rank": rank, "started": started,
                                 "got": got}), flush=True)
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
print("EXIT " + json.dumps({"rank": rank, "ended": time.time()}), flush=True)
