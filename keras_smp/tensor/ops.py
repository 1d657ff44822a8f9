"""The collectives of tensor parallelism, with their gradients.

A `TensorGroup` is the processes splitting one pipeline stage's layers
(`Topology.tp_group()`), over TensorFlow's collective ops (gRPC between
processes; NCCL on GPUs). Megatron-LM's four operators:

| operator | forward | backward | used by |
|---|---|---|---|
| `copy_to(x)` | identity | all-reduce | input of a column-parallel layer |
| `reduce_from(x)` | all-reduce | identity | output of a row-parallel layer, vocab-parallel embedding |
| `gather_from(x, axis)` | all-gather on `axis` | this rank's slice | output of a lone column-parallel layer |
| `sum(x)` | all-reduce | (not differentiated) | gradient norms, finite checks |

Every rank of a group builds the same collectives in the same order (the
same program traces the same layers), so a per-group counter gives them
the same instance keys. Half-precision tensors cross as float32 (exactly
representable; TensorFlow's CPU collectives have no bfloat16 kernel).

Example (one process: a group of one is the identity):

>>> import tensorflow as tf
>>> group = TensorGroup(size=1, rank=0, group_key=1)
>>> float(group.reduce_from(tf.constant(2.0)))
2.0
"""

import collections
import contextlib
import functools
import itertools
import warnings

import tensorflow as tf

from keras_smp import tensor
from keras_smp.runtime import tf_private

_WIRE = {tf.float16: tf.float32, tf.bfloat16: tf.float32}

# Instance keys of a group (no other user shares its group key). A
# collective whose first dimension is only known when the step runs (the
# batch of a Keras step function, traced once for every batch size) takes
# a key that encodes it: TensorFlow keeps the shape of each (group,
# instance key) for the life of the process, so the last, smaller batch of
# an epoch must not reuse a key. Other collectives count from 1.
_BATCHED_BASE = 20_000_000
_ROWS_STRIDE = 100_000
MAX_ROWS = (2**31 - 1 - _BATCHED_BASE) // _ROWS_STRIDE - 1


def sharable(t):
    """Whether a batch's tensor `t` can be broadcast by a collective: a
    dense tensor with a batch axis, not of strings."""
    return (isinstance(t, tf.Tensor) and t.dtype != tf.string
            and bool(t.shape.rank))


