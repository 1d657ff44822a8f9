"""Pipeline schedules as data: per-stage ordered actions, in pure Python.

A schedule says, for every pipeline stage, in which order it runs the
forward (`F`) and backward (`B`) pass of every microbatch, and where it
sends and receives activations (`SEND_F` / `RECV_F`) and their gradients
(`SEND_B` / `RECV_B`). A backward may also run split in two (zero-bubble
schedules): `I` computes the gradients of the stage's inputs (what the
previous stage waits for) and `W` later computes the weights' gradients
from what `I` saved. The pipeline runtime
(`keras_smp.pipeline.runtime.execute`) runs whatever action lists
`actions(stage)` gives it, with stages on devices of one process or one
stage per process.

`simulate()` plays a schedule with given costs to measure its idle time
("bubble") and memory (microbatches in flight), print it as a grid and draw
it. This module never imports TensorFlow or Keras (matplotlib is imported
only when drawing), so schedules can be inspected anywhere:

    python -m keras_smp.pipeline.schedule --schedule 1f1b -p 4 -m 8
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import re
import sys

__all__ = [
    "Action",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "GPipe",
    "KINDS",
    "OneFOneB",
    "OneFOneBSplit",
    "SCHEDULES",
    "ZeroBubbleH1",
    "Schedule",
    "Timeline",
    "get_schedule",
    "simulate",
]

#: Compute kinds: the forward and the backward pass of one microbatch, and
#: the backward split in two: input gradients (`I`), weight gradients (`W`).
COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
#: Kinds that produce the gradients a previous stage waits for.
_GRAD_KINDS = ("B", "I")
#: Point-to-point kinds: activations go forward, their gradients go backward.
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: Every action kind.
KINDS: tuple[str, ...] = COMPUTE_KINDS + COMM_KINDS

# Longest kinds first so that "SEND_F" is not read as "S" + ... .
_ACTION_RE = re.compile(
    r"^\s*(\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")(\d+)\s*$")

# Stage a transfer goes to (SEND_*) or comes from (RECV_*), relative to the
# stage running it.
_PEER_OFFSET = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One step of one pipeline stage: compute or transfer one microbatch.

    The compact string form is `<stage><kind><microbatch>`, as in
    torch.distributed.pipelining: `2F0` is the forward pass of microbatch 0
    on stage 2, `1RECV_F3` is stage 1 receiving the activations of
    microbatch 3 from stage 0. `Action.parse` reads it back.

    Args:
        stage: Index of the stage that runs the action, an int >= 0.
        kind: One of `"F"` (forward), `"B"` (backward), `"I"` (backward,
            input gradients only), `"W"` (backward, weight gradients
            only, after the microbatch's `I`), `"SEND_F"`,
            `"RECV_F"` (activations to / from the neighbouring stages),
            `"SEND_B"`, `"RECV_B"` (gradients of those activations).
        microbatch: Index of the microbatch, an int >= 0.

    Example:

    >>> a = Action(1, "RECV_F", 3)
    >>> str(a), a.peer, Action.parse("1RECV_F3") == a
    ('1RECV_F3', 0, True)
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if not _is_int(value) or value < 0:
                raise ValueError(
                    f"Invalid Action {field}: received {value!r}, expected an "
                    f"int >= 0. Pass e.g. Action(stage=0, kind='F', microbatch=0).")
        if self.kind not in KINDS:
            raise ValueError(
                f"Invalid Action kind: received {self.kind!r}, expected one of "
                f"{', '.join(repr(k) for k in KINDS)} (upper case).")

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Reads an action from its compact string form.

        Args:
            text: A string such as `"2F0"` or `"1RECV_F3"`.

        Returns:
            The `Action`; `str()` of it gives `text` back (without spaces).

        Example:

        >>> Action.parse("2F0")
        Action(stage=2, kind='F', microbatch=0)
        """
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"Cannot parse action {text!r}: expected '<stage><kind>"
                f"<microbatch>' such as '2F0' or '1RECV_F3', with kind one of "
                f"{', '.join(KINDS)}.")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))

    @property
    def is_compute(self) -> bool:
        """Whether the action is a forward or backward pass (or a part)."""
        return self.kind in COMPUTE_KINDS

    @property
    def peer(self) -> int | None:
        """Stage a transfer goes to or comes from; `None` for compute."""
        if self.is_compute:
            return None
        return self.stage + _PEER_OFFSET[self.kind]


# --------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------


