"""Rank 1 raises before it sends; rank 0 waits for it in `smp.recv_from`
(a key-value wait, not a collective). Started without the launcher, with
`collective_timeout_seconds=300`: rank 0 must stop within seconds with an
error naming rank 1's exception, not after the timeout."""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_smp as smp  # noqa: E402

smp.init({"collective_timeout_seconds": 300})
if smp.rank() == 1:
    time.sleep(1)
    raise ValueError("rank 1 fails on purpose before it sends")
start = time.monotonic()
try:
    smp.recv_from(1)
finally:
    print(f"WAITED {time.monotonic() - start:.1f}", file=sys.stderr,
          flush=True)
