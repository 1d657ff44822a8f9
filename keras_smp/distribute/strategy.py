"""`SMPStrategy`: the `tf.distribute.Strategy` of keras-smp.

The strategy is a thin subclass of TensorFlow's collective all-reduce
strategy (the class behind `tf.distribute.MultiWorkerMirroredStrategy`), so
Keras 3 recognises it as multi-worker and `model.fit` works unchanged. What
is ours:

- the process is set up by `keras_smp.runtime.process.start` (the same
  set-up as `smp.init`): one validated `SMPConfig`, the cluster from
  TF_CONFIG, SLURM or one process, the `Topology`, the `StageLayout` of
  local devices (GPUs, or N logical CPU devices with `local_devices=N`)
  and TensorFlow's distributed runtime; `keras_smp.runtime.of(strategy)`
  returns that `Runtime`;
- gradient sync goes through `GradientAllReduce` (fusion, ring or
  hierarchical), not TensorFlow's default;
- fixes for Keras 3.15 on TF 2.21 (`Strategy.reduce` of nested batches and
  scalar logs, which stock MultiWorkerMirroredStrategy fails on);
- only the chief prints Keras progress.
"""

import itertools
import sys
import weakref

import tensorflow as tf

from keras_smp.distribute import groups
from keras_smp.distribute.allreduce import GradientAllReduce
from keras_smp.distribute.groups import resolve_algorithm
from keras_smp.runtime import data_end
from keras_smp.runtime import data_order
from keras_smp.runtime import errors
from keras_smp.runtime import patches
from keras_smp.runtime import placement
from keras_smp.runtime import process
from keras_smp.runtime import split_draws
from keras_smp.runtime import tf_private

# Group keys TensorFlow's own CollectiveKeys may take per pipeline stage
# (one stage per process): one per distinct device set, a handful in use.
TF_KEYS_PER_STAGE = 1_000


