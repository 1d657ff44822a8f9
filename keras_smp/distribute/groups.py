"""Communication groups for gradient sync, in pure Python (no TensorFlow).

A *replica* is one model copy on one device: global replica id
`worker_rank * devices_per_worker + local_device`. Each algorithm is
described as the list of groups (tuples of replica ids) it communicates in;
the executor in `allreduce.py` turns each group into TF collectives.
"""

from dataclasses import dataclass

ALGORITHMS = ("ring", "hierarchical", "horovod")


@dataclass(frozen=True)
class ReplicaLayout:
    """Where every data-parallel replica lives.

    Args:
        replica_hosts: host index of every global replica, in replica order.
        replica_id: id of the replica this plan is made for (local view).

    Example:

    >>> layout = ReplicaLayout.from_workers(worker_hosts=(0, 0, 1, 1),
    ...                                     devices_per_worker=1, worker_rank=2)
    >>> layout.intra_host_group, layout.cross_host_group
    ((2, 3), (0, 2))
    """

    replica_hosts: tuple
    replica_id: int = 0

    @classmethod
    def from_workers(cls, worker_hosts, devices_per_worker, worker_rank=0,
                     local_device=0):
        hosts = tuple(h for h in worker_hosts for _ in range(devices_per_worker))
        return cls(hosts, worker_rank * devices_per_worker + local_device)

    def for_replica(self, replica_id):
        return ReplicaLayout(self.replica_hosts, replica_id)

    @property
    def size(self):
        return len(self.replica_hosts)

    @property
    def num_hosts(self):
        return len(set(self.replica_hosts))

    def host_members(self, host):
        return tuple(
            r for r, h in enumerate(self.replica_hosts) if h == host)

    @property
    def local_size(self):
        return len(self.host_members(self.replica_hosts[self.replica_id]))

    @property
    def local_index(self):
        members = self.host_members(self.replica_hosts[self.replica_id])
        return members.index(self.replica_id)

    @property
    def world_group(self):
        return tuple(range(self.size))

    @property
    def intra_host_group(self):
        return self.host_members(self.replica_hosts[self.replica_id])

    @property
    def cross_host_group(self):
        """Replicas with this replica's local index, one per host."""
        idx = self.local_index
        hosts = sorted(set(self.replica_hosts))
        return tuple(self.host_members(h)[idx] for h in hosts)

    def all_groups(self):
        """Every group any replica of the cluster uses, in a fixed order.

        All workers enumerate the same list, so group keys derived from the
        position in it agree cluster-wide.
        """
        hosts = sorted(set(self.replica_hosts))
        members = {h: [] for h in hosts}
        for r, h in enumerate(self.replica_hosts):
            members[h].append(r)
        groups = [self.world_group]
        groups += [tuple(members[h]) for h in hosts]
        if self.is_uniform:
            # Replica r's cross-host group: the replicas of r's local index
            # on every host; the first replica of local index i comes
            # before the first of index i + 1.
            groups += [tuple(members[h][i] for h in hosts)
                       for i in range(len(members[hosts[0]]))]
        return list(dict.fromkeys(groups))

    @property
    def is_uniform(self):
        """True when every host holds the same number of replicas."""
        counts = {}
        for h in self.replica_hosts:
            counts[h] = counts.get(h, 0) + 1
        return len(set(counts.values())) == 1


def resolve_algorithm(name, layout):
    """Turns `allreduce="auto"` into a concrete algorithm for `layout`.

    "auto" picks "hierarchical" when there is more than one host and more
    than one replica per host, else "ring". An explicit "hierarchical" on a
    layout whose hosts hold different numbers of replicas is an error.
    """
    if name == "auto":
        if layout.num_hosts > 1 and layout.local_size > 1 and layout.is_uniform:
            return "hierarchical"
        return "ring"
    if name == "hierarchical" and not layout.is_uniform:
        counts = {h: layout.replica_hosts.count(h)
                  for h in sorted(set(layout.replica_hosts))}
        raise ValueError(
            "allreduce='hierarchical' needs the same number of replicas on "
            f"every host; received replicas per host {counts}. Use "
            "allreduce='ring' or balance the workers across hosts.")
    if name not in ALGORITHMS:
        raise ValueError(
            f"Unknown allreduce algorithm {name!r}; expected one of "
            f"{('auto',) + ALGORITHMS}.")
    return name


def stage_replica_layout(topology, devices_per_worker, multi_process,
                         rank=None):
    """The `ReplicaLayout` of the replicas that sum gradients with `rank`.

    All workers (each holding whole pipelines), or with one pipeline stage
    per process (`multi_process`) the data-parallel group of `rank`'s
    stage; `rank` defaults to the topology's own.

    >>> from keras_smp.topology import Topology
    >>> topo = Topology(world_size=4, rank=3, hosts=("a", "a", "b", "b"),
    ...                 partitions=2)
    >>> stage_replica_layout(topo, 1, multi_process=True).replica_hosts
    (0, 1)
    """
    rank = topology.rank if rank is None else rank
    peers = (topology.dp_group(rank) if multi_process
             else tuple(range(topology.world_size)))
    host_index = {label: i for i, label in enumerate(topology.host_labels)}
    return ReplicaLayout.from_workers(
        worker_hosts=tuple(host_index[topology.hosts[r]] for r in peers),
        devices_per_worker=devices_per_worker,
        worker_rank=peers.index(rank))


def group_key_counts(topology, devices_per_worker, num_local_stages,
                     multi_process):
    """Group keys the gradient all-reduce needs, per block of keys.

    `GradientAllReduce` takes one group key per (local stage, group of
    `ReplicaLayout.all_groups()`). With one stage per process
    (`multi_process`, or tensor-parallel ranks in processes) every
    pipeline stage's (and tensor-parallel rank's) data-parallel group needs
    its own keys: one block per `mp_rank`, in order, so that every process
    allocates the same total and uses its own block. Otherwise one block.

    >>> from keras_smp.topology import Topology
    >>> topo = Topology(world_size=6, rank=0, hosts=tuple("aaabcc"),
    ...                 partitions=2, placement_strategy="spread")
    >>> group_key_counts(topo, 1, 1, multi_process=True)
    [4, 3]
    """
    if not multi_process:
        layout = stage_replica_layout(topology, devices_per_worker, False)
        return [num_local_stages * len(layout.all_groups())]
    return [num_local_stages * len(stage_replica_layout(
        topology, devices_per_worker, True,
        rank=topology.rank_of(s, 0, t)).all_groups())
        for s in range(topology.pp_size) for t in range(topology.tp_size)]