class Schedule:
    """Base class of pipeline schedules: per-stage ordered actions.

    A subclass only implements `_compute_actions(stage)`, the order of the
    `F` and `B` actions of one stage. Everything else (transfers,
    validation, simulation, printing) is derived from it.

    Args:
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Example:

    >>> schedule = OneFOneB(num_stages=2, num_microbatches=3)
    >>> [str(a) for a in schedule.compute_actions(0)]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    >>> [str(a) for a in schedule.actions(1)][:4]
    ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
    """

    #: Short name, as accepted by `get_schedule`.
    name = "schedule"

    def __init__(self, num_stages: int, num_microbatches: int):
        for arg, value in (("num_stages", num_stages),
                           ("num_microbatches", num_microbatches)):
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"Invalid {arg} for the {self.name!r} pipeline schedule: "
                    f"received {value!r}, expected an int >= 1. Use "
                    f"num_stages=1 for no pipelining and num_microbatches=1 "
                    f"for whole batches.")
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches

    def __repr__(self):
        return (f"{type(self).__name__}(num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches})")

    def __str__(self):
        return simulate(self).grid()

    # -- the order -------------------------------------------------------

    def _compute_actions(self, stage: int) -> list[Action]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement _compute_actions(stage), "
            f"returning the F and B actions of that stage in execution order.")

    def _check_stage(self, stage):
        if not _is_int(stage) or not 0 <= stage < self.num_stages:
            raise ValueError(
                f"Invalid stage for {self!r}: received {stage!r}, expected an "
                f"int in [0, {self.num_stages - 1}].")

    def compute_actions(self, stage: int) -> list[Action]:
        """Forward and backward actions of one stage, in execution order.

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            A list of `Action`s of kind `"F"` and `"B"`.

        Example:

        >>> [str(a) for a in GPipe(2, 2).compute_actions(1)]
        ['1F0', '1F1', '1B0', '1B1']
        """
        self._check_stage(stage)
        return list(self._compute_actions(stage))

    def actions(self, stage: int) -> list[Action]:
        """Every action of one stage, transfers included, in execution order.

        Each `F` is preceded by `RECV_F` (except on the first stage) and
        followed by `SEND_F` (except on the last stage); each `B` is
        preceded by `RECV_B` (except on the last stage) and followed by
        `SEND_B` (except on the first stage). Sends are meant to be
        asynchronous: a stage does not wait for its peer to receive.

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            A list of `Action`s.

        Example:

        >>> [str(a) for a in GPipe(2, 1).actions(0)]
        ['0F0', '0SEND_F0', '0RECV_B0', '0B0']
        """
        out = []
        first, last = stage == 0, stage == self.num_stages - 1
        for a in self.compute_actions(stage):
            k = a.microbatch
            if a.kind == "F":
                if not first:
                    out.append(Action(stage, "RECV_F", k))
                out.append(a)
                if not last:
                    out.append(Action(stage, "SEND_F", k))
            elif a.kind in _GRAD_KINDS:
                if not last:
                    out.append(Action(stage, "RECV_B", k))
                out.append(a)
                if not first:
                    out.append(Action(stage, "SEND_B", k))
            else:
                out.append(a)  # validate() reports it.
        return out

    def all_actions(self) -> dict[int, list[Action]]:
        """`actions(stage)` for every stage.

        Returns:
            A dict from stage index to that stage's action list.

        Example:

        >>> {s: len(a) for s, a in GPipe(3, 2).all_actions().items()}
        {0: 8, 1: 12, 2: 8}
        """
        return {s: self.actions(s) for s in range(self.num_stages)}

    # -- properties of the order ----------------------------------------

    def ideal_bubble_fraction(self) -> float:
        """Idle fraction of a step with equal stages and free transfers.

        Returns:
            `(p - 1) / (m + p - 1)`, the same for GPipe and 1F1B (the split
            schedules do better: `simulate()` them).

        Example:

        >>> round(GPipe(4, 8).ideal_bubble_fraction(), 4)
        0.2727
        """
        p, m = self.num_stages, self.num_microbatches
        return (p - 1) / (m + p - 1)

    def peak_in_flight(self, stage: int) -> int:
        """Most microbatches whose activations a stage holds at once.

        Counted from the compute order alone: a microbatch is in flight
        between the end of its `F` and the end of its `B` (or its `W`).

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            An int; `m` for GPipe, `min(p - stage, m)` for 1F1B.

        Example:

        >>> [OneFOneB(4, 8).peak_in_flight(s) for s in range(4)]
        [4, 3, 2, 1]
        """
        return _peak_in_flight(self.compute_actions(stage))

    def in_flight_limit(self, stage: int) -> int:
        """Most microbatches the schedule promises to hold on a stage.

        `validate()` checks `peak_in_flight(stage)` against it.

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            An int; `num_microbatches` unless a subclass promises less.

        Example:

        >>> GPipe(4, 8).in_flight_limit(0), OneFOneB(4, 8).in_flight_limit(0)
        (8, 4)
        """
        self._check_stage(stage)
        return self.num_microbatches

    def validate(self) -> None:
        """Checks that the schedule is complete, ordered and can run.

        Checks, stage by stage: every microbatch has exactly one `F` and
        either one `B` or one `I` and one `W`, in that order, no more than `in_flight_limit(stage)`
        microbatches are in flight; every send has its matching receive on
        the peer stage and both sides handle a link's microbatches in the
        same order; and the compute order does not deadlock.

        Raises:
            ValueError: naming the first offending action.

        Example:

        >>> OneFOneB(4, 8).validate()
        """
        p, m = self.num_stages, self.num_microbatches
        where = f"Invalid pipeline schedule {self!r}"
        for s in range(p):
            order = self.compute_actions(s)
            seen = collections.defaultdict(list)
            for pos, a in enumerate(order):
                if not isinstance(a, Action) or a.stage != s or not a.is_compute:
                    raise ValueError(
                        f"{where}: compute_actions({s}) returned {a!s} at "
                        f"position {pos}, expected a compute Action (F or B, "
                        f"or I and W) of stage {s} (transfers are added by "
                        f"actions()).")
                if a.microbatch >= m:
                    raise ValueError(
                        f"{where}: stage {s} runs {a}, but microbatches are "
                        f"numbered 0..{m - 1}. Only use microbatch indices "
                        f"below num_microbatches.")
                seen[a].append(pos)
            for k in range(m):
                f = Action(s, "F", k)
                split = bool(seen[Action(s, "I", k)] or seen[Action(s, "W", k)])
                kinds = ("F", "I", "W") if split else ("F", "B")
                for kind in COMPUTE_KINDS:
                    a = Action(s, kind, k)
                    want = 1 if kind in kinds else 0
                    if len(seen[a]) != want:
                        raise ValueError(
                            f"{where}: stage {s} runs {a} {len(seen[a])} "
                            f"times, expected {'exactly once' if want else 'never'}"
                            f" (a microbatch's backward is either one B, or "
                            f"one I followed by one W).")
                later = [Action(s, kind, k) for kind in kinds[1:]]
                for before, after in zip([f] + later, later):
                    if seen[after][0] < seen[before][0]:
                        raise ValueError(
                            f"{where}: stage {s} runs {after} (position "
                            f"{seen[after][0]}) before {before} (position "
                            f"{seen[before][0]}); a backward pass needs its "
                            f"forward pass, and W needs its I. Move {after} "
                            f"after {before}.")
            peak, limit = _peak_in_flight(order), self.in_flight_limit(s)
            if peak > limit:
                raise ValueError(
                    f"{where}: stage {s} holds {peak} microbatches in flight, "
                    f"expected at most {limit} for this schedule. Run "
                    f"backward passes earlier.")
        self._validate_transfers()
        simulate(self)  # Raises if the compute order deadlocks.

    def _validate_transfers(self):
        p = self.num_stages
        where = f"Invalid pipeline schedule {self!r}"
        # Per link (sender, receiver, kind): microbatches in the order sent
        # and in the order received.
        sent = collections.defaultdict(list)
        received = collections.defaultdict(list)
        first_action = {}
        for s in range(p):
            for a in self.actions(s):
                if a.is_compute:
                    continue
                if not 0 <= a.peer < p:
                    raise ValueError(
                        f"{where}: stage {s} runs {a}, whose peer stage "
                        f"{a.peer} does not exist (stages 0..{p - 1}).")
                direction = a.kind[-1]
                if a.kind.startswith("SEND"):
                    link = (s, a.peer, direction)
                    sent[link].append(a.microbatch)
                else:
                    link = (a.peer, s, direction)
                    received[link].append(a.microbatch)
                first_action.setdefault((link, a.kind[:4], a.microbatch), a)
        for link in sorted(set(sent) | set(received)):
            src, dst, direction = link
            out, into = sent[link], received[link]
            missing = collections.Counter(out) - collections.Counter(into)
            extra = collections.Counter(into) - collections.Counter(out)
            if missing:
                k = min(missing)
                raise ValueError(
                    f"{where}: {first_action[(link, 'SEND', k)]} has no "
                    f"matching {dst}RECV_{direction}{k} on stage {dst}.")
            if extra:
                k = min(extra)
                raise ValueError(
                    f"{where}: {first_action[(link, 'RECV', k)]} has no "
                    f"matching {src}SEND_{direction}{k} on stage {src}.")
            if out != into:
                raise ValueError(
                    f"{where}: stage {src} sends {direction} to stage {dst} in "
                    f"microbatch order {out}, but stage {dst} receives in "
                    f"order {into}. Point-to-point links deliver in order; "
                    f"make both stages handle the link's microbatches in the "
                    f"same order.")


