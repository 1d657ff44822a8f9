"""`SMPStrategy`: the `tf.distribute.Strategy` of keras-smp.

The strategy is a thin subclass of TensorFlow's collective all-reduce
strategy (the class behind `tf.distribute.MultiWorkerMirroredStrategy`), so
Keras 3 recognises it as multi-worker and `model.fit` works unchanged. What
is ours:

- the cluster comes from `keras_smp.topology` (TF_CONFIG, SLURM, or one
  process), the options from one validated `SMPConfig`;
- local devices: GPUs, or N logical CPU devices (`local_devices=N`);
- gradient sync goes through `GradientAllReduce` (fusion, ring or
  hierarchical), not TensorFlow's default;
- fixes for Keras 3.15 on TF 2.21 (`Strategy.reduce` of nested batches and
  scalar logs, which stock MultiWorkerMirroredStrategy fails on);
- only the chief prints Keras progress.
"""

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as cars
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import distribute_lib

from keras_smp import state
from keras_smp.config import SMPConfig
from keras_smp.distribute import chief_io
from keras_smp.distribute import failures
from keras_smp.distribute.allreduce import GROUP_KEY_STRIDE
from keras_smp.distribute.allreduce import GradientAllReduce
from keras_smp.distribute.groups import ReplicaLayout
from keras_smp.distribute.groups import resolve_algorithm
from keras_smp.pipeline import scope
from keras_smp.topology import Topology
from keras_smp.topology import resolve_cluster


def configure_local_devices(requested):
    """Returns `(device_type, count)`, creating logical CPUs if asked."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        count = requested or len(gpus)
        if count > len(gpus):
            raise ValueError(
                f"local_devices={count} but this process sees {len(gpus)} "
                "GPU(s). Pass local_devices <= the number of visible GPUs, "
                "or leave it unset to use all of them.")
        return "GPU", count
    count = requested or 1
    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        existing = tf.config.get_logical_device_configuration(cpu) or []
        if len(existing) < count:
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * count)
            except RuntimeError as e:
                raise RuntimeError(
                    f"local_devices={count} needs {count} logical CPU "
                    f"devices, but TensorFlow was already initialised with "
                    f"{max(len(existing), 1)}. Create SMPStrategy at the top "
                    "of the program, before any other TensorFlow call."
                ) from e
    return "CPU", count


class SMPStrategy(cars.CollectiveAllReduceStrategy):
    """Data- (and later pipeline-) parallel strategy for Keras 3.

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
        config = SMPConfig.build(config, **kwargs)
        cluster = resolve_cluster()
        local_devices, mode = _pipeline_mode(config, cluster)
        # In-process pipelines: every process holds whole model replicas
        # (P devices each). Multi-process: one stage per process.
        topology = Topology.from_cluster(
            cluster,
            partitions=config.partitions if mode == "multi_process" else 1,
            placement_strategy=config.placement_strategy)
        stages = config.partitions if mode == "in_process" else 1
        device_type, count = configure_local_devices(local_devices)
        if count % stages:
            raise ValueError(
                f"partitions={stages} pipeline stages do not divide the "
                f"{count} local {device_type} device(s) of this process: "
                "each model replica needs one device per stage. Use "
                f"local_devices={stages * max(1, count // stages)} (a multiple "
                f"of {stages}), or a different number of partitions.")
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=config.collective_timeout_seconds)
        resolver = cluster_resolver(cluster)
        configure_coordination(cluster, config)
        try:
            extended = _SMPExtended(
                self, resolver, options, device_type, count, stages, config,
                topology, mode)
        except failures.LOST as e:
            raise RuntimeError(
                failures.startup_error(e, cluster, config)) from e
        distribute_lib.Strategy.__init__(self, extended)
        self.config = config
        self.cluster = cluster
        self.topology = topology
        state.install(config, cluster, topology)
        chief_io.install()
        if cluster.world_size > 1:
            failures.install()
        if stages > 1:
            from keras_smp.pipeline.model import install_guard

            install_guard()
        if topology.rank != 0:
            import keras

            keras.config.disable_interactive_logging()

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
        return self.extended._smp_stages

    @property
    def pipeline_mode(self):
        """"none" (partitions=1), "in_process" or "multi_process"."""
        return self.extended._smp_mode

    @property
    def stage_devices(self):
        """For each local model replica, the device of each pipeline stage."""
        return [list(row) for row in self.extended._smp_stage_devices]

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
        if axis is not None:
            parts = (value.values
                     if isinstance(value, tf.distribute.DistributedValues)
                     else (value,))
            if getattr(parts[0], "shape", None) is not None and (
                    parts[0].shape.rank == 0):
                axis = None
        return super().reduce(reduce_op, value, axis)


