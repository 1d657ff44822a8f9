"""Every private TensorFlow API keras-smp uses, in one place.

keras-smp subclasses TensorFlow's collective all-reduce strategy and its
cross-device ops, and starts TensorFlow's distributed runtime itself; those
live under `tensorflow.python`, which has no stability promise. Modules of
`keras_smp.runtime` and `keras_smp.distribute` import them only from here,
so a TensorFlow upgrade that moves one breaks (and is fixed in) this file.

Checked against TensorFlow 2.21.
"""

# pylint: disable=unused-import
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: F401
from tensorflow.core.protobuf import tensorflow_server_pb2  # noqa: F401
from tensorflow.python.distribute import collective_all_reduce_strategy  # noqa: F401
from tensorflow.python.distribute import cross_device_ops  # noqa: F401
from tensorflow.python.distribute import cross_device_utils  # noqa: F401
from tensorflow.python.distribute import device_util  # noqa: F401
from tensorflow.python.distribute import distribute_lib  # noqa: F401
from tensorflow.python.distribute import multi_worker_util  # noqa: F401
from tensorflow.python.distribute import reduce_util  # noqa: F401
from tensorflow.python.eager import context  # noqa: F401
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
