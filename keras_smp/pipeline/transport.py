"""Transports: how the pipeline runtime moves tensors between stages.

The runtime (`keras_smp.pipeline.runtime.execute`) calls a transport for
every `SEND_*` / `RECV_*` action; one transport serves each setting:

- `LocalTransport`: stages on devices of one process. A send hands the
  tensors over; the receive copies them onto the receiving stage's device
  (the runtime builds it under that device), in the stage's action order.
- `CollectiveTransport`: one stage per worker process. Sends and receives
  are TensorFlow collective point-to-point ops (`CollectiveBcastSendV2` /
  `CollectiveBcastRecvV2` on the two-member group of neighbouring stages)
  over TensorFlow's own runtime (gRPC; NCCL on GPUs). A send blocks until
  its receive is posted: receives are not chained (`chain_receives =
  False`) but posted where `Schedule.posted_actions` puts them, early
  enough that no send waits forever and late enough that a rank does not
  hold a buffer per microbatch. Every op carries
  `timeout_seconds`: a dead or hung peer becomes a `DeadlineExceededError`
  instead of a hang.

A tensor whose shape the receiving process cannot know before the step
runs (a sequence length that changes from batch to batch: `padded_batch`)
travels as a shape header, then its values flattened and padded to a size
bucket (`Dynamic`, `StageLinks.send_dynamic`): TensorFlow keeps one shape
per collective instance key for the life of the process, and the bucket
picks the key.

`StageLinks` holds the collective groups of one stage process: one pair
per boundary between model stages, its replica's pipeline group (losses,
outputs, weights) and tied-weight groups, with keys from one
`PipelineKeys` allocation. With virtual stages a process runs several
model stages (`StageLinks.held`).
"""

import tensorflow as tf

from keras_smp.pipeline.backward import dense

# The flattened sizes a tensor of unknown shape is padded to: 1, 2, 3 and
# every n * 2**e with n in 4..7 (under 25% padding), up to 2**31 - 1 (120
# sizes; each has its own instance key, `StageLinks._dynamic_keys`).
_BUCKETS = sorted({n << e for e in range(31) for n in (4, 5, 6, 7)
                   if (n << e) < 2**31} | {1, 2, 3, 2**31 - 1})
# Header: a tensor's shape, padded to this rank.
_MAX_RANK = 8


class Dynamic:
    """A `(shape, dtype)` spec's shape known only when the step runs.

    Tensors of such specs cross processes as a shape header, then their
    values flattened and zero-padded to the next of `_BUCKETS` sizes, each
    bucket under its own instance key (`StageLinks.send_dynamic`): the
    receiver learns the shape from the header, and no key ever carries
    two shapes.

    Args:
        shape: the static shape the received tensor takes (`None` where
            unknown: the rows, a sequence length), a `tf.TensorShape`.
    """

    def __init__(self, shape):
        self.shape = tf.TensorShape(shape)
        if self.shape.rank is None or self.shape.rank > _MAX_RANK:
            raise ValueError(
                f"keras-smp: a tensor of shape {self.shape} crosses "
                "processes with a shape known only when the step runs; "
                f"that needs a known rank of at most {_MAX_RANK}.")

    def __repr__(self):
        return f"Dynamic({self.shape})"


def is_dynamic(spec_shape):
    """Whether a spec's shape is a `Dynamic` one."""
    return isinstance(spec_shape, Dynamic)


class LocalTransport:
    """Moves tensors between stages held by one process.

    Example: see `keras_smp.pipeline.runtime.execute`.
    """

    #: Receives are ordered with the receiving stage's other actions.
    chain_receives = True

    def __init__(self):
        self._box = {}

    @staticmethod
    def _key(action):
        # (direction, receiving stage, microbatch)
        if action.kind.startswith("SEND"):
            return action.kind[-1], action.peer, action.microbatch
        return action.kind[-1], action.stage, action.microbatch

    def can_receive(self, action):
        """Whether the matching send has been built."""
        return self._key(action) in self._box

    def pending(self, action):
        """The tensors a receive will copy (for timing)."""
        return list(self._box.get(self._key(action), []))

    def send(self, action, tensors):
        """Hands `tensors` to the peer; no op of its own."""
        self._box[self._key(action)] = [dense(t) for t in tensors]
        return []

    def receive(self, action):
        """Copies the sent tensors onto the current (receiving) device."""
        return [tf.identity(t) for t in self._box.pop(self._key(action))]


