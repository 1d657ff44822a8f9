"""Process-wide state: the active config, cluster and topology.

`SMPStrategy` (and later `smp.init`) installs them; the rank helpers read
them. Before either ran, the helpers resolve the cluster from the
environment (TF_CONFIG, SLURM, or a single process) with the config from
`SMP_CONFIG`, so `keras_smp.rank()` works at the top of any script.
"""

import threading

from keras_smp.config import SMPConfig
from keras_smp.topology import Topology
from keras_smp.topology import resolve_cluster

_lock = threading.Lock()
_state = {}


def install(config, cluster, topology):
    """Makes `config`, `cluster`, `topology` the process-wide state."""
    with _lock:
        _state.update(config=config, cluster=cluster, topology=topology)


def reset():
    """Forgets the installed state (tests)."""
    with _lock:
        _state.clear()


def _ensure():
    with _lock:
        if not _state:
            config = SMPConfig.build()
            cluster = resolve_cluster()
            topology = Topology.from_cluster(
                cluster, partitions=config.partitions,
                placement_strategy=config.placement_strategy)
            _state.update(config=config, cluster=cluster, topology=topology)
        return _state


def config():
    """Returns the active `SMPConfig`."""
    return _ensure()["config"]


def cluster():
    """Returns the active `ClusterInfo`."""
    return _ensure()["cluster"]


def topology():
    """Returns the active `Topology`."""
    return _ensure()["topology"]
