"""SMP's communication helpers on Python objects.

`broadcast`, `send` / `recv_from`, `allgather` and `barrier` move small
picklable Python objects (configs, step counts, metrics, file names)
between worker processes. They use the key-value store of TensorFlow's
coordination service (part of TensorFlow's distributed runtime, started by
`smp.init` or `SMPStrategy` from `TF_CONFIG` / SLURM): no other transport.
They are for control data, not tensors: every object is pickled and
passes through the coordination leader (task 0).

Groups (`CommGroup`) and rank numberings (`RankType`) follow SMP:

- `CommGroup.WORLD`: every process.
- `CommGroup.MP_GROUP`: the processes holding the stages of this
  process's model replica.
- `CommGroup.DP_GROUP`: the processes holding this process's stage in
  every replica.

Every member of a group must make the same calls in the same order (as
with any collective); `broadcast`'s receivers may call `recv_from(first
rank)` instead, as SMP's scripts do. A call waits at most `collective_timeout_seconds`
(config) and then raises `RuntimeError` naming the rank it waited for.

Example (one process; with `keras-smp launch -n 2` every rank gets rank
0's dict):

```python
import keras_smp as smp
smp.init({"partitions": 1})
settings = smp.broadcast({"lr": 0.1} if smp.rank() == 0 else None)
assert settings == {"lr": 0.1}
assert smp.allgather(smp.rank()) == list(range(smp.size()))
smp.barrier()
```
"""

import base64
import collections
import enum
import pickle
import threading

from keras_smp import state

_PREFIX = "keras_smp/comms"
_lock = threading.Lock()
_counters = collections.Counter()


class CommGroup(enum.Enum):
    """Process groups of SMP's communication helpers."""

    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2


class RankType(enum.Enum):
    """Which numbering a rank passed to `send` / `recv_from` uses."""

    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2


WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP
# SMP also spelled them as module constants.
PP_GROUP = CommGroup.MP_GROUP
WORLD_RANK = RankType.WORLD_RANK
MP_RANK = RankType.MP_RANK
DP_RANK = RankType.DP_RANK


def _group_ranks(group):
    topology = state.topology()
    if isinstance(group, str) and group.upper() in CommGroup.__members__:
        group = CommGroup[group.upper()]
    if group is CommGroup.WORLD:
        return tuple(range(topology.world_size))
    if group is CommGroup.MP_GROUP:
        return tuple(topology.pp_group())
    if group is CommGroup.DP_GROUP:
        return tuple(topology.dp_group())
    raise ValueError(
        f"Unknown communication group {group!r}: use smp.CommGroup.WORLD, "
        "smp.CommGroup.MP_GROUP or smp.CommGroup.DP_GROUP.")


def _world_rank(rank, rank_type):
    topology = state.topology()
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int, received {rank!r}.")
    if rank_type is RankType.WORLD_RANK:
        size = topology.world_size
        world = rank
    elif rank_type is RankType.MP_RANK:
        size = topology.pp_size
        world = topology.rank_of(rank, topology.dp_rank) if rank < size else 0
    elif rank_type is RankType.DP_RANK:
        size = topology.dp_size
        world = topology.rank_of(topology.pp_rank, rank) if rank < size else 0
    else:
        raise ValueError(
            f"Unknown rank type {rank_type!r}: use smp.RankType.WORLD_RANK, "
            "MP_RANK or DP_RANK.")
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_type.name} {rank} is out of range: this job has {size} "
            f"ranks of that type (0..{size - 1}).")
    return world


def _context():
    from keras_smp.runtime.tf_private import context

    ctx = context.context()
    if state.topology().world_size > 1 and ctx.coordination_service is None:
        raise RuntimeError(
            "keras-smp communication helpers need TensorFlow's distributed "
            "runtime: call smp.init() (or create SMPStrategy) before "
            "smp.broadcast / send / recv_from / allgather / barrier.")
    return ctx


def _encode(obj):
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def _decode(text):
    return pickle.loads(base64.b64decode(text))


def _next(name):
    with _lock:
        _counters[name] += 1
        return _counters[name]


def _put(key, obj):
    _context().set_config_key_value(key, _encode(obj))


def _get(key, source, what):
    """The value at `key`, waiting at most `collective_timeout_seconds`, in
    slices: a rank that fails and says so (`runtime.shutdown`) ends the
    wait with its error."""
    from keras_smp.runtime import shutdown

    return _decode(shutdown.wait_for_key(
        _context(), key, rank=state.topology().rank, source=source,
        what=what,
        timeout_seconds=state.config().collective_timeout_seconds))


