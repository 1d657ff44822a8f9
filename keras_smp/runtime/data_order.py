"""Data-parallel processes shuffle NumPy arrays alike, seeded or not.

`fit(x, y)` on arrays shuffles them (Keras' default `shuffle=True`): Keras
permutes the rows' indices each epoch with `tf.random.shuffle`, seeded by
the process's own random state unless the script sets a seed. With
data-parallel replicas in different processes, every process reads each
global batch and keeps its replica's share of it (TensorFlow's
auto-sharding). Unseeded processes each kept their share of a permutation
of their own: within an epoch some rows trained twice and others not at
all (with 2 processes, a quarter of the rows each way), unlike the same
model on one device, where every row trains once per epoch.

So, under an `SMPStrategy` whose data-parallel replicas span processes:

- with no TensorFlow global seed set, Keras' permutations come from one
  seed agreed at the strategy's construction (rank 0's, random, through the
  coordination service's store) and a counter that each permutation
  advances: a new order every epoch, the same on every process;
- with a seed set (`keras.utils.set_random_seed(s)` on every process),
  Keras' own permutation, as on one device seeded with `s`;
- processes that differ (one seeded, another not, or other seeds) fail
  before the first step, naming each rank's order (`runtime.calls`: the
  fit's record says which order this rank shuffles in). Only the ranks
  whose order trains are compared: a replica's first stage's
  tensor-parallel rank 0; its other ranks take its batch.

A `tf.data` dataset's `shuffle` cannot be reseeded once made: its seeds
go into each call's record too, and a dataset shuffled without a seed (each
process its own order), or with other seeds on other ranks, fails before
the first step of `fit`, `evaluate` or `predict` naming the fix (a seed), as
an unseeded shuffle fed each process's share of another order (in an
evaluation too: some rows counted twice, others not at all). Not when the
dataset turns TensorFlow's auto-sharding off or shards by file (each
process reads data of its own: its own files, whose list TensorFlow
shuffles after sharding). A `PyDataset` shuffled by Keras (`shuffle=True`) draws its order
from Python's `random`: processes whose random states differ (unseeded)
fail alike. A generator must give every process the same batches.

Costs one store key per strategy, and a counter update per permutation
(per epoch; per batch with `shuffle="batch"`).
"""

import hashlib
import itertools
import random

#: The call record's argument naming how a fit's arrays are shuffled.
ORDER = ("order of the shuffled arrays (set the same seed on every rank "
         "with keras.utils.set_random_seed, or none)")
AGREED = "keras-smp's, alike on every rank (no seed set)"
NOT_SHUFFLED = "in order (shuffle=False)"

#: The same, for a `fit`'s `validation_data` (checked at the fit's start).
VALIDATION_ORDER = (
    "order of the validation data's shuffle (give Dataset.shuffle a seed "
    "and call keras.utils.set_random_seed with the same seed on every "
    "rank before making it, or do not shuffle validation data)")

PY_DATASET_ORDER = (
    "order of the PyDataset's shuffle (call keras.utils.set_random_seed with "
    "the same seed on every rank, or shuffle=False)")
DATASET_ORDER = (
    "order of the dataset's shuffle (give Dataset.shuffle, or the utility "
    "that made the dataset, a seed, and call keras.utils.set_random_seed "
    "with the same seed on every rank before making it, or none; a dataset "
    "each rank reads on its own turns auto-sharding off)")

_strategies = itertools.count()
_KEY = "keras_smp/data_order"


def allocate(extended, runtime):
    """Gives a strategy's extended its agreed permutation state (a
    `tf.Variable` `[seed, permutations so far]`) where its data-parallel
    replicas span processes. Called at the same point on every rank (the
    strategy's construction); rank 0 draws the seed."""
    topology = runtime.topology
    if not (runtime.collectives and topology.world_size > 1
            and topology.dp_size > 1):
        return
    import tensorflow as tf

    from keras_smp.runtime import shutdown
    from keras_smp.runtime import tf_private

    ctx = tf_private.context.context()
    key = f"{_KEY}/{next(_strategies)}"
    if topology.rank == 0:
        seed = random.SystemRandom().randrange(1, 2**62)
        ctx.set_config_key_value(key, str(seed))
    else:
        seed = int(shutdown.wait_for_key(
            ctx, key, rank=topology.rank, source=0,
            what="the seed of the shuffled arrays' order",
            timeout_seconds=runtime.config.collective_timeout_seconds))
    # On this worker's host CPU, where tf.data runs the permutations.
    with tf.init_scope(), tf.device("/device:CPU:0"):
        state = tf.Variable([seed, 0], dtype=tf.int64, trainable=False,
                            name="smp_data_order")
    # The ranks whose order trains: a replica's first stage's
    # tensor-parallel rank 0 reads its replica's batch; the others take it
    # from there (`TensorGroup.from_first`, `StageLinks.share_from_first`).
    extended._smp_data_order = _Order(
        seed, state, reads=topology.pp_rank == 0 and topology.tp_rank == 0)


