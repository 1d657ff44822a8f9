"""The process's keras-smp runtime: TensorFlow set-up below everything else.

`keras_smp.runtime.process.start(config)` (called by `SMPStrategy(...)`
and by `smp.init(...)`) resolves the cluster once, builds the `Topology`
and the `StageLayout`, configures the local devices and TensorFlow's
cluster, collective ops and coordination service, installs the Keras /
TensorFlow patches (`runtime.patches`) and returns a `Runtime`.

Layers, each importing only the ones before it:

1. pure Python: `config`, `topology`, `state`, `ranks`, `launch`,
   `runtime.keys` (collective keys), `runtime.layout` (stage -> device),
   `runtime.placement` (variable placement settings);
2. the runtime: `runtime.process`, `runtime.errors`, `runtime.patches`,
   `runtime.tf_private`, `runtime.keras_private`;
3. `keras_smp.distribute` and `keras_smp.pipeline`;
4. `keras_smp.smp` (SageMaker smp's custom-loop API), `SMPStrategy`,
   `DistributedModel`.

This package itself is pure Python: `current()` and `of()` work without
TensorFlow.

Example:

>>> from keras_smp import runtime
>>> rt = runtime.current()      # nothing started: resolved from the environment
>>> rt.started, rt.topology.world_size
(False, 1)
>>> runtime.of(object()) is None
True
"""

import contextlib
from dataclasses import dataclass
from typing import Any

from keras_smp.runtime.keys import KeyAllocator
from keras_smp.runtime.keys import process_keys
from keras_smp.runtime.layout import StageLayout


@dataclass(frozen=True)
class Runtime:
    """What `runtime.process.start` set up (or, unstarted, would).

    Fields:
        config: the validated `SMPConfig`.
        cluster: the `ClusterInfo` (TF_CONFIG, SLURM or one process).
        topology: the `Topology` (pipeline x data-parallel ranks).
        layout: the `StageLayout` (stage -> device); `None` until started
            (devices are only known once TensorFlow runs).
        keys: the process's collective `KeyAllocator`.
        started: whether TensorFlow was set up for it.
        collectives: whether TensorFlow's multi-worker collective runtime
            (gRPC server, collective ops, coordination service) runs.
        local_tensor_parallel: tensor-parallel ranks that are local
            devices of this one process (`local_devices ==
            tensor_parallel_degree`), or 1.
    """

    config: Any
    cluster: Any
    topology: Any
    layout: StageLayout | None = None
    keys: KeyAllocator | None = None
    started: bool = False
    collectives: bool = False
    local_tensor_parallel: int = 1

    @property
    def mode(self):
        """The pipeline mode (`"none"`, `"in_process"`, `"multi_process"`),
        or `None` before the runtime started."""
        return self.layout.mode if self.layout is not None else None

    @property
    def is_chief(self):
        """True on world rank 0."""
        return self.topology.rank == 0


def current():
    """The active `Runtime`.

    The one started last by `SMPStrategy` or `smp.init`; before either, an
    unstarted one resolved from the environment (`SMP_CONFIG`, TF_CONFIG or
    SLURM) without TensorFlow.
    """
    from keras_smp import state

    installed = state.runtime()
    if installed is not None:
        return installed
    return Runtime(config=state.config(), cluster=state.cluster(),
                   topology=state.topology(), layout=None,
                   keys=process_keys(), started=False)


def of(strategy):
    """The `Runtime` of `strategy` if it is an `SMPStrategy`, else `None`.

    Recognised by its `_smp_runtime` attribute, so layers below the
    strategy need not import it.
    """
    return getattr(strategy, "_smp_runtime", None)


_sparse_as_is = []


@contextlib.contextmanager
def sparse_gradients_as_is():
    """Within: gradient all-reduces keep sparse gradients sparse.

    Norm clipping counts a sparse gradient's rows as Keras does (each row
    as it comes, repeated ids included), and so do optimizers other than
    SGD (Adam squares each row); summed densely, repeated rows would merge
    and the norm or the step would differ from single-device training.
    Process-wide (not thread-local): TensorFlow may run the all-reduce in
    another thread than the one entering this.
    """
    _sparse_as_is.append(True)
    try:
        yield
    finally:
        _sparse_as_is.pop()


def keep_sparse():
    """Whether `sparse_gradients_as_is` is active."""
    return bool(_sparse_as_is)


_summing_gradients = []


@contextlib.contextmanager
def summing_gradients():
    """Within: the data-parallel all-reduces sum gradients (the optimizer's
    gradient sync), whose float32 values `allreduce_compression` may send
    as 16-bit floats (`keras_smp.distribute.compression`); every other
    all-reduce (metrics, losses, moving statistics) is exact. Sums inside
    the sync that must stay exact are not float32 (the replicas' float64
    count checks). Process-wide, as `sparse_gradients_as_is`: it is read
    when the all-reduce is traced, and the replicas of one process trace
    their steps in turn, in threads of their own (a `GradientAllReduce`
    traced by another thread at the same moment would read it too)."""
    _summing_gradients.append(True)
    try:
        yield
    finally:
        _summing_gradients.pop()


def gradients_being_summed():
    """Whether `summing_gradients` is active."""
    return bool(_summing_gradients)


__all__ = ["Runtime", "current", "of", "keep_sparse",
           "sparse_gradients_as_is", "summing_gradients",
           "gradients_being_summed"]
