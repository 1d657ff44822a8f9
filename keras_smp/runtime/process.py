"""Starting keras-smp in a process: one `start()` for `SMPStrategy` and `smp.init`.

`start(config)`:

1. validates the config (`SMPConfig.build`; `SMP_CONFIG` overrides it),
2. resolves the cluster once (TF_CONFIG, SLURM, or one process),
3. picks the pipeline mode and builds the one `Topology` and `StageLayout`,
4. creates the local devices (GPUs, or `local_devices` logical CPUs),
5. with several processes: starts TensorFlow's coordination service (with
   bounded waits) and its collective runtime (gRPC server, collective ops),
   once per process, and the orderly exit (`runtime.shutdown`: every
   rank waits at exit until every rank's script has ended); then checks
   that every process runs with the same options, device layout and
   versions (`check_same_settings`: a clear error on every rank, not a
   hang),
6. installs the Keras / TensorFlow patches (`runtime.patches`) and the
   process-wide state (`keras_smp.state`: rank helpers),

and returns the `Runtime`. Call it (through `SMPStrategy` or `smp.init`)
at the top of the program, before other TensorFlow calls: devices and the
distributed runtime can only be configured before TensorFlow initialises.
"""

import copy
import itertools

import tensorflow as tf

from keras_smp import state
from keras_smp.config import SMPConfig
from keras_smp.config import agreement_record
from keras_smp.config import disagreements
from keras_smp.runtime import Runtime
from keras_smp.runtime import agreement
from keras_smp.runtime import errors
from keras_smp.runtime import patches
from keras_smp.runtime import shutdown
from keras_smp.runtime import tf_private
from keras_smp.runtime.keys import process_keys
from keras_smp.runtime.layout import StageLayout
from keras_smp.runtime.layout import check_tensor_parallel
from keras_smp.runtime.layout import resolve_mode
from keras_smp.runtime.layout import topology_for
from keras_smp.topology import resolve_cluster

# What this process started of TensorFlow's distributed runtime (once per
# process: TensorFlow cannot restart it).
_started = {}
# The settings checks of this process (one per multi-process `start`;
# every rank makes them in the same order, so the n-th keys match).
_settings_checks = itertools.count()


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


def configure_coordination(cluster, config):
    """Starts TensorFlow's coordination service with bounded waits.

    TensorFlow's default lets a worker wait an hour for a peer that never
    starts. Here registration waits at most `collective_timeout_seconds`
    and then fails naming the missing tasks. Call before the strategy (or
    any other TensorFlow runtime use); no-op for one process or when a
    coordination service is already configured.
    """
    context = tf_private.context
    if cluster.world_size == 1 or context.context().coordination_service:
        return
    coordination_config_pb2 = tf_private.coordination_config_pb2
    spec = tf.train.ClusterSpec(cluster.cluster_spec)
    jobs = [coordination_config_pb2.CoordinatedJob(
        name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker") if job in spec.jobs]
    timeout_ms = int(config.collective_timeout_seconds * 1000)
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=tf_private.multi_worker_util.coordination_leader(spec),
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


def worker_device(cluster):
    """This process's device prefix, as TensorFlow's strategies name it."""
    if cluster.world_size == 1:
        return ""
    return f"/job:{cluster.task_type}/task:{cluster.task_index}"


def _pipeline_mode(config, cluster):
    """Returns `(local devices to create or None, pipeline mode)`."""
    return resolve_mode(
        config.partitions, config.local_devices, cluster.world_size,
        has_gpus=bool(tf.config.list_physical_devices("GPU")))


def task_label(cluster):
    """`"worker:1 of 2"`: a process's place in its cluster, for messages."""
    return (f"{cluster.task_type}:{cluster.task_index} of "
            f"{cluster.world_size}")


def start_collectives(cluster, config):
    """Starts TensorFlow's multi-worker collective runtime (once per process).

    What `tf.distribute.MultiWorkerMirroredStrategy` does when created in a
    worker, without creating a strategy: configures collective ops (group
    leader: the chief), the coordination service (`configure_coordination`)
    and starts this task's gRPC server with the cluster's `ServerDef`.
    Collective ops, `tf.distribute` strategies and the coordination
    service's key-value store then work across the processes. No-op for one
    process; a second call only checks that the cluster is the same.

    Raises:
        RuntimeError: a peer did not join within `collective_timeout_seconds`
            (names it), or the runtime was started for another cluster.
    """
    if cluster.world_size == 1:
        return False
    key = (tuple(cluster.workers), cluster.task_type, cluster.task_index)
    if _started:
        if _started["cluster"] != key:
            raise RuntimeError(
                "keras-smp: TensorFlow's distributed runtime already runs "
                f"for the cluster {_started['cluster']}, not {key}. A process "
                "joins one cluster: start a new process for another.")
        return True
    context = tf_private.context
    if tf_private.tensorflow_started():
        raise RuntimeError(
            "keras-smp: TensorFlow already started in this process (a "
            "tensor, tf.data dataset, Keras model or TensorFlow call ran "
            f"before the strategy), so this process ({task_label(cluster)}) can no "
            "longer join the multi-worker collective runtime (TensorFlow "
            "would say: 'Collective ops must be configured at program "
            "startup'). Create `keras_smp.SMPStrategy(...)` (or call "
            "`smp.init(...)`) first, at the top of the script, before any "
            "other TensorFlow or Keras code.")
    spec = tf_private.multi_worker_util.normalize_cluster_spec(
        tf.train.ClusterSpec(cluster.cluster_spec))
    task_type, task_id = cluster.task_type, cluster.task_index
    leader = tf_private.multi_worker_util.collective_leader(
        spec, task_type, task_id)
    device_filter = f"/job:{task_type}/task:{task_id}"
    # The same arguments as TensorFlow's strategy, which configures them
    # again (and must find them equal) when SMPStrategy is created.
    context.context().configure_collective_ops(
        collective_leader=leader,
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(device_filter,))
    configure_coordination(cluster, config)
    # TensorFlow's strategy session config: scoped allocator for
    # CollectiveReduce, the group leader, and only this task's devices.
    config_proto = copy.deepcopy(context.context().config)
    rewrite = config_proto.graph_options.rewrite_options
    rewrite.scoped_allocator_optimization = (
        tf_private.rewriter_config_pb2.RewriterConfig.ON)
    del rewrite.scoped_allocator_opts.enable_op[:]
    rewrite.scoped_allocator_opts.enable_op.append("CollectiveReduce")
    config_proto.experimental.collective_group_leader = leader
    del config_proto.device_filters[:]
    config_proto.device_filters.append(device_filter)
    server_def = tf_private.tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), default_session_config=config_proto,
        job_name=task_type, task_index=task_id, protocol="grpc", port=0)
    try:
        context.context().enable_collective_ops(server_def)
        # Connects to the coordination service: waits (bounded) for peers.
        context.context().ensure_initialized()
    except errors.LOST as e:
        raise RuntimeError(errors.startup_error(
            e, cluster, config.collective_timeout_seconds)) from e
    _started["cluster"] = key
    shutdown.install(cluster, config.collective_timeout_seconds)
    return True