class _Order:
    """A strategy's agreed seed, its `tf.Variable` `[dataset's seed,
    permutations so far]`, the shuffled datasets made so far, and whether
    this rank's order trains (`reads`)."""

    def __init__(self, seed, state, reads):
        self.seed, self.state, self.datasets = seed, state, 0
        self.reads = reads


def _order_of(strategy):
    """The strategy's `_Order`, or `None` (no agreement needed)."""
    return getattr(getattr(strategy, "extended", None), "_smp_data_order",
                   None)


def _reading(strategy):
    """The strategy's `_Order` where this rank's order trains, else None."""
    agreed = _order_of(strategy)
    return agreed if agreed is not None and agreed.reads else None


def shuffle_for(strategy, shuffle):
    """`(replacement, order)` for Keras' arrays read under `strategy`
    (`shuffle`: `True`, `"batch"` or `False`): `replacement` replaces the
    permutation's `tf.random.shuffle` (`None`: Keras' own), `order` says
    which order this rank shuffles in, for the call's record (`None`: no
    agreement needed, or this rank's order does not train: its replica's
    first rank's batch does).

    Each dataset starts a counter of its own from a seed of its own (the
    strategy's, and how many shuffled datasets came before): a pass a
    previous `fit` left unfinished (stopped early, or prefetched ahead)
    leaves no rank behind. The record names the mode and the dataset's
    number, so ranks that differ there fail before the first step."""
    agreed = _order_of(strategy)
    if agreed is None:
        return None, None
    if not shuffle:  # recorded too: ranks shuffling or not differ
        return None, NOT_SHUFFLED if agreed.reads else None
    from keras_smp.runtime import tf_private

    index = agreed.datasets  # counted seeded or not: ranks stay in step
    agreed.datasets += 1
    seed = tf_private.global_seed()
    if seed is not None:
        order = f"Keras' own, tf.random seed {seed}, shuffle={shuffle!r}"
        return None, order if agreed.reads else None
    mixed = (agreed.seed * 1_000_003 + index) % 2**62
    agreed.state.assign([mixed, 0])
    order = f"{AGREED}, shuffle={shuffle!r}, dataset {index + 1}"
    return _agreed_shuffle(agreed.state), order if agreed.reads else None


def _agreed_shuffle(state):
    import tensorflow as tf

    def shuffle(value, seed=None, name=None):
        del seed, name  # the agreed state seeds it
        counted = state.assign_add(tf.constant([0, 1], tf.int64))
        return tf.random.experimental.stateless_shuffle(value, seed=counted)

    return shuffle


def dataset_order(strategy, dataset, rank):
    """This rank's order of a `tf.data` `dataset` read under `strategy`, for
    the call's record, or `None` where none is needed (data-parallel
    replicas in one process, a rank whose order does not train, no
    shuffle, each rank reading data of its own). Unseeded, the value names `rank`: it
    differs on every rank."""
    if _reading(strategy) is None:
        return None
    import tensorflow as tf

    from keras_smp.runtime import tf_private

    if not isinstance(dataset, tf.data.Dataset) or tf_private.reads_own_data(
            dataset):
        return None
    seeds = tf_private.dataset_shuffle_seeds(dataset)
    if not seeds:
        return None
    if any(pair == (0, 0) for pair in seeds):
        return f"unseeded, rank {rank}'s own order"
    return "seeds " + ", ".join(f"({a}, {b})" for a, b in seeds)


def py_dataset_order(strategy):
    """This rank's order of a `PyDataset` Keras shuffles (Python's `random`
    state, as a digest) for the call's record, or `None` where none is
    needed (data-parallel replicas in one process, a rank whose order does
    not train)."""
    if _reading(strategy) is None:
        return None
    digest = hashlib.sha1(repr(random.getstate()).encode()).hexdigest()
    return f"Python's random state {digest[:10]}"