class SMPStrategy(tf_private.CollectiveAllReduceStrategy):
    """Data- and pipeline-parallel strategy for Keras 3.

    Build and compile the model inside `strategy.scope()`; `model.fit`,
    `evaluate`, `predict` and Keras callbacks then work unchanged, in one
    process or across the worker processes described by `TF_CONFIG` (or
    SLURM). Each process feeds the same global-batch dataset; it is
    sharded across replicas automatically, and gradients are summed with
    keras-smp's fused collective all-reduce.

    Create the strategy at the start of the program, before other
    TensorFlow calls (like `tf.distribute.MultiWorkerMirroredStrategy`).

    Args:
        config: `None`, a dict of options, or an `SMPConfig`. The JSON
            env var `SMP_CONFIG` overrides it; see `SMPConfig` for keys.
        **kwargs: options, overriding `config`'s.

    Example:

    ```python
    import keras, numpy as np, keras_smp
    strategy = keras_smp.SMPStrategy(local_devices=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    ```
    """

    def __init__(self, config=None, /, **kwargs):
        # Config, cluster, topology, stage layout, local devices and
        # TensorFlow's distributed runtime: set up once, by the runtime.
        runtime = process.start(config, **kwargs)
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=runtime.config.collective_timeout_seconds)
        try:
            extended = _SMPExtended(self, runtime, options)
        except errors.LOST as e:
            raise RuntimeError(errors.startup_error(
                e, runtime.cluster,
                runtime.config.collective_timeout_seconds)) from e
        tf_private.Strategy.__init__(self, extended)
        # `keras_smp.runtime.of(strategy)` and the Keras patches recognise
        # an SMPStrategy by this attribute.
        self._smp_runtime = runtime
        # Tensor-parallel layers and the optimizer patches find their
        # group here (`None` without tensor parallelism).
        self._smp_tensor_group = extended._smp_tensor_group
        self.config = runtime.config
        self.cluster = runtime.cluster
        self.topology = runtime.topology
        if runtime.topology.rank != 0:
            import keras

            keras.config.disable_interactive_logging()

    @property
    def runtime(self):
        """The `keras_smp.runtime.Runtime` this strategy runs in."""
        return self._smp_runtime

    @property
    def layout(self):
        """The `StageLayout`: the device of each (local replica, stage)."""
        return self._smp_runtime.layout

    @property
    def tensor_group(self):
        """The `TensorGroup` of this process's tensor-parallel ranks, or
        `None` (`tensor_parallel_degree=1`)."""
        return self._smp_tensor_group

    @property
    def is_chief(self):
        """True on world rank 0."""
        return self.topology.rank == 0

    @property
    def gradient_sync(self):
        """The `GradientAllReduce` that sums gradients across replicas."""
        return self.extended._cross_device_ops

    @property
    def num_stages(self):
        """Pipeline stages per model replica held in this process."""
        return len(self.layout.local_stages)

    @property
    def pipeline_mode(self):
        """"none" (partitions=1), "in_process" or "multi_process"."""
        return self.layout.mode

    @property
    def stage_devices(self):
        """For each local model replica, the device of each pipeline stage."""
        return [list(row) for row in self.layout.devices]

    @property
    def allreduce_algorithm(self):
        """The gradient all-reduce algorithm in use ("ring", ...)."""
        return self.gradient_sync.algorithm

    def reduce(self, reduce_op, value, axis):
        # Keras 3 reduces whole (x, y, sample_weight) batches and scalar
        # logs with axis=0; stock MultiWorkerMirroredStrategy fails on both.
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(
                lambda v: self.reduce(reduce_op, v, axis), value)
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(value, keras.Variable):
            # A metric whose `result()` returns its state variable (as in
            # Keras' custom-metric guide): its TensorFlow variable, which
            # reduces as Keras' own metrics' results do (a Keras variable
            # has no device: TensorFlow's reduction failed on it).
            value = value.value
        if axis is not None:
            parts = (value.values
                     if isinstance(value, tf.distribute.DistributedValues)
                     else (value,))
            if getattr(parts[0], "shape", None) is not None and (
                    parts[0].shape.rank == 0):
                axis = None
        return super().reduce(reduce_op, value, axis)

    def experimental_local_results(self, value):
        # The local replicas of tensor parallelism over local devices are
        # ranks of one model fed the same batch: the first one's output
        # is the process's (Keras concatenates predictions from these).
        if (getattr(self.extended, "_smp_local_tp", 1) > 1
                and isinstance(value, tf.distribute.DistributedValues)
                and not isinstance(value, tf.Variable)
                and len(value.values) == self.extended._smp_local_tp):
            return (value.values[0],)
        return super().experimental_local_results(value)

    def gather(self, value, axis):
        if (getattr(self.extended, "_smp_local_tp", 1) > 1
                and isinstance(value, tf.distribute.DistributedValues)
                and not isinstance(value, tf.Variable)):
            # Tensor-parallel ranks on local devices: one model's output.
            return self.experimental_local_results(value)[0]
        # TensorFlow's collective all-gather has no bfloat16 kernel; Keras
        # gathers predictions with it (mixed_bfloat16 models output
        # bfloat16). float32 holds every bfloat16 value exactly.
        parts = (value.values
                 if isinstance(value, tf.distribute.DistributedValues)
                 else (value,))
        dtype = getattr(parts[0], "dtype", None)
        if dtype != tf.bfloat16:
            return super().gather(value, axis)
        if isinstance(value, tf.distribute.DistributedValues):
            wide = self.run(lambda v: tf.cast(v, tf.float32), args=(value,))
        else:
            wide = tf.cast(value, tf.float32)
        return tf.cast(super().gather(wide, axis), dtype)


