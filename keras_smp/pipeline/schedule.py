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
    "Interleaved1F1B",
    "OneFOneBSplit",
    "SCHEDULES",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "Schedule",
    "Timeline",
    "get_schedule",
    "post_receives",
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
        extra = (f", virtual_stages={self.virtual_stages}"
                 if self.virtual_stages > 1 else "")
        return (f"{type(self).__name__}(num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches}{extra})")

    # -- where the model's stages run -------------------------------------

    #: Model stages per pipeline rank (`v`); 1 except for the schedules
    #: with virtual stages (`Interleaved1F1B`, `ZeroBubbleV`).
    virtual_stages = 1

    @property
    def num_model_stages(self) -> int:
        """Pieces the model is cut into: `num_stages * virtual_stages`.

        With virtual stages an `Action`'s `stage` is a model stage in
        `[0, num_model_stages)`, run by pipeline rank `rank_of(stage)`;
        otherwise model stage and rank are the same.

        Example:

        >>> Interleaved1F1B(2, 4, virtual_stages=2).num_model_stages
        4
        """
        return self.num_stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """Pipeline rank (process or device) that runs model stage `stage`.

        Args:
            stage: Model stage index in `[0, num_model_stages)`.

        Returns:
            An int in `[0, num_stages)`: `stage` itself without virtual
            stages, `stage % num_stages` for `Interleaved1F1B` (rank `r`
            holds stages `r, r + p, ...`), a V for `ZeroBubbleV`.

        Example:

        >>> [Interleaved1F1B(2, 4).rank_of(s) for s in range(4)]
        [0, 1, 0, 1]
        """
        if not _is_int(stage) or not 0 <= stage < self.num_model_stages:
            raise ValueError(
                f"Invalid model stage for {self!r}: received {stage!r}, "
                f"expected an int in [0, {self.num_model_stages - 1}].")
        return self._rank_of(stage)

    def _rank_of(self, stage):
        return stage % self.num_stages

    def stages_of(self, rank: int) -> list[int]:
        """Model stages that pipeline rank `rank` runs, in model order.

        Example:

        >>> ZeroBubbleV(2, 4).stages_of(0), ZeroBubbleV(2, 4).stages_of(1)
        ([0, 3], [1, 2])
        """
        self._check_stage(rank)
        return [s for s in range(self.num_model_stages)
                if self._rank_of(s) == rank]

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
                f"Invalid pipeline rank (stage) for {self!r}: received "
                f"{stage!r}, expected an int in [0, {self.num_stages - 1}].")

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
        final = self.num_model_stages - 1
        for a in self.compute_actions(stage):
            k = a.microbatch
            first, last = a.stage == 0, a.stage == final
            if a.kind == "F":
                if not first:
                    out.append(Action(a.stage, "RECV_F", k))
                out.append(a)
                if not last:
                    out.append(Action(a.stage, "SEND_F", k))
            elif a.kind in _GRAD_KINDS:
                if not last:
                    out.append(Action(a.stage, "RECV_B", k))
                out.append(a)
                if not first:
                    out.append(Action(a.stage, "SEND_B", k))
            else:
                out.append(a)  # validate() reports it.
        return out

    def posted_actions(self, rank: int) -> list[Action]:
        """`actions(rank)` with each receive from another rank moved to
        where it should be *posted* when sends block until their receive
        is posted (TensorFlow's collective send/receive between
        processes).

        A posted receive holds its buffer until its data arrives: posting
        every receive at the start of the step is deadlock-free but keeps
        one buffer per microbatch (GPipe's activation memory on a 1F1B
        rank). Here each receive is posted two compute actions (`2 v` with
        virtual stages) before the first compute action of the rank that,
        in the simulated plan
        (`simulate` with forward 1, backward 2, each `1/v` with virtual
        stages), ends after the peer sends its data: in time for the send,
        with room for a rank running behind the plan (posting just in time
        made steps 2-16% slower across processes). The result is then
        played with blocking sends (each send
        waits until the peer has posted its receive); where that would
        deadlock, the receive the stuck send waits for is moved earlier,
        until no rank is stuck. Transfers between two stages of one rank
        stay where `actions` puts them.

        Args:
            rank: Pipeline rank in `[0, num_stages)`.

        Returns:
            A list of `Action`s: the same as `actions(rank)`, reordered.

        Example:

        >>> [str(a) for a in OneFOneB(2, 3).posted_actions(1)]
        ['1RECV_F0', '1RECV_F1', '1F0', '1B0', '1SEND_B0', '1RECV_F2', '1F1', '1B1', '1SEND_B1', '1F2', '1B2', '1SEND_B2']
        """
        self._check_stage(rank)
        plan = getattr(self, "_posting", None)
        if plan is None:
            plan = self._posting = _post_receives(self)
        return list(plan[rank])

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
        for r in range(p):
            order = self.compute_actions(r)
            held = self.stages_of(r)
            seen = collections.defaultdict(list)
            for pos, a in enumerate(order):
                if not isinstance(a, Action) or not a.is_compute or (
                        a.stage not in held):
                    raise ValueError(
                        f"{where}: compute_actions({r}) returned {a!s} at "
                        f"position {pos}, expected a compute Action (F or B, "
                        f"or I and W) of a stage rank {r} runs ({held}; "
                        f"transfers are added by actions()).")
                if a.microbatch >= m:
                    raise ValueError(
                        f"{where}: rank {r} runs {a}, but microbatches are "
                        f"numbered 0..{m - 1}. Only use microbatch indices "
                        f"below num_microbatches.")
                seen[a].append(pos)
            for s, k in ((s, k) for s in held for k in range(m)):
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
            peak, limit = _peak_in_flight(order), self.in_flight_limit(r)
            if peak > limit:
                raise ValueError(
                    f"{where}: {'rank' if self.virtual_stages > 1 else 'stage'} "
                    f"{r} holds {peak} microbatches in flight, "
                    f"expected at most {limit} for this schedule. Run "
                    f"backward passes earlier.")
        self._validate_transfers()
        simulate(self)  # Raises if the compute order deadlocks.

    def _validate_transfers(self):
        p = self.num_model_stages
        where = f"Invalid pipeline schedule {self!r}"
        # Per link (sender, receiver, kind): microbatches in the order sent
        # and in the order received.
        sent = collections.defaultdict(list)
        received = collections.defaultdict(list)
        first_action = {}
        for r in range(self.num_stages):
            for a in self.actions(r):
                if a.is_compute:
                    continue
                s = a.stage
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