class CollectiveTransport:
    """Moves tensors between stage processes with TensorFlow collectives.

    With virtual stages a process runs several model stages; a transfer
    between two of its own stages (ZB-V's turn) is handed over in the
    process, as `LocalTransport` does.

    Args:
        links: this process's `StageLinks`.
        recv_specs: `{(direction, stage): specs}`: `(shape, dtype)` of each
            tensor model stage `stage` (held here) receives forward
            (`"F"`, from stage - 1) and backward (`"B"`, gradients from
            stage + 1); or a function of a microbatch's rows giving them.
            A `Dynamic` shape: known only when the step runs.
        send_specs: the same for what model stage `stage` sends
            (`"F"` to stage + 1, `"B"` to stage - 1): its receiver's specs,
            so both sides send a `Dynamic` one the same way (default:
            none is).
        after: what every receive waits for: this rank's batch. At the
            end of data of unknown length the step fails getting it, and
            a receive posted before (one whose shape and key do not
            depend on the batch) would stay registered with its sender,
            to meet the next step's receive under the same key ("Second
            consumer arrived for key").
        rows: the microbatch's rows (a Python int or an int32 tensor), or
            a list: each microbatch's (a batch that does not divide into
            the microbatches); transfers of different microbatch sizes use
            different instance keys (`StageLinks.batched_key`).
    """

    chain_receives = False

    def __init__(self, links, recv_specs, rows, send_specs=None, after=()):
        self.links = links
        self.recv_specs = recv_specs
        self.send_specs = send_specs or {}
        self.after = list(after)
        if isinstance(rows, (list, tuple)):
            self._per_microbatch = [links.checked_rows(r) for r in rows]
            self.rows = self._per_microbatch[0]
        else:
            self.rows = links.checked_rows(rows)
            self._per_microbatch = None
        self._local = LocalTransport()

    def rows_of(self, microbatch):
        """The rows of `microbatch` (checked, an int32 tensor)."""
        if self._per_microbatch is None:
            return self.rows
        return self._per_microbatch[microbatch]

    def _is_local(self, action):
        return self.links.rank_of(action.peer) == self.links.rank

    def can_receive(self, action):
        if self._is_local(action):
            return self._local.can_receive(action)
        return True  # a posted receive waits for its data

    def pending(self, action):
        return []

    def send(self, action, tensors):
        if self._is_local(action):
            return self._local.send(action, tensors)
        rows = self.rows_of(action.microbatch)
        specs = self.send_specs.get((action.kind[-1], action.stage))
        if callable(specs):
            specs = specs(rows)
        return self.links.send_to(
            action.stage, action.peer, action.kind[-1], action.microbatch,
            [dense(t) for t in tensors], rows,
            dynamic=None if specs is None else
            [is_dynamic(shape) for shape, _ in specs])

    def receive(self, action):
        if self._is_local(action):
            return self._local.receive(action)
        direction = action.kind[-1]
        rows = self.rows_of(action.microbatch)
        specs = self.recv_specs[(direction, action.stage)]
        with tf.control_dependencies(self.after):
            return self.links.receive_from(
                action.stage, action.peer, direction, action.microbatch,
                specs(rows) if callable(specs) else specs, rows)


