"""Which device runs which pipeline stage of which replica (pure Python).

`StageLayout` is the one place that maps (local model replica, pipeline
stage) to a device. `keras_smp.runtime.start` builds it once per process
from the config, the topology and the local devices; `SMPStrategy`,
`DistributedModel`, `@smp.step` and the gradient all-reduce read it.

Three modes (`resolve_mode` picks one):

- `"none"`: `partitions=1`; every local device holds a whole replica.
- `"in_process"`: every process holds whole pipelines; local replica `r`
  runs stage `s` on local device `r * P + s` (`P = partitions`).
- `"multi_process"`: one stage per process (`pp_rank`); the pipeline of a
  replica spans `P` processes.

Example:

>>> from keras_smp.topology import Topology
>>> topo = Topology(world_size=1, rank=0, hosts=("a",))
>>> layout = StageLayout.build("in_process", 2, topo, "CPU", 4)
>>> layout.devices
(('/device:CPU:0', '/device:CPU:1'), ('/device:CPU:2', '/device:CPU:3'))
>>> layout.local_stages, layout.num_local_replicas
((0, 1), 2)
>>> layout.stage_device(1, 0)
'/device:CPU:2'
"""

from dataclasses import dataclass

from keras_smp.topology import Topology

MODES = ("none", "in_process", "multi_process")


def resolve_mode(partitions, local_devices, world_size, has_gpus):
    """Returns `(local devices to create or None, pipeline mode)`.

    - `partitions=1`: mode `"none"`.
    - several processes with one device each (`local_devices=1`, or unset
      without GPUs): one stage per process, `"multi_process"`;
      `partitions` must divide the number of processes.
    - otherwise every process runs whole pipelines, `"in_process"` (on CPUs
      with `local_devices` unset: `partitions` logical devices).

    >>> resolve_mode(1, None, 4, False)
    (None, 'none')
    >>> resolve_mode(2, None, 4, False)
    (1, 'multi_process')
    >>> resolve_mode(2, None, 1, False)
    (2, 'in_process')
    >>> resolve_mode(2, None, 3, False)
    Traceback (most recent call last):
    ...
    ValueError: partitions=2 does not divide the number of worker processes world_size=3. Use a multiple of 2 workers (one pipeline stage per process), or set local_devices=2 to run a whole pipeline inside every process.
    """
    p = partitions
    if p == 1:
        return local_devices, "none"
    w = world_size
    one_device = local_devices == 1 or (local_devices is None and not has_gpus)
    if w > 1 and one_device:
        if w % p:
            raise ValueError(
                f"partitions={p} does not divide the number of worker "
                f"processes world_size={w}. Use a multiple of {p} workers "
                f"(one pipeline stage per process), or set local_devices={p} "
                "to run a whole pipeline inside every process.")
        return 1, "multi_process"
    if local_devices is None and not has_gpus:
        return p, "in_process"
    return local_devices, "in_process"


