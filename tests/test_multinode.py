"""Two nodes, one `keras-smp launch --nnodes 2` on each, as a user runs it.

The "nodes" are two network namespaces joined by a veth pair (created by
this module, removed after it; the same `EmulatedHosts` as
benchmarks/allreduce_topology.py, unshaped here): each node's workers see
only their namespace's network, so the rendezvous at node 0's address and
TensorFlow's gRPC between workers really cross the link. Needs root and
iproute2 (`make test` installs it); skipped with the reason otherwise, and
failed instead under CI as root.

- A data-parallel fit and a pipelined fit (one stage per node) across the
  two nodes match single-device training.
- SIGKILL to one node's launcher while training ends the other node's job
  within seconds (not the 300 s collective timeout). (That the killed
  launcher's workers die with it: tests/test_launch.py.)
"""

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from conftest import assert_same_training
from conftest import env
from conftest import fit_model
from conftest import load

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from allreduce_topology import HOST_IPS  # noqa: E402
from allreduce_topology import EmulatedHosts  # noqa: E402

MASTER = f"{HOST_IPS[0]}:29400"


@pytest.fixture(scope="module")
def nodes():
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif not shutil.which("ip") or not shutil.which("tc"):
        reason = "iproute2 (ip, tc) is missing; `make test` installs it"
    hosts = None
    if reason is None:
        try:
            hosts = EmulatedHosts(rate_mbit=10000, delay_ms=0).__enter__()
        except OSError as e:
            reason = f"cannot create network namespaces: {e}"
    if reason is not None:
        if os.environ.get("CI") and os.geteuid() == 0:
            pytest.fail(f"root in CI, yet two nodes cannot be emulated: {reason}")
        pytest.skip(f"multi-node launch across namespaces skipped: {reason}")
    try:
        yield hosts
    finally:
        hosts.remove()


class _Node:
    """`keras-smp launch --nnodes 2 --node-rank R` inside node R's namespace,
    its output collected by threads (readable while it runs)."""

    def __init__(self, hosts, rank, nproc, args):
        cmd = hosts.exec_prefix(rank) + [
            sys.executable, "-m", "keras_smp.launch", "--nnodes", "2",
            "--node-rank", str(rank), "--master", MASTER, "-n", str(nproc),
            "--timeout", "280", "--rendezvous-timeout", "60", "--",
            sys.executable, *args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.out, self.err = [], []
        self.threads = [
            threading.Thread(target=self._read, args=(s, into), daemon=True)
            for s, into in ((self.proc.stdout, self.out),
                            (self.proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, into):
        for line in iter(stream.readline, ""):
            into.append(line)

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        for t in self.threads:
            t.join(5)
        return code

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # the launcher and its workers only
            self.proc.wait()

    def text(self):
        return "".join(self.out), "".join(self.err)


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True],
                         ids=["data-parallel", "pipelined"])
def test_fit_across_two_nodes_matches_single_device(
        nodes, tmp_path, reference, pipelined):
    flags = (["--pipelined", "--config", '{"partitions": 2, "microbatches": 2}']
             if pipelined else [])
    job = [_Node(nodes, r, 1, fit_model(tmp_path, *flags)) for r in (1, 0)]
    try:
        codes = [n.wait(240) for n in job]
    finally:
        for n in job:
            n.stop()
    texts = [n.text() for n in job]
    assert codes == [0, 0], texts
    node1_out, node0_out = texts[0][0], texts[1][0]
    # World ranks: node 0's worker is rank 0, node 1's is rank 1, each at
    # its own node's address (the cluster crosses the veth link).
    assert "[0] rank 0 done" in node0_out and "[1] rank 1 done" in node1_out
    for rank, (_, err) in zip((1, 0), texts):
        assert re.search(
            rf"node {rank} of 2: world ranks {rank}-{rank} of 2; cluster "
            rf"{HOST_IPS[0]}:\d+, {HOST_IPS[1]}:\d+", err), err
    for rank in (0, 1):
        assert_same_training(load(tmp_path, rank), reference())


@pytest.mark.slow
def test_killing_one_nodes_launcher_stops_the_other_node(nodes, tmp_path):
    args = fit_model(tmp_path, "--epochs", "500", "--callbacks")
    job = [_Node(nodes, r, 1, args) for r in (0, 1)]
    try:
        # Wait until both nodes train (node 0's chief prints epochs).
        deadline = time.monotonic() + 180
        while not any("Epoch 2/500" in line for line in job[0].out):
            assert time.monotonic() < deadline and job[0].proc.poll() is None, (
                job[0].text(), job[1].text())
            time.sleep(0.2)
        start = time.monotonic()
        job[1].proc.kill()  # SIGKILL to node 1's launcher only
        code = job[0].wait(60)
        elapsed = time.monotonic() - start
        out, err = job[0].text()
        assert code == 1, (out, err)
        assert "the job stopped: node 1's launcher disconnected" in err, err
        assert elapsed < 30, elapsed
    finally:
        for n in job:
            n.stop()
