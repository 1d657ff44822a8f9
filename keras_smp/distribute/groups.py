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
        groups = [self.world_group]
        groups += [self.host_members(h) for h in sorted(set(self.replica_hosts))]
        if self.is_uniform:
            groups += [self.for_replica(r).cross_host_group
                       for r in range(self.size)]
        return list(dict.fromkeys(groups))

    @property
    def is_uniform(self):
        """True when every host holds the same number of replicas."""
        counts = {self.replica_hosts.count(h) for h in set(self.replica_hosts)}
        return len(counts) == 1


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