def check_tensor_parallel(tensor_parallel_degree, partitions, local_devices,
                          world_size):
    """Checks that tensor parallelism can run as configured; returns
    whether its ranks are the local devices of one process.

    Two layouts:

    - one tensor-parallel rank per worker process with one device
      (`local_devices` unset or 1); with `partitions > 1` each pipeline
      stage's tensor-parallel ranks are processes too (tensor x pipeline x
      data parallelism);
    - one process whose `local_devices` are the ranks (GPUs, or logical
      CPUs for notebooks and tests): `local_devices ==
      tensor_parallel_degree`, `partitions=1`.

    >>> check_tensor_parallel(2, 1, None, 4)
    False
    >>> check_tensor_parallel(2, 2, None, 8)
    False
    >>> check_tensor_parallel(2, 1, 2, 1)
    True
    >>> check_tensor_parallel(2, 1, None, 1)
    Traceback (most recent call last):
    ...
    ValueError: tensor_parallel_degree=2 runs one tensor-parallel rank per worker process, or one per local device of a single process, but this job has 1 process and local_devices=None. Start a multiple of 2 processes (`keras-smp launch -n 2 -- python train.py`, or `keras_smp.notebook_launcher(fn, num_workers=2)` in a notebook), or in one process set local_devices=2 (with partitions=1).
    """
    t = tensor_parallel_degree
    if t == 1:
        return False
    if world_size == 1 and local_devices == t and partitions == 1:
        return True
    if world_size == 1 or local_devices not in (None, 1):
        n = t * partitions
        if world_size > 1:
            where = (f"this job has {world_size} processes and "
                     f"local_devices={local_devices} (use 1: with several "
                     "processes, each is one rank)")
        elif partitions > 1:
            where = (f"this job has 1 process and partitions={partitions} "
                     "(the ranks of one process's devices split a whole "
                     "model: partitions=1)")
        else:
            where = f"this job has 1 process and local_devices={local_devices}"
        raise ValueError(
            f"tensor_parallel_degree={t} runs one tensor-parallel rank per "
            "worker process, or one per local device of a single process, "
            f"but {where}. Start a multiple of {n} processes (`keras-smp "
            f"launch -n {n} -- python train.py`, or "
            f"`keras_smp.notebook_launcher(fn, num_workers={n})` in a "
            f"notebook), or in one process set local_devices={t} (with "
            "partitions=1).")
    return False


def topology_for(cluster, partitions, placement_strategy, mode,
                 tensor_parallel_degree=1):
    """The job's `Topology` for a pipeline `mode`.

    Only one stage per process (`"multi_process"`) splits the processes
    into pipeline stages; otherwise every process is a data-parallel
    replica (`pp_size == 1`).

    >>> from keras_smp.topology import resolve_cluster
    >>> topology_for(resolve_cluster(environ={}), 2, "cluster",
    ...              "in_process").pp_size
    1
    """
    return Topology.from_cluster(
        cluster, partitions=partitions if mode == "multi_process" else 1,
        placement_strategy=placement_strategy,
        tensor_parallel_degree=tensor_parallel_degree)


