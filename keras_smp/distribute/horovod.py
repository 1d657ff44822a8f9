"""Horovod as the gradient-sync backend of `SMPStrategy` (`allreduce="horovod"`).

keras-smp initialises Horovod itself (scripts must not call `hvd.init()`):
one Horovod process set per pipeline stage's data-parallel group when each
process holds one stage, the global set otherwise. Then

- every variable's initial value is broadcast from world rank 0 with
  `hvd.broadcast` (instead of TensorFlow's collective broadcast), and
- gradients are packed into keras-smp's fusion buckets and summed with
  `hvd.allreduce` over the stage's data-parallel group.

Everything else (metrics, losses, the cluster itself) still runs on
TensorFlow's runtime, so jobs are started with `keras-smp launch --horovod`,
which gives each worker both its `TF_CONFIG` and its `HOROVOD_*` variables.
Horovod's TensorFlow ops accept neither bfloat16 (all-reduce) nor unsigned
32/64-bit integers (broadcast): those travel as float32 / int64, exactly.
"""

import atexit
import itertools

import tensorflow as tf

from keras_smp.distribute.allreduce import GradientAllReduce
from keras_smp.runtime import shutdown

# What Horovod 0.28's TensorFlow ops accept; other dtypes are cast.
_ALLREDUCE_DTYPES = {tf.float16, tf.float32, tf.float64, tf.int32, tf.int64,
                     tf.int8, tf.uint8}
_BROADCAST_DTYPES = _ALLREDUCE_DTYPES | {tf.bool, tf.int16, tf.uint16}


def import_horovod(what="allreduce='horovod'"):
    """Returns `horovod.tensorflow`, or raises an ImportError saying how to get it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            f"{what} needs Horovod (horovod.tensorflow), which is not "
            "installed in this Python environment. Build the Horovod "
            "environment with `bash scripts/horovod-env.sh` (TensorFlow "
            "2.15.1, Horovod 0.28.1 with Gloo) and run there, or use "
            "keras-smp's own all-reduce (allreduce='ring' / 'hierarchical' / "
            "'auto', or horovod=False in custom loops: TensorFlow collectives, "
            "no Horovod needed).") from e
    return hvd


def init(topology, stage_groups=None, what="allreduce='horovod'"):
    """Initialises Horovod for `topology`; returns `(hvd, process_set)`.

    Args:
        topology: the job's `Topology` (world ranks must equal Horovod's).
        stage_groups: the data-parallel group (world ranks) of every pipeline
            stage when each process holds one stage; `None`: one group, the
            world.
        what: what needs Horovod, for error messages.

    Returns:
        The `horovod.tensorflow` module and the process set this rank's
        gradients are summed over.
    """
    hvd = import_horovod(what)
    groups = [tuple(g) for g in stage_groups or ()]
    if len(groups) <= 1:
        groups = []
    if not hvd.is_initialized():
        sets = [hvd.ProcessSet(list(g)) for g in groups]
        hvd.init(process_sets=sets)
        _process_sets.update(zip(groups, sets))
        # Horovod shuts itself down at exit (an atexit hook, which would
        # run before keras-smp's wait for the other ranks): after it, so
        # that the first rank to finish does not shut Horovod down under
        # ranks still in all-reduces.
        atexit.unregister(hvd.shutdown)
        shutdown.after_wait(hvd.shutdown)
    if hvd.size() != topology.world_size or hvd.rank() != topology.rank:
        raise RuntimeError(
            f"{what}: Horovod sees rank {hvd.rank()} of "
            f"{hvd.size()}, but keras-smp's cluster (TF_CONFIG / SLURM) has "
            f"rank {topology.rank} of {topology.world_size}. Start the job "
            "with `keras-smp launch --horovod -n N`, which sets up both "
            "consistently.")
    if not groups:
        return hvd, hvd.global_process_set
    mine = next(g for g in groups if topology.rank in g)
    if mine not in _process_sets:
        raise RuntimeError(
            f"{what}: Horovod was initialised before keras-smp, "
            "without a process set for this stage's data-parallel group "
            f"{list(mine)}. Do not call hvd.init() yourself: keras-smp "
            "initialises Horovod with the groups its pipeline needs.")
    return hvd, _process_sets[mine]


# Process sets keras-smp created in `hvd.init`, by their ranks.
_process_sets = {}


class HorovodAllReduce(GradientAllReduce):
    """Fused gradient all-reduce with `hvd.allreduce` over one process set.

    One model replica per process (Horovod's model: one process per
    device); pipeline stages inside the process each reduce their own
    gradients on their own device.

    Args:
        hvd: the initialised `horovod.tensorflow` module.
        process_set: the Horovod process set of this stage's replicas.
        **kwargs: as for `GradientAllReduce` (without `algorithm`).
    """

    _ALGORITHMS = ("horovod",)

    def __init__(self, hvd, process_set, **kwargs):
        self._hvd = hvd
        self._process_set = process_set
        super().__init__(algorithm="horovod", **kwargs)
        if len(self._devices) != 1:
            raise ValueError(
                "allreduce='horovod' runs one model replica per process "
                f"(one process per device, as Horovod does); this process "
                f"has {len(self._devices)} replicas on {list(self._devices)}. "
                "Use local_devices equal to the number of pipeline stages "
                "(1 without pipelining) and start one process per replica, "
                "or use allreduce='ring' / 'hierarchical'.")
        self._names = itertools.count()

    def _reduce_flat(self, flat, replica_id, stage, options):
        dtype = flat.dtype
        wire = flat if dtype in _ALLREDUCE_DTYPES else tf.cast(flat, tf.float32)
        out = self._hvd.allreduce(
            wire, op=self._hvd.Sum, process_set=self._process_set,
            name=f"keras_smp_grad_s{stage}_{next(self._names)}")
        return out if dtype in _ALLREDUCE_DTYPES else tf.cast(out, dtype)


_broadcasts = itertools.count()


def broadcast_initial_value(hvd, value, root_rank=0):
    """`value` as world rank `root_rank` has it (every rank must call)."""
    dtype = value.dtype
    if dtype in _BROADCAST_DTYPES:
        wire = value
    elif dtype.is_integer:
        wire = tf.cast(value, tf.int64)
    else:
        wire = tf.cast(value, tf.float32)
    out = hvd.broadcast(wire, root_rank=root_rank,
                        name=f"keras_smp_init_{next(_broadcasts)}")
    return out if out.dtype == dtype else tf.cast(out, dtype)
