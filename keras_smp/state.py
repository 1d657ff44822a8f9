"""Process-wide state: the active config, cluster, topology and runtime.

`keras_smp.runtime.process.start` (run by `SMPStrategy` and `smp.init`)
installs them; the rank helpers read them. Before either ran, the helpers
resolve the cluster from the environment (TF_CONFIG, SLURM, or a single
process) with the config from `SMP_CONFIG`, so `keras_smp.rank()` works at
the top of any script. The topology is built as the runtime will build it
(`runtime.layout.topology_for`), assuming no GPUs: one pipeline stage per
process when several processes have one device each.
"""

import threading

from keras_smp.config import SMPConfig
from keras_smp.runtime.layout import resolve_mode
from keras_smp.runtime.layout import topology_for
from keras_smp.topology import resolve_cluster

_lock = threading.Lock()
_state = {}


def install(config, cluster, topology, runtime=None, replica_rank=None):
    """Makes `config`, `cluster`, `topology` (and the started `runtime`)
    the process-wide state. `replica_rank`: with tensor-parallel ranks on
    the local devices of this process, a function giving the rank of the
    replica whose step runs now (`keras_smp.tp_rank()`)."""
    with _lock:
        _state.clear()
        _state.update(config=config, cluster=cluster, topology=topology)
        if runtime is not None:
            _state["runtime"] = runtime
        if replica_rank is not None:
            _state["replica_rank"] = replica_rank


def reset():
    """Forgets the installed state (tests)."""
    with _lock:
        _state.clear()


def _ensure():
    with _lock:
        if not _state:
            config = SMPConfig.build()
            cluster = resolve_cluster()
            _, mode = resolve_mode(config.partitions, config.local_devices,
                                   cluster.world_size, has_gpus=False)
            topology = topology_for(cluster, config.partitions,
                                    config.placement_strategy, mode)
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


def runtime():
    """Returns the started `keras_smp.runtime.Runtime`, or `None`."""
    with _lock:
        return _state.get("runtime")


def replica_rank():
    """The `replica_rank` function installed with the state, or `None`."""
    with _lock:
        return _state.get("replica_rank")