def _peak_in_flight(order) -> int:
    # A microbatch is held from its F until its B (or its W: the weight
    # gradients need the saved inputs).
    held, peak = set(), 0
    for a in order:
        if a.kind == "F":
            held.add(a.microbatch)
            peak = max(peak, len(held))
        elif a.kind in ("B", "W"):
            held.discard(a.microbatch)
    return peak


class GPipe(Schedule):
    """GPipe: every stage runs all forward passes, then all backward passes.

    Backward passes run in microbatch order `0, 1, ..., m-1` on every stage
    (as in torch's `ScheduleGPipe`). A stage holds the activations of all
    `m` microbatches at its peak. SMP calls this schedule `"simple"`.

    Args:
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Example:

    >>> [str(a) for a in GPipe(2, 3).compute_actions(0)]
    ['0F0', '0F1', '0F2', '0B0', '0B1', '0B2']
    """

    name = "gpipe"

    def _compute_actions(self, stage):
        m = self.num_microbatches
        return ([Action(stage, "F", k) for k in range(m)]
                + [Action(stage, "B", k) for k in range(m)])


class OneFOneB(Schedule):
    """1F1B: after a warm-up, each stage alternates one forward, one backward.

    The standard non-interleaved schedule (PipeDream-Flush, as in Megatron,
    DeepSpeed and torch's `Schedule1F1B`): stage `s` runs
    `w = min(p - 1 - s, m)` warm-up forward passes, then `m - w` times one
    forward and one backward pass, then the `w` remaining backward passes,
    all in microbatch order. A stage holds at most `min(p - s, m)`
    microbatches, against `m` for GPipe, with the same bubble. SMP calls
    this schedule `"interleaved"` (it interleaves forward and backward
    passes; it is not Megatron's interleaved schedule with model chunks).

    Args:
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Example:

    >>> [str(a) for a in OneFOneB(3, 4).compute_actions(0)]
    ['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
    """

    name = "1f1b"

    def warmup(self, stage: int) -> int:
        """Number of forward passes stage `stage` runs before its first backward.

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            `min(num_stages - 1 - stage, num_microbatches)`.

        Example:

        >>> [OneFOneB(4, 2).warmup(s) for s in range(4)]
        [2, 2, 1, 0]
        """
        self._check_stage(stage)
        return min(self.num_stages - 1 - stage, self.num_microbatches)

    def in_flight_limit(self, stage):
        self._check_stage(stage)
        return min(self.num_stages - stage, self.num_microbatches)

    def _compute_actions(self, stage):
        m, w = self.num_microbatches, self.warmup(stage)
        order = [Action(stage, "F", k) for k in range(w)]
        for i in range(m - w):
            order += [Action(stage, "F", w + i), Action(stage, "B", i)]
        order += [Action(stage, "B", k) for k in range(m - w, m)]
        return order


