"""Every private TensorFlow API keras-smp uses, in one place.

keras-smp subclasses TensorFlow's collective all-reduce strategy and its
cross-device ops, and starts TensorFlow's distributed runtime itself; those
live under `tensorflow.python`, which has no stability promise. Modules of
`keras_smp.runtime` and `keras_smp.distribute` import them only from here,
so a TensorFlow upgrade that moves one breaks (and is fixed in) this file.

Checked against TensorFlow 2.21.
"""

# pylint: disable=unused-import
import threading

from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: F401
from tensorflow.core.protobuf import tensorflow_server_pb2  # noqa: F401
from tensorflow.python.distribute import collective_all_reduce_strategy  # noqa: F401
from tensorflow.python.distribute import cross_device_ops  # noqa: F401
from tensorflow.python.distribute import cross_device_utils  # noqa: F401
from tensorflow.python.distribute import device_util  # noqa: F401
from tensorflow.python.distribute import distribute_lib  # noqa: F401
from tensorflow.python.distribute import input_lib  # noqa: F401
from tensorflow.python.distribute import multi_worker_util  # noqa: F401
from tensorflow.python.distribute import reduce_util  # noqa: F401
from tensorflow.python.distribute import values as distribute_values  # noqa: F401
from tensorflow.python.eager import context  # noqa: F401
from tensorflow.python.framework import dtypes  # noqa: F401
from tensorflow.python.framework import ops  # noqa: F401
from tensorflow.python.ops import math_ops  # noqa: F401
from tensorflow.python.ops import collective_ops  # noqa: F401
from tensorflow.python.util import nest  # noqa: F401

# The coordination service's proto module moved between TensorFlow
# versions; TensorFlow's own strategy module imports it from wherever it
# lives.
coordination_config_pb2 = collective_all_reduce_strategy.coordination_config_pb2

# Short names used by keras-smp.
CollectiveAllReduceStrategy = collective_all_reduce_strategy.CollectiveAllReduceStrategy
CollectiveAllReduceExtended = collective_all_reduce_strategy.CollectiveAllReduceExtended
CollectiveKeys = cross_device_utils.CollectiveKeys
InputContext = distribute_lib.InputContext
Strategy = distribute_lib.Strategy


# --- used by keras_smp.pipeline --------------------------------------------

def canonical_device(name):
    """A device string in TensorFlow's canonical long form."""
    return device_util.canonicalize(name)