def versions():
    """What must be the same version on every process of a job."""
    import keras

    import keras_smp

    return {"keras-smp": keras_smp.__version__,
            "TensorFlow": tf.__version__, "Keras": keras.__version__}


def check_same_settings(cluster, config, layout, context=None):
    """Checks that every process of the job runs with the same keras-smp
    options (all but `config.PER_PROCESS_KEYS`: `collective_timeout_seconds`
    and `local_devices`), the same pipeline mode, model replicas and type
    and number of local devices (TensorFlow's collectives need as many on
    every worker), and the same keras-smp, TensorFlow and Keras versions,
    through the coordination service's key-value store: every rank puts
    its `agreement_record`, rank 0 reads them all and puts its verdict,
    every rank reads the verdict.

    Different options would otherwise make ranks wait for each other
    (different microbatch counts, schedules, fusion buckets) until
    `collective_timeout_seconds`, then fail with a lost-peer error that
    names none of them, or train wrongly. Costs one key per rank at
    start-up, and rank 0 one read per rank.

    Args:
        cluster: this job's `ClusterInfo` (several processes).
        config: this process's `SMPConfig`.
        layout: this process's `StageLayout`.
        context: TensorFlow's eager context module (tests pass a fake).

    Raises:
        ValueError: on every rank, when any rank differs: the message
            (`keras_smp.config.disagreements`) names each option or version,
            the ranks holding each value and where it came from.
        RuntimeError: a rank failed, or did not answer within
            `collective_timeout_seconds`.
    """
    base = f"keras_smp/settings/{next(_settings_checks)}"
    mine = agreement_record(config, versions(), {
        "pipeline mode": layout.mode, "device type": layout.device_type,
        "model replicas per process": len(layout.devices),
        "devices per process": len({d for row in layout.devices
                                    for d in row})})
    # A rank that never posts runs a keras-smp without this check (or
    # another key layout), or made fewer SMPStrategy / smp.init calls.
    what = ("the start-up settings check (a rank that never answers may run "
            "another keras-smp version, or create fewer SMPStrategy / "
            "smp.init objects)")
    verdict = agreement.agree(
        (context or tf_private.context).context(), base, cluster.rank,
        cluster.world_size, mine, disagreements, what=what,
        timeout_seconds=config.collective_timeout_seconds)
    if verdict:
        raise ValueError(verdict)


