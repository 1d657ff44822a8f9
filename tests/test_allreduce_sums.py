"""Gradient sync returns exactly the NumPy sum: algorithms x hosts x fusion x dtypes.

Real worker processes (`keras-smp launch`), emulated hosts (`--host-map`):
4 processes on 2 hosts with ring, hierarchical and horovod (in the Horovod
environment, `launch --horovod`), and 2 processes on 2 hosts with
hierarchical; fusion on (64 MB: one bucket per dtype) and off (one per tensor), one
call each in the same job. Each
all-reduce call mixes float32, float16 and bfloat16 tensors of several
shapes holding small integers, whose sums are exact in every dtype (one
float32 tensor of a shape unknown when traced), and float32 random values
(float32 rounding only); one 13 MB tensor makes the
hierarchical algorithm pipeline its buckets in chunks and the ring send its
bucket as 4 pieces in flight together.
"""

import json

import pytest

from conftest import HVD_PYTHON
from conftest import WORKERS
from conftest import hvd_env_or_skip
from conftest import launch


@pytest.mark.slow
# Every algorithm with 2 processes per host; the hierarchical one (a reduce
# inside each host first) also with one process per host.
@pytest.mark.parametrize("workers,hosts,algorithm", [
    (4, "a,a,b,b", "ring"), (4, "a,a,b,b", "hierarchical"),
    (4, "a,a,b,b", "horovod"), (2, "a,b", "hierarchical")],
    ids=["4procs-2hosts-ring", "4procs-2hosts-hierarchical",
         "4procs-2hosts-horovod", "2procs-2hosts-hierarchical"])
def test_allreduce_equals_numpy_sum(workers, hosts, algorithm):
    # Fused (64 MB) and unfused (0), one call each, in one job.
    extra = dict(python=None, launcher_args=("--host-map", hosts))
    if algorithm == "horovod":
        hvd_env_or_skip()
        extra = dict(python=HVD_PYTHON,
                     launcher_args=("--host-map", hosts, "--horovod"))
    proc = launch(workers, [f"{WORKERS}/allreduce_sums.py", algorithm,
                            "64", "0"], timeout=180, **extra)
    results = [json.loads(l.split("RESULT ", 1)[1])
               for l in proc.stdout.splitlines() if "RESULT " in l]
    assert [r["fusion_mb"] for r in results] == [64, 0], proc.stdout[-2000:]
    for r in results:
        assert r["algorithm"] == algorithm and r["replicas"] == workers
        wrong = [(dtype, shape) for dtype, shape, ok in r["exact"] if not ok]
        assert not wrong, (r["fusion_mb"], wrong)
        assert {d for d, _, _ in r["exact"]} == {"float32", "float16",
                                                 "bfloat16"}
        assert r["random_max_rel"] < 1e-4
        assert [3_300_001] in [shape for _, shape, _ in r["exact"]]
        assert [None] in [shape for _, shape, _ in r["exact"]]
        # 17 tensors of known shapes in 3 dtypes: fused into one bucket per
        # dtype, or not fused; the one of unknown shape alone (with it
        # every tensor went alone: no bucket).
        assert r["buckets_traced"] == (3 if r["fusion_mb"] else 17), r
        # Ring on CPU: the bucket holding the 13 MB tensor goes as 4
        # pieces in flight together (allreduce_pieces=4), the others whole
        # (under 2 MB), and the tensor of unknown shape as one more; the
        # other algorithms keep buckets whole.
        assert r["pieces_traced"] == (
            r["buckets_traced"] + 4 if algorithm == "ring" else 0), r