class OneFOneBSplit(OneFOneB):
    """1F1B with every backward split into `I` and `W`.

    The order of 1F1B, each `B` replaced by `I` (the gradients of the
    stage's inputs, sent to the previous stage at once) followed right away
    by `W` (the weights' gradients). The previous stage gets its gradients
    one `W` earlier, so with `p` stages the fill and drain cost
    `(p - 1) (F + I)` instead of 1F1B's `(p - 1) (F + B)`, and a transfer's
    latency hides behind the `W` that follows it. Activation memory is
    1F1B's: a stage holds at most `min(p - s, m)` microbatches.

    The simplest zero-bubble schedule; `ZeroBubbleH1` also defers `W`s
    into the drain, for a smaller bubble at more memory on later stages.

    Args:
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Example:

    >>> [str(a) for a in OneFOneBSplit(2, 2).compute_actions(0)]
    ['0F0', '0F1', '0I0', '0W0', '0I1', '0W1']
    >>> t = simulate(OneFOneBSplit(4, 8), forward_cost=1, backward_cost=2)
    >>> t.makespan, simulate(OneFOneB(4, 8), 1, 2).makespan
    (30.0, 33.0)
    """

    name = "1f1b_split"

    def _compute_actions(self, stage):
        out = []
        for a in super()._compute_actions(stage):
            if a.kind == "B":
                out += [Action(stage, "I", a.microbatch),
                        Action(stage, "W", a.microbatch)]
            else:
                out.append(a)
        return out