def _check_member(ranks, what):
    me = state.topology().rank
    if me not in ranks:
        raise ValueError(
            f"{what}: rank {me} is not a member of the group {ranks}.")
    return me


def broadcast(obj, group=CommGroup.WORLD):
    """Returns the object of the group's first rank, on every member.

    The group's first rank sends `obj` to each other member, as `send`
    does; they receive it by calling `broadcast` too, or `recv_from(first
    rank)` (SMP's pattern: `smp.broadcast(obj, group)` on the sender,
    `smp.recv_from(0, smp.RankType.WORLD_RANK)` on the others). Objects
    from one rank arrive in the order sent, whichever call sent them.

    Args:
        obj: any picklable object (ignored on the other ranks).
        group: a `CommGroup`.
    """
    ranks = _group_ranks(group)
    me = _check_member(ranks, "broadcast")
    if len(ranks) == 1:
        return obj
    if me == ranks[0]:
        text = _encode(("broadcast", obj))
        for dest in ranks[1:]:
            _context().set_config_key_value(_p2p_key(me, dest), text)
        return obj
    return _receive(ranks[0], "broadcast", expect="broadcast")


def share(obj, group=CommGroup.WORLD):
    """`broadcast` for keras-smp's own use: every member calls it, and its
    keys are its own, so it never takes (or leaves) an object of the
    script's `send` / `recv_from` / `broadcast` between the same ranks."""
    ranks = _group_ranks(group)
    me = _check_member(ranks, "broadcast")
    if len(ranks) == 1:
        return obj
    key = f"{_PREFIX}/bcast/{'-'.join(map(str, ranks))}/{_next(('b', ranks))}"
    if me == ranks[0]:
        _put(key, obj)
        return obj
    return _get(key, ranks[0], "broadcast")


def allgather(obj, group=CommGroup.WORLD):
    """Returns the list of every member's object, in rank order."""
    ranks = _group_ranks(group)
    me = _check_member(ranks, "allgather")
    if len(ranks) == 1:
        return [obj]
    base = f"{_PREFIX}/gather/{'-'.join(map(str, ranks))}/{_next(('g', ranks))}"
    _put(f"{base}/{me}", obj)
    return [obj if r == me else _get(f"{base}/{r}", r, "allgather")
            for r in ranks]


def barrier(group=CommGroup.WORLD):
    """Waits until every member of `group` reached this barrier."""
    allgather(None, group)


def dp_barrier():
    """`barrier(CommGroup.DP_GROUP)`."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier():
    """`barrier(CommGroup.MP_GROUP)`."""
    barrier(CommGroup.MP_GROUP)


pp_barrier = mp_barrier


def _p2p_key(src, dest):
    """The key of the next object from world rank `src` to `dest` (each
    end counts its own: the sender its sends, the receiver its receives)."""
    me = state.topology().rank
    return (f"{_PREFIX}/p2p/{src}-{dest}/"
            f"{_next(('s', dest) if src == me else ('r', src))}")


def _receive(src, what, expect=None):
    """The next object from world rank `src`. With `expect` ("broadcast"),
    an object another call sent (`send`) raises and stays next."""
    me = state.topology().rank
    key = _p2p_key(src, me)
    kind, obj = _get(key, src, what)
    if expect is not None and kind != expect:
        with _lock:  # the send's object stays the next one from src
            _counters[("r", src)] -= 1
        raise ValueError(
            f"{what}: rank {me}'s next object from rank {src} was sent with "
            f"smp.{kind}, not smp.{expect}: objects from one rank arrive "
            f"in the order sent. Receive it first with smp.recv_from({src}).")
    _context().delete_config_key_value(key)
    return obj


def send(obj, dest_rank, rank_type=RankType.WORLD_RANK):
    """Sends a picklable object to one rank (returns at once)."""
    me = state.topology().rank
    dest = _world_rank(dest_rank, rank_type)
    if dest == me:
        raise ValueError(f"send: rank {me} cannot send to itself.")
    _put(_p2p_key(me, dest), ("send", obj))


def recv_from(src_rank, rank_type=RankType.WORLD_RANK):
    """Receives the next object `send` (or `broadcast`) by rank
    `src_rank`."""
    me = state.topology().rank
    src = _world_rank(src_rank, rank_type)
    if src == me:
        raise ValueError(f"recv_from: rank {me} cannot receive from itself.")
    return _receive(src, "recv_from")
