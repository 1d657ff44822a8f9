"""Gradient sync for `SMPStrategy`: fused, topology-aware all-reduce.

`GradientAllReduce` is the `CrossDeviceOps` that `SMPStrategy` hands to
TensorFlow. Keras' optimizer calls `replica_context.all_reduce(SUM, grads)`
once per step; that lands in `GradientAllReduce._all_reduce`, which

1. packs the dense gradients into buckets (`fusion.plan_buckets`),
2. runs the chosen algorithm on each bucket with TensorFlow collective ops,
3. unpacks the buckets.

Algorithms (groups described in `groups.py`):

- "ring": one collective all-reduce over every data-parallel replica.
- "hierarchical": sum inside each host, all-reduce one shard per local
  replica across hosts (in parallel), then share the shards back inside the
  host. Fewer bytes cross the inter-host link.
"""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import reduce_util
from tensorflow.python.util import nest

from keras_smp.distribute import fusion
from keras_smp.distribute.groups import ReplicaLayout

# Group keys of our own groups start here; TensorFlow's own start at 1 and
# grow by one per distinct device set, far below this.
GROUP_KEY_BASE = 100_000


class GradientAllReduce(cross_device_ops_lib.CollectiveAllReduce):
    """Fused ring or hierarchical all-reduce over TF collective ops.

    Args:
        devices: this worker's local devices (one replica each).
        layout: `ReplicaLayout` of the whole cluster (local device 0's view).
        algorithm: "ring" or "hierarchical".
        fusion_threshold_bytes: bucket size; 0 disables fusion.
        options: `tf.distribute.experimental.CommunicationOptions`.
        collective_keys: the strategy's `CollectiveKeys`, for the base class.
    """

    def __init__(self, devices, layout, algorithm="ring",
                 fusion_threshold_bytes=64 * 2**20, options=None,
                 collective_keys=None):
        options = options or tf.distribute.experimental.CommunicationOptions()
        super().__init__(devices=devices, group_size=layout.size,
                         options=options, collective_keys=collective_keys)
        if algorithm not in ("ring", "hierarchical"):
            raise ValueError(
                f"GradientAllReduce supports 'ring' and 'hierarchical'; "
                f"received algorithm={algorithm!r}.")
        self.algorithm = algorithm
        self.layout = layout
        self.fusion_threshold_bytes = int(fusion_threshold_bytes)
        # Buckets traced so far (all replicas): tests and users can check
        # that gradients really went through this component.
        self.buckets_traced = 0
        first = layout.replica_id
        self._local_layouts = [
            layout.for_replica(first + i) for i in range(len(devices))]
        self._keys = cross_device_utils.CollectiveKeys(
            group_key_start=GROUP_KEY_BASE)
        group_keys = {
            g: self._keys._get_new_group_key(self._devices)
            for g in layout.all_groups()
        }
        # One ordering token per device shared by all our launchers, so every
        # collective on a device runs in program order on every worker.
        tokens = [launcher._ordering_token for launcher in self._launchers]

        def launcher(group, i):
            lau = cross_device_utils.CollectiveReplicaLauncher(
                group_keys[group], len(group), self._keys, self._devices[i],
                options)
            lau._ordering_token = tokens[i]
            return lau

        self._world = []
        self._intra = []
        self._cross = []
        for i, local in enumerate(self._local_layouts):
            self._world.append(launcher(local.world_group, i))
            if algorithm == "hierarchical":
                self._intra.append(launcher(local.intra_host_group, i))
                self._cross.append(launcher(local.cross_host_group, i))

    def _reduce_flat(self, flat, replica_id, options):
        """All-reduces (sums) one flat bucket on local replica `replica_id`."""
        if self.algorithm == "ring":
            return self._world[replica_id].all_reduce(flat, options=options)
        local = self._local_layouts[replica_id]
        g, idx = local.local_size, local.local_index
        if g > 1:
            flat = self._intra[replica_id].all_reduce(flat, options=options)
        if local.num_hosts == 1:
            return flat
        if g == 1:
            return self._cross[replica_id].all_reduce(flat, options=options)
        n = tf.size(flat)
        shard = (n + g - 1) // g
        padded = tf.pad(flat, [[0, shard * g - n]])
        mine = padded[idx * shard:(idx + 1) * shard]
        mine = self._cross[replica_id].all_reduce(mine, options=options)
        # Share shards back inside the host: every peer contributes its
        # shard in its own slot and zeros elsewhere; the sum is exact.
        slots = tf.pad(mine, [[idx * shard, (g - 1 - idx) * shard]])
        full = self._intra[replica_id].all_reduce(slots, options=options)
        return full[:n]

    def _all_reduce(self, reduce_op, value, replica_id, options):
        flat_values = nest.flatten(value)
        dense_values, dense_idx, sparse_values, sparse_idx = (
            cross_device_utils.split_by_sparsity(flat_values))
        options = self._options.merge(options)
        dense_results = []
        if dense_values:
            device = self._devices[replica_id]
            with tf.device(device):
                dense_results = self._all_reduce_dense(
                    dense_values, replica_id, options)
                if reduce_op == reduce_util.ReduceOp.MEAN:
                    dense_results = [
                        v / tf.cast(self._group_size, v.dtype)
                        for v in dense_results]
        sparse_results = []
        if sparse_values:
            sparse_results = nest.flatten(super()._all_reduce(
                reduce_op, sparse_values, replica_id, options))
        flat_results = cross_device_utils.stitch_values(
            ((dense_results, dense_idx), (sparse_results, sparse_idx)))
        return nest.pack_sequence_as(value, flat_results)

    def _all_reduce_dense(self, values, replica_id, options):
        values = [tf.convert_to_tensor(v) for v in values]
        shapes = [v.shape for v in values]
        if not all(s.is_fully_defined() for s in shapes):
            return [self._reduce_flat(v, replica_id, options) for v in values]
        shapes = [tuple(s.as_list()) for s in shapes]
        buckets = fusion.plan_buckets(
            shapes, [v.dtype.name for v in values],
            [v.dtype.size for v in values], self.fusion_threshold_bytes)
        out = {}
        self.buckets_traced += len(buckets)
        for bucket in buckets:
            flat = fusion.pack(values, bucket)
            flat = self._reduce_flat(flat, replica_id, options)
            out.update(fusion.unpack(flat, bucket, shapes))
        return [out[i] for i in range(len(values))]

    def __deepcopy__(self, memo):
        # Launchers hold variables (ordering tokens); share, like TF does.
        return self