#: How many compute actions (times `virtual_stages`: each is 1/v of a
#: stage's) before its planned point a receive from another rank is posted
#: (`Schedule.posted_actions`): room for a rank that runs behind the plan,
#: for a few more buffers per link.
_POST_SLACK = 2


def _post_receives(schedule):
    """`{rank: actions}` with cross-rank receives moved to their posting
    points (see `Schedule.posted_actions`)."""
    p, v = schedule.num_stages, schedule.virtual_stages
    rank_of = schedule.rank_of
    timeline = simulate(schedule, 1.0 / v, 2.0 / v)
    base = {r: schedule.actions(r) for r in range(p)}

    def remote(a):
        return not a.is_compute and rank_of(a.peer) != rank_of(a.stage)

    def producer(recv):
        # The compute action whose output the peer sends.
        if recv.kind == "RECV_F":
            return Action(recv.peer, "F", recv.microbatch)
        kind = "I" if Action(recv.peer, "I", recv.microbatch) in \
            timeline.spans else "B"
        return Action(recv.peer, kind, recv.microbatch)

    # Posting points: index into the rank's compute actions.
    lists = {}
    for r, acts in base.items():
        computes = [a for a in acts if a.is_compute]
        ends = [timeline.spans[a][1] for a in computes]
        where = {}  # compute index -> receives posted just before it
        pos = 0
        for a in acts:
            if a.is_compute:
                pos += 1
                continue
            if a.kind.startswith("RECV") and remote(a):
                sent = timeline.spans[producer(a)][1]
                # The consumer is the compute right after it (index pos).
                # `_POST_SLACK` actions earlier than the plan says: a rank
                # running late would otherwise hold its peer's send up.
                i = next((j for j in range(pos + 1) if ends[j] > sent), pos)
                where.setdefault(max(0, min(i, pos) - _POST_SLACK * v),
                                 []).append(a)
        out, pos = [], 0
        for a in acts:
            if a.kind.startswith("RECV") and remote(a):
                continue
            if a.is_compute:
                out += where.pop(pos, [])
                pos += 1
            out.append(a)
        lists[r] = out
    return post_receives(lists, rank_of)


