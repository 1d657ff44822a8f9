"""Gradient sync for `SMPStrategy`: fused, topology-aware all-reduce.

`GradientAllReduce` is the `CrossDeviceOps` that `SMPStrategy` hands to
TensorFlow. Keras' optimizer calls `replica_context.all_reduce(SUM, grads)`
once per step; that lands in `GradientAllReduce._all_reduce`, which

1. packs the dense gradients into buckets (`fusion.plan_buckets`),
2. runs the chosen algorithm on each bucket with TensorFlow collective ops,
3. unpacks the buckets.

Algorithms (groups described in `groups.py`):

- "ring": one collective all-reduce over every data-parallel replica. On
  CPU devices, with `pieces` > 1, a large bucket goes as up to that many
  pieces in flight together (`fusion.plan_pieces`), piece k on ordering
  stream k.
- "hierarchical": sum inside each host, all-reduce one shard per local
  replica across hosts (in parallel), then share the shards back inside the
  host. Fewer bytes cross the inter-host link.

Buckets are issued in reverse model order, roughly the order in which the
backward pass produces their gradients (as PyTorch DDP does): a bucket's
collectives then wait on their stream only behind buckets whose gradients
were ready earlier.
"""

import tensorflow as tf

from keras_smp import runtime
from keras_smp.distribute import compression as compression_lib
from keras_smp.distribute import fusion
from keras_smp.distribute.groups import ReplicaLayout
from keras_smp.runtime import tf_private
from keras_smp.runtime.keys import process_keys

collective_ops = tf_private.collective_ops
cross_device_ops_lib = tf_private.cross_device_ops
cross_device_utils = tf_private.cross_device_utils
device_util = tf_private.device_util
nest = tf_private.nest
reduce_util = tf_private.reduce_util

# Pipelined hierarchical all-reduce: chunks of at least this many bytes.
_MIN_CHUNK = 4 * 2**20


def _blocks(flat, g):
    """`flat` zero-padded to a multiple of `g`, as `g` rows."""
    if flat.shape[0] is not None and flat.shape[0] % g == 0:
        return tf.reshape(flat, [g, -1])
    n = tf.size(flat)
    shard = (n + g - 1) // g
    return tf.reshape(tf.pad(flat, [[0, shard * g - n]]), [g, shard])


# CollectiveGatherV2's dtypes; others travel bit-cast to one of these.
_GATHER_DTYPES = {tf.float16, tf.float32, tf.float64, tf.int32, tf.int64}
_SAME_WIDTH = {2: tf.float16, 4: tf.int32, 8: tf.int64}


def _all_gather(launcher, t, options):
    """The group's `t`s concatenated in TensorFlow's order (bits unchanged)."""
    if t.dtype in _GATHER_DTYPES:
        return launcher._all_gather(t, options)
    wire = _SAME_WIDTH[t.dtype.size]
    return tf.bitcast(launcher._all_gather(tf.bitcast(t, wire), options),
                      t.dtype)


def _all_to_all(launcher, t, options):
    """Row k of `t` to the group's k-th member; returns the rows received."""
    options = launcher._options.merge(options)
    wire = t.dtype if t.dtype in _GATHER_DTYPES else _SAME_WIDTH[t.dtype.size]
    with tf.device(launcher._device):
        out = collective_ops.all_to_all_v2(
            tf.bitcast(t, wire) if wire != t.dtype else t,
            launcher._group_size, launcher._group_key,
            launcher._next_instance_key(),
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())
    return tf.bitcast(out, t.dtype) if wire != t.dtype else out