class ZeroBubbleH1(OneFOneB):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).

    1F1B's order of forwards and input-gradient passes (`I`), with each
    weight-gradient pass (`W`) of stage `s` deferred by `s` microbatches
    (`W` of microbatch `k` runs after `I` of microbatch `k + s`; the rest
    at the end). The later stages then send their input gradients sooner
    and do the deferred `W`s in the drain, where 1F1B leaves them idle:
    with `m >= p` and `W <= I` a step costs `m (F + B) + (p - 1) (F + I -
    W)` (simulated), against 1F1B's `(m + p - 1) (F + B)`: a third of
    1F1B's bubble when `F = I = W`. Every stage holds at most `min(p, m)` microbatches,
    1F1B's peak (stage 0's); later stages hold more than in 1F1B.

    Args:
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Example:

    >>> [str(a) for a in ZeroBubbleH1(2, 3).compute_actions(1)]
    ['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2']
    >>> simulate(ZeroBubbleH1(4, 8), 1, 2).makespan
    27.0
    """

    name = "zb_h1"

    def in_flight_limit(self, stage):
        self._check_stage(stage)
        return min(self.num_stages, self.num_microbatches)

    def _compute_actions(self, stage):
        out, deferred = [], []
        for a in super()._compute_actions(stage):
            if a.kind == "F":
                out.append(a)
                continue
            out.append(Action(stage, "I", a.microbatch))
            deferred.append(a.microbatch)
            if len(deferred) > stage:
                out.append(Action(stage, "W", deferred.pop(0)))
        return out + [Action(stage, "W", k) for k in deferred]


#: Accepted schedule names (SMP's `"simple"` and `"interleaved"` included).
SCHEDULES: dict[str, type] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "1f1b_split": OneFOneBSplit,
    "zb_h1": ZeroBubbleH1,
    "simple": GPipe,
    "interleaved": OneFOneB,
}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Builds a schedule from its name, as in `SMPConfig.pipeline`.

    Args:
        name: `"gpipe"` (alias `"simple"`), `"1f1b"` (alias
            `"interleaved"`), `"1f1b_split"` or `"zb_h1"`,
            case-insensitive.
        num_stages: Number of pipeline stages `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.

    Returns:
        A `GPipe`, `OneFOneB`, `OneFOneBSplit` or `ZeroBubbleH1`
        instance.

    Example:

    >>> get_schedule("interleaved", 4, 8)
    OneFOneB(num_stages=4, num_microbatches=8)
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in SCHEDULES:
        raise ValueError(
            f"Unknown pipeline schedule: received {name!r}, expected one of "
            f"{', '.join(repr(n) for n in SCHEDULES)}. 'simple' is GPipe and "
            f"'interleaved' is 1F1B (SMP's names).")
    return SCHEDULES[key](num_stages, num_microbatches)


# --------------------------------------------------------------------------
# Simulation
# --------------------------------------------------------------------------


class Timeline:
    """When every compute action of a simulated schedule ran.

    Built by `simulate()`. Times are in the units of the costs given there.

    Args:
        schedule: The simulated `Schedule`.
        entries: Per stage, a list of `(start, end, action)` in time order.

    Example:

    >>> t = simulate(GPipe(2, 2), forward_cost=1, backward_cost=1)
    >>> stage1 = t.entries[1]
    >>> t.makespan, t.bubble_fraction(), stage1[0]
    (6.0, 0.3333333333333333, (1.0, 2.0, Action(stage=1, kind='F', microbatch=0)))
    """

    def __init__(self, schedule: Schedule, entries: list, unit: str = "time"):
        self.schedule = schedule
        self.unit = unit
        self.entries = [list(e) for e in entries]
        self.spans = {a: (start, end)
                      for stage in self.entries for start, end, a in stage}

    @property
    def num_stages(self) -> int:
        return len(self.entries)

    @property
    def makespan(self) -> float:
        """Time at which the last action ends."""
        return max((end for stage in self.entries for _, end, _ in stage),
                   default=0.0)

    def busy_time(self, stage: int) -> float:
        """Total compute time (forward and backward) of one stage."""
        return sum(end - start for start, end, a in self.entries[stage]
                   if a.is_compute)

    def bubble_fraction(self) -> float:
        """Idle time of all stages over `num_stages * makespan`.

        Returns:
            A float in `[0, 1)`.

        Example:

        >>> simulate(OneFOneB(4, 8), 1, 1).bubble_fraction() == 3 / 11
        True
        """
        total = self.num_stages * self.makespan
        if total == 0:
            return 0.0
        busy = sum(self.busy_time(s) for s in range(self.num_stages))
        return (total - busy) / total

    def peak_in_flight(self, stage: int) -> int:
        """Most microbatches with `F` done and `B` (or `W`) not yet done.

        Args:
            stage: Stage index in `[0, num_stages)`.

        Returns:
            An int.

        Example:

        >>> simulate(GPipe(4, 8)).peak_in_flight(3)
        8
        """
        return _peak_in_flight(
            a for _, _, a in sorted(self.entries[stage], key=lambda e: e[1]))

    def grid(self, step: float | None = None) -> str:
        """The timeline as text: one row per stage, one column per time slot.

        A cell shows the action running at the middle of its slot (`F3`,
        `B3`) or `.` when the stage is idle; an action longer than a slot
        fills several cells.

        Args:
            step: Length of a slot. Defaults to the shortest action, which
                is exact when all costs are multiples of it; pass a smaller
                step otherwise.

        Returns:
            A multi-line string; the first line gives each slot's start time.

        Example:

        >>> print(simulate(GPipe(2, 2), 1, 1).grid())
        time     0  1  2  3  4  5
        stage 0  F0 F1 .  .  B0 B1
        stage 1  .  F0 F1 B0 B1 .
        """
        durations = [end - start for stage in self.entries
                     for start, end, a in stage if end > start and a.is_compute]
        if step is None:
            step = min(durations, default=1.0)
        if not isinstance(step, (int, float)) or isinstance(step, bool) \
                or not math.isfinite(step) or step <= 0:
            raise ValueError(
                f"Invalid grid step: received {step!r}, expected a number > 0 "
                f"(the length of one column, in cost units).")
        slots = math.ceil(self.makespan / step - 1e-9)
        rows = []
        for stage in self.entries:
            row, i = [], 0
            for c in range(slots):
                mid = (c + 0.5) * step
                while i < len(stage) and stage[i][1] <= mid:
                    i += 1
                if i < len(stage) and stage[i][0] <= mid < stage[i][1]:
                    a = stage[i][2]
                    row.append(f"{a.kind}{a.microbatch}")
                else:
                    row.append(".")
            rows.append(row)
        times = [f"{c * step:g}" for c in range(slots)]
        width = max([len(x) for x in times] + [len(x) for r in rows for x in r]
                    + [1])
        label = len(f"stage {self.num_stages - 1}")
        lines = ["time".ljust(label) + "  " + " ".join(t.ljust(width)
                                                       for t in times)]
        for s, row in enumerate(rows):
            lines.append(f"stage {s}".ljust(label) + "  "
                         + " ".join(x.ljust(width) for x in row))
        return "\n".join(line.rstrip() for line in lines)

    def draw(self, path: str, title: str | None = None) -> str:
        """Draws the timeline to a PNG file with matplotlib.

        Stages go down the y axis, time along the x axis; forward passes are
        blue boxes, backward passes orange ones, each labelled with its
        microbatch. Uses matplotlib's Agg canvas without touching pyplot's
        global state.

        Args:
            path: File to write, e.g. `"1f1b.png"`.
            title: Figure title. Defaults to the schedule, its size, the
                simulated bubble and the largest peak in flight.

        Returns:
            `path`.

        Example:

        >>> import os, tempfile
        >>> out = os.path.join(tempfile.mkdtemp(), "gpipe.png")
        >>> _ = simulate(GPipe(2, 4)).draw(out)
        >>> os.path.getsize(out) > 0
        True
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError(
                "Timeline.draw() needs matplotlib, which is not installed. "
                "Install it with `pip install matplotlib`, or print the "
                "timeline with Timeline.grid() instead.") from e
        sched, p = self.schedule, self.num_stages
        span = self.makespan or 1.0
        colors = {"F": "#4c8bd6", "B": "#f0a04b", "I": "#f0a04b",
                  "W": "#6bbf59", "RECV_F": "#9aa0a6",
                  "RECV_B": "#9aa0a6", "SEND_F": "#9aa0a6",
                  "SEND_B": "#9aa0a6"}
        fig = Figure(figsize=(min(max(6.0, 0.35 * span + 2), 24.0),
                              0.55 * p + 1.6))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        durations = [e - s for st in self.entries for s, e, a in st
                     if a.is_compute] or [1.0]
        box_pt = min(durations) / span * fig.get_figwidth() * 72 * 0.8
        fontsize = max(5.0, min(9.0, box_pt / 2.2))
        for s, stage in enumerate(self.entries):
            for start, end, a in stage:
                ax.barh(s, end - start, left=start, height=0.8,
                        color=colors.get(a.kind, "#999999"),
                        edgecolor="black", linewidth=0.6)
                if a.is_compute:
                    ax.text((start + end) / 2, s, str(a.microbatch),
                            ha="center", va="center", fontsize=fontsize)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"stage {s}" for s in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_xlim(0, span)
        ax.set_xlabel(self.unit)
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_axisbelow(True)
        handles = [Patch(color=colors["F"], label="forward"),
                   Patch(color=colors["B"], label="backward")]
        if any(a.kind == "W" for st in self.entries for _, _, a in st):
            handles[-1] = Patch(color=colors["I"],
                                label="backward (B, or I: input grads)")
            handles.append(Patch(color=colors["W"],
                                 label="W: weight gradients"))
        if any(not a.is_compute for st in self.entries for _, _, a in st):
            handles.append(Patch(color=colors["RECV_F"],
                                 label="communication"))
        ax.legend(handles=handles,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                  frameon=False)
        if title is None:
            peak = max((self.peak_in_flight(s) for s in range(p)), default=0)
            title = (f"{sched.name}: p={sched.num_stages}, "
                     f"m={sched.num_microbatches}, bubble "
                     f"{self.bubble_fraction():.1%}, peak in flight {peak}")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return path


    def to_chrome_trace(self, path: str) -> str:
        """Writes the timeline as a Chrome trace (chrome://tracing, Perfetto).

        One row (thread) per stage, one complete event per action, named
        like `F3` / `B3`. Times are taken as milliseconds.

        Args:
            path: JSON file to write.

        Returns:
            `path`.

        Example:

        >>> import json, os, tempfile
        >>> out = os.path.join(tempfile.mkdtemp(), "trace.json")
        >>> _ = simulate(GPipe(2, 2)).to_chrome_trace(out)
        >>> len(json.load(open(out))["traceEvents"])
        10
        """
        import json

        events = [{"name": f"stage {s}", "ph": "M", "pid": 0, "tid": s,
                   "args": {"name": f"stage {s}"}}
                  for s in range(self.num_stages)]
        events = [dict(e, name="thread_name") for e in events]
        for s, stage in enumerate(self.entries):
            for start, end, a in stage:
                events.append({
                    "name": f"{a.kind}{a.microbatch}", "ph": "X", "pid": 0,
                    "tid": s, "ts": 1000.0 * start,
                    "dur": 1000.0 * (end - start),
                    "cat": {"F": "forward", "W": "weight gradients"}.get(
                        a.kind, "backward")})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path


