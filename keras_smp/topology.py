"""Cluster discovery and the tensor x pipeline x data-parallel rank layout.

`resolve_cluster()` finds out which processes take part in a job (from
`TF_CONFIG`, SLURM, or a single process) and `Topology` maps world ranks to
(pipeline stage, data-parallel replica, tensor-parallel rank) coordinates.

This module is pure Python (standard library only) and never imports
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ClusterInfo",
    "Topology",
    "PLACEMENT_STRATEGIES",
    "expand_hostlist",
    "parse_tasks_per_node",
    "resolve_cluster",
]

PLACEMENT_STRATEGIES = ("cluster", "spread")

_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


# --------------------------------------------------------------------------
# ClusterInfo
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """The processes of a job and this process's place among them.

    Args:
        workers: `"host:port"` of every process, in world-rank order.
        rank: This process's world rank.
        task_type: TensorFlow job name of this process, `"chief"` or `"worker"`.
        task_index: Index of this process within its TensorFlow job.
        source: Where the information came from: `"tf_config"`, `"slurm"` or
            `"single"`.
        hosts: Host label per world rank.
        cluster_spec: TensorFlow-style `{"chief": [...], "worker": [...]}`
            dict to hand to TensorFlow (empty for a single process).

    Example:

    ```python
    from keras_smp.topology import resolve_cluster

    info = resolve_cluster(environ={})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")
    ```
    """

    workers: tuple[str, ...]
    rank: int
    task_type: str
    task_index: int
    source: str
    hosts: tuple[str, ...]
    cluster_spec: dict = dataclasses.field(default_factory=dict, hash=False)

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return len(self.workers)


def _tf_error(part: str, fix: str) -> ValueError:
    return ValueError(f"Invalid TF_CONFIG: {part}. {fix}")


def _parse_address(addr: Any, where: str, env: str) -> str:
    """Validates a "host:port" address and returns its host part."""
    fix = 'Each address must be a string "host:port" with an integer port in 1..65535.'
    if not isinstance(addr, str) or ":" not in addr:
        raise ValueError(
            f"Invalid {env}: {where} is {addr!r}, which is not a \"host:port\" address. {fix}"
        )
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"Invalid {env}: {where} is {addr!r}, which is not a \"host:port\" address "
            f"with a valid port. {fix}"
        )
    if host.startswith("[") and host.endswith("]"):  # IPv6 literal
        host = host[1:-1]
    return host


def _from_tf_config(raw: str) -> tuple[tuple[str, ...], int, str, int, dict]:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _tf_error(
            f"it is not valid JSON ({e}); received {raw!r}",
            f"Set TF_CONFIG to a JSON object such as {_TF_CONFIG_EXAMPLE}.",
        ) from None
    if not isinstance(config, dict):
        raise _tf_error(
            f"it must be a JSON object, received {type(config).__name__} {raw!r}",
            f"Set TF_CONFIG to a JSON object such as {_TF_CONFIG_EXAMPLE}.",
        )
    for part in ("cluster", "task"):
        if part not in config:
            raise _tf_error(
                f'missing "{part}" (received keys {sorted(config)})',
                f'TF_CONFIG needs both "cluster" and "task", e.g. {_TF_CONFIG_EXAMPLE}.',
            )
        if not isinstance(config[part], dict):
            raise _tf_error(
                f'"{part}" must be a JSON object, received {config[part]!r}',
                f"See the expected form: {_TF_CONFIG_EXAMPLE}.",
            )
    cluster, task = config["cluster"], config["task"]

    unsupported = sorted(k for k in cluster if k not in ("chief", "worker"))
    if unsupported:
        raise _tf_error(
            f'"cluster" has job(s) {unsupported}, which are not supported by keras-smp',
            "keras-smp is all-reduce based: every process trains, so only the 'chief' "
            "and 'worker' jobs are allowed (no parameter servers 'ps' or 'evaluator'). "
            "Remove the other jobs from the cluster and run evaluation separately.",
        )
    jobs: dict[str, list[str]] = {}
    for job in ("chief", "worker"):
        addrs = cluster.get(job, [])
        if not isinstance(addrs, list):
            raise _tf_error(
                f'cluster["{job}"] must be a list of "host:port" strings, received {addrs!r}',
                "Sparse (dict) cluster specs are not supported; list every address.",
            )
        if addrs:
            jobs[job] = addrs
    if len(jobs.get("chief", [])) > 1:
        raise _tf_error(
            f'cluster["chief"] has {len(jobs["chief"])} addresses {jobs["chief"]}, '
            "but there can be at most one chief",
            'Keep one address under "chief" and move the others to "worker".',
        )
    if not jobs:
        raise _tf_error(
            'cluster["worker"] is empty and there is no "chief"',
            'List at least one "host:port" address under "worker".',
        )

    workers = jobs.get("chief", []) + jobs.get("worker", [])
    seen: dict[str, str] = {}
    for job, addrs in jobs.items():
        for i, addr in enumerate(addrs):
            where = f'cluster["{job}"][{i}]'
            _parse_address(addr, where, "TF_CONFIG")
            if addr in seen:
                raise _tf_error(
                    f"address {addr!r} appears twice ({seen[addr]} and {where})",
                    "Every process needs its own host:port; give each a distinct port.",
                )
            seen[addr] = where

    task_type = task.get("type")
    if task_type not in jobs:
        if task_type in ("ps", "evaluator"):
            fix = (
                f"Task type {task_type!r} is not supported by keras-smp, which is "
                "all-reduce based; run this process as 'chief' or 'worker'."
            )
        else:
            fix = f'Set task["type"] to one of {list(jobs)}.'
        raise _tf_error(
            f'task["type"] is {task_type!r}, which is not a job in "cluster" '
            f"(jobs: {list(jobs)})",
            fix,
        )
    n_tasks = len(jobs[task_type])
    if "index" not in task and n_tasks == 1:
        task_index = 0
    else:
        task_index = task.get("index")
        if isinstance(task_index, bool) or not isinstance(task_index, int):
            raise _tf_error(
                f'task["index"] must be an integer, received {task_index!r}',
                f'Set task["index"] to this process\'s position in cluster["{task_type}"] '
                f"(0..{n_tasks - 1}).",
            )
        if not 0 <= task_index < n_tasks:
            raise _tf_error(
                f'task["index"] is {task_index}, out of range for cluster["{task_type}"] '
                f"with {n_tasks} address(es)",
                f"Use an index in 0..{n_tasks - 1}.",
            )
    offset = 1 if (task_type == "worker" and "chief" in jobs) else 0
    rank = offset + task_index
    spec = {job: list(addrs) for job, addrs in jobs.items()}
    return tuple(workers), rank, task_type, task_index, spec


# --------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------


def _split_top_level(text: str) -> list[str]:
    """Splits on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Invalid SLURM hostlist {text!r}: nested '[' at position {i}.")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Invalid SLURM hostlist {text!r}: unmatched ']' at position {i}.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"Invalid SLURM hostlist {text!r}: unmatched '['.")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, full: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(
                f"Invalid SLURM hostlist {full!r}: {item!r} inside [...] is not a number "
                "or a range like 01-03."
            )
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(
                f"Invalid SLURM hostlist {full!r}: range {item!r} ends before it starts."
            )
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a compressed SLURM hostlist into host names.

    Ranges keep their zero padding, and several bracket groups in one name
    expand to their product, as `scontrol show hostnames` does.

    Args:
        hostlist: A SLURM hostlist such as `"node[01-03,7],gpu5"`.

    Returns:
        The list of host names, in order.

    Raises:
        ValueError: If the hostlist is malformed.

    Example:

    ```python
    from keras_smp.topology import expand_hostlist

    hosts = expand_hostlist("node[01-03,7],gpu5")
    assert hosts == ["node01", "node02", "node03", "node7", "gpu5"]
    ```
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise ValueError(f"Invalid SLURM hostlist {hostlist!r}: expected a non-empty string.")
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        part = part.strip()
        if not part:
            raise ValueError(f"Invalid SLURM hostlist {hostlist!r}: empty entry.")
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", part):
            if not literal and not body:
                continue
            names = [n + literal for n in names]
            if body:
                names = [n + s for n in names for s in _expand_range_set(body, hostlist)]
        hosts.extend(names)
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Parses SLURM's tasks-per-node syntax, e.g. `"2(x3),1"`.

    Args:
        spec: Value of `SLURM_TASKS_PER_NODE` or `SLURM_STEP_TASKS_PER_NODE`.

    Returns:
        One task count per node.

    Raises:
        ValueError: If the string is malformed.

    Example:

    ```python
    from keras_smp.topology import parse_tasks_per_node

    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    ```
    """
    counts: list[int] = []
    for item in str(spec).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(
                f"Invalid SLURM tasks-per-node value {spec!r}: {item!r} is not N or N(xK)."
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _env_int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer, received {value!r}."
        ) from None


def _from_slurm(environ: Mapping[str, str]) -> tuple[tuple[str, ...], int]:
    rank = _env_int(environ, "SLURM_PROCID")
    ntasks = _env_int(environ, "SLURM_NTASKS")
    if ntasks < 1 or not 0 <= rank < ntasks:
        raise ValueError(
            f"Inconsistent SLURM environment: SLURM_PROCID={rank} with SLURM_NTASKS={ntasks}; "
            "expected 0 <= SLURM_PROCID < SLURM_NTASKS. Launch with srun, which sets both."
        )
    nodelist_var = next(
        (v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
         if environ.get(v)), None,
    )
    if nodelist_var is None:
        raise ValueError(
            "SLURM_PROCID and SLURM_NTASKS are set but no node list was found: expected "
            "SLURM_STEP_NODELIST or SLURM_JOB_NODELIST. Launch with srun, or set TF_CONFIG "
            "instead."
        )
    nodes = expand_hostlist(environ[nodelist_var])

    tpn_var = next(
        (v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if environ.get(v)),
        None,
    )
    if tpn_var is not None:
        per_node = parse_tasks_per_node(environ[tpn_var])
        source = f"{tpn_var}={environ[tpn_var]!r}"
    elif ntasks % len(nodes) == 0:
        per_node = [ntasks // len(nodes)] * len(nodes)
        source = "an even split (no SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE set)"
    else:
        raise ValueError(
            f"Cannot place SLURM_NTASKS={ntasks} tasks on {len(nodes)} nodes: "
            "SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE is not set and the tasks do "
            "not split evenly. Launch with srun, which sets them."
        )
    if len(per_node) != len(nodes):
        raise ValueError(
            f"Inconsistent SLURM environment: {source} describes {len(per_node)} node(s) but "
            f"{nodelist_var}={environ[nodelist_var]!r} lists {len(nodes)} node(s) {nodes}. "
            "Both should come from the same srun step."
        )
    if sum(per_node) != ntasks:
        raise ValueError(
            f"Inconsistent SLURM environment: {source} adds up to {sum(per_node)} tasks but "
            f"SLURM_NTASKS={ntasks}. Both should come from the same srun step."
        )
    try:
        base = int(environ.get("SMP_PORT_BASE", 12345))
    except ValueError:
        raise ValueError(
            f"SMP_PORT_BASE must be an integer port, received {environ.get('SMP_PORT_BASE')!r}."
        ) from None
    top = base + max(per_node) - 1
    if base < 1 or top > 65535:
        raise ValueError(
            f"SMP_PORT_BASE={base} gives ports {base}..{top}, outside 1..65535. "
            "Choose a base such as 12345."
        )
    workers = tuple(
        f"{node}:{base + i}" for node, count in zip(nodes, per_node) for i in range(count)
    )
    return workers, rank


# --------------------------------------------------------------------------
# resolve_cluster
# --------------------------------------------------------------------------


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Discovers the job's processes and this process's rank.

    Precedence: `TF_CONFIG` (if set and non-empty; world order is the chief,
    then the workers), then SLURM (if `SLURM_PROCID` and `SLURM_NTASKS` are
    set; ranks are assigned block-wise to nodes and ports are
    `SMP_PORT_BASE` (default 12345) plus the task's index on its node), then a
    single process. `SMP_HOST_MAP`, if set, gives a comma-separated host label
    per world rank (for emulating several hosts on one machine); otherwise the
    host part of each address is used.

    Args:
        environ: Mapping to read environment variables from. Defaults to
            `os.environ`.

    Returns:
        A `ClusterInfo`.

    Raises:
        ValueError: If `TF_CONFIG`, the SLURM variables or `SMP_HOST_MAP` are
            malformed or inconsistent.

    Example:

    ```python
    import json
    from keras_smp.topology import resolve_cluster

    tf_config = {"cluster": {"chief": ["a:2222"], "worker": ["b:2222", "b:2223"]},
                 "task": {"type": "worker", "index": 1}}
    info = resolve_cluster(environ={"TF_CONFIG": json.dumps(tf_config)})
    assert (info.rank, info.world_size, info.hosts) == (2, 3, ("a", "b", "b"))
    ```
    """
    environ = os.environ if environ is None else environ
    tf_config = environ.get("TF_CONFIG", "")
    if tf_config and tf_config.strip():
        workers, rank, task_type, task_index, spec = _from_tf_config(tf_config)
        source = "tf_config"
    elif environ.get("SLURM_PROCID") is not None and environ.get("SLURM_NTASKS") is not None:
        workers, rank = _from_slurm(environ)
        task_type, task_index, spec, source = "worker", rank, {"worker": list(workers)}, "slurm"
    else:
        workers, rank, task_type, task_index, spec, source = (
            ("localhost:0",), 0, "worker", 0, {}, "single"
        )

    host_map = environ.get("SMP_HOST_MAP")
    if host_map is not None and host_map.strip():
        hosts = tuple(h.strip() for h in host_map.split(","))
        if len(hosts) != len(workers) or not all(hosts):
            raise ValueError(
                f"SMP_HOST_MAP={host_map!r} gives {len(hosts)} host label(s), but the world "
                f"size is {len(workers)} (from {source}). Give exactly one non-empty, "
                f"comma-separated label per world rank, e.g. "
                f"{','.join(['h0'] * len(workers))!r}."
            )
    elif source == "single":
        hosts = ("localhost",)
    else:
        hosts = tuple(_parse_address(w, f"address {i}", source) for i, w in enumerate(workers))
    return ClusterInfo(
        workers=tuple(workers), rank=rank, task_type=task_type, task_index=task_index,
        source=source, hosts=hosts, cluster_spec=spec,
    )


