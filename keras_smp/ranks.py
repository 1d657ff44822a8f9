"""Rank helpers with SMP's names: `rank()`, `dp_rank()`, `pp_size()`, ...

Ranks count worker *processes*. `dp_rank()` is what scripts use to seed
shuffling and shard data. With several devices per process
(`local_devices > 1`), `SMPStrategy.num_replicas_in_sync` is
`dp_size() * local_devices`.

Example:

>>> import keras_smp
>>> keras_smp.rank(), keras_smp.size()
(0, 1)
"""

from keras_smp import state


def rank():
    """World rank of this process (0 is the chief)."""
    return state.topology().rank


def size():
    """Number of worker processes in the job."""
    return state.topology().world_size


def local_rank():
    """Rank of this process among the processes on its host."""
    return state.topology().local_rank


def local_size():
    """Number of processes on this process's host."""
    return state.topology().local_size


def dp_rank():
    """Index of this process's model replica (data-parallel rank)."""
    return state.topology().dp_rank


def dp_size():
    """Number of model replicas (data-parallel degree) across processes."""
    return state.topology().dp_size


def pp_rank():
    """Pipeline stage held by this process."""
    return state.topology().pp_rank


def pp_size():
    """Number of pipeline stages (`partitions`)."""
    return state.topology().pp_size


def _local_tp():
    """Tensor-parallel ranks that are local devices of this process (1:
    none; the ranks are processes)."""
    runtime = state.runtime()
    return getattr(runtime, "local_tensor_parallel", 1) or 1


def tp_rank():
    """Index of this process in its tensor-parallel group. With the ranks
    on the local devices of one process (`local_devices ==
    tensor_parallel_degree`): the rank of the replica whose step runs
    now, 0 outside the steps."""
    replica_rank = state.replica_rank()
    if replica_rank is not None:
        return replica_rank()
    return state.topology().tp_rank


def tp_size():
    """Tensor-parallel degree (`tensor_parallel_degree`)."""
    return max(state.topology().tp_size, _local_tp())


def mp_rank():
    """Model-parallel rank: `pp_rank() * tp_size() + tp_rank()` (SMP's
    rank within a model replica, tensor x pipeline)."""
    if _local_tp() > 1:
        return state.topology().pp_rank * tp_size() + tp_rank()
    return state.topology().mp_rank


def mp_size():
    """Model-parallel degree: `pp_size() * tp_size()`."""
    return state.topology().pp_size * tp_size()


def is_chief():
    """True on world rank 0, which prints progress and writes files."""
    return rank() == 0
