"""Collective group keys, handed out in one place (pure Python).

TensorFlow's collective ops name a group of devices by an integer *group
key* that must mean the same devices on every process of the job, and the
collective runtime caches a group by its key for the life of the process.
Two groups given the same key (two strategies in one notebook, two pipeline
stages, a gradient all-reduce and a point-to-point link) would silently
talk to the wrong peers, or fail with a group-size mismatch.

So nobody numbers keys by hand: every user of collectives asks the
process-wide `KeyAllocator` (`process_keys()`) for a `KeyRange` of the size
it needs, and takes its keys from that range.

**Why the keys agree across processes.** Every rank of a job runs the same
program, so it makes the same `allocate` calls, with the same sizes, in the
same order, and gets the same ranges: a range's keys mean the same thing
cluster-wide. Two rules keep that true:

- allocate a size that does not depend on the rank (when ranks need
  different groups, e.g. one pipeline stage per process, allocate room for
  every rank's groups and let each rank use its own part, `KeyRange.part`);
- allocate at the same point of the program on every rank (at strategy or
  model construction, not from rank-dependent branches).

TensorFlow's own `CollectiveKeys` (`tf.distribute` strategies) count from
1 up, one key per distinct device set: they stay inside `TF_RESERVED`,
below the first key handed out here.

Example:

>>> keys = KeyAllocator(start=1_000_000)
>>> grads = keys.allocate("gradient all-reduce", 6)
>>> links = keys.allocate("pipeline links", 4)
>>> grads.key(0), grads.key(5), links.key(0)
(1000000, 1000005, 1000006)
>>> links.key(4)
Traceback (most recent call last):
...
ValueError: key index 4 is outside the key range 'pipeline links' of size 4 (keys 1000006..1000009); ask for a larger range when allocating it.
"""

import threading
from dataclasses import dataclass

# Where TensorFlow's own CollectiveKeys live: MultiWorkerMirroredStrategy
# and MirroredStrategy start at group_key_start=1 and add one per device set.
TF_RESERVED = range(1, 1_000_000)
# Largest group key TensorFlow accepts (an int32).
MAX_KEY = 2**31 - 1


@dataclass(frozen=True)
class KeyRange:
    """A block of consecutive collective keys, `start` .. `start + size - 1`.

    Args:
        name: what the keys are for (shown in errors).
        start: the first key.
        size: how many keys.

    Example:

    >>> r = KeyRange("links", 1_000_000, 8)
    >>> r.key(3), r.stop, 1_000_007 in r
    (1000003, 1000008, True)
    >>> r.part(4, 4, "stage 1").key(0)
    1000004
    """

    name: str
    start: int
    size: int

    @property
    def stop(self):
        """One past the last key."""
        return self.start + self.size

    def key(self, index):
        """The `index`-th key of the range (`0 <= index < size`)."""
        if (isinstance(index, bool) or not isinstance(index, int)
                or not 0 <= index < self.size):
            raise ValueError(
                f"key index {index!r} is outside the key range "
                f"{self.name!r} of size {self.size} "
                f"(keys {self.start}..{self.stop - 1}); ask for a larger "
                "range when allocating it.")
        return self.start + index

    def part(self, offset, size, name=None):
        """The sub-range of `size` keys from `offset` (e.g. one stage's share)."""
        if (isinstance(offset, bool) or not isinstance(offset, int)
                or isinstance(size, bool) or not isinstance(size, int)
                or offset < 0 or size < 0 or offset + size > self.size):
            raise ValueError(
                f"part(offset={offset!r}, size={size!r}) does not fit in the "
                f"key range {self.name!r} of size {self.size}; allocate a "
                "range large enough for every part.")
        return KeyRange(name or f"{self.name}[{offset}:{offset + size}]",
                        self.start + offset, size)

    def __contains__(self, key):
        return self.start <= key < self.stop

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self):
        return self.size


class KeyAllocator:
    """Hands out disjoint `KeyRange`s in call order.

    Args:
        start: the first key handed out (default: just above
            `TF_RESERVED`).
        limit: the largest key that may be handed out (default: 2**31 - 1,
            TensorFlow's largest).

    Example:

    >>> keys = KeyAllocator(start=10, limit=19)
    >>> keys.allocate("a", 4), keys.allocate("b", 6)
    (KeyRange(name='a', start=10, size=4), KeyRange(name='b', start=14, size=6))
    >>> keys.allocate("c", 1)
    Traceback (most recent call last):
    ...
    ValueError: cannot allocate 1 collective key(s) for 'c': keys 10..19 are exhausted (10 used by 2 ranges: 'a' 4, 'b' 6). Collective key ranges are allocated once per strategy / model; create fewer of them in one process, or restart the process.
    """

    def __init__(self, start=1_000_000, limit=MAX_KEY):
        for what, value in (("start", start), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"KeyAllocator {what} must be an int; received {value!r}.")
        if not 0 <= start <= limit <= MAX_KEY:
            raise ValueError(
                f"KeyAllocator needs 0 <= start <= limit <= {MAX_KEY}; "
                f"received start={start}, limit={limit}.")
        self.start = start
        self.limit = limit
        self._next = start
        self._ranges = []
        self._lock = threading.Lock()

    def allocate(self, name, size):
        """Returns the next `size` keys as a `KeyRange` named `name`."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"allocate({name!r}, size={size!r}): size must be an int "
                ">= 0 (the number of collective keys needed).")
        with self._lock:
            if self._next + size - 1 > self.limit:
                used = ", ".join(f"{r.name!r} {r.size}" for r in self._ranges)
                raise ValueError(
                    f"cannot allocate {size} collective key(s) for {name!r}: "
                    f"keys {self.start}..{self.limit} are exhausted "
                    f"({self._next - self.start} used by "
                    f"{len(self._ranges)} ranges: {used}). Collective key "
                    "ranges are allocated once per strategy / model; create "
                    "fewer of them in one process, or restart the process.")
            r = KeyRange(str(name), self._next, size)
            self._next += size
            self._ranges.append(r)
            return r

    @property
    def ranges(self):
        """The ranges handed out so far, in allocation order."""
        with self._lock:
            return list(self._ranges)

    @property
    def next_key(self):
        """The first key of the next range."""
        return self._next

    def __repr__(self):
        return (f"KeyAllocator(start={self.start}, limit={self.limit}, "
                f"{len(self._ranges)} ranges, next={self._next})")


_process = []
_process_lock = threading.Lock()


def process_keys():
    """The process-wide `KeyAllocator` (created on first use).

    Every allocation of collective keys in keras-smp goes through it; see
    the module docstring for why every rank gets the same keys.
    """
    with _process_lock:
        if not _process:
            _process.append(KeyAllocator())
        return _process[0]


def reset_process_keys():
    """Forgets the process-wide allocator (tests).

    Only for tests that do not start TensorFlow collectives: TensorFlow
    keeps the groups of keys already used for the life of the process.
    """
    with _process_lock:
        _process.clear()