class _SMPExtended(cars.CollectiveAllReduceExtended):
    """TensorFlow's collective extended with our devices and gradient sync."""

    def __init__(self, container, resolver, options, device_type, count,
                 stages, config, topology, mode):
        self._smp_device_type = device_type
        self._smp_device_count = count
        self._smp_stages = stages
        self._smp_mode = mode
        self._smp_topology = topology
        super().__init__(container, cluster_resolver=resolver,
                         communication_options=options)
        # Gradients are summed among the workers holding the same stage:
        # all workers, or (one stage per process) this stage's dp group.
        peers = (topology.dp_group() if mode == "multi_process"
                 else tuple(range(topology.world_size)))
        layout = ReplicaLayout.from_workers(
            worker_hosts=tuple(topology.host_of(r) for r in peers),
            devices_per_worker=len(self.worker_devices),
            worker_rank=peers.index(topology.rank))
        algorithm = resolve_algorithm(config.allreduce, layout)
        common = dict(
            devices=self.worker_devices, layout=layout,
            fusion_threshold_bytes=int(config.fusion_threshold_mb * 2**20),
            options=options,
            collective_keys=(
                self._collective_keys if mode != "multi_process" else
                cross_device_utils.CollectiveKeys(
                    group_key_start=50_000 + 1_000 * topology.pp_rank)),
            stage_devices=self._smp_stage_devices,
            key_offset=(GROUP_KEY_STRIDE // 10 * topology.pp_rank
                        if mode == "multi_process" else 0))
        self._smp_horovod = None
        if algorithm == "horovod":
            from keras_smp.distribute import horovod

            stage_groups = (
                [topology.dp_group(topology.rank_of(s, 0))
                 for s in range(topology.pp_size)]
                if mode == "multi_process" else None)
            hvd, process_set = horovod.init(topology, stage_groups)
            self._smp_horovod = hvd
            self._cross_device_ops = horovod.HorovodAllReduce(
                hvd, process_set, **common)
        else:
            self._cross_device_ops = GradientAllReduce(
                algorithm=algorithm, **common)

    def _get_variable_creator_initial_value(self, replica_id, device,
                                            primary_var, **kwargs):
        if self._smp_horovod is None or replica_id != 0:
            return super()._get_variable_creator_initial_value(
                replica_id=replica_id, device=device,
                primary_var=primary_var, **kwargs)
        from keras_smp.distribute import horovod

        def initial_value_fn():
            # Rank 0's initial value, broadcast by Horovod (every process
            # creates the same variables in the same order).
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                value = getattr(value, "wrapped_value", value)
                value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
                if self._smp_topology.world_size == 1:
                    return value
                return horovod.broadcast_initial_value(
                    self._smp_horovod, value)

        return initial_value_fn

    @property
    def _num_replicas_in_sync(self):
        if self._smp_mode == "multi_process":
            return self._smp_topology.dp_size
        return super()._num_replicas_in_sync

    def _make_input_context(self):
        if self._smp_mode != "multi_process":
            return super()._make_input_context()
        # Every stage of a replica reads the same shard of each batch.
        topo = self._smp_topology
        return distribute_lib.InputContext(
            num_input_pipelines=topo.dp_size,
            input_pipeline_id=topo.dp_rank,
            num_replicas_in_sync=topo.dp_size)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices = [
            f"{worker_device}/device:{self._smp_device_type}:{i}"
            for i in range(self._smp_device_count)]
        p = self._smp_stages
        # Replica r owns devices r*p .. r*p+p-1, one per stage; its stage-0
        # device is its replica device (where its input batch arrives).
        self._smp_stage_devices = tuple(
            tuple(devices[r * p:(r + 1) * p])
            for r in range(len(devices) // p))
        return (tuple(row[0] for row in self._smp_stage_devices),
                self._smp_device_type)

    def _create_variable(self, next_creator, **kwargs):
        if scope.creating_local():
            kwargs.pop("colocate_with", None)
            return next_creator(**kwargs)
        stage = scope.current_placement()
        if stage is not None and kwargs.get("colocate_with") is None:
            # Each replica's copy goes on that replica's device for `stage`.
            kwargs["colocate_with"] = _DeviceSet(tuple(
                row[stage] for row in self._smp_stage_devices))
        return super()._create_variable(next_creator, **kwargs)


def configure_coordination(cluster, config):
    """Starts TensorFlow's coordination service with bounded waits.

    TensorFlow's default lets a worker wait an hour for a peer that never
    starts. Here registration waits at most `collective_timeout_seconds`
    and then fails naming the missing tasks. Call before the strategy (or
    any other TensorFlow runtime use); no-op for one process or when a
    coordination service is already configured.
    """
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    if cluster.world_size == 1 or context.context().coordination_service:
        return
    # The proto module moved between TensorFlow versions; TensorFlow's own
    # strategy module imports it from wherever it lives.
    coordination_config_pb2 = cars.coordination_config_pb2
    spec = tf.train.ClusterSpec(cluster.cluster_spec)
    jobs = [coordination_config_pb2.CoordinatedJob(
        name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker") if job in spec.jobs]
    timeout_ms = int(config.collective_timeout_seconds * 1000)
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=timeout_ms)
    service = context.context().coordination_service
    if "cluster_register_with_barrier" in service.DESCRIPTOR.fields_by_name:
        # Every task waits (at most the timeout) for all to register.
        service.cluster_register_with_barrier = True


def cluster_resolver(cluster):
    """A TensorFlow cluster resolver for a `ClusterInfo`."""
    if cluster.world_size > 1:
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.cluster_spec),
            task_type=cluster.task_type, task_id=cluster.task_index,
            rpc_layer="grpc")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({}), rpc_layer="grpc")


class _DeviceSet:
    """Stands in for a variable in `colocate_with`: just its devices."""

    def __init__(self, devices):
        self._devices = devices


def _pipeline_mode(config, cluster):
    """Returns `(local devices to create or None, pipeline mode)`."""
    p = config.partitions
    if p == 1:
        return config.local_devices, "none"
    w = cluster.world_size
    gpus = bool(tf.config.list_physical_devices("GPU"))
    one_device = config.local_devices == 1 or (
        config.local_devices is None and not gpus)
    if w > 1 and one_device:
        if w % p:
            raise ValueError(
                f"partitions={p} does not divide the number of worker "
                f"processes world_size={w}. Use a multiple of {p} workers "
                f"(one pipeline stage per process), or set local_devices={p} "
                "to run a whole pipeline inside every process.")
        return 1, "multi_process"
    if config.local_devices is None and not gpus:
        return p, "in_process"
    return config.local_devices, "in_process"