# --------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Maps world ranks to (pipeline stage, replica, tensor rank) coordinates.

    A model replica spans `mp_size = partitions * tensor_parallel_degree`
    processes: `pp_size = partitions` pipeline stages, each held by
    `tp_size = tensor_parallel_degree` processes that split its layers
    (tensor parallelism); there are `dp_size = world_size // mp_size`
    replicas. The tensor-parallel group is innermost (consecutive ranks, so
    it stays inside one host), then the pipeline stages, then the replicas.
    With `placement_strategy="cluster"` a replica's processes are
    consecutive (`rank = (dp_rank * pp_size + pp_rank) * tp_size +
    tp_rank`); with `"spread"` the replicas of a stage are (`rank =
    (pp_rank * dp_size + dp_rank) * tp_size + tp_rank`). `mp_rank =
    pp_rank * tp_size + tp_rank`, SageMaker smp's model-parallel rank.

    Args:
        world_size: Number of processes, >= 1.
        rank: This process's world rank, in `0..world_size - 1`.
        hosts: Host label per world rank (`len(hosts) == world_size`).
        partitions: Pipeline stages per replica.
        placement_strategy: `"cluster"` or `"spread"`.
        tensor_parallel_degree: Processes splitting each stage's layers;
            `partitions * tensor_parallel_degree` must divide `world_size`.

    Example:

    ```python
    from keras_smp.topology import Topology

    topo = Topology(world_size=4, rank=3, hosts=("a", "a", "b", "b"), partitions=2)
    assert (topo.pp_rank, topo.dp_rank) == (1, 1)
    assert topo.pp_group() == (2, 3) and topo.dp_group() == (1, 3)
    assert (topo.local_rank, topo.local_size, topo.host_index) == (1, 2, 1)
    tp = Topology(world_size=8, rank=5, hosts=("h",) * 8, partitions=2,
                  tensor_parallel_degree=2)
    assert (tp.tp_rank, tp.pp_rank, tp.dp_rank, tp.mp_rank) == (1, 0, 1, 1)
    assert tp.tp_group() == (4, 5) and tp.dp_group() == (1, 5)
    ```
    """

    world_size: int
    rank: int
    hosts: tuple[str, ...]
    partitions: int = 1
    placement_strategy: str = "cluster"
    tensor_parallel_degree: int = 1

    def __post_init__(self):
        for name in ("world_size", "rank", "partitions", "tensor_parallel_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Topology {name} must be an int, received {value!r}.")
        if self.world_size < 1:
            raise ValueError(
                f"Topology world_size must be >= 1, received {self.world_size!r}."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"Topology rank must be in 0..{self.world_size - 1} "
                f"(world_size={self.world_size}), received {self.rank!r}."
            )
        if self.partitions < 1:
            raise ValueError(
                f"Topology partitions must be >= 1, received {self.partitions!r}."
            )
        if self.tensor_parallel_degree < 1:
            raise ValueError(
                "Topology tensor_parallel_degree must be >= 1, received "
                f"{self.tensor_parallel_degree!r}."
            )
        t, w = self.tensor_parallel_degree, self.world_size
        p = self.partitions * t
        if w % p:
            lower, upper = w - w % p, w - w % p + p
            counts = f"{lower} or {upper}" if lower else f"{upper}"
            what, fix = (
                (f"partitions={self.partitions} x tensor_parallel_degree={t} "
                 f"= {p}", "choose partitions and tensor_parallel_degree "
                 f"whose product divides {w}") if t > 1 else
                (f"partitions={p}", f"set partitions to a divisor of {w}"))
            raise ValueError(
                f"{what} does not divide the number of workers world_size={w}: "
                f"each model replica needs exactly {p} processes. Run a multiple "
                f"of {p} workers (e.g. {counts}), or {fix} "
                f"({', '.join(map(str, _divisors(w)))})."
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"Topology placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"received {self.placement_strategy!r}."
            )
        if isinstance(self.hosts, str):
            raise ValueError(
                f"Topology hosts must be a sequence of host labels, one per rank, "
                f"received the string {self.hosts!r}."
            )
        hosts = tuple(self.hosts)
        if len(hosts) != self.world_size:
            raise ValueError(
                f"Topology hosts must have one label per rank (world_size="
                f"{self.world_size}), received {len(hosts)}: {hosts!r}."
            )
        object.__setattr__(self, "hosts", hosts)

    @classmethod
    def from_cluster(
        cls, cluster: ClusterInfo, partitions: int = 1, placement_strategy: str = "cluster",
        tensor_parallel_degree: int = 1,
    ) -> "Topology":
        """Builds the topology of a resolved cluster.

        Args:
            cluster: A `ClusterInfo`, e.g. from `resolve_cluster()`.
            partitions: Pipeline stages per replica.
            placement_strategy: `"cluster"` or `"spread"`.
            tensor_parallel_degree: Processes splitting each stage's layers.

        Returns:
            A `Topology` for `cluster.rank`.

        Example:

        ```python
        from keras_smp.topology import Topology, resolve_cluster

        topo = Topology.from_cluster(resolve_cluster(environ={}))
        assert (topo.world_size, topo.pp_size, topo.dp_size) == (1, 1, 1)
        ```
        """
        return cls(
            world_size=cluster.world_size, rank=cluster.rank, hosts=cluster.hosts,
            partitions=partitions, placement_strategy=placement_strategy,
            tensor_parallel_degree=tensor_parallel_degree,
        )

    # ---- sizes and this rank's coordinates --------------------------------

    @property
    def pp_size(self) -> int:
        """Number of pipeline stages per replica."""
        return self.partitions

    @property
    def tp_size(self) -> int:
        """Number of processes splitting each stage's layers."""
        return self.tensor_parallel_degree

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas."""
        return self.world_size // (self.partitions * self.tensor_parallel_degree)

    @property
    def mp_size(self) -> int:
        """Processes of one model replica: `pp_size * tp_size`."""
        return self.pp_size * self.tp_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index."""
        return self.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.tp_of(self.rank)

    @property
    def mp_rank(self) -> int:
        """Index in the model replica: `pp_rank * tp_size + tp_rank`."""
        return self.pp_rank * self.tp_size + self.tp_rank

    # ---- hosts --------------------------------------------------------------

    @property
    def host_labels(self) -> tuple[str, ...]:
        """Distinct host labels, in order of first appearance."""
        return tuple(dict.fromkeys(self.hosts))

    @property
    def num_hosts(self) -> int:
        """Number of distinct hosts."""
        return len(self.host_labels)

    @property
    def host_index(self) -> int:
        """Index of this rank's host among the distinct hosts."""
        return self.host_of(self.rank)

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """World ranks on this rank's host, ascending."""
        return self._ranks_on(self.hosts[self.rank])

    @property
    def local_rank(self) -> int:
        """Index of this rank among the ranks on its host."""
        return self.local_rank_of(self.rank)

    @property
    def local_size(self) -> int:
        """Number of ranks on this rank's host."""
        return len(self.host_ranks)

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not (
            0 <= rank < self.world_size
        ):
            raise ValueError(
                f"rank must be an int in 0..{self.world_size - 1}, received {rank!r}."
            )
        return rank

    def _ranks_on(self, label: str) -> tuple[int, ...]:
        return tuple(r for r, h in enumerate(self.hosts) if h == label)

    def local_rank_of(self, rank: int) -> int:
        """Returns the index of `rank` among the ranks on its host.

        Args:
            rank: A world rank.

        Returns:
            The local rank (0-based, in world-rank order).

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=3, rank=0, hosts=("a", "b", "a"))
        assert topo.local_rank_of(2) == 1
        ```
        """
        rank = self._check_rank(rank)
        return self._ranks_on(self.hosts[rank]).index(rank)

    def host_of(self, rank: int) -> int:
        """Returns the index of the host of `rank` among the distinct hosts.

        Args:
            rank: A world rank.

        Returns:
            The host index (hosts numbered in order of first appearance).

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=3, rank=0, hosts=("b", "a", "b"))
        assert [topo.host_of(r) for r in range(3)] == [0, 1, 0]
        ```
        """
        rank = self._check_rank(rank)
        return self.host_labels.index(self.hosts[rank])

    # ---- layout -------------------------------------------------------------

    def coords(self, rank: int) -> tuple[int, int]:
        """Returns the `(pp_rank, dp_rank)` of a world rank.

        Args:
            rank: A world rank.

        Returns:
            A `(pp_rank, dp_rank)` tuple.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=0, hosts=("h",) * 4, partitions=2)
        assert topo.coords(3) == (1, 1) and topo.coords(1) == (1, 0)
        ```
        """
        group = self._check_rank(rank) // self.tp_size
        if self.placement_strategy == "cluster":
            return group % self.pp_size, group // self.pp_size
        return group // self.dp_size, group % self.dp_size

    def tp_of(self, rank: int) -> int:
        """Returns the tensor-parallel rank of a world rank.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=0, hosts=("h",) * 4, tensor_parallel_degree=2)
        assert [topo.tp_of(r) for r in range(4)] == [0, 1, 0, 1]
        ```
        """
        return self._check_rank(rank) % self.tp_size

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """Returns the world rank holding stage `pp_rank` of replica `dp_rank`.

        Args:
            pp_rank: Pipeline stage, in `0..pp_size - 1`.
            dp_rank: Data-parallel replica, in `0..dp_size - 1`.
            tp_rank: Tensor-parallel rank, in `0..tp_size - 1`.

        Returns:
            The world rank.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=0, hosts=("h",) * 4, partitions=2,
                        placement_strategy="spread")
        assert topo.rank_of(1, 0) == 2
        ```
        """
        for name, value, size in (("pp_rank", pp_rank, self.pp_size),
                                  ("dp_rank", dp_rank, self.dp_size),
                                  ("tp_rank", tp_rank, self.tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(
                    f"{name} must be an int in 0..{size - 1}, received {value!r}."
                )
        if self.placement_strategy == "cluster":
            group = dp_rank * self.pp_size + pp_rank
        else:
            group = pp_rank * self.dp_size + dp_rank
        return group * self.tp_size + tp_rank

    def pp_group(self, rank: int | None = None) -> tuple[int, ...]:
        """Returns the ranks of a rank's pipeline (model) replica, by stage.

        Args:
            rank: A world rank; defaults to this process's rank.

        Returns:
            `pp_size` world ranks; element `i` holds stage `i`.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=2, hosts=("h",) * 4, partitions=2)
        assert topo.pp_group() == (2, 3)
        ```
        """
        rank = self.rank if rank is None else rank
        dp_rank, tp_rank = self.coords(rank)[1], self.tp_of(rank)
        return tuple(self.rank_of(s, dp_rank, tp_rank) for s in range(self.pp_size))

    def dp_group(self, rank: int | None = None) -> tuple[int, ...]:
        """Returns the ranks holding the same stage as a rank, by replica.

        Args:
            rank: A world rank; defaults to this process's rank.

        Returns:
            `dp_size` world ranks; element `i` belongs to replica `i`.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=1, hosts=("h",) * 4, partitions=2)
        assert topo.dp_group() == (1, 3)
        ```
        """
        rank = self.rank if rank is None else rank
        pp_rank, tp_rank = self.coords(rank)[0], self.tp_of(rank)
        return tuple(self.rank_of(pp_rank, d, tp_rank) for d in range(self.dp_size))

    def tp_group(self, rank: int | None = None) -> tuple[int, ...]:
        """Returns the ranks splitting a rank's stage, by tensor-parallel rank.

        Example:

        ```python
        from keras_smp.topology import Topology

        topo = Topology(world_size=4, rank=3, hosts=("h",) * 4, tensor_parallel_degree=2)
        assert topo.tp_group() == (2, 3) and topo.dp_group() == (1, 3)
        ```
        """
        rank = self.rank if rank is None else rank
        pp_rank, dp_rank = self.coords(rank)
        return tuple(self.rank_of(pp_rank, dp_rank, t) for t in range(self.tp_size))

    def mp_group(self, rank: int | None = None) -> tuple[int, ...]:
        """Returns the ranks of a rank's model replica, by `mp_rank`."""
        rank = self.rank if rank is None else rank
        dp_rank = self.coords(rank)[1]
        return tuple(self.rank_of(s, dp_rank, t) for s in range(self.pp_size)
                     for t in range(self.tp_size))

    def mp_of(self, rank: int) -> int:
        """Returns the `mp_rank` of a world rank."""
        return self.coords(rank)[0] * self.tp_size + self.tp_of(rank)
