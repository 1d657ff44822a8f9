"""`benchmarks/allreduce_topology.py` runs end to end (small and fast here).

A smoke test, not a speed check: the benchmark creates 2 network namespaces
and a tc-shaped veth link, runs 2 workers per emulated host for ring and
hierarchical (every all-reduce result checked exactly by the workers), and
removes its namespaces. Speed figures come from running the benchmark itself
(docs/gradient-sync.md).
"""

import os
import re
import subprocess

import pytest

from conftest import ROOT
from conftest import run_python


def _namespaces():
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True, timeout=30)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


@pytest.mark.slow
def test_allreduce_topology_benchmark_runs_and_cleans_up():
    proc = run_python(
        [os.path.join(ROOT, "benchmarks", "allreduce_topology.py"),
         "--mbytes", "16", "--rate-mbit", "400", "--reps", "1",
         "--no-floor", "--timeout", "150"], timeout=400)
    out = proc.stdout
    if "skipped:" in out:
        reason = out.strip().splitlines()[-1]
        if os.environ.get("CI") and os.geteuid() == 0:
            pytest.fail(f"root in CI, yet the benchmark could not run: {reason}")
        pytest.skip(reason)
    assert "2 emulated hosts x 2 workers" in out, out
    for algorithm in ("ring", "hierarchical"):
        assert re.search(rf"^  {algorithm} +[0-9.]+ s", out, re.M), out
    assert re.search(r"hierarchical / ring  = [0-9.]+x", out), out
    assert re.search(r"hierarchical / bound = [0-9.]+x", out), out
    # Its own namespaces (and their veth ends) are gone. Only its own: other
    # tests running beside it (test_multinode) create and remove theirs.
    names = re.search(r"^network namespaces: (.+) \(removed on exit\)$", out,
                      re.M)
    assert names, out
    mine = set(names.group(1).split())
    assert len(mine) == 2, out
    assert not mine & _namespaces(), (mine, _namespaces())