def post_receives(lists, rank_of=None):
    """Per-rank action lists whose receives are posted early enough for
    blocking sends.

    Plays the lists with sends that wait until the peer has posted the
    matching receive (TensorFlow's collective send between processes) and
    a compute that waits for the data of its receives; wherever a send
    would wait forever, moves the receive it waits for to just before where
    its rank is stuck, and plays again. Receives already early enough stay
    where they are. `Schedule.posted_actions` uses it after placing each
    receive by the simulated plan; hand-written lists for
    `keras_smp.pipeline.runtime.execute` across processes can use it as
    they are.

    Args:
        lists: `{rank: [Action or str, ...]}`, transfers included.
        rank_of: `stage -> rank` (default: the stage is the rank).

    Returns:
        `{rank: [Action, ...]}`, the same actions with receives moved.

    Raises:
        ValueError: if the lists deadlock whatever the receives' places.

    Example:

    >>> plain = {0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    ...          1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"}
    >>> posted = post_receives({r: a.split() for r, a in plain.items()})
    >>> " ".join(map(str, posted[1]))
    '1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1'
    """
    rank_of = rank_of or (lambda stage: stage)
    lists = {r: [Action.parse(a) if isinstance(a, str) else a for a in acts]
             for r, acts in lists.items()}
    for _ in range(sum(len(a) for a in lists.values()) + 1):
        stuck = _blocked_sends(lists, rank_of)
        if not stuck:
            return lists
        for recv, r, at in stuck:
            acts = lists[r]
            acts.remove(recv)
            acts.insert(at, recv)
    raise AssertionError("receive posting did not converge")


def _blocked_sends(lists, rank_of):
    """Plays per-rank action lists with blocking sends (a send waits until
    the peer has posted the matching receive; a compute waits for the
    data of its receives). Returns `[]` when every rank finishes, else
    `[(receive, rank, index)]`: for each send stuck forever, the receive it
    waits for and the index before which its rank must post it."""
    pos = {r: 0 for r in lists}
    posted, sent = set(), set()

    def match(a):
        # (stage sending, stage receiving, direction, microbatch)
        if a.kind.startswith("SEND"):
            return (a.stage, a.peer, a.kind[-1], a.microbatch)
        return (a.peer, a.stage, a.kind[-1], a.microbatch)

    waiting = {}  # compute action -> the transfers it needs
    for acts in lists.values():
        for a in acts:
            if a.kind.startswith("RECV"):
                consumer = next(
                    b for b in acts[acts.index(a):] if b.is_compute
                    and b.stage == a.stage and b.microbatch == a.microbatch
                    and (b.kind == "F") == (a.kind == "RECV_F"))
                waiting.setdefault(consumer, []).append(match(a))
    progress = True
    while progress:
        progress = False
        for r, acts in lists.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                local = not a.is_compute and rank_of(a.peer) == r
                if a.kind.startswith("SEND"):
                    if not local and match(a) not in posted:
                        break
                    sent.add(match(a))
                elif a.kind.startswith("RECV"):
                    posted.add(match(a))
                elif any(t not in sent for t in waiting.get(a, ())):
                    break
                pos[r] += 1
                progress = True
    if all(pos[r] == len(acts) for r, acts in lists.items()):
        return []
    out = []
    for r, acts in lists.items():
        if pos[r] < len(acts) and acts[pos[r]].kind.startswith("SEND"):
            key = match(acts[pos[r]])
            peer = rank_of(acts[pos[r]].peer)
            recv = next(a for a in lists[peer] if a.kind.startswith("RECV")
                        and match(a) == key)
            if lists[peer].index(recv) >= pos[peer]:
                out.append((recv, peer, pos[peer]))
    if not out:
        raise ValueError(
            "Pipeline action lists deadlock even with receives posted "
            "early: " + ", ".join(
                f"rank {r} at {acts[pos[r]]}" for r, acts in lists.items()
                if pos[r] < len(acts)))
    return out