class PipelineKeys:
    """Collective group keys of every pipeline group of the job.

    Allocated once per model from the process-wide `KeyAllocator` (every
    rank allocates in the same order, so all agree); each group's key is a
    function of the layout, so no two groups share one.

    Args:
        num_replicas: pipelines of the job: data-parallel replicas
            (`dp_size`) times tensor-parallel ranks (`tp_size`), each
            tensor-parallel rank index a pipeline of its own.
        num_stages: model stages of a replica (`pp_size`, times the
            virtual stages): one two-process group per stage boundary.
        tied_sets: the distinct sets of pipeline ranks sharing a weight
            (sorted tuples), the same on every rank.
        allocator: a `keras_smp.runtime.keys.KeyAllocator` (default: the
            process-wide one).
    """

    def __init__(self, num_replicas, num_stages, tied_sets=(),
                 allocator=None):
        from keras_smp.runtime.keys import process_keys

        allocator = allocator or process_keys()
        self.num_replicas, self.num_stages = num_replicas, num_stages
        self.tied_sets = sorted({tuple(sorted(t)) for t in tied_sets})
        r, p = num_replicas, num_stages
        # One group per boundary between model stages: with virtual stages
        # two processes meet at several boundaries, each its own group.
        self._pairs = allocator.allocate("pipeline/pairs", r * max(1, p - 1))
        self._replica = allocator.allocate("pipeline/replica", r)
        self._tied = allocator.allocate(
            "pipeline/tied", r * max(1, len(self.tied_sets)))
        self._world = allocator.allocate("pipeline/world", 1)
        #: `StageLinks._data_slot`'s positions, kept as long as the keys.
        self.data_slots = {}

    def pair(self, replica, boundary):
        """Model stages `boundary` and `boundary + 1` of `replica`."""
        return self._pairs.key(replica * (self.num_stages - 1) + boundary)

    def replica(self, replica):
        """Every pipeline rank of `replica`."""
        return self._replica.key(replica)

    def tied(self, replica, ranks):
        """The pipeline ranks of `replica` in `ranks` (which share a
        weight)."""
        index = self.tied_sets.index(tuple(sorted(ranks)))
        return self._tied.key(replica * len(self.tied_sets) + index)

    def world(self):
        """Every process of the job."""
        return self._world.key(0)