def _dependencies(action: Action, num_stages: int, grad_kind=None):
    """Compute actions `action` waits for, each with whether a transfer is
    needed. `grad_kind(stage, microbatch)`: the kind (`B` or `I`) that
    stage runs for that microbatch's input gradients (default `B`)."""
    s, k = action.stage, action.microbatch
    if action.kind == "F":
        return [(Action(s - 1, "F", k), True)] if s > 0 else []
    if action.kind == "W":
        return [(Action(s, "I", k), False)]
    deps = [(Action(s, "F", k), False)]
    if s < num_stages - 1:
        kind = grad_kind(s + 1, k) if grad_kind else "B"
        deps.append((Action(s + 1, kind, k), True))
    return deps


def _check_cost(name, value, allow_zero):
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ValueError(
            f"Invalid {name} for simulate(): received {value!r}, expected a "
            f"finite number {'>= 0' if allow_zero else '> 0'} (time units).")
    return float(value)


def simulate(schedule: Schedule, forward_cost: float = 1.0,
             backward_cost: float = 2.0, comm_cost: float = 0.0,
             weight_cost: float | None = None) -> Timeline:
    """Plays a schedule, event by event, with fixed costs per action.

    Each stage runs its compute actions in order, each as soon as the stage
    is free and its inputs are there: `F` of stage `s` waits for `F` of the
    same microbatch on stage `s - 1` (plus `comm_cost`); `B` waits for its
    own `F` and for `B` of the same microbatch on stage `s + 1` (plus
    `comm_cost`; the last stage's `B` only needs its `F`). A split
    backward's `I` waits as `B` does and costs `backward_cost -
    weight_cost`; its `W` waits for its `I` and costs `weight_cost`
    (default: half the backward, as for a matmul's two gradients).

    Args:
        schedule: A `Schedule`.
        forward_cost: Duration of one forward pass on one stage, > 0.
        backward_cost: Duration of one backward pass on one stage, > 0.
        comm_cost: Delay of one transfer between neighbouring stages, >= 0.

    Returns:
        A `Timeline`.

    Raises:
        ValueError: if the order deadlocks (no stage can run its next
            action), naming the stuck actions and what they wait for.

    Example:

    >>> t = simulate(OneFOneB(4, 8), forward_cost=1, backward_cost=2)
    >>> t.makespan, round(t.bubble_fraction(), 4), t.peak_in_flight(0)
    (33.0, 0.2727, 4)
    """
    costs = {"F": _check_cost("forward_cost", forward_cost, False),
             "B": _check_cost("backward_cost", backward_cost, False)}
    weight = (costs["B"] / 2 if weight_cost is None
              else _check_cost("weight_cost", weight_cost, False))
    if weight >= costs["B"]:
        raise ValueError(
            f"Invalid weight_cost for simulate(): received {weight_cost!r}, "
            f"expected less than backward_cost ({backward_cost!r}): it is "
            "the weight-gradient part of the backward.")
    costs["W"], costs["I"] = weight, costs["B"] - weight
    comm = _check_cost("comm_cost", comm_cost, True)
    p = schedule.num_stages
    orders = [schedule.compute_actions(s) for s in range(p)]
    split = set()
    for s, order in enumerate(orders):
        for a in order:
            if not isinstance(a, Action) or a.stage != s or not a.is_compute:
                raise ValueError(
                    f"Cannot simulate {schedule!r}: compute_actions({s}) "
                    f"returned {a!s}, expected only compute Actions (F, B, "
                    f"I, W) of stage {s}.")
            if a.kind == "I":
                split.add((s, a.microbatch))

    def grad_kind(stage, k):
        return "I" if (stage, k) in split else "B"
    end = {}
    free = [0.0] * p
    pos = [0] * p
    entries = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                deps = _dependencies(a, p, grad_kind)
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[s]] + [end[d] + (comm if c else 0.0)
                                         for d, c in deps])
                finish = start + costs[a.kind]
                end[a] = finish
                free[s] = finish
                entries[s].append((start, finish, a))
                pos[s] += 1
                progress = True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        scheduled = {a for order in orders for a in order}
        stuck = []
        for s in range(p):
            if pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                waits = []
                for d, _ in _dependencies(a, p, grad_kind):
                    if d in end:
                        continue
                    if d not in scheduled:
                        waits.append(f"{d} (stage {d.stage} never runs it)")
                    else:
                        waits.append(f"{d}")
                stuck.append(f"stage {s} is stuck at {a}, waiting for "
                             f"{' and '.join(waits)}")
        raise ValueError(
            f"Pipeline schedule {schedule!r} deadlocks: no stage can run its "
            f"next action. " + "; ".join(stuck) + ". Reorder compute_actions() "
            f"so that every F runs after the previous stage's F of the same "
            f"microbatch, every B (or I) after its own F and the next stage's "
            f"B (or I), and every W after its I.")
    return Timeline(schedule, entries)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def main(argv=None) -> int:
    """Prints a schedule's grid, bubble and memory; optionally draws it."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_smp.pipeline.schedule",
        description="Print (and draw) a pipeline schedule.")
    parser.add_argument("--schedule", default="1f1b",
                        help="gpipe | 1f1b | 1f1b_split | zb_h1 | simple | "
                        "interleaved (default 1f1b)")
    parser.add_argument("-p", "--num-stages", type=int, default=4)
    parser.add_argument("-m", "--num-microbatches", type=int, default=8)
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--comm-cost", type=float, default=0.0)
    parser.add_argument("--step", type=float, default=None,
                        help="grid column length (default: shortest action)")
    parser.add_argument("--actions", action="store_true",
                        help="also print every stage's action list")
    parser.add_argument("--draw", metavar="PNG", help="write a picture here")
    args = parser.parse_args(argv)
    try:
        schedule = get_schedule(args.schedule, args.num_stages,
                                args.num_microbatches)
        timeline = simulate(schedule, args.forward_cost, args.backward_cost,
                            args.comm_cost)
        grid = timeline.grid(args.step)
    except ValueError as e:
        parser.error(str(e))
    p, m = schedule.num_stages, schedule.num_microbatches
    print(f"{schedule.name}: p={p} stages, m={m} microbatches "
          f"(forward {args.forward_cost:g}, backward {args.backward_cost:g}, "
          f"comm {args.comm_cost:g})\n")
    print(grid + "\n")
    if args.actions:
        for s, actions in schedule.all_actions().items():
            print(f"stage {s}: " + " ".join(str(a) for a in actions))
        print()
    print(f"ideal bubble      {schedule.ideal_bubble_fraction():.2%}  "
          f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}")
    print(f"simulated bubble  {timeline.bubble_fraction():.2%}  "
          f"(makespan {timeline.makespan:g})")
    print("peak in flight    " + ", ".join(
        f"stage {s}: {timeline.peak_in_flight(s)}" for s in range(p)))
    if args.draw:
        timeline.draw(args.draw)
        print(f"wrote {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
