"""The SLURM and Kubernetes examples (examples/slurm, examples/kubernetes),
checked as far as they can be on one machine.

- SLURM: `examples/slurm/train.sbatch` runs under emulated `srun` and
  `scontrol` (the variables SLURM sets, the nodes as local processes); its
  launchers meet and every worker sees one cluster with its own rank.
- Kubernetes: the manifest is parsed and its wiring checked (Service <->
  pod labels, DNS name of pod 0 = --master, ports, node count = Job
  completions); then each pod's command runs locally, with pod 0's DNS
  name mapped to this machine, and every worker gets its rank.

The training scripts are replaced by a TensorFlow-free check of what a
worker receives (real training across nodes: tests/test_multinode.py).
"""

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from keras_smp import launch

# What a worker was given: its rank as keras-smp resolves it, the cluster.
CHECK = """
import json, os
from keras_smp.topology import resolve_cluster
c = resolve_cluster()
print("CHECK " + json.dumps({"rank": c.rank, "size": c.world_size,
      "node": os.environ["SMP_NODE_RANK"],
      "workers": json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]}))
"""


def _checks(text):
    return [json.loads(line.split("CHECK ", 1)[1])
            for line in text.splitlines() if "CHECK " in line]


def _assert_one_cluster(checks, nnodes, per_node):
    size = nnodes * per_node
    assert sorted(c["rank"] for c in checks) == list(range(size)), checks
    assert {c["size"] for c in checks} == {size}
    assert len({json.dumps(c["workers"]) for c in checks}) == 1
    for c in checks:  # node R's workers are ranks R*per_node ...
        assert int(c["node"]) == c["rank"] // per_node, c


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.timeout(120)
def test_slurm_sbatch_script_launches_one_cluster(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # srun: runs its command once per task (SLURM_NNODES tasks, one per
    # node), with the variables SLURM gives each task.
    _executable(fake / "srun", """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
code=0
for p in "${pids[@]}"; do wait "$p" || code=$?; done
exit $code
""")
    _executable(fake / "scontrol", """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$3"
""")
    (tmp_path / "check.py").write_text(CHECK)
    env = dict(os.environ)
    env.update({
        "PATH": os.pathsep.join([str(fake), os.path.dirname(sys.executable),
                                 env["PATH"]]),
        "PYTHONPATH": ROOT, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST":
        "127.0.0.1", "SLURM_GPUS_ON_NODE": "2", "MASTER_PORT":
        str(launch.free_ports(1)[0]), "TRAIN":
        f"{sys.executable} {tmp_path / 'check.py'}"})
    for k in ("TF_CONFIG", "SLURM_PROCID", "SMP_HOST_MAP"):
        env.pop(k, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm",
                                                 "train.sbatch")],
                          env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    # 2 nodes x SLURM_GPUS_ON_NODE workers, one cluster.
    _assert_one_cluster(_checks(proc.stdout), nnodes=2, per_node=2)


def _manifest():
    with open(os.path.join(ROOT, "examples", "kubernetes",
                           "keras-smp-job.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "Job"}
    return kinds["Service"], kinds["Job"]


def _pod_command(job, index):
    """The launcher arguments pod `index` runs (bash expands the index)."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["bash", "-c"]
    (script,) = container["args"]
    words = shlex.split(script.replace("$JOB_COMPLETION_INDEX", str(index)))
    assert words[:3] == ["exec", "keras-smp", "launch"], words
    return words[3:]


def test_kubernetes_manifest_wiring():
    service, job = _manifest()
    spec, pod = job["spec"], job["spec"]["template"]
    # The headless Service selects the Job's pods and names them.
    assert service["spec"]["clusterIP"] == "None"
    # Pod 0's name must resolve before the pods are ready (the rendezvous
    # runs before any readiness).
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert pod["spec"]["restartPolicy"] == "Never"
    nnodes = spec["completions"]
    ranks = set()
    for index in range(nnodes):
        args, command, _ = launch._parse(_pod_command(job, index))
        assert args.nnodes == nnodes and command
        ranks.add(args.node_rank)
        host, port = args.master.rsplit(":", 1)
        # Pod 0's DNS name under the headless Service, and its port.
        assert host == (f"{job['metadata']['name']}-0."
                        f"{service['metadata']['name']}")
        assert int(port) in [p["port"] for p in service["spec"]["ports"]]
        container = pod["spec"]["containers"][0]
        assert int(port) in [p["containerPort"] for p in container["ports"]]
        assert args.num_workers == int(
            container["resources"]["limits"]["nvidia.com/gpu"])
    assert ranks == set(range(nnodes))


@pytest.mark.timeout(120)
def test_kubernetes_pods_commands_launch_one_cluster(tmp_path):
    """Each pod's command, run here: pod 0's DNS name mapped to 127.0.0.1,
    the training script replaced by the check."""
    service, job = _manifest()
    nnodes = job["spec"]["completions"]
    (tmp_path / "check.py").write_text(CHECK)
    port = launch.free_ports(1)[0]
    procs = []
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("TF_CONFIG", "SLURM_PROCID", "SMP_HOST_MAP"):
        env.pop(k, None)
    for index in range(nnodes):
        words = _pod_command(job, index)
        i = words.index("--master")
        words[i + 1] = f"127.0.0.1:{port}"
        words = words[:words.index("--") + 1] + [
            sys.executable, str(tmp_path / "check.py")]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "keras_smp.launch", *words], env=env,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0, (out, err)
        assert re.search(r"node \d of %d: world ranks" % nnodes, err), err
        outs.append(out)
    per_node = launch._parse(_pod_command(job, 0))[0].num_workers
    _assert_one_cluster(_checks("".join(outs)), nnodes, per_node)