class StageLinks:
    """Collective links of one stage process within its pipeline replica.

    Args:
        num_ranks: pipeline ranks (stage processes) per replica (`P`).
        rank: this process's pipeline rank (`pp_rank`).
        replica: this process's pipeline among `PipelineKeys.num_replicas`
            (`dp_rank * tp_size + tp_rank`).
        keys: the model's `PipelineKeys`.
        timeout_seconds: timeout of every collective op (0 = none).
        placement: the pipeline rank of each model stage (default: stage
            `s` on rank `s`); with virtual stages a rank runs several
            (`Schedule.rank_of`).
    """

    # Instance keys (unique within a group) of the collectives whose shapes
    # do not follow the batch (below BATCHED_BASE).
    INSTANCE_STAGE_SUM = 600_000  # optimizer sums over stages (norms)
    # + the call's slot (< 300): a custom loop's added losses summed over
    # the stages (`@smp.step` with one stage per process)
    INSTANCE_ADDED_LOSSES = 650_000
    INSTANCE_TIED = 700_000      # tied-weight gradient sums
    INSTANCE_INIT = 800_000      # tied weights' initial values
    # Tied group only (no batched_key collective uses it): sparse tied
    # gradients' rows, whose shapes follow the batch (+ padded rows x
    # slots + slot, `gather_rows`).
    INSTANCE_TIED_ROWS = 1 << 30
    INSTANCE_TIMELINE = 900_000  # executed_timeline (+ actions per stage)
    INSTANCE_WEIGHTS = 1_000_000  # sync_weights (+ 190,000 per call)
    # Per-step collectives whose shapes follow the batch (transfers, the
    # last stage's outputs and loss) take keys that encode the
    # microbatch's rows, `batched_key`: TensorFlow keeps the shape of each
    # (group, instance key) for the life of the process, so a fit with
    # batch 8 and a later predict with batch 32 must not share a key.
    BATCHED_BASE = 20_000_000
    ROWS_STRIDE = 100_000
    MAX_ROWS = (2**31 - 1 - BATCHED_BASE) // ROWS_STRIDE - 1
    # Positions (below ROWS_STRIDE) of what the last stage shares: one per
    # role, so a step sharing only its loss and one sharing outputs too
    # never give one key two shapes.
    SHARE_OUTPUTS = 60_000  # + output index
    SHARE_SPLIT_OUTPUTS = 60_500  # + output index: vocabulary-split logits
    SHARE_LOSS = 61_000
    SHARE_TRACKED = 61_001  # + loss-tracker variable index
    # Positions of the batch's tensors the first rank shares (targets,
    # sample weights, inputs for output masks): + the batch's rows modulo
    # the microbatches x 100 + the tensor's index (`share_from_first`).
    SHARE_DATA = 62_000
    # Tensors of `Dynamic` specs (`send_dynamic`): per position, a header's
    # key, then one key per size bucket.
    # - pair groups (transfers only): below BATCHED_BASE, from
    #   DYNAMIC_PAIR_BASE + the transfer's position x DYNAMIC_STRIDE;
    # - the replica group: `batched_key(position, 0)` for the header and
    #   `batched_key(position, 1 + bucket)` for the values, at positions
    #   no other share uses (+ data slot, + output index).
    DYNAMIC_STRIDE = 128
    DYNAMIC_PAIR_BASE = 2_000_000
    SHARE_DYNAMIC_DATA = 92_000
    SHARE_DYNAMIC_OUTPUTS = 92_100
    SHARE_DYNAMIC_SPLIT_OUTPUTS = 92_600

    def __init__(self, num_ranks, rank, replica, keys, timeout_seconds=0,
                 placement=None):
        self.num_ranks = num_ranks
        self.rank = rank
        self.replica = replica
        self.keys = keys
        self.timeout = float(timeout_seconds or 0)
        self.placement = tuple(range(num_ranks) if placement is None
                               else placement)
        #: The model stages this process runs, in model order.
        self.held = tuple(s for s, r in enumerate(self.placement)
                          if r == rank)

    @property
    def num_model_stages(self):
        return len(self.placement)

    def rank_of(self, stage):
        """The pipeline rank running model stage `stage`."""
        return self.placement[stage]

    @property
    def last_rank(self):
        """The rank running the last model stage (its outputs, the loss)."""
        return self.placement[-1]

    def holds(self, stage):
        return self.placement[stage] == self.rank

    # -- weights of the stages held here ---------------------------------

    def held_weights(self, graph):
        """Weights of the model stages held here, each once, in order."""
        out, seen = [], set()
        for s in self.held:
            for w in graph.stage_weights(s):
                if id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
        return out

    def weight_ranks(self, graph):
        """`id(weight) -> sorted pipeline ranks using it` (a weight used
        by two stages of one rank counts that rank once)."""
        return {w: sorted({self.placement[s] for s in stages})
                for w, stages in graph.weight_users().items()}

    def home_ranks(self, graph):
        """`id(weight) -> the rank of its first stage` (which owns it)."""
        return {w: self.placement[s] for w, s in graph.home_stage().items()}

    def send(self, tensor, group_key, group_size, instance_key):
        return tf.raw_ops.CollectiveBcastSendV2(
            input=_to_wire(tensor), group_size=group_size, group_key=group_key,
            instance_key=instance_key, communication_hint="auto",
            timeout_seconds=self.timeout)

    def recv(self, shape, dtype, group_key, group_size, instance_key):
        dtype = tf.as_dtype(dtype)
        return _from_wire(tf.raw_ops.CollectiveBcastRecvV2(
            group_size=group_size, group_key=group_key,
            instance_key=instance_key, shape=shape,
            T=_WIRE.get(dtype, dtype), communication_hint="auto",
            timeout_seconds=self.timeout), dtype)

    def send_dynamic(self, tensor, group_key, group_size, keys):
        """Sends `tensor` to a receiver that learns its shape from it
        (`recv_dynamic`): its shape first (padded to `_MAX_RANK` with
        ones), then its values flattened and zero-padded to the next
        `_BUCKETS` size. `keys`: `i -> instance key`, `keys(0)` the
        header's, `keys(1 + bucket)` the values' (a tensor)."""
        rank = Dynamic(tensor.shape).shape.rank  # (checked as received)
        tensor = _to_wire(tensor)
        header = tf.pad(tf.shape(tensor, out_type=tf.int32),
                        [[0, _MAX_RANK - rank]], constant_values=1)
        flat = tf.reshape(tensor, [-1])
        bucket, padded = _bucket(tf.size(flat, out_type=tf.int32))
        flat = tf.pad(flat, [[0, padded - tf.size(flat, out_type=tf.int32)]])
        return [self.send(header, group_key, group_size, keys(0)),
                self.send(flat, group_key, group_size, keys(1 + bucket))]

    def recv_dynamic(self, spec_shape, dtype, group_key, group_size, keys):
        """Receives a tensor sent with `send_dynamic` (`spec_shape`: its
        `Dynamic` shape)."""
        dtype = tf.as_dtype(dtype)
        wire = _WIRE.get(dtype, dtype)
        rank = spec_shape.shape.rank
        header = self.recv([_MAX_RANK], tf.int32, group_key, group_size,
                           keys(0))
        shape = header[:rank]
        size = tf.reduce_prod(shape)
        bucket, padded = _bucket(size)
        flat = tf.raw_ops.CollectiveBcastRecvV2(
            group_size=group_size, group_key=group_key,
            instance_key=keys(1 + bucket), shape=tf.reshape(padded, [1]),
            T=wire, communication_hint="auto", timeout_seconds=self.timeout)
        out = _from_wire(tf.reshape(flat[:size], shape), dtype)
        out.set_shape(spec_shape.shape)
        return out

    def reduce(self, tensor, group_key, group_size, instance_key):
        """Sum over a group (tied-weight gradients)."""
        return _from_wire(tf.raw_ops.CollectiveReduceV2(
            input=_to_wire(tensor), group_size=group_size,
            group_key=group_key, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id",
            communication_hint="auto", timeout_seconds=self.timeout),
            tensor.dtype)

    def gather_rows(self, slices, group_key, group_size, position,
                    positions):
        """Every member's rows of a sparse gradient (`tf.IndexedSlices`),
        concatenated in the group's order, as Keras concatenates the
        parts of a weight read in several places (repeated ids kept).

        Members may hold any number of rows (none included): their counts
        travel first, then their indices and values, padded to the most
        with zero rows (which would change no sum), dropped on arrival.
        `position` (of `positions`): the weight's place among the tied
        weights of the model, for instance keys in the tied group: the
        counts' is `INSTANCE_TIED + position`; the padded rows' encode
        their number (TensorFlow keeps one shape per instance key, and it
        changes with the batch)."""
        indices = tf.cast(slices.indices, tf.int64)
        values = _to_wire(slices.values)
        count = tf.shape(indices, out_type=tf.int64)[:1]
        counts = self._gather(count, group_key, group_size,
                              self.INSTANCE_TIED + position)
        most = tf.reduce_max(counts)
        pad = most - count[0]
        key = self.INSTANCE_TIED_ROWS + most * (2 * positions) + 2 * position
        check = tf.debugging.assert_less(
            key, tf.constant(2**31 - 2, tf.int64), message=(
                "keras-smp: too many rows in the sparse gradient of a "
                "weight used by several stage processes (an Embedding "
                "looked up in two stages); use smaller batches."))
        with tf.control_dependencies([check]):
            key = tf.cast(key, tf.int32)
        indices = self._gather(tf.pad(indices, [[0, pad]]), group_key,
                               group_size, key)
        values = self._gather(
            tf.pad(values, [[0, pad]] + [[0, 0]] * (values.shape.rank - 1)),
            group_key, group_size, key + 1)
        keep = tf.reshape(tf.sequence_mask(counts, most), [-1])
        return tf.IndexedSlices(
            _from_wire(tf.boolean_mask(values, keep), slices.values.dtype),
            tf.boolean_mask(indices, keep), slices.dense_shape)

    def _gather(self, tensor, group_key, group_size, instance_key):
        return tf.raw_ops.CollectiveGatherV2(
            input=tensor, group_size=group_size, group_key=group_key,
            instance_key=instance_key, ordering_token=[],
            communication_hint="auto", timeout_seconds=self.timeout)

    @classmethod
    def batched_key(cls, position, rows):
        """The instance key of `position` (< ROWS_STRIDE) in a step whose
        microbatches have `rows` rows (see `checked_rows`)."""
        return cls.BATCHED_BASE + position + rows * cls.ROWS_STRIDE

    @classmethod
    def checked_rows(cls, rows):
        """`rows` as an int32 tensor, checked against `MAX_ROWS` when the
        step runs."""
        rows = tf.convert_to_tensor(rows, tf.int32)
        check = tf.debugging.assert_less_equal(
            rows, cls.MAX_ROWS, message=(
                f"keras-smp: a microbatch of more than {cls.MAX_ROWS} rows "
                "crosses a stage boundary between processes; use more "
                "microbatches or a smaller batch."))
        with tf.control_dependencies([check]):
            return tf.identity(rows)

    # Positions: distinct per tensor, microbatch and direction within a
    # step; the next step of the same microbatch size reuses the keys.
    @classmethod
    def _position(cls, direction, microbatch, index):
        key = 1 + (microbatch * 2 + (direction == "B")) * 100 + index
        if index >= 100 or key >= cls.SHARE_OUTPUTS:
            raise ValueError(
                f"Too many microbatches ({microbatch + 1}) or tensors "
                f"crossing a stage boundary ({index + 1}) for one step: at "
                "most 299 microbatches and 100 tensors. Use fewer.")
        return key

    @classmethod
    def call_position(cls, direction, call, index):
        """The position (of `batched_key`) of a model's `call`-th call's
        `index`-th output, broadcast by the last stage over the replica
        group (`@smp.step` with one stage per process)."""
        return cls._position(direction, call, index)

    def _pair_key(self, stage, peer):
        if abs(stage - peer) != 1 or not self.holds(stage):
            raise ValueError(
                f"StageLinks: model stage {stage} (rank "
                f"{self.rank_of(stage)}) cannot exchange with stage {peer} "
                f"from rank {self.rank}: transfers go between neighbouring "
                "model stages, from the rank running them.")
        return self.keys.pair(self.replica, min(stage, peer))

    def send_to(self, stage, peer, direction, microbatch, tensors, rows,
                dynamic=None):
        """Sends `tensors` of `microbatch` from model stage `stage` (held
        here) to its neighbour `peer` (`rows`: from `checked_rows`;
        `dynamic`: per tensor, whether the receiver's spec is `Dynamic`,
        default none)."""
        key = self._pair_key(stage, peer)
        dynamic = dynamic or [False] * len(tensors)
        out = []
        for i, (t, dyn) in enumerate(zip(tensors, dynamic, strict=True)):
            position = self._position(direction, microbatch, i)
            if dyn:
                out += self.send_dynamic(t, key, 2,
                                         self._pair_dynamic_keys(position))
            else:
                out.append(self.send(t, key, 2,
                                     self.batched_key(position, rows)))
        return out

    def receive_from(self, stage, peer, direction, microbatch, specs, rows):
        """Receives into model stage `stage` (held here) tensors of `specs`
        `(shape, dtype)` from its neighbour `peer` (a `Dynamic` shape:
        sent with its shape, `send_dynamic`)."""
        key = self._pair_key(stage, peer)
        out = []
        for i, (shape, dtype) in enumerate(specs):
            position = self._position(direction, microbatch, i)
            if is_dynamic(shape):
                out.append(self.recv_dynamic(
                    shape, dtype, key, 2, self._pair_dynamic_keys(position)))
            else:
                out.append(self.recv(shape, dtype, key, 2,
                                     self.batched_key(position, rows)))
        return out

    @classmethod
    def _pair_dynamic_keys(cls, position):
        base = cls.DYNAMIC_PAIR_BASE + position * cls.DYNAMIC_STRIDE
        return lambda i: base + i

    @classmethod
    def _shared_dynamic_keys(cls, position):
        return lambda i: cls.batched_key(position, i)

    def barrier(self, world_size, instance_key):
        """Waits (eagerly) until every worker of the job has arrived.

        TensorFlow resolves collective groups through task 0, so a worker
        whose collectives finished must not let task 0 exit before the
        others' have: callers end their collective sequences with this.
        """
        return self.reduce(tf.zeros([1]), self.keys.world(), world_size,
                           instance_key)

    def share_from_first(self, tensors, microbatches, lengths=False):
        """Broadcasts the first stage's rank's batch `tensors` (targets,
        sample weights) to every rank of the replica.

        Each rank of a replica reads the data itself, but only the first
        stage's rank's batch is used: another rank's data may come in
        another order (a shuffle or a `PyDataset` seeded differently, a
        generator of its own), and its targets would then train the first
        stage's inputs' outputs. Every rank reads batches of the same
        shapes and dtypes (`fit` checks that before its first step).

        Args:
            tensors: `{role: [dense tensor]}` (e.g. "y", "sample_weight",
                "x"), every tensor's first dimension the batch's rows
                (the same rows for all).
            microbatches: the step's microbatches `m` (keys tell batches of
                different rows apart by their first microbatch's rows and
                the rows modulo `m`).
            lengths: the model's inputs leave a dimension other than the
                rows unknown (`keras.Input((None,))`): every tensor of
                rank 2 or more travels with its shape (`send_dynamic`), as
                each rank's batch may have another length. (Decided from
                the model, not from this rank's batch, so that every rank
                decides alike.)

        Returns:
            `(tensors, done)`: `tensors` as given on the first stage's
            rank (its sends are not waited for) and received elsewhere
            (each of the receiver's own shape and dtype), in the same
            structure; `done`, the ops the step must wait for (the sends,
            or the receives), so that none is pruned.
        """
        p = self.num_ranks
        flat = [(role, i, t) for role, ts in tensors.items()
                for i, t in enumerate(ts)]
        if p == 1 or not flat:
            return tensors, []
        if microbatches > 299:
            raise ValueError(
                f"Too many microbatches ({microbatches}) for one step: at "
                "most 299. Use fewer.")
        rows = tf.shape(flat[0][2], out_type=tf.int32)[0]
        first = self.checked_rows((rows + microbatches - 1) // microbatches)
        position = self.SHARE_DATA + (rows % microbatches) * 100
        group = self.keys.replica(self.replica)
        sender = self.rank == self.rank_of(0)
        out = {role: list(ts) for role, ts in tensors.items()}
        done = []
        for role, i, t in flat:
            dynamic = lengths and (t.shape.rank or 0) >= 2
            slot = self._data_slot(role, i, t, dynamic)
            if sender:
                done += (self.send_dynamic(t, group, p,
                                           self._shared_dynamic_keys(
                                               self.SHARE_DYNAMIC_DATA + slot))
                         if dynamic else
                         [self.send(t, group, p,
                                    self.batched_key(position + slot, first))])
                continue
            # A receive waits for this rank's own batch: at the end of data
            # of unknown length the step fails in `get_next`, and a receive
            # posted before that would stay registered with the sender,
            # meeting the next step's under the same key.
            with tf.control_dependencies([t]):
                if dynamic:
                    # A length that may change from batch to batch (and
                    # from rank to rank: each rank's batch is its own).
                    r = self.recv_dynamic(
                        Dynamic(t.shape), t.dtype, group, p,
                        self._shared_dynamic_keys(
                            self.SHARE_DYNAMIC_DATA + slot))
                    out[role][i] = r
                    done.append(r)
                    continue
                k = self.batched_key(position + slot, first)
                r = self.recv(tf.shape(t), t.dtype, group, p, k)
            r.set_shape(t.shape)
            out[role][i] = r
            done.append(r)
        return out, done

    def _data_slot(self, role, index, tensor, dynamic=False):
        """The position (< 100) of the batch's `index`-th tensor of `role`
        among `share_from_first`'s: one per role, index, dtype and shape
        beyond the batch, the same on every rank (they trace the same
        steps, on batches of the same specs). A collective's shape and
        dtype are kept per key, so a key is never reused for another:
        predict's inputs, say, where fit's targets went."""
        slots = self.keys.data_slots  # (its groups' keys: per model)
        which = (role, index, tensor.dtype.name,
                 # (a tensor sent with its shape: its rank alone, as each
                 # rank's batch may have another length)
                 ("dynamic", tensor.shape.rank) if dynamic else
                 tuple(tensor.shape.as_list()[1:]) if tensor.shape.rank
                 is not None else None)
        if which not in slots:
            if len(slots) >= 100:
                raise ValueError(
                    "keras-smp: more than 100 kinds of target, sample-weight "
                    "and input tensors shared by the first pipeline stage "
                    "in this process; use fewer outputs, or fewer shapes "
                    "and dtypes of data.")
            slots[which] = len(slots)
        return slots[which]

    def share_from_last(self, tensors, specs, positions, rows):
        """Broadcasts the last stage's `tensors` to every rank of the replica.

        On the last stage's rank returns `tensors` (after sending); elsewhere
        receives tensors of `specs` (shape, dtype). `positions`: one per
        tensor, of `batched_key` in a step whose microbatches have `rows`
        rows; a `Dynamic` shape's travels with its shape
        (`send_dynamic`), its keys from its position alone (every rank
        derives the same specs from the model).
        """
        p = self.num_ranks
        if p == 1:
            return list(tensors)
        key = self.keys.replica(self.replica)
        if self.rank == self.last_rank:
            sends = []
            for t, (shape, _), k in zip(tensors, specs, positions,
                                        strict=True):
                if is_dynamic(shape):
                    sends += self.send_dynamic(
                        t, key, p, self._shared_dynamic_keys(k))
                else:
                    sends.append(self.send(t, key, p,
                                           self.batched_key(k, rows)))
            with tf.control_dependencies(sends):
                return [tf.identity(t) for t in tensors]
        return [self.recv_dynamic(shape, dtype, key, p,
                                  self._shared_dynamic_keys(k))
                if is_dynamic(shape) else
                self.recv(shape, dtype, key, p, self.batched_key(k, rows))
                for (shape, dtype), k in zip(specs, positions, strict=True)]


# TensorFlow's collective kernels have no bfloat16 (mixed_bfloat16 models'
# activations and outputs): such tensors travel as float32, which holds
# every bfloat16 value exactly.
# Keras masks (bool) travel as int32: NCCL has no bool type; so do the
# narrow integers a batch may hold (uint8 images, int16 ids).
_WIRE = {tf.bfloat16: tf.float32, tf.bool: tf.int32, tf.uint8: tf.int32,
         tf.int8: tf.int32, tf.uint16: tf.int32, tf.int16: tf.int32}


def _to_wire(tensor):
    wire = _WIRE.get(tensor.dtype)
    return tensor if wire is None else tf.cast(tensor, wire)


def _from_wire(tensor, dtype):
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


def _bucket(size):
    """`(index, padded size)`: the smallest of `_BUCKETS` holding `size`
    elements (an int32 tensor), and its index."""
    index = tf.searchsorted(tf.constant(_BUCKETS, tf.int32),
                            tf.reshape(size, [1]), side="left",
                            out_type=tf.int32)[0]
    return index, tf.gather(tf.constant(_BUCKETS, tf.int32), index)