def start(config=None, /, *, custom_loop=False, **kwargs):
    """Sets up keras-smp and TensorFlow in this process; returns the `Runtime`.

    Args:
        config: `None`, a dict of options, or an `SMPConfig` (the JSON env
            var `SMP_CONFIG` overrides it).
        custom_loop: `smp.init`'s set-up: every process runs whole model
            replicas (stage `s` on local device `s`, sharing devices when
            there are fewer than stages; the default device when TensorFlow
            already started), no strategy.
        **kwargs: options, overriding `config`'s.

    Raises:
        ValueError: bad options, or stages that do not divide the devices or
            processes (naming the fix).
        RuntimeError: TensorFlow already initialised with too few devices
            (`SMPStrategy`), or peers that never joined (naming them).
    """
    config = SMPConfig.build(config, **kwargs)
    cluster = resolve_cluster()
    p = config.partitions
    tp = config.tensor_parallel_degree
    if custom_loop and tp > 1 and config.horovod:
        raise ValueError(
            f"tensor_parallel_degree={tp} with horovod=True is not "
            "supported: Horovod's allreduce would average different "
            "tensor-parallel ranks' shards. Use horovod=False (keras-smp "
            "averages the replicas of each tensor-parallel rank in "
            "`StepOutput.accumulate()`), or tensor_parallel_degree=1.")
    # A custom loop runs a process's stages on its devices: only the
    # tensor-parallel ranks (and replicas) are processes.
    if custom_loop and tp > 1 and cluster.world_size % tp:
        raise ValueError(
            f"tensor_parallel_degree={tp} with smp.init / @smp.step runs one "
            f"tensor-parallel rank per worker process, but this job has "
            f"{cluster.world_size} process(es). Start a multiple of {tp} "
            f"processes (`keras-smp launch -n {tp} -- python train.py`). "
            "Ranks on the local devices of one process work with "
            f"`SMPStrategy(tensor_parallel_degree={tp}, local_devices={tp})` "
            "and model.fit.")
    local_tp = check_tensor_parallel(
        tp, 1 if custom_loop else p,
        None if custom_loop else config.local_devices, cluster.world_size)
    if custom_loop:
        mode = "none" if p == 1 else "in_process"
    elif local_tp:
        # The ranks are this process's devices: one model, no processes
        # to split it across (the topology counts processes).
        local_devices, mode = tp, "none"
    else:
        local_devices, mode = _pipeline_mode(config, cluster)
        if tp > 1:
            if p > 1 and mode != "multi_process":
                raise ValueError(
                    f"tensor_parallel_degree={tp} with partitions={p} runs "
                    "one pipeline stage's tensor-parallel rank per "
                    "process; this job would run whole pipelines in each "
                    f"process ({mode}). Set local_devices=1.")
            local_devices = 1
    topology = topology_for(cluster, p, config.placement_strategy, mode,
                            tensor_parallel_degree=1 if local_tp else tp)
    if custom_loop:
        layout = _custom_loop_layout(config, topology, mode)
    else:
        device_type, count = configure_local_devices(local_devices)
        layout = StageLayout.build(
            mode, p, topology, device_type, count,
            worker_device=worker_device(cluster))
    collectives = start_collectives(cluster, config)
    if collectives:
        check_same_settings(cluster, config, layout)
    patches.install()
    runtime = Runtime(config=config, cluster=cluster, topology=topology,
                      layout=layout, keys=process_keys(), started=True,
                      collectives=collectives,
                      local_tensor_parallel=tp if local_tp else 1)
    state.install(config, cluster, topology, runtime, replica_rank=(
        (lambda: tf_private.local_replica_index(tp)) if local_tp else None))
    return runtime


def _custom_loop_layout(config, topology, mode):
    """Stage devices of `@smp.step`: one whole replica in every process.

    Stage `s` runs on local device `s` (GPU `s % GPUs`, or logical CPU `s`
    created here); on the default device (`""`) with `partitions=1`, or
    when TensorFlow already started with one CPU.
    """
    p = config.partitions
    gpus = tf.config.list_physical_devices("GPU")
    if p == 1:
        return StageLayout.build(
            mode, 1, topology, "GPU" if gpus else "CPU", 1
        ).with_default_devices()
    try:
        device_type, count = configure_local_devices(None if gpus else p)
    except RuntimeError:
        # TensorFlow already started with fewer CPU devices: the stages
        # share the default device (the same numbers, no placement).
        tf.get_logger().info(
            "keras-smp: TensorFlow already initialised; the %d stages "
            "of a step share the default CPU device.", p)
        return StageLayout.build(
            mode, p, topology, "CPU", 1, share_devices=True
        ).with_default_devices()
    return StageLayout.build(mode, p, topology, device_type, count,
                             share_devices=True)