@dataclass(frozen=True)
class StageLayout:
    """Devices of this process's model replicas and pipeline stages.

    Fields:
        mode: `"none"`, `"in_process"` or `"multi_process"`.
        num_stages: the model's pipeline stages `P` (1 for `"none"`).
        local_stages: the stage indices this process runs: all `P`, or
            `(pp_rank,)` with one stage per process.
        devices: per local replica, a tuple of device strings, one per
            entry of `local_stages`.
        device_type: `"CPU"` or `"GPU"`.
        pp_rank, pp_size, dp_rank, dp_size: the process's coordinates in
            the `Topology` (process counts: the replicas in sync are
            `dp_size * num_local_replicas`).

    Example (one stage per process, rank 3 of 4 = stage 1 of replica 1):

    >>> from keras_smp.topology import Topology
    >>> topo = Topology(world_size=4, rank=3, hosts=("a",) * 4, partitions=2)
    >>> layout = StageLayout.build("multi_process", 2, topo, "CPU", 1,
    ...                            worker_device="/job:worker/task:3")
    >>> layout.local_stages, layout.stage_devices()
    ((1,), ['/job:worker/task:3/device:CPU:0'])
    >>> layout.stage_device(0, 1)
    '/job:worker/task:3/device:CPU:0'
    >>> (layout.pp_rank, layout.pp_size, layout.dp_rank, layout.dp_size)
    (1, 2, 1, 2)
    """

    mode: str
    num_stages: int
    local_stages: tuple
    devices: tuple
    device_type: str = "CPU"
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"StageLayout mode must be one of {MODES}; received "
                f"{self.mode!r}.")
        if not self.devices or any(
                len(row) != len(self.local_stages) for row in self.devices):
            raise ValueError(
                "StageLayout needs, for every local replica, one device per "
                f"local stage {self.local_stages}; received {self.devices!r}.")

    @classmethod
    def build(cls, mode, partitions, topology, device_type, device_count,
              worker_device="", share_devices=False):
        """Lays out `device_count` local devices of `device_type`.

        Args:
            mode: `"none"`, `"in_process"` or `"multi_process"`.
            partitions: pipeline stages per model replica (`P`).
            topology: the job's `Topology` (see `topology_for`).
            device_type: `"CPU"` or `"GPU"`.
            device_count: local devices of that type to use.
            worker_device: prefix of local device names, e.g.
                `"/job:worker/task:0"` in a multi-worker job, `""` alone.
            share_devices: `"in_process"`: one replica whose stage `s`
                runs on device `s % device_count` (custom loops), whatever
                the number of devices.

        Raises:
            ValueError: the stages do not divide the local devices.
        """
        if mode not in MODES:
            raise ValueError(
                f"StageLayout mode must be one of {MODES}; received {mode!r}.")
        names = [f"{worker_device}/device:{device_type}:{i}"
                 for i in range(device_count)]
        coords = dict(pp_rank=topology.pp_rank, pp_size=topology.pp_size,
                      dp_rank=topology.dp_rank, dp_size=topology.dp_size,
                      device_type=device_type)
        if mode == "none":
            return cls(mode, 1, (0,), tuple((d,) for d in names), **coords)
        if mode == "multi_process":
            return cls(mode, partitions, (topology.pp_rank,),
                       tuple((d,) for d in names), **coords)
        p = partitions
        stages = tuple(range(p))
        if share_devices and device_count > 0:
            return cls(mode, p, stages,
                       (tuple(names[s % device_count] for s in stages),),
                       **coords)
        if device_count % p or not device_count:
            raise ValueError(
                f"partitions={p} pipeline stages do not divide the "
                f"{device_count} local {device_type} device(s) of this "
                "process: each model replica needs one device per stage. "
                f"Use local_devices={p * max(1, device_count // p)} (a "
                f"multiple of {p}), or a different number of partitions.")
        return cls(mode, p, stages,
                   tuple(tuple(names[r * p:(r + 1) * p])
                         for r in range(device_count // p)), **coords)

    @property
    def num_local_replicas(self):
        """Model replicas (pipelines, or stage copies) in this process."""
        return len(self.devices)

    @property
    def replica_devices(self):
        """The device of each local replica's first local stage (where its
        input batch arrives)."""
        return tuple(row[0] for row in self.devices)

    def stage_devices(self, local_replica=0):
        """The device of each local stage of local replica `local_replica`."""
        return list(self._row(local_replica))

    def stage_device(self, local_replica, stage):
        """The device of pipeline stage `stage` of a local replica."""
        row = self._row(local_replica)
        if stage not in self.local_stages:
            raise ValueError(
                f"stage {stage!r} is not run by this process: its local "
                f"stages are {self.local_stages} of {self.num_stages} "
                f"(mode {self.mode!r}, pp_rank {self.pp_rank}). Ask the "
                "process that runs it, or use a stage index in local_stages.")
        return row[self.local_stages.index(stage)]

    def with_default_devices(self):
        """The same layout with every stage on the default device (`""`)."""
        return StageLayout(
            self.mode, self.num_stages, self.local_stages,
            (("",) * len(self.local_stages),), self.device_type,
            self.pp_rank, self.pp_size, self.dp_rank, self.dp_size)

    def _row(self, local_replica):
        if (isinstance(local_replica, bool) or not isinstance(local_replica, int)
                or not 0 <= local_replica < len(self.devices)):
            raise ValueError(
                f"local replica {local_replica!r} does not exist: this "
                f"process holds {len(self.devices)} replica(s) "
                f"(0..{len(self.devices) - 1}).")
        return self.devices[local_replica]