class _SMPExtended(tf_private.CollectiveAllReduceExtended):
    """TensorFlow's collective extended with our devices and gradient sync."""

    def __init__(self, container, runtime, options):
        self._smp_runtime = runtime
        self._smp_layout = layout = runtime.layout
        self._smp_topology = topology = runtime.topology
        config = runtime.config
        if runtime.collectives:
            # keras_smp.runtime.process started TensorFlow's server and
            # collective ops (the same way TensorFlow's strategy would);
            # the coordination service's heartbeats detect lost peers.
            self._std_server_started = True
            if tf_private.context.context().coordination_service:
                self._enable_check_health = False
        super().__init__(container,
                         cluster_resolver=process.cluster_resolver(
                             runtime.cluster),
                         communication_options=options)
        # A model replica spans processes: one pipeline stage per process
        # and/or tensor-parallel ranks. Gradients are then summed among
        # the processes holding the same part of the model (the dp group
        # of this `mp_rank`), otherwise among all workers.
        multi = topology.mp_size > 1
        devices_per_worker = len(self.worker_devices)
        replica_layout = groups.stage_replica_layout(
            topology, devices_per_worker, multi)
        algorithm = resolve_algorithm(config.allreduce, replica_layout)
        self._smp_local_tp = runtime.local_tensor_parallel
        tp_degree = max(topology.tp_size, self._smp_local_tp)
        if tp_degree > 1 and algorithm == "horovod":
            raise ValueError(
                f"tensor_parallel_degree={tp_degree} with the Horovod "
                "backend is not supported yet; use allreduce='ring' or "
                "'hierarchical' (TensorFlow's collectives) with tensor "
                "parallelism.")
        # Collective keys, the same on every process (same calls, same
        # order): room for every mp rank's groups, this rank's block used.
        keys = runtime.keys
        blocks = groups.group_key_counts(
            topology, devices_per_worker, len(layout.local_stages), multi)
        block = topology.mp_rank if multi else 0
        grad_keys = keys.allocate(
            "SMPStrategy gradient all-reduce", sum(blocks))
        if multi:
            grad_keys = grad_keys.part(
                sum(blocks[:block]), blocks[block],
                f"{grad_keys.name}, model-parallel rank {block}")
        collective_keys = self._collective_keys
        data_end.allocate(self, runtime)
        data_order.allocate(self, runtime)
        self._smp_init_group = None
        if multi:
            # Initial values are broadcast within each stage's processes
            # (its data-parallel replicas and tensor-parallel ranks) only:
            # they create the same variables in the same order, other
            # stages' processes do not.
            init_keys = keys.allocate("SMPStrategy initial values per stage",
                                      topology.pp_size)
            self._smp_init_group = init_keys.key(topology.pp_rank)
            self._smp_init_instances = itertools.count(1)
            tf_keys = keys.allocate(
                "SMPStrategy CollectiveKeys per model-parallel rank",
                topology.mp_size * TF_KEYS_PER_STAGE)
            collective_keys = tf_private.CollectiveKeys(
                group_key_start=tf_keys.key(
                    topology.mp_rank * TF_KEYS_PER_STAGE))
        elif topology.world_size == 1:
            # Keys of this strategy's own: TensorFlow's start at group 1 in
            # every strategy, and a second strategy of the process (another
            # model's pipeline) would give an instance key of group 1 other
            # shapes (the all-gather of a sparse gradient: "Shape mismatch
            # in the collective instance").
            tf_keys = keys.allocate("SMPStrategy CollectiveKeys",
                                    TF_KEYS_PER_STAGE)
            collective_keys = tf_private.CollectiveKeys(
                group_key_start=tf_keys.key(0))
        self._smp_tensor_group = None
        if topology.tp_size > 1:
            from keras_smp.tensor.ops import TensorGroup

            tp_keys = keys.allocate(
                "tensor-parallel groups",
                topology.world_size // topology.tp_size)
            self._smp_tensor_group = TensorGroup(
                topology.tp_size, topology.tp_rank,
                tp_keys.key(topology.rank // topology.tp_size),
                timeout=config.collective_timeout_seconds,
                initial_value_sync=self._broadcast_in_stage)
        elif self._smp_local_tp > 1:
            from keras_smp.tensor.ops import TensorGroup

            # The ranks are this process's devices, one local replica
            # each: every replica runs the step on the same batch and
            # holds its own shard of the split weights.
            self._smp_tensor_group = TensorGroup(
                self._smp_local_tp, None,
                keys.allocate("tensor-parallel group of local devices",
                              1).key(0),
                timeout=config.collective_timeout_seconds, local=True,
                devices=self.worker_devices)
        common = dict(
            devices=self.worker_devices, layout=replica_layout,
            fusion_threshold_bytes=int(config.fusion_threshold_mb * 2**20),
            options=options, collective_keys=collective_keys,
            stage_devices=layout.devices, group_keys=grad_keys,
            compression=config.allreduce_compression)
        self._smp_horovod = None
        if algorithm == "horovod":
            from keras_smp.distribute import horovod

            stage_groups = (
                [topology.dp_group(topology.rank_of(s, 0))
                 for s in range(topology.pp_size)]
                if multi else None)  # tp_size == 1 here
            hvd, process_set = horovod.init(topology, stage_groups)
            self._smp_horovod = hvd
            self._cross_device_ops = horovod.HorovodAllReduce(
                hvd, process_set, **common)
        else:
            self._cross_device_ops = GradientAllReduce(
                algorithm=algorithm, pieces=config.allreduce_pieces,
                **common)

    def _get_variable_creator_initial_value(self, replica_id, device,
                                            primary_var, **kwargs):
        shard_of = placement.local_shard_initializer()
        if shard_of is not None:
            # A tensor-parallel weight over local devices: each replica
            # (rank) starts from its own shard.
            def shard_value():
                with tf.device(device):
                    return tf.identity(shard_of(replica_id))

            return shard_value
        if self._smp_init_group is not None and replica_id == 0:
            return self._stage_initial_value(device, kwargs)
        if replica_id != 0:
            return super()._get_variable_creator_initial_value(
                replica_id=replica_id, device=device,
                primary_var=primary_var, **kwargs)
        if self._smp_horovod is None:
            return self._collective_initial_value(device, primary_var, kwargs)
        from keras_smp.distribute import horovod

        def initial_value_fn():
            # Rank 0's initial value, broadcast by Horovod (every process
            # creates the same variables in the same order).
            with tf.device(device):
                value = _initial_value(kwargs)
                if self._smp_topology.world_size == 1:
                    return value
                return horovod.broadcast_initial_value(
                    self._smp_horovod, value)

        return initial_value_fn

    def _collective_initial_value(self, device, primary_var, kwargs):
        """TensorFlow's initial value broadcast from the chief, for every
        dtype: those its broadcast has no kernel for (a quantized layer's
        `int8` kernel, `bfloat16`) cross as a wider one, exactly."""
        dtypes = []

        def wire_value():
            value = _initial_value(kwargs)
            dtypes.append(value.dtype)
            return tf.cast(value, _INIT_WIRE.get(value.dtype, value.dtype))

        broadcast = super()._get_variable_creator_initial_value(
            replica_id=0, device=device, primary_var=primary_var,
            **dict(kwargs, initial_value=wire_value, dtype=None))

        def initial_value_fn():
            value = broadcast()
            with tf.device(device):
                return tf.cast(value, dtypes[-1])

        return initial_value_fn

    def _stage_initial_value(self, device, kwargs):
        """A replica spanning processes: a new variable's initial value as
        this stage's first process (first data-parallel replica, first
        tensor-parallel rank) has it."""

        def initial_value_fn():
            with tf.device(device):
                value = _initial_value(kwargs)
                if placement.initial_values_consistent():
                    return value  # a tensor-parallel shard, already synced
                return self._broadcast_in_stage(value)

        return initial_value_fn

    def _broadcast_in_stage(self, value):
        """`value` as the first process of this pipeline stage has it (its
        replicas and tensor-parallel ranks; eager, at variable creation)."""
        topo = self._smp_topology
        size = topo.dp_size * topo.tp_size
        if size == 1:
            return value
        timeout = self._smp_runtime.config.collective_timeout_seconds
        common = dict(group_size=size,
                      group_key=self._smp_init_group,
                      instance_key=next(self._smp_init_instances),
                      communication_hint="auto",
                      timeout_seconds=float(timeout or 0))
        wire = _INIT_WIRE.get(value.dtype, value.dtype)
        if topo.dp_rank == 0 and topo.tp_rank == 0:
            send = tf.raw_ops.CollectiveBcastSendV2(
                input=tf.cast(value, wire), **common)
            with tf.control_dependencies([send]):
                return tf.identity(value)
        return tf.cast(tf.raw_ops.CollectiveBcastRecvV2(
            shape=value.shape, T=wire, **common), value.dtype)

    # ---- tensor parallelism over the local devices ----------------------
    # The local replicas are tensor-parallel ranks, not data-parallel
    # replicas: one replica in sync (Keras does not divide the loss), the
    # same batch on every one, and no reduction among them (a gradient of
    # a shard is that rank's own; the group's layers sum what must be
    # summed themselves).

    def _smp_same_batch(self, dataset):
        """`dataset` with each element repeated once per local replica
        (a replica's iterator takes every T-th element)."""
        copies = self._smp_local_tp

        def repeat(*element):
            if type(dataset.element_spec) is not tuple:  # noqa: E721
                (element,) = element
            return tf.data.Dataset.from_tensors(element).repeat(copies)

        return dataset.flat_map(repeat)

    def _experimental_distribute_dataset(self, dataset, options):
        if self._smp_local_tp > 1:
            dataset = self._smp_same_batch(dataset)
        return super()._experimental_distribute_dataset(dataset, options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self._smp_local_tp > 1:
            inner = dataset_fn

            def dataset_fn(context):
                return self._smp_same_batch(inner(context))
        return super()._distribute_datasets_from_function(dataset_fn,
                                                          options)

    def _call_for_each_replica(self, fn, args, kwargs):
        if tf_private.is_tf_function(fn):
            # TensorFlow runs the replicas of a `tf.function` inside one
            # trace of it (where `merge_call` works): the same function,
            # its Python body wrapped (one clone per function).
            clones = self.__dict__.setdefault(
                "_smp_clones", weakref.WeakKeyDictionary())
            if fn not in clones:
                clones[fn] = tf_private.function_with_python(
                    fn, self._smp_drawing_its_rows(fn.python_function))
            return super()._call_for_each_replica(clones[fn], args, kwargs)
        return super()._call_for_each_replica(
            self._smp_drawing_its_rows(fn), args, kwargs)

    def _smp_drawing_its_rows(self, fn):
        """`fn` run by a replica as its part of the global batch
        (`runtime.split_draws`): its random layers draw its rows of what
        one device draws for the whole batch. TensorFlow gives local
        replica `l` of data-parallel process `d` (of `D`) the global
        batch's `i`-th share, `i = l * D + d` (measured: 2 processes x 2
        local replicas, batches of 8 rows: shares 0 and 2 on process 0);
        tensor-parallel copies share their rank's. It holds rows
        `[i * b, (i + 1) * b)`, `b` its first argument's rows."""
        def run(*args, **kwargs):
            first = next((t for t in tf.nest.flatten((args, kwargs))
                          if isinstance(t, tf.Tensor) and t.shape.rank),
                         None)
            if first is None:
                return fn(*args, **kwargs)
            rows = tf.shape(first)[0]
            with split_draws.part(self._smp_share_index() * rows, rows):
                return fn(*args, **kwargs)

        return run

    def _smp_share_index(self):
        """The index of this replica's share of the global batch (in a
        replica context): `l * D + d` (`_smp_drawing_its_rows`)."""
        local = (1 if self._smp_local_tp > 1
                 else self._smp_layout.num_local_replicas)
        return self._smp_topology.dp_rank + self._smp_topology.dp_size * (
            tf_private.local_replica_index(local) if local > 1 else 0)

    def _smp_share_bounds(self, rows):
        """`(offset, total)`: the first row of this replica's share of the
        global batch, which holds `rows` rows, and the batch's rows (int32
        scalars), from every replica's rows (one all-reduce in the replica
        context: all replicas must call it). TensorFlow splits a batch of
        a size the replicas do not divide as evenly as it can (27 rows over
        2 replicas: 14 and 13, measured), so a share's first row is not
        its index times its rows."""
        n = self._num_replicas_in_sync
        index = self._smp_share_index()
        mine = tf.one_hot(index, n, dtype=tf.float32) * tf.cast(
            rows, tf.float32)
        every = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, mine)
        before = tf.reduce_sum(tf.where(tf.range(n) < index, every,
                                        tf.zeros_like(every)))
        return (tf.cast(before, tf.int32),
                tf.cast(tf.reduce_sum(every), tf.int32))

    def _smp_own_values(self, value):
        """A tensor-parallel rank's own value of `value` for every local
        replica (no reduction among them), or `None` (not per replica)."""
        if (self._smp_local_tp > 1
                and isinstance(value, tf.distribute.DistributedValues)
                and len(value.values) == self._smp_local_tp):
            return tf_private.mirrored(value.values)
        return None

    def _reduce_to(self, reduce_op, value, destinations, options):
        own = self._smp_own_values(value)
        if own is not None:
            return own
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if self._smp_local_tp > 1:
            # One by one: a value that is not per replica (the same tensor
            # on every rank) must not send the others to a real sum.
            return [self._reduce_to(reduce_op, v, d, options)
                    for v, d in value_destination_pairs]
        return super()._batch_reduce_to(reduce_op, value_destination_pairs,
                                        options)

    def _use_merge_call(self):
        # `placement.replica_updates`: Keras' conditional optimizer updates
        # (gradient accumulation, EMA overwrites) on gradients already
        # summed over the replicas.
        if placement.updating_in_replicas():
            return False
        if (patches.applies_own_stage_only()
                and tf.distribute.in_cross_replica_context()):
            # A custom loop's `optimizer.apply_gradients` outside
            # `strategy.run` (`smp.init` with one stage per process: the
            # gradients were averaged in `StepOutput.accumulate`): Keras
            # updates each variable's copies directly (a merge call needs
            # a replica context).
            return False
        return super()._use_merge_call()

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self._smp_local_tp > 1:
            return value
        return super()._replica_ctx_all_reduce(reduce_op, value, options)

    @property
    def _num_replicas_in_sync(self):
        if self._smp_local_tp > 1:
            return self._smp_topology.dp_size
        if self._smp_topology.mp_size > 1:
            return self._smp_topology.dp_size
        return super()._num_replicas_in_sync

    def _make_input_context(self):
        if self._smp_local_tp > 1:
            return tf_private.InputContext(
                num_input_pipelines=1, input_pipeline_id=0,
                num_replicas_in_sync=1)
        if self._smp_topology.mp_size == 1:
            return super()._make_input_context()
        # Every process of a replica (its stages and tensor-parallel
        # ranks) reads the same shard of each batch.
        topo = self._smp_topology
        return tf_private.InputContext(
            num_input_pipelines=topo.dp_size,
            input_pipeline_id=topo.dp_rank,
            num_replicas_in_sync=topo.dp_size)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        # The runtime's StageLayout: replica r's stage devices; its first
        # stage's device is its replica device (where its input arrives).
        layout = self._smp_layout
        first = layout.replica_devices[0]
        if not first.startswith(f"{worker_device}/device:"):
            raise RuntimeError(
                f"keras-smp: the stage layout's devices ({first!r}) are not "
                f"those of TensorFlow's worker {worker_device!r}.")
        return layout.replica_devices, layout.device_type

    def _create_variable(self, next_creator, **kwargs):
        if placement.creating_local():
            kwargs.pop("colocate_with", None)
            return next_creator(**kwargs)
        if (self._smp_local_tp > 1 and kwargs.get("synchronization")
                == tf.VariableSynchronization.ON_READ):
            # A metric's state: every rank (local replica) counts the same
            # batch, so the first one's is the value (not their sum).
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        if _moving_statistic(kwargs):
            # BatchNormalization's moving statistics: Keras leaves their
            # aggregation "none", so each replica keeps its own update and
            # the ranks drift apart (their predictions too). The mean over
            # the replicas keeps them equal, and the moving mean equal to
            # the global batch's.
            kwargs["aggregation"] = tf.VariableAggregation.MEAN
        stage = placement.current_placement()
        if stage is not None and kwargs.get("colocate_with") is None:
            # Each replica's copy goes on that replica's device for `stage`.
            layout = self._smp_layout
            kwargs["colocate_with"] = _DeviceSet(tuple(
                layout.stage_device(r, stage)
                for r in range(layout.num_local_replicas)))
        return super()._create_variable(next_creator, **kwargs)


def _initial_value(kwargs):
    """The tensor a variable creator's `initial_value` (or callable) gives."""
    value = kwargs["initial_value"]
    if callable(value):
        value = value()
    value = getattr(value, "wrapped_value", value)
    return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))


# Dtypes TensorFlow's collective broadcast has no kernel for, and what they
# cross as (exactly).
_INIT_WIRE = {tf.bfloat16: tf.float32, tf.bool: tf.int32,
              tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32,
              tf.uint16: tf.int32, tf.uint32: tf.int64}


# Names Keras' BatchNormalization gives its moving statistics.
_MOVING_STATISTICS = ("moving_mean", "moving_variance")


def _moving_statistic(kwargs):
    """A BatchNormalization moving statistic left unaggregated.

    Only these: other non-trainable state (optimizer slots, the loss
    scale) is updated inside control flow, where an aggregated assignment
    (a merge_call) is not allowed.
    """
    name = str(kwargs.get("name") or "").split("/")[-1].split(":")[0]
    if name not in _MOVING_STATISTICS or kwargs.get("trainable", True):
        return False
    return kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE)


class _DeviceSet:
    """Stands in for a variable in `colocate_with`: just its devices."""

    def __init__(self, devices):
        self._devices = devices