class TensorGroup:
    """One tensor-parallel group of processes.

    Args:
        size: processes in the group (`tensor_parallel_degree`).
        rank: this process's index in it (`tp_rank`).
        group_key: the group's TensorFlow collective group key (the same
            on every member, from `runtime.keys`).
        timeout: seconds a collective may wait for the others (0: forever).
        initial_value_sync: `fn(value)` making a new weight's whole
            initial value the same on every process of the stage (the
            strategy's broadcast), or `None` (trust the seeds).
        stage_keys: for a process running several model stages on their
            own devices (`@smp.step`): the group key of each stage's
            collectives (a TensorFlow collective group has one device per
            process). Collectives made within `keras_smp.tensor.stage(s)`
            use stage `s`'s; the others (the optimizer's sums, weight
            gathers) use `group_key` on the default device.
        stage_devices: the device of each stage (for the collectives of
            its gradients, made outside the stage's device scope).
        local: the ranks are the local replicas of one process (its
            devices), not processes: `rank` is the index of the replica
            whose step is being traced (`rank` must be `None`).
        devices: a local group's device of each rank.
    """

    def __init__(self, size, rank, group_key, timeout=0.0,
                 initial_value_sync=None, stage_keys=None,
                 stage_devices=None, local=False, devices=None):
        if local and rank is not None:
            raise ValueError(
                "TensorGroup: a local group's rank is that of the replica "
                f"being traced; pass rank=None, not {rank!r}.")
        if local and len(devices or ()) != size:
            raise ValueError(
                f"TensorGroup: a local group of {size} ranks needs one "
                f"device per rank; received devices={devices!r}.")
        self.size = size
        self.local = bool(local)
        self.devices = tuple(devices or ())
        self._tokens = {}
        self._rank = rank
        self.group_key = group_key
        self.timeout = float(timeout or 0)
        self.initial_value_sync = initial_value_sync
        self.stage_keys = list(stage_keys or ())
        self.stage_devices = list(stage_devices or ())
        if len(self.stage_devices) not in (0, len(self.stage_keys)):
            raise ValueError(
                f"TensorGroup: {len(self.stage_keys)} stage_keys but "
                f"{len(self.stage_devices)} stage_devices; give one device "
                "per stage key.")
        # Instance-key counters per rank: a local group's ranks trace the
        # same collectives, in the same order, in one process.
        self._instances = collections.defaultdict(
            functools.partial(itertools.count, 1))
        self._batched = collections.defaultdict(itertools.count)

    @property
    def rank(self):
        """This rank's index in the group (a local group: the replica
        being traced, 0 outside a replica's step)."""
        if self.local:
            return tf_private.local_replica_index(self.size)
        return self._rank

    def _stage(self):
        """The model stage collectives are made for now (`None`: the
        default key and device)."""
        s = tensor.current_stage()
        if s is None or not self.stage_keys:
            return None
        if not 0 <= s < len(self.stage_keys):
            raise ValueError(
                f"keras-smp: a tensor-parallel collective for model stage "
                f"{s}, but the group has keys for {len(self.stage_keys)} "
                "stages (internal error).")
        return s

    def _device(self):
        """The device scope of a collective made now: its stage's device
        (whatever scope the caller is in: a gradient function, a
        recomputation), matching the stage's group key."""
        stage = self._stage()
        if stage is None or not self.stage_devices:
            return contextlib.nullcontext()
        return tf.device(self.stage_devices[stage])

    def __repr__(self):
        return (f"TensorGroup(size={self.size}, rank={self.rank}, "
                f"group_key={self.group_key})")

    # ---- plain collectives ------------------------------------------------

    def _common(self, x=None):
        if x is not None and x.shape.rank and None in x.shape[1:]:
            raise ValueError(
                f"keras-smp: a tensor-parallel collective on a tensor of shape "
                f"{x.shape}: only the batch (first) dimension may vary "
                "between steps. Give the model fixed sizes in the other "
                "dimensions (e.g. pad sequences to one length: "
                "keras.Input((length,))).")
        if x is not None and x.shape.rank and x.shape[0] is None:
            position = next(self._batched[self.rank])
            if position >= _ROWS_STRIDE:
                raise RuntimeError(
                    f"keras-smp: more than {_ROWS_STRIDE} tensor-parallel "
                    "collectives traced in this process; retracing step "
                    "functions without end? Keep input shapes fixed.")
            rows = tf.shape(x, out_type=tf.int32)[0]
            if self.local:
                # No assertion here: TensorFlow runs a function's stateful
                # ops in program order, so a local rank's collective
                # waiting on one would wait for the previous rank's next
                # collective (a deadlock). Larger batches share the last
                # key and fail TensorFlow's shape check instead.
                key = (_BATCHED_BASE + position
                       + tf.minimum(rows, MAX_ROWS) * _ROWS_STRIDE)
            else:
                check = tf.debugging.assert_less_equal(
                    rows, MAX_ROWS, message=(
                        f"keras-smp: tensor parallelism takes batches of at "
                        f"most {MAX_ROWS} rows; use a smaller batch."))
                with tf.control_dependencies([check]):
                    key = _BATCHED_BASE + position + rows * _ROWS_STRIDE
        else:
            key = next(self._instances[self.rank])
            if key >= _BATCHED_BASE:
                raise RuntimeError(
                    "keras-smp: too many tensor-parallel collectives traced "
                    "in this process.")
        stage = self._stage()
        group_key = (self.group_key if stage is None
                     else self.stage_keys[stage])
        return dict(group_size=self.size, group_key=group_key,
                    instance_key=key, communication_hint="auto",
                    timeout_seconds=self.timeout)

    def _ordering(self):
        """The `ordering_token` of a collective made now: a local group's
        collectives need one per device (in-process collectives hang
        without it); a process's run unordered."""
        if not self.local:
            return []
        rank = self.rank
        if rank not in self._tokens:
            self._tokens[rank] = tf_private.ordering_token(self.devices[rank])
        return [self._tokens[rank].handle]

    def _outside_ranks(self):
        """A local group's collective made outside a replica's step: only
        Keras' shape inference may do that (each rank is a local replica;
        there is no rank to meet here)."""
        if not self.local:
            return False
        if tf_private.in_strategy_replica():
            if tf.executing_eagerly():
                raise RuntimeError(
                    "keras-smp: a tensor-parallel collective between the "
                    "local devices of this process, run eagerly: TensorFlow "
                    "then runs the devices' steps one after another, and "
                    "a rank would wait for one that has not started. Run "
                    "the step inside a `tf.function` (Keras does, unless "
                    "run_eagerly=True).")
            return False
        from keras_smp.runtime import keras_private

        if keras_private.in_symbolic_scope():
            return True  # shapes only: a stand-in of the right shape
        raise RuntimeError(
            "keras-smp: a tensor-parallel layer whose ranks are the local "
            "devices of this process was called outside the strategy's "
            "replicas (e.g. `model(x)` directly): each device holds one "
            "shard. Call it through Keras (`model.predict(x)`, "
            "`model.evaluate`, `model.fit`) or `strategy.run(fn, ...)` "
            "inside a `tf.function`.")

    def sum(self, x):
        """Sum of `x` over the group (no gradient)."""
        return self._reduce(x, "Add")

    def from_first(self, batch):
        """Rank 0's `batch` (a nested structure of tensors) on every
        member of a group of processes (no gradient).

        Every rank of a group computes on the same batch, but each process
        reads its own: another order (Keras' default `shuffle=True` with
        each process's own random state, a `PyDataset`, a generator)
        would silently give each rank other rows. Rank 0's is summed with
        the others' zeros (exact). Strings, composite tensors and
        scalars stay each rank's own; a local group's ranks are given one
        batch already (`SMPStrategy` repeats it per replica).
        """
        if self.size == 1 or self.local:
            return batch

        def first(t):
            if not sharable(t):
                return t
            if None in t.shape[1:]:
                # A collective's shape is kept per key: a size that may
                # change between steps beyond the batch cannot be shared.
                warnings.warn(
                    f"keras-smp: a batch tensor of shape {t.shape} (sizes "
                    "beyond the batch unknown until the step runs) stays "
                    "each tensor-parallel rank's own: give every process "
                    "the same batches in the same order (seed the "
                    "shuffle), or fixed sizes (e.g. pad sequences to one "
                    "length).", stacklevel=2)
                return t
            mine = t if self.rank == 0 else tf.zeros_like(t)
            wire = (tf.int64 if t.dtype in (tf.uint32, tf.uint64)
                    else tf.int32 if t.dtype.is_bool or (
                        t.dtype.is_integer and t.dtype.size < 4)
                    else t.dtype)
            return tf.cast(self.sum(tf.cast(mine, wire)), t.dtype)

        return tf.nest.map_structure(first, batch)

    def maximum(self, x):
        """Element-wise maximum of `x` over the group (no gradient)."""
        return self._reduce(x, "Max")

    def minimum(self, x):
        """Element-wise minimum of `x` over the group (no gradient)."""
        return self._reduce(x, "Min")

    def _reduce(self, x, merge_op):
        if self.size == 1 or self._outside_ranks():
            return x
        wire = _WIRE.get(x.dtype, x.dtype)
        with self._device():
            out = tf.raw_ops.CollectiveReduceV2(
                input=tf.cast(x, wire), ordering_token=self._ordering(),
                merge_op=merge_op, final_op="Id", **self._common(x))
        return tf.stop_gradient(tf.cast(out, x.dtype))

    def all_gather(self, x, axis):
        """The members' `x` concatenated on `axis`, in rank order."""
        if self.size == 1:
            return x
        x = tf.convert_to_tensor(x)
        if self._outside_ranks():
            return tf.concat([x] * self.size, axis)
        rank = x.shape.rank
        axis = axis % rank
        perm = [axis] + [i for i in range(rank) if i != axis]
        wire = _WIRE.get(x.dtype, x.dtype)
        moved = tf.cast(tf.transpose(x, perm), wire)
        with self._device():
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=moved, ordering_token=self._ordering(),
                **self._common(x))
        back = [perm.index(i) for i in range(rank)]
        out = tf.cast(tf.transpose(gathered, back), x.dtype)
        shape = x.shape.as_list()
        if shape[axis] is not None:
            shape[axis] *= self.size
        out.set_shape(shape)  # the op itself tells no static sizes
        return out

    # ---- Megatron's operators ---------------------------------------------

    def copy_to(self, x):
        """Identity forward; gradients summed over the group backward."""
        if self.size == 1:
            return x

        stage = self._stage()

        @tf.custom_gradient
        def copy(x):
            def grad(dy):
                # The gradient has x's shape; say so (shape inference may
                # have lost static sizes on the way back).
                with tensor.stage(stage):
                    return self.sum(tf.ensure_shape(dy, x.shape))
            return tf.identity(x), grad

        return copy(x)

    def reduce_from(self, x):
        """Sum over the group forward; identity backward."""
        if self.size == 1:
            return x

        @tf.custom_gradient
        def reduce(x):
            def grad(dy):
                return tf.ensure_shape(dy, x.shape)
            return self.sum(x), grad

        return reduce(x)

    def gather_from(self, x, axis):
        """All-gather on `axis` forward; this rank's slice backward."""
        if self.size == 1:
            return x

        @tf.custom_gradient
        def gather(x):
            width = tf.shape(x)[axis]

            def grad(dy):
                rank = dy.shape.rank
                begin = [0] * rank
                size = [-1] * rank
                begin[axis % rank] = self.rank * width
                size[axis % rank] = width
                part = tf.slice(dy, begin, size)
                part.set_shape(x.shape)
                return part
            return self.all_gather(x, axis), grad

        return gather(x)