def _chunk_sizes(n, parts):
    """Sizes of the pipelined chunks of `n` elements: the first and last
    are a quarter of the others, so the link starts early and the last
    share-back is short."""
    if parts < 3:
        return _even_split(n, parts)
    edge = max(1, n // (4 * parts))
    return [edge] + _even_split(n - 2 * edge, parts - 2) + [edge]


def _even_split(n, parts):
    """Sizes of `parts` near-equal pieces of `n` elements."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class GradientAllReduce(cross_device_ops_lib.CollectiveAllReduce):
    """Fused ring or hierarchical all-reduce over TF collective ops.

    With pipeline stages in the process (`stage_devices`), each stage's
    gradients are summed among that stage's data-parallel peers, on the
    stage's own devices.

    Args:
        devices: this worker's local devices (one replica each).
        layout: `ReplicaLayout` of the whole cluster (local device 0's view).
        algorithm: "ring" or "hierarchical".
        fusion_threshold_bytes: bucket size; 0 disables fusion.
        options: `tf.distribute.experimental.CommunicationOptions`.
        collective_keys: the strategy's `CollectiveKeys`, for the base class.
        stage_devices: for each local replica, the device of each pipeline
            stage (default: one stage, on `devices`).
        pieces: "ring" on CPU devices: a bucket is all-reduced as up to
            this many pieces in flight together (`fusion.plan_pieces`); 1
            keeps buckets whole. GPUs keep 1: NCCL needs every rank to
            launch its collectives in one order.
        group_keys: the `keras_smp.runtime.keys.KeyRange` our own groups
            take their keys from, at least `keys_needed(layout, stages)`
            long; by default a new range of the process-wide allocator.
            Every process of the job must get the same keys for the same
            groups (see `keras_smp.runtime.keys`).
        compression: None, "bfloat16" or "float16": gradient sums (within
            `keras_smp.runtime.summing_gradients`) send their float32
            values as that dtype (`keras_smp.distribute.compression`).
    """

    _ALGORITHMS = ("ring", "hierarchical")

    def __init__(self, devices, layout, algorithm="ring",
                 fusion_threshold_bytes=64 * 2**20, options=None,
                 collective_keys=None, stage_devices=None, group_keys=None,
                 pieces=1, compression=None):
        options = options or tf.distribute.experimental.CommunicationOptions()
        super().__init__(devices=devices, group_size=layout.size,
                         options=options, collective_keys=collective_keys)
        if algorithm not in self._ALGORITHMS:
            raise ValueError(
                f"{type(self).__name__} supports {self._ALGORITHMS}; "
                f"received algorithm={algorithm!r}.")
        if compression is not None and compression not in compression_lib.DTYPES:
            raise ValueError(
                f"{type(self).__name__}: compression must be None or one of "
                f"{compression_lib.DTYPES}; received {compression!r}.")
        self.algorithm = algorithm
        self.compression = compression
        # Gradients sent compressed so far (traced, all replicas).
        self.compressed_traced = 0
        self.layout = layout
        self.fusion_threshold_bytes = int(fusion_threshold_bytes)
        # Hierarchical: buckets are cut into up to this many chunks whose
        # intra-host and cross-host steps overlap.
        self.pipeline_chunks = 8
        # Buckets traced so far (all replicas): tests and users can check
        # that gradients really went through this component.
        self.buckets_traced = 0
        first = layout.replica_id
        self._local_layouts = [
            layout.for_replica(first + i) for i in range(len(devices))]
        if stage_devices is None:
            stage_devices = [[d] for d in devices]
        self._stage_devices = [
            [device_util.canonicalize(d) for d in row] for row in stage_devices]
        self.num_stages = len(self._stage_devices[0])
        # Pieces of a bucket in flight together (ring on CPU only).
        self.pieces = fusion.pieces_in_flight(
            pieces, algorithm,
            [d for row in self._stage_devices for d in row])
        # Ring all-reduces traced so far (all replicas), one per piece.
        self.pieces_traced = 0
        self._world, self._intra, self._cross = [], [], []
        self._streams = []
        if algorithm not in ("ring", "hierarchical"):
            return  # a subclass communicates by other means
        needed = self.keys_needed(layout, self.num_stages)
        if group_keys is None:
            group_keys = process_keys().allocate(type(self).__name__, needed)
        if group_keys.size < needed:
            raise ValueError(
                f"{type(self).__name__} needs {needed} group keys "
                f"({self.num_stages} stage(s) x {needed // self.num_stages} "
                f"groups); the key range {group_keys.name!r} has "
                f"{group_keys.size}. Allocate keys_needed(layout, stages).")
        self.group_keys = group_keys
        self._keys = cross_device_utils.CollectiveKeys(
            group_key_start=group_keys.start)
        key_of = {
            (s, g): self._keys._get_new_group_key(
                [row[s] for row in self._stage_devices])
            for s in range(self.num_stages) for g in layout.all_groups()
        }
        # Ordering tokens: the collectives of one stream on a device run in
        # program order on every worker. Streams per device: the base
        # class's token for world and intra-host collectives (and piece 0),
        # one for the cross-host collectives, so that a chunk's cross-host
        # step overlaps the next chunk's intra-host step, and one per
        # further piece in flight (each group still sees one order per
        # stream).
        tokens = {("intra", self._devices[i]): launcher._ordering_token
                  for i, launcher in enumerate(self._launchers)}

        def launcher(stage, group, i, stream="intra"):
            device = self._stage_devices[i][stage]
            lau = cross_device_utils.CollectiveReplicaLauncher(
                key_of[(stage, group)], len(group), self._keys, device,
                options)
            lau._ordering_token = tokens.setdefault(
                (stream, device), lau._ordering_token)
            return lau

        # Launchers indexed [local replica][stage]; ring on CPU: a list
        # per stage, one launcher (ordering stream) per piece in flight.
        # Piece k of every bucket runs on stream k, so each stream still
        # sees its collectives in one order on every rank.
        for i, local in enumerate(self._local_layouts):
            stages = range(self.num_stages)
            self._world.append(
                [launcher(s, local.world_group, i) for s in stages])
            self._streams.append(
                [[self._world[i][s]]
                 + [launcher(s, local.world_group, i, f"piece{k}")
                    for k in range(1, self.pieces)] for s in stages])
            if algorithm == "hierarchical":
                self._intra.append(
                    [launcher(s, local.intra_host_group, i) for s in stages])
                self._cross.append(
                    [launcher(s, local.cross_host_group, i, "cross")
                     for s in stages])

    @staticmethod
    def keys_needed(layout, num_stages=1):
        """Group keys of one instance: one per (stage, group of `layout`)."""
        return num_stages * len(layout.all_groups())

    def _reduce_flat(self, flat, replica_id, stage, options):
        """All-reduces (sums) one flat bucket of `stage` on a local replica."""
        if self.algorithm == "ring":
            streams = self._streams[replica_id][stage]
            n = flat.shape[0] if flat.shape.rank == 1 else None
            sizes = ([n] if n is None or len(streams) == 1 else
                     fusion.plan_pieces(n, flat.dtype.size, len(streams)))
            self.pieces_traced += len(sizes)
            if len(sizes) == 1:
                return streams[0].all_reduce(flat, options=options)
            return tf.concat(
                [streams[k].all_reduce(piece, options=options)
                 for k, piece in enumerate(tf.split(flat, sizes))], axis=0)
        local = self._local_layouts[replica_id]
        intra = self._intra[replica_id][stage]
        cross = self._cross[replica_id][stage]
        if local.num_hosts == 1:
            return intra.all_reduce(flat, options=options)
        if local.local_size == 1:
            return cross.all_reduce(flat, options=options)
        n = flat.shape[0]
        chunks = 1 if n is None else min(
            self.pipeline_chunks, max(1, n * flat.dtype.size // _MIN_CHUNK))
        parts = [flat] if chunks == 1 else tf.split(flat, _chunk_sizes(n, chunks))
        g = local.local_size
        # TensorFlow ranks a group's devices in its own order; entry k of
        # `order` is the local index of the peer it ranks k-th.
        order = intra._all_gather(
            tf.constant([local.local_index], tf.int32), options)
        # Pipelined over chunks: all intra-host reduce-scatters are issued
        # first, then the cross-host all-reduces of one shard per local peer
        # (their own ordering stream), then the intra-host all-gathers:
        # chunk c crosses hosts while chunk c+1 is summed inside the host.
        # Reduce-scatter is an all-to-all of shards plus a local sum
        # (TensorFlow implements CollectiveReduceScatterV2 for NCCL only);
        # block k goes to the peer ranked k-th, the shard of its local index.
        mine = [tf.reduce_sum(_all_to_all(
            intra, tf.gather(_blocks(p, g), order), options), axis=0)
            for p in parts]
        crossed = [cross.all_reduce(m, options=options) for m in mine]
        inverse = tf.math.invert_permutation(order)
        out = []
        for c, p in zip(crossed, parts):
            gathered = tf.reshape(_all_gather(intra, c, options), [g, -1])
            out.append(tf.reshape(tf.gather(gathered, inverse), [-1])[
                :tf.size(p)])
        return out[0] if len(out) == 1 else tf.concat(out, axis=0)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        flat_values = [self._maybe_dense(v) for v in nest.flatten(value)]
        dense_values, dense_idx, sparse_values, sparse_idx = (
            cross_device_utils.split_by_sparsity(flat_values))
        options = self._options.merge(options)
        dense_results = []
        if dense_values and self.layout.size == 1:
            dense_results = list(dense_values)  # one replica: nothing to sum
        elif dense_values:
            dense_results = [None] * len(dense_values)
            for stage, idx in self._by_stage(dense_values, replica_id):
                with tf.device(self._stage_devices[replica_id][stage]):
                    reduced = self._all_reduce_dense(
                        [dense_values[k] for k in idx], replica_id, stage,
                        options)
                    if reduce_op == reduce_util.ReduceOp.MEAN:
                        reduced = [v / tf.cast(self._group_size, v.dtype)
                                   for v in reduced]
                for k, v in zip(idx, reduced):
                    dense_results[k] = v
        sparse_results = []
        if sparse_values:
            sparse_results = nest.flatten(super()._all_reduce(
                reduce_op, sparse_values, replica_id, options))
        flat_results = cross_device_utils.stitch_values(
            ((dense_results, dense_idx), (sparse_results, sparse_idx)))
        return nest.pack_sequence_as(value, flat_results)

    def _maybe_dense(self, value):
        """A sparse gradient summed densely when that moves less
        (`fusion.sum_sparse_as_dense`) and the optimizer allows it (not
        within `runtime.sparse_gradients_as_is`); other values
        unchanged."""
        if not isinstance(value, tf.IndexedSlices) or runtime.keep_sparse():
            return value
        dense_shape = tf.get_static_value(value.dense_shape)
        if dense_shape is None or not fusion.sum_sparse_as_dense(
                value.values.shape[0], int(dense_shape[0]),
                self.layout.size):
            return value
        with tf.device(value.values.device):  # stays on its stage's device
            return tf.convert_to_tensor(value)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs,
                                    options):
        # Gradients of different pipeline stages live on different devices,
        # so their destinations differ; TensorFlow would then reduce them one
        # by one. Each value's destination is its own devices (an
        # all-reduce): fuse them per stage instead.
        if all(cross_device_ops_lib._devices_match(v, d, True)
               for v, d in value_destination_pairs):
            return self._all_reduce_per_replica_values(
                reduce_op, [v for v, _ in value_destination_pairs], options)
        return super().batch_reduce_implementation(
            reduce_op, value_destination_pairs, options)

    def _by_stage(self, values, replica_id):
        """Groups value indices by the pipeline stage whose device holds them."""
        stage_of = {d: s for s, d in enumerate(self._stage_devices[replica_id])}
        groups = {}
        for k, v in enumerate(values):
            device = getattr(v, "device", "") or ""
            stage = stage_of.get(
                device_util.canonicalize(device) if device else None, 0)
            groups.setdefault(stage, []).append(k)
        return sorted(groups.items())

    def _all_reduce_dense(self, values, replica_id, stage, options):
        values = [tf.convert_to_tensor(v) for v in values]
        wire = self.compression if runtime.gradients_being_summed() else None
        self.compressed_traced += sum(
            compression_lib.compresses(v, wire) for v in values)
        return compression_lib.summed(
            values, wire, lambda values: self._all_reduce_wire(
                values, replica_id, stage, options))

    def _all_reduce_wire(self, values, replica_id, stage, options):
        # Values of shapes unknown when traced (a length left unknown) go
        # one by one; the others in buckets.
        known = [i for i, v in enumerate(values)
                 if v.shape.is_fully_defined()]
        out = {i: self._reduce_flat(v, replica_id, stage, options)
               for i, v in enumerate(values)
               if not v.shape.is_fully_defined()}
        shapes = [tuple(values[i].shape.as_list()) for i in known]
        buckets = fusion.plan_buckets(
            shapes, [values[i].dtype.name for i in known],
            [values[i].dtype.size for i in known],
            self.fusion_threshold_bytes)
        self.buckets_traced += len(buckets)
        packed = [values[i] for i in known]
        # Last bucket first: the backward pass produces it first.
        for bucket in reversed(buckets):
            flat = fusion.pack(packed, bucket)
            flat = self._reduce_flat(flat, replica_id, stage, options)
            out.update({known[k]: v for k, v in
                        fusion.unpack(flat, bucket, shapes).items()})
        return [out[i] for i in range(len(values))]

    def __deepcopy__(self, memo):
        # Launchers hold variables (ordering tokens); share, like TF does.
        return self