def local_replica_index(num_local_replicas):
    """This replica's index among the process's local replicas (0 outside
    a replica context)."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return 0
    return ctx._replica_id_in_sync_group % num_local_replicas


def mirrored(components):
    """A `Mirrored` distributed value of per-replica `components` (what
    a strategy's reduction returns: replica `r` receives `components[r]`)."""
    return distribute_values.Mirrored(tuple(components))


def add_control_input(op, dependency):
    """Makes the graph operation `op` run only after `dependency` (an
    operation of the same graph, built later than `op`, which
    `tf.control_dependencies` cannot express)."""
    op._add_control_input(dependency)


def ordering_token(device):
    """A resource on `device` whose handle, passed as a collective's
    `ordering_token`, runs that device's collectives in program order.
    Collectives between the devices of one process hang without one (TF
    2.21); TensorFlow's `CollectiveReplicaLauncher` makes the same."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import resource_variable_ops

    with ops.init_scope(), ops.device(device):
        return resource_variable_ops.ResourceVariable(0.0)


def replica_id():
    """The running replica's id in its sync group, as a Python int where
    TensorFlow has one (0 outside a replica context)."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    return 0 if ctx is None else ctx._replica_id_in_sync_group


def in_strategy_replica():
    """Whether a strategy's replica function is being run or traced now
    (not its cross-replica context, nor code outside any strategy)."""
    import tensorflow as tf

    return (tf.distribute.has_strategy()
            and tf.distribute.get_replica_context() is not None)


# --- used by keras_smp.runtime.process / patches ----------------------------

def tensorflow_started():
    """Whether this process's TensorFlow context is initialised (any op,
    dataset or model has run; collective ops can no longer be set up)."""
    return context.context()._context_handle is not None


def global_seed():
    """The global seed `tf.random.set_seed` (or `keras.utils.set_random_seed`)
    set in this process, or `None`; reads it without drawing an operation
    seed (`random_seed.get_seed` would advance the sequence of op seeds)."""
    return context.global_seed()


def _datasets_in(dataset):
    """`dataset` and every dataset its pipeline reads from (walking
    `DatasetV2._inputs()`), in a fixed order."""
    stack, seen = [dataset], set()
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        yield ds
        try:
            stack.extend(reversed(ds._inputs()))
        except (AttributeError, NotImplementedError):
            pass


def dataset_shuffle_seeds(dataset):
    """`[(seed, seed2)]` (ints) of every `shuffle` in `dataset`'s input
    pipeline (`(0, 0)`: unseeded, a random order per process, as
    TensorFlow's kernels read it), in a fixed order."""
    from tensorflow.python.data.experimental.ops import shuffle_ops
    from tensorflow.python.data.ops import shuffle_op

    kinds = (shuffle_op._ShuffleDataset, shuffle_ops._ShuffleAndRepeatDataset)
    return [tuple(0 if seed is None else int(seed)
                  for seed in (ds._seed, ds._seed2))
            for ds in _datasets_in(dataset) if isinstance(ds, kinds)]


# File readers: under the AUTO policy TensorFlow shards a pipeline that
# reads files by file (each worker its own files), its file list unshuffled.
_READERS = ("TextLineDataset", "TFRecordDataset", "FixedLengthRecordDataset")


def reads_own_data(dataset):
    """Whether each worker reads data of its own from `dataset` under
    TensorFlow's auto-sharding: turned off, by file (`FILE`, `HINT`), or
    `AUTO` with a file reader in the pipeline (a reader dataset, or a
    reader op in an `interleave` / `flat_map` function)."""
    import tensorflow as tf

    policies = tf.data.experimental.AutoShardPolicy
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy in (policies.OFF, policies.FILE, policies.HINT):
        return True
    if policy != policies.AUTO:
        return False
    for ds in _datasets_in(dataset):
        if type(ds).__name__.lstrip("_").startswith(_READERS):
            return True
        try:
            functions = ds._functions()
        except (AttributeError, NotImplementedError):
            continue
        for wrapper in functions:
            try:  # the function's ops and its nested functions'
                graph = wrapper.function.graph.as_graph_def()
            except AttributeError:
                continue
            ops = [node.op for node in graph.node] + [
                node.op for f in graph.library.function
                for node in f.node_def]
            if any(op.startswith(_READERS) for op in ops):
                return True
    return False


def trace_time_instance_keys(fn):
    """`fn` with collective instance keys fixed when it is traced.

    TensorFlow's collective launchers feed instance keys at call time
    (`capture_call_time_value`); the deferred capture is lost when the
    step function runs inside another function's control flow (Keras'
    `steps_per_execution > 1` loop), which fails with "You must feed a value
    for placeholder tensor ... while/cond/Placeholder". Keys fixed at trace
    time are the same on every worker as long as they trace the same steps,
    which Keras' SPMD step functions do.
    """
    import functools

    launcher = cross_device_utils.CollectiveReplicaLauncher

    @functools.wraps(fn)
    def run(*args, **kwargs):
        previous = launcher._prefer_unique_instance_key
        launcher._prefer_unique_instance_key = False
        try:
            return fn(*args, **kwargs)
        finally:
            launcher._prefer_unique_instance_key = previous

    return run


def first_replica_spec(spec):
    """The type spec of the first local replica's part of a distributed
    dataset's `element_spec` component (itself when not per replica)."""
    value_specs = getattr(spec, "_value_specs", None)
    if isinstance(spec, distribute_values.PerReplicaSpec) and value_specs:
        return value_specs[0]
    return spec


# --- used by keras_smp.runtime.data_end ------------------------------------

_iterating = threading.local()


def route_replicas_with_values(hook):
    """Routes the count by which a distributed iterator decides whether a
    next batch exists through `hook` (idempotent).

    TensorFlow's `get_next` and `get_next_as_optional` of a distributed
    iterator (`input_lib.DistributedIteratorBase`) take each local
    replica's next element as an optional and count the replicas holding
    one (`input_lib._calculate_replicas_with_values`, summed over the
    workers by the strategy's reduce): none, and the data has ended; some,
    and the others get empty batches. `hook(strategy, cardinality, count,
    replicas, device)` is called instead with the iterator's dataset's
    `cardinality` (as the iterator was traced: a step function serves
    data of other lengths too), this process's `count` (an int64 scalar
    tensor) of its `replicas` (a Python int) holding a batch, and its
    input `device`; it returns the job's count or `None` for
    TensorFlow's.
    """
    original = input_lib._calculate_replicas_with_values
    if getattr(original, "_smp_routed", False):
        return

    def calculate(strategy, input_workers, optional_list):
        stack = getattr(_iterating, "cardinalities", None)
        if stack:
            counts = []
            for worker, optionals in zip(input_workers.worker_devices,
                                         optional_list):
                with ops.device(worker):
                    counts.append(math_ops.add_n([
                        math_ops.cast(v.has_value(), dtypes.int64)
                        for v in optionals]))
            got = hook(strategy, stack[-1], math_ops.add_n(counts),
                       sum(len(o) for o in optional_list),
                       input_workers.worker_devices[0])
            if got is not None:
                return got
        return original(strategy, input_workers, optional_list)

    calculate._smp_routed = True
    input_lib._calculate_replicas_with_values = calculate
    base = input_lib.DistributedIteratorBase
    for name in ("get_next", "get_next_as_optional"):
        setattr(base, name, _with_cardinality(getattr(base, name)))


def trace_by_length_class():
    """Makes TensorFlow trace a step function again for a distributed
    dataset or iterator of another kind of length (idempotent).

    A distributed iterator rebuilt inside a traced function keeps the
    first trace's `_cardinality` and `_enable_get_next_as_optional`,
    but its type spec ignores both (`DistributedDatasetAndIteratorSpec.
    _serialize`): a step traced on infinite data (which takes its next
    batch without asking whether one exists) served finite data of the
    same element spec without the end-of-data handling. The spec here
    also tells infinite data and the iterators' end handling apart.
    """
    base = input_lib.DistributedDatasetAndIteratorSpec
    if getattr(base._serialize, "_smp_patched", False):
        return
    serialize = base._serialize
    subtype = base.is_subtype_of
    supertype = base.most_specific_common_supertype

    def length_class(spec):
        return (getattr(spec, "_cardinality", None) == INFINITE_CARDINALITY,
                bool(getattr(spec, "_enable_get_next_as_optional", False)))

    def _serialize(self):
        return tuple(serialize(self)) + (length_class(self),)

    def is_subtype_of(self, other):
        return (length_class(self) == length_class(other)
                and subtype(self, other))

    def most_specific_common_supertype(self, others):
        if any(length_class(o) != length_class(self) for o in others):
            return None
        return supertype(self, others)

    for fn in (_serialize, is_subtype_of, most_specific_common_supertype):
        fn._smp_patched = True
    base._serialize = _serialize
    base.is_subtype_of = is_subtype_of
    base.most_specific_common_supertype = most_specific_common_supertype


INFINITE_CARDINALITY = -1  # tf.data.INFINITE_CARDINALITY


def _with_cardinality(method):
    import functools

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        stack = _iterating.__dict__.setdefault("cardinalities", [])
        stack.append(getattr(self, "_cardinality", None))
        try:
            return method(self, *args, **kwargs)
        finally:
            stack.pop()

    return run


def replicas_update_without_merge_call():
    """Whether the current strategy's replicas update their variables
    without a `merge_call` (`tf.__internal__`'s
    `strategy_supports_no_merge_call`, what Keras' optimizer asks)."""
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


# --- used by keras_smp.runtime.split_draws ----------------------------------

def in_xla_context():
    """Whether the code being traced now is compiled by XLA (a
    `tf.function(jit_compile=True)`, or a function it calls)."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(
        ops.get_default_graph())


# --- used by keras_smp.distribute.strategy (per-replica random draws) -------

def is_tf_function(fn):
    """Whether `fn` is a `tf.function`."""
    from tensorflow.python.eager.polymorphic_function import (
        polymorphic_function)

    return isinstance(fn, polymorphic_function.Function)


def function_with_python(fn, python_function):
    """The `tf.function` `fn` (its options kept) running
    `python_function` (what TensorFlow's mirrored run does to run a
    function's replicas in one trace)."""
    return fn._clone(python_function=python_function)


def called_graph(op):
    """The traced graph (`FuncGraph`) of the function a call op
    (`PartitionedCall`, `StatefulPartitionedCall`) of a traced graph
    calls, or None: its outputs are the op's outputs, its `inputs` the
    op's inputs, in order."""
    try:
        name = op.get_attr("f").name
        function = op.graph._get_function(name)
        return getattr(function, "graph", None)
    except (ValueError, AttributeError, KeyError):
        return None