def _peak_in_flight(order) -> int:
    # A microbatch is held from its F until its B (or its W: the weight
    # gradients need the saved inputs), per model stage: with virtual
    # stages a rank counts one per (stage, microbatch) it holds.
    held, peak = set(), 0
    for a in order:
        if a.kind == "F":
            held.add((a.stage, a.microbatch))
            peak = max(peak, len(held))
        elif a.kind in ("B", "W"):
            held.discard((a.stage, a.microbatch))
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


class Interleaved1F1B(Schedule):
    """Megatron's interleaved 1F1B: `v` virtual stages per pipeline rank.

    The model is cut into `p * v` stages and rank `r` runs stages `r, r +
    p, ..., r + (v - 1) p` (Narayanan et al., "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", 2021;
    torch's `ScheduleInterleaved1F1B`). Each rank goes through its
    stages' forward passes in rounds of `p` microbatches (stage `r` for
    microbatches 0..p-1, then stage `r + p` for the same ones, ...) and
    its backward passes in the reverse stage order, after a warm-up of
    `2 (p - 1 - r) + (v - 1) p` forward passes. Every action is `1/v` of a
    rank's work, so the fill and drain shrink `v` times: the idle fraction
    is `(p - 1) / (v m + p - 1)` with free transfers, against `(p - 1) /
    (m + p - 1)` for 1F1B, for `v` times as many transfers. A rank holds
    at most `warm-up + 1` (stage, microbatch) pairs, each `1/v` of a
    rank's activations: `p + (p - 1 - 2 r) / v` microbatches' worth
    (capped at `m`), against 1F1B's `p - r`.

    `num_microbatches` must be a multiple of `num_stages` (as in
    Megatron).

    Args:
        num_stages: Pipeline ranks `p` (processes or devices), an int >= 1.
        num_microbatches: Microbatches per step `m`, a multiple of `p`.
        virtual_stages: Model stages per rank `v`, an int >= 2 (default 2).

    Example:

    >>> sched = Interleaved1F1B(2, 4, virtual_stages=2)
    >>> [str(a) for a in sched.compute_actions(1)]
    ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1F2', '1B0', '1F3', '1B1', '3F2', '3B2', '3F3', '3B3', '1B2', '1B3']
    >>> sched.ideal_bubble_fraction(), OneFOneB(2, 4).ideal_bubble_fraction()
    (0.1111111111111111, 0.2)
    """

    name = "interleaved_1f1b"

    def __init__(self, num_stages: int, num_microbatches: int,
                 virtual_stages: int = 2):
        super().__init__(num_stages, num_microbatches)
        if not _is_int(virtual_stages) or virtual_stages < 2:
            raise ValueError(
                f"Invalid virtual_stages for the 'interleaved_1f1b' pipeline "
                f"schedule: received {virtual_stages!r}, expected an int >= 2 "
                f"(model stages per pipeline rank). Use pipeline='1f1b' for "
                f"one stage per rank.")
        if num_microbatches % num_stages:
            lower = num_microbatches // num_stages * num_stages
            fixes = " or ".join(f"microbatches={n}" for n in
                                (lower, lower + num_stages) if n > 0)
            raise ValueError(
                f"Invalid num_microbatches for the 'interleaved_1f1b' "
                f"pipeline schedule: received {num_microbatches}, expected a "
                f"multiple of num_stages={num_stages} (microbatches go round "
                f"the ranks in groups of {num_stages}). Use {fixes}.")
        self.virtual_stages = virtual_stages

    def warmup(self, rank: int) -> int:
        """Forward actions rank `rank` runs before its first backward.

        Returns:
            `min(2 (p - 1 - rank) + (v - 1) p, v m)`.

        Example:

        >>> [Interleaved1F1B(4, 8).warmup(r) for r in range(4)]
        [10, 8, 6, 4]
        """
        self._check_stage(rank)
        p, v = self.num_stages, self.virtual_stages
        return min(2 * (p - 1 - rank) + (v - 1) * p,
                   v * self.num_microbatches)

    def in_flight_limit(self, stage):
        return min(self.warmup(stage) + 1,
                   self.virtual_stages * self.num_microbatches)

    def ideal_bubble_fraction(self):
        """`(p - 1) / (v m + p - 1)`: 1F1B's, with fill and drain `v` times
        shorter.

        Example:

        >>> round(Interleaved1F1B(4, 8, 2).ideal_bubble_fraction(), 4)
        0.1579
        """
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)

    def _compute_actions(self, rank):
        p, v, m = self.num_stages, self.virtual_stages, self.num_microbatches

        def action(k, kind):
            # The k-th forward (or backward) action of the rank: rounds of
            # p microbatches per stage, stages in order (reversed for the
            # backward), then the next p microbatches.
            chunk = (k // p) % v
            if kind == "B":
                chunk = v - 1 - chunk
            return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

        total, w = v * m, self.warmup(rank)
        order = [action(k, "F") for k in range(w)]
        for i in range(total - w):
            order += [action(w + i, "F"), action(i, "B")]
        order += [action(k, "B") for k in range(total - w, total)]
        return order


class ZeroBubbleV(Schedule):
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2024, section 6).

    The model is cut into `2 p` stages placed in a V: rank `r` runs stage
    `r` on the way down and stage `2 p - 1 - r` on the way back, so rank 0
    holds both the first and the last stage, and the turn (stages `p - 1`
    and `p`) stays on rank `p - 1` without a transfer. Every backward is
    split into `I` and `W` (see `ZeroBubbleH1`), and the `W`s fill the
    fill and drain: with `F = I = W` and free transfers the bubble is
    close to zero for `m >= 2 p - 1`, at 1F1B's peak activation memory
    (at most `2 p` half-size stages' microbatches, on every rank: 1F1B's
    `p` whole ones, which 1F1B holds on rank 0 only). The order follows
    torch's `ScheduleZBVZeroBubble`.

    Args:
        num_stages: Pipeline ranks `p` (processes or devices), an int >= 1.
        num_microbatches: Microbatches per step `m`, an int >= 1.

    Example:

    >>> sched = ZeroBubbleV(2, 4)
    >>> sched.stages_of(0), sched.stages_of(1)
    ([0, 3], [1, 2])
    >>> t = simulate(sched, 1, 2, weight_cost=1)
    >>> t.makespan, simulate(OneFOneB(2, 4), 2, 4).makespan
    (25.0, 30.0)
    """

    name = "zb_v"
    virtual_stages = 2

    def _rank_of(self, stage):
        p = self.num_stages
        return stage if stage < p else 2 * p - 1 - stage

    def in_flight_limit(self, stage):
        self._check_stage(stage)
        return min(2 * self.num_stages, 2 * self.num_microbatches)

    def _compute_actions(self, rank):
        p, m = self.num_stages, self.num_microbatches
        n = max(2 * p - 1, m)  # then drop the microbatches >= m
        down, up = rank, 2 * p - 1 - rank
        order = []
        count = collections.Counter()

        def put(stage, kind):
            order.append(Action(stage, kind, count[(stage, kind)]))
            count[(stage, kind)] += 1

        for _ in range(2 * (p - rank) - 1):
            put(down, "F")
        for _ in range(rank):
            put(up, "F")
            put(down, "F")
        for _ in range(p - rank):
            put(up, "F")
            put(up, "I")
            put(up, "W")
        while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:
            if count[(down, "F")] < n:
                put(down, "F")
            put(down, "I")
            put(down, "W")
            put(up, "F")
            put(up, "I")
            put(up, "W")
        for _ in range(rank):
            put(down, "I")
            put(up, "I")
        for _ in range(p - rank):
            put(down, "I")
            put(down, "W")
        while count[(up, "W")] < count[(up, "I")]:
            put(up, "W")
        while count[(down, "W")] < count[(down, "I")]:
            put(down, "W")
        return [a for a in order if a.microbatch < m]


#: Accepted schedule names (SMP's `"simple"` and `"interleaved"` included).
SCHEDULES: dict[str, type] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "1f1b_split": OneFOneBSplit,
    "zb_h1": ZeroBubbleH1,
    "interleaved_1f1b": Interleaved1F1B,
    "zb_v": ZeroBubbleV,
    "simple": GPipe,
    "interleaved": OneFOneB,
}


def get_schedule(name: str, num_stages: int, num_microbatches: int,
                 virtual_stages: int | None = None) -> Schedule:
    """Builds a schedule from its name, as in `SMPConfig.pipeline`.

    Args:
        name: `"gpipe"` (alias `"simple"`), `"1f1b"` (alias
            `"interleaved"`), `"1f1b_split"`, `"zb_h1"`,
            `"interleaved_1f1b"` or `"zb_v"`, case-insensitive.
        num_stages: Number of pipeline ranks `p`, an int >= 1.
        num_microbatches: Number of microbatches per step `m`, an int >= 1.
        virtual_stages: Model stages per rank `v`: `None` for the
            schedule's own (2 for `"interleaved_1f1b"` and `"zb_v"`, 1 for
            the others); any `v >= 2` for `"interleaved_1f1b"`, 2 for
            `"zb_v"`, 1 for the others.

    Returns:
        A `Schedule` instance.

    Example:

    >>> get_schedule("interleaved", 4, 8)
    OneFOneB(num_stages=4, num_microbatches=8)
    >>> get_schedule("interleaved_1f1b", 2, 4, virtual_stages=3)
    Interleaved1F1B(num_stages=2, num_microbatches=4, virtual_stages=3)
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in SCHEDULES:
        raise ValueError(
            f"Unknown pipeline schedule: received {name!r}, expected one of "
            f"{', '.join(repr(n) for n in SCHEDULES)}. 'simple' is GPipe and "
            f"'interleaved' is 1F1B (SMP's names); Megatron's interleaved "
            f"schedule with virtual stages is 'interleaved_1f1b'.")
    cls = SCHEDULES[key]
    if cls is Interleaved1F1B:
        return cls(num_stages, num_microbatches,
                   2 if virtual_stages is None else virtual_stages)
    if virtual_stages is not None and virtual_stages != cls.virtual_stages:
        raise ValueError(
            f"Invalid virtual_stages for the {key!r} pipeline schedule: "
            f"received {virtual_stages!r}, but it runs {cls.virtual_stages} "
            f"model stage(s) per rank. Leave virtual_stages unset, or use "
            f"pipeline='interleaved_1f1b' for v >= 2 stages per rank.")
    return cls(num_stages, num_microbatches)


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
        virtual = getattr(self.schedule, "virtual_stages", 1) > 1
        rows = []
        for stage in self.entries:
            row, i = [], 0
            for c in range(slots):
                mid = (c + 0.5) * step
                while i < len(stage) and stage[i][1] <= mid:
                    i += 1
                if i < len(stage) and stage[i][0] <= mid < stage[i][1]:
                    a = stage[i][2]
                    # With virtual stages a rank runs several: name it.
                    row.append(str(a) if virtual else f"{a.kind}{a.microbatch}")
                else:
                    row.append(".")
            rows.append(row)
        times = [f"{c * step:g}" for c in range(slots)]
        width = max([len(x) for x in times] + [len(x) for r in rows for x in r]
                    + [1])
        name = "rank" if virtual else "stage"
        label = len(f"{name} {self.num_stages - 1}")
        lines = ["time".ljust(label) + "  " + " ".join(t.ljust(width)
                                                       for t in times)]
        for s, row in enumerate(rows):
            lines.append(f"{name} {s}".ljust(label) + "  "
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
        v = getattr(sched, "virtual_stages", 1)
        for s, stage in enumerate(self.entries):
            held = sched.stages_of(s) if v > 1 else [s]
            for start, end, a in stage:
                # Later virtual stages of a rank: lighter, hatched boxes.
                later = held.index(a.stage) if a.stage in held else 0
                ax.barh(s, end - start, left=start, height=0.8,
                        color=colors.get(a.kind, "#999999"),
                        alpha=1.0 if later == 0 else 0.55,
                        hatch="//" if later else None,
                        edgecolor="black", linewidth=0.6)
                if a.is_compute:
                    ax.text((start + end) / 2, s, str(a.microbatch),
                            ha="center", va="center", fontsize=fontsize)
        ax.set_yticks(range(p))
        ax.set_yticklabels([
            (f"rank {s}: stages {','.join(map(str, sched.stages_of(s)))}"
             if v > 1 else f"stage {s}") for s in range(p)])
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
        if v > 1:
            handles.append(Patch(facecolor="white", edgecolor="black",
                                 hatch="//", label="rank's later stage"))
        ax.legend(handles=handles,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                  frameon=False)
        if title is None:
            peak = max((self.peak_in_flight(s) for s in range(p)), default=0)
            title = (f"{sched.name}: p={sched.num_stages}, "
                     + (f"v={v}, " if v > 1 else "")
                     + f"m={sched.num_microbatches}, bubble "
                     f"{self.bubble_fraction():.1%}, peak in flight {peak}"
                     + (f" (1/{v}-stage microbatches)" if v > 1 else ""))
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

        virtual = getattr(self.schedule, "virtual_stages", 1) > 1
        row = "rank" if virtual else "stage"
        events = [{"name": f"{row} {s}", "ph": "M", "pid": 0, "tid": s,
                   "args": {"name": f"{row} {s}"}}
                  for s in range(self.num_stages)]
        events = [dict(e, name="thread_name") for e in events]
        for s, stage in enumerate(self.entries):
            for start, end, a in stage:
                events.append({
                    "name": (str(a) if virtual else f"{a.kind}{a.microbatch}"),
                    "ph": "X", "pid": 0,
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

    Each pipeline rank runs its compute actions in order, each as soon as
    the rank is free and its inputs are there: `F` of stage `s` waits for
    `F` of the same microbatch on stage `s - 1` (plus `comm_cost`); `B`
    waits for its own `F` and for `B` of the same microbatch on stage `s +
    1` (plus `comm_cost`; the last stage's `B` only needs its `F`). With
    virtual stages a transfer between two stages of one rank costs
    nothing, and each action is one model stage's: pass a rank's costs
    divided by `virtual_stages` to compare with one stage per rank. A split
    backward's `I` waits as `B` does and costs `backward_cost -
    weight_cost`; its `W` waits for its `I` and costs `weight_cost`
    (default: half the backward, as for a matmul's two gradients).

    Args:
        schedule: A `Schedule`.
        forward_cost: Duration of one forward pass on one stage, > 0.
        backward_cost: Duration of one backward pass on one stage, > 0.
        comm_cost: Delay of one transfer between neighbouring stages, >= 0.
        weight_cost: Duration of a `W` (default `backward_cost / 2`).

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
    p, last = schedule.num_stages, schedule.num_model_stages - 1
    rank_of = schedule.rank_of
    orders = [schedule.compute_actions(r) for r in range(p)]
    split = set()
    for r, order in enumerate(orders):
        held = schedule.stages_of(r)
        for a in order:
            if not isinstance(a, Action) or not a.is_compute or (
                    a.stage not in held):
                raise ValueError(
                    f"Cannot simulate {schedule!r}: compute_actions({r}) "
                    f"returned {a!s}, expected only compute Actions (F, B, "
                    f"I, W) of the stages rank {r} runs ({held}).")
            if a.kind == "I":
                split.add((a.stage, a.microbatch))

    def grad_kind(stage, k):
        return "I" if (stage, k) in split else "B"

    def deps_of(a):
        # Dependencies, each with the transfer delay (none on one rank).
        return [(d, comm if c and rank_of(d.stage) != rank_of(a.stage)
                 else 0.0) for d, c in _dependencies(a, last + 1, grad_kind)]
    end = {}
    free = [0.0] * p
    pos = [0] * p
    entries = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = deps_of(a)
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[r]] + [end[d] + c for d, c in deps])
                finish = start + costs[a.kind]
                end[a] = finish
                free[r] = finish
                entries[r].append((start, finish, a))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(orders[r]) for r in range(p)):
        scheduled = {a for order in orders for a in order}
        stuck = []
        for r in range(p):
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                waits = []
                for d, _ in deps_of(a):
                    if d in end:
                        continue
                    if d not in scheduled:
                        waits.append(f"{d} (stage {d.stage} never runs it)")
                    else:
                        waits.append(f"{d}")
                who = "rank" if schedule.virtual_stages > 1 else "stage"
                stuck.append(f"{who} {r} is stuck at {a}, waiting for "
                             f"{' and '.join(waits)}")
        raise ValueError(
            f"Pipeline schedule {schedule!r} deadlocks: no rank can run its "
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
                        help="gpipe | 1f1b | 1f1b_split | zb_h1 | interleaved_1f1b | "
                        "zb_v | simple | interleaved (default 1f1b)")
    parser.add_argument("-p", "--num-stages", type=int, default=4,
                        help="pipeline ranks (processes or devices)")
    parser.add_argument("-m", "--num-microbatches", type=int, default=8)
    parser.add_argument("-v", "--virtual-stages", type=int, default=None,
                        help="model stages per rank (interleaved_1f1b: "
                        "default 2; zb_v: 2). Costs are a rank's whole "
                        "share and are divided by v per action")
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
                                args.num_microbatches, args.virtual_stages)
        v = schedule.virtual_stages
        timeline = simulate(schedule, args.forward_cost / v,
                            args.backward_cost / v, args.comm_cost)
        grid = timeline.grid(args.step)
    except ValueError as e:
        parser.error(str(e))
    p, m = schedule.num_stages, schedule.num_microbatches
    print(f"{schedule.name}: p={p} " + (
        f"ranks x v={v} virtual stages, " if v > 1 else "stages, ")
          + f"m={m} microbatches "
          f"(forward {args.forward_cost:g}, backward {args.backward_cost:g}, "
          f"comm {args.comm_cost:g})\n")
    print(grid + "\n")
    if args.actions:
        for s, actions in schedule.all_actions().items():
            print(f"{'rank' if v > 1 else 'stage'} {s}: "
                  + " ".join(str(a) for a in actions))
        print()
    if isinstance(schedule, Interleaved1F1B):
        print(f"ideal bubble      {schedule.ideal_bubble_fraction():.2%}  "
              f"(p-1)/(vm+p-1) = {p - 1}/{v * m + p - 1} (interleaved)")
    else:
        split = any(a.kind == "I" for a in schedule.compute_actions(0))
        print(f"ideal bubble      {(p - 1) / (m + p - 1):.2%}  "
              f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1} ("
              + ("1F1B's, for comparison" if split else "GPipe, 1F1B") + ")")
    print(f"simulated bubble  {timeline.bubble_fraction():.2%}  "
          f"(makespan {timeline.makespan:g})")
    print("peak in flight    " + ", ".join(
        f"{'rank' if v > 1 else 'stage'} {s}: {timeline.peak_in_flight(s)}"
        for s in range(p)) + (f" (each a 1/{v} stage)" if v > 1 else ""))
    if args.draw:
        timeline.draw(args.draw)
        print(f"wrote {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
