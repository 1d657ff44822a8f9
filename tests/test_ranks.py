"""Rank helpers inside real launched workers (no TensorFlow needed)."""

import json
import sys

from conftest import run_python

SCRIPT = (
    "import json, keras_smp as s;"
    "print(json.dumps([s.rank(), s.size(), s.local_rank(), s.local_size(),"
    " s.dp_rank(), s.dp_size(), s.pp_rank(), s.pp_size(), s.mp_rank(),"
    " s.mp_size(), s.is_chief()]))")


def _ranks(proc):
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[") and "] [" in line:
            rank, payload = line.split("] ", 1)
            out[int(rank[1:])] = json.loads(payload)
    return out


def test_ranks_in_four_launched_workers_on_two_emulated_hosts():
    proc = run_python(
        ["-m", "keras_smp.launch", "-n", "4", "--host-map", "a,a,b,b",
         "--timeout", "60", "--", sys.executable, "-c", SCRIPT],
        extra_env={"SMP_CONFIG": json.dumps({"partitions": 2})}, timeout=90)
    got = _ranks(proc)
    assert sorted(got) == [0, 1, 2, 3]
    for r, (rank, size, lr, ls, dpr, dps, ppr, pps, mpr, mps, chief) in (
            got.items()):
        assert (rank, size) == (r, 4)
        assert (lr, ls) == (r % 2, 2)
        # placement "cluster": a replica's 2 stages on consecutive ranks.
        assert (ppr, pps, dpr, dps) == (r % 2, 2, r // 2, 2)
        assert (mpr, mps) == (ppr, pps)
        assert chief == (r == 0)


def test_spread_placement_in_launched_workers():
    proc = run_python(
        ["-m", "keras_smp.launch", "-n", "4", "--timeout", "60", "--",
         sys.executable, "-c", SCRIPT],
        extra_env={"SMP_CONFIG": json.dumps(
            {"partitions": 2, "placement_strategy": "spread"})}, timeout=90)
    for r, vals in _ranks(proc).items():
        dpr, dps, ppr, pps = vals[4:8]
        assert (ppr, dpr, pps, dps) == (r // 2, r % 2, 2, 2)
