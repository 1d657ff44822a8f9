"""Ranks started with different keras-smp settings (used by tests).

Run under `keras-smp launch -n 2`. Rank 1 differs from rank 0 in
`microbatches` (its SMPStrategy argument), in `fusion_threshold_mb` (its
own SMP_CONFIG, as a node with another environment would have) and in
`collective_timeout_seconds` (allowed to differ). Both ranks must fail at
start-up, before any training, with the same error naming the two
options; prints STARTED if the strategy was created anyway.
"""

import json
import os

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if rank == 1:
    os.environ["SMP_CONFIG"] = json.dumps({"fusion_threshold_mb": 1})

import keras_smp  # noqa: E402

keras_smp.SMPStrategy(partitions=2, microbatches=2 if rank == 0 else 4,
                      collective_timeout_seconds=150 if rank == 0 else 120)
print("STARTED", flush=True)
