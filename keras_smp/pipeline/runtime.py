"""The pipeline runtime: executes per-stage action lists with TensorFlow.

One function, `execute`, runs every pipeline step of keras-smp, whatever
the schedule and wherever the stages are:

- the schedule layer (`keras_smp.pipeline.schedule`, pure Python) gives
  each stage an ordered list of `Action`s: `F` / `B` (forward / backward
  of one microbatch), or a backward split into `I` (input gradients, sent
  on at once) and `W` (the weights' gradients, later, from what `I`
  saved: nothing is recomputed), and the transfers `SEND_F`, `RECV_F`,
  `SEND_B`, `RECV_B`;
- a *transport* moves tensors between stages: `LocalTransport` between
  devices of one process (a receive is a copy onto the stage's device),
  `CollectiveTransport` between stage processes (TensorFlow collective
  send/recv over its gRPC/NCCL runtime);
- `execute` builds, inside a `tf.function`, the ops of every action of the
  pipeline ranks held here, in each rank's order: every compute action is
  control-dependent on the previous action of its rank (sends included),
  so a rank runs exactly its list (with virtual stages a rank's list mixes
  the actions of several model stages: its chain runs through all of
  them); a send itself waits only for its data,
  so a backward's weight gradients never delay the input gradients a peer
  waits for. Receives are chained too when the transport says
  so (`chain_receives`); otherwise (between processes, where a send
  blocks until its receive is posted) each receive is posted when its
  rank's chain reaches its place in `Schedule.posted_actions` (in time
  for the peer's send in the plan, and early enough that no send waits
  forever), and waits for its data without holding the chain up.

The runtime knows nothing of Keras or of particular schedules: a new
schedule is a new action list. Ops of an action are named
`stage{s}/fwd_mb{m}/...`, `stage{s}/bwd_mb{m}/...` (TensorBoard, profiler).
"""

import contextlib
import dataclasses

import tensorflow as tf

from keras_smp.pipeline.backward import _replica_variable
from keras_smp.pipeline.backward import accumulate
from keras_smp.pipeline.backward import input_backward
from keras_smp.pipeline.backward import stage_backward
from keras_smp.pipeline.backward import weight_backward
from keras_smp.pipeline.backward import weight_meetings
from keras_smp.pipeline.schedule import Action
from keras_smp.runtime import sparse


@dataclasses.dataclass
class Stage:
    """One pipeline stage as the runtime runs it.

    Args:
        index: the stage's index in the pipeline.
        fn: `list[Tensor] -> list[Tensor]`: the stage's forward pass.
        variables: `tf.Variable`s whose gradients the backward computes
            (summed over microbatches); empty for forward-only steps.
        device: where the stage's ops run (`None`: the default device).
        replay: optional, for activation checkpointing:
            `(inputs, snapshot, finish) -> finish(outputs)` recomputes the
            forward pass in the backward action (whose gradients then come
            from the recomputation: the forward's activations are freed as
            soon as its outputs exist). `snapshot` is what `snapshot()`
            returned before the microbatch's forward (the stage's state
            then: random seeds, statistics); `finish` adds the loss on the
            last stage.
        snapshot: `() -> object`, called before each forward (with
            `replay`).
        adds_loss: `fn` returns `(outputs, added)` (and `replay`
            `(finished, added)`): `added` is a scalar loss the stage adds
            to the step's loss for this microbatch (Keras' `add_loss()`,
            activity regularizers; weighted for the step), or `None`. Its
            gradient joins the stage's backward: its weights' gradients,
            and its inputs' (to the previous stage).
        merge_rows: indices into `variables` of those whose sparse
            gradients' microbatch parts are added position by position,
            not concatenated (`keras_smp.runtime.sparse`: a lookup whose
            ids do not depend on the batch, as a position embedding's).
        around: optional `microbatch -> context manager`, entered around
            a microbatch's forward (its snapshot too).
        rows_add_up: whether the optimizer applies a sparse gradient's
            repeated ids as their sum (SGD): a weight read by several
            lookups of distinct ids then steps alike, without a warning
            (`sparse.warn_split_lookups`).
    """

    index: int
    fn: object
    variables: list = dataclasses.field(default_factory=list)
    device: str | None = None
    replay: object = None
    snapshot: object = None
    adds_loss: bool = False
    merge_rows: frozenset = frozenset()
    around: object = None
    rows_add_up: bool = False

    def scope(self, microbatch):
        """`around(microbatch)`, or no change without one."""
        if self.around is None:
            return contextlib.nullcontext()
        return self.around(microbatch)


@dataclasses.dataclass
class StepResult:
    """What `execute` built.

    Attributes:
        losses: per microbatch, the loss computed by the last stage (`None`
            where the last stage is not held here or there is no loss).
        outputs: per microbatch, the last stage's outputs (or `None`).
        grads: `{stage index: [gradient per variable]}`, summed over
            microbatches (dense or `tf.IndexedSlices`; `None` for a
            variable the stage's outputs do not depend on).
        done: an op that runs after every action and every send of the
            stages held here.
        split_fallbacks: the `I` actions whose stage could not split its
            backward (see `backward.weight_meetings`): they computed the
            whole backward, and their `W` nothing.
    """

    losses: list
    outputs: list
    grads: dict
    done: object
    split_fallbacks: list = dataclasses.field(default_factory=list)


def on_device(device):
    """`tf.device(device)`, or no change without a device (`None` or ""):
    the enclosing device stays, a replica's under `strategy.run`
    (`tf.device(None)` would clear it, and the strategy's all-reduce of
    a tensor without a device fails: "destinations can not be empty")."""
    return tf.device(device) if device else contextlib.nullcontext()


def _on_this_device(grad):
    """`grad` (dense or sparse) re-made on the current device."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values),
                                tf.identity(grad.indices), grad.dense_shape)
    return tf.identity(grad)


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _scope(action):
    kind = {"F": "fwd", "B": "bwd"}.get(action.kind, action.kind.lower())
    return f"stage{action.stage}/{kind}_mb{action.microbatch}"


def execute(actions, stages, transport, num_stages, inputs, loss_fn=None,
            forward_only=False, times=None):
    """Builds the ops of one pipelined step from per-stage action lists.

    Must be called inside a `tf.function` (the backward uses
    `tf.gradients`).

    Args:
        actions: `{rank: [Action, ...]}` for the pipeline ranks held here,
            transfers included (see `Schedule.actions(rank)`; between
            processes, where a send waits until its receive is posted and
            a receive is posted at its place in the list,
            `Schedule.posted_actions(rank)`, or any lists passed through
            `schedule.post_receives`); an action's
            `stage` is a model stage (the rank itself without virtual
            stages).
        stages: `{model stage index: Stage}` for every stage those lists
            run.
        transport: a `LocalTransport` or `CollectiveTransport`.
        num_stages: model stages of the whole pipeline (`p`, or `p * v`
            with virtual stages).
        inputs: per microbatch, the list of model inputs (used by stage 0).
        loss_fn: `(last_stage_outputs, microbatch) -> scalar` for the last
            stage, or `None` (no loss: forward only).
        forward_only: skip backward actions and gradient transfers.
        times: optional list; every compute action and every chained
            receive appends `(action, start, end)` `tf.timestamp()`s taken
            on its stage's device (the executed timeline).

    Returns:
        A `StepResult`.

    Raises:
        ValueError: when the action lists cannot run (a receive whose send
            no stage here performs, a forward without its input, a
            backward without its forward), naming the blocked actions.

    Example (one process, two stages on the default device):

    ```python
    import tensorflow as tf
    from keras_smp.pipeline.runtime import Stage, execute
    from keras_smp.pipeline.schedule import Action
    from keras_smp.pipeline.transport import LocalTransport

    w0, w1 = tf.Variable([[2.0]]), tf.Variable([[3.0]])
    plan = {0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
            1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]}
    actions = {s: [Action.parse(a) for a in acts] for s, acts in plan.items()}

    @tf.function
    def step(x):
        stages = {0: Stage(0, lambda t: [t[0] @ w0], [w0]),
                  1: Stage(1, lambda t: [t[0] @ w1], [w1])}
        result = execute(actions, stages, LocalTransport(), 2, [[x]],
                         loss_fn=lambda out, mb: tf.reduce_sum(out[0]))
        return result.losses[0], result.grads[0][0], result.grads[1][0]

    loss, g0, g1 = step(tf.constant([[1.0]]))
    assert float(loss) == 6.0 and float(g0) == 3.0 and float(g1) == 2.0
    ```
    """
    p = num_stages
    m = len(inputs)
    lists, lane = {}, {}
    for r, acts in actions.items():
        acts = [Action.parse(a) if isinstance(a, str) else a for a in acts]
        if forward_only:
            acts = [a for a in acts
                    if a.kind not in ("B", "I", "W", "SEND_B", "RECV_B")]
        for a in acts:
            if a.stage not in stages or not 0 <= a.microbatch < m:
                raise ValueError(
                    f"execute: action {a} in the list of rank {r} does not "
                    f"belong there (stage {a.stage}, microbatch "
                    f"{a.microbatch} of {m}; stages given: "
                    f"{sorted(stages)}).")
            if lane.setdefault(a.stage, r) != r:
                raise ValueError(
                    f"execute: stage {a.stage} has actions in the lists of "
                    f"ranks {lane[a.stage]} and {r}; a stage runs on one "
                    "rank.")
        lists[r] = acts
    unused = sorted(set(stages) - set(lane))
    if unused and not forward_only:
        raise ValueError(
            f"execute: stage function(s) {unused} are given but no action "
            "list runs them; pass the stages of the ranks held here.")
    run = _Builder(stages, transport, p, inputs, loss_fn, times)
    run.lane = lane
    run.splits = {a.stage for acts in lists.values() for a in acts
                  if a.kind == "I"}
    pos = {s: 0 for s in lists}
    while any(pos[s] < len(lists[s]) for s in lists):
        progressed = False
        for s in sorted(lists):
            # Build as many actions of rank s as can be built now.
            while pos[s] < len(lists[s]) and run.ready(lists[s][pos[s]]):
                run.build(lists[s][pos[s]])
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = ", ".join(str(lists[s][pos[s]]) for s in sorted(lists)
                                if pos[s] < len(lists[s]))
            raise ValueError(
                f"execute: the action lists cannot run: {blocked} wait(s) "
                "for data that no earlier action provides. Every RECV needs "
                "its peer's SEND earlier in the peer's list, every F its "
                "RECV_F (stage > 0), every B or I its F and its RECV_B "
                "(stage < last), every W its I.")
    return run.result(lists)


def _name(variable):
    return getattr(variable, "path", None) or getattr(variable, "name", "?")


class _Builder:
    """Builds the ops of actions, one at a time, keeping per-stage state."""

    def __init__(self, stages, transport, num_stages, inputs, loss_fn, times):
        self.stages = stages
        self.transport = transport
        self.p = num_stages
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.times = times
        m = len(inputs)
        self.losses, self.outputs = [None] * m, [None] * m
        self.stage_in, self.stage_out = {}, {}
        self.snapshots = {}
        self.added = {}
        self.received = {}
        self.grad_in = {}
        self.grads = {s: [None] * len(st.variables) for s, st in stages.items()}
        self.last = {}  # per rank (lane): its previous action's op
        self.lane = {}  # model stage -> rank (set by execute)
        self.sends = []
        # Split backwards (I, then W): the forward's ops, then what I saved.
        self.forward_ops, self.saved = {}, {}
        self.splits = set()
        self.split_fallbacks = []
        self.tf_vars = {s: [_replica_variable(v) for v in st.variables]
                        for s, st in stages.items()}

    # -- readiness (graph construction order only) ------------------------

    def ready(self, a):
        s, mb = a.stage, a.microbatch
        if a.kind in ("RECV_F", "RECV_B"):
            return self.transport.can_receive(a)
        if a.kind == "F":
            return s == 0 or (s, "F", mb) in self.received
        if a.kind in ("B", "I"):
            return (s, mb) in self.stage_out and (
                s == self.p - 1 or (s, "B", mb) in self.received)
        if a.kind == "W":
            return (s, mb) in self.saved
        if a.kind == "SEND_F":
            return (s, mb) in self.stage_out
        if a.kind == "SEND_B":
            return (s, mb) in self.grad_in
        raise ValueError(f"execute: unknown action kind in {a}.")

    # -- building ---------------------------------------------------------

    def _chain(self, s):
        r = self.lane[s]
        return [self.last[r]] if r in self.last else []

    def _set_last(self, s, op):
        self.last[self.lane[s]] = op

    def _timestamp(self, deps):
        with tf.control_dependencies(deps):
            return tf.timestamp()

    def build(self, a):
        s, mb = a.stage, a.microbatch
        stage = self.stages[s]
        with on_device(stage.device), tf.name_scope(_scope(a)):
            if a.kind in ("RECV_F", "RECV_B"):
                self._receive(a)
            elif a.kind in ("SEND_F", "SEND_B"):
                tensors = (self.stage_out[(s, mb)] if a.kind == "SEND_F"
                           else self.grad_in[(s, mb)])
                # A send waits only for its own data (not for the rest of
                # the action that made it: a backward's weight gradients
                # must not delay the input gradients the peer waits for);
                # the stage's next action waits for the send.
                sent = self.transport.send(a, tensors)
                if sent:
                    self.sends += sent
                    self._set_last(s, tf.group(*sent, *self._chain(s)))
            elif a.kind == "F":
                self._forward(a)
            elif a.kind == "W":
                self._weights(a)
            else:
                self._backward(a)

    def _receive(self, a):
        s, mb = a.stage, a.microbatch
        key = (s, a.kind[-1], mb)
        if not self.transport.chain_receives:
            # Posted when the rank's chain gets here (its place in
            # `Schedule.posted_actions`), without holding the chain up: a
            # posted receive holds its buffer until the data comes.
            with tf.control_dependencies(self._chain(s)):
                self.received[key] = self.transport.receive(a)
            return
        deps = self._chain(s)
        start = None
        if self.times is not None:
            start = self._timestamp(deps + self.transport.pending(a))
            deps = [start]
        with tf.control_dependencies(deps):
            got = self.transport.receive(a)
        self.received[key] = got
        self._set_last(s, tf.group(*got) if got else tf.no_op())
        if self.times is not None:
            self.times.append((a, start, self._timestamp(got)))

    def _forward(self, a):
        s, mb = a.stage, a.microbatch
        src = self.inputs[mb] if s == 0 else self.received.pop((s, "F", mb))
        deps = self._chain(s) + ([] if s == 0 else list(src))
        start = None
        if self.times is not None:
            start = self._timestamp(deps)
            deps = [start]
        stage = self.stages[s]
        with tf.control_dependencies(deps):
            ins = [tf.identity(t) for t in _as_list(src)]
            graph = tf.compat.v1.get_default_graph()
            with stage.scope(mb):
                if stage.replay is not None:
                    self.snapshots[(s, mb)] = (stage.snapshot()
                                               if stage.snapshot else None)
                first_op = (len(graph.get_operations()) if s in self.splits
                            else None)
                out = stage.fn(ins)
            added = None
            if stage.adds_loss:
                out, added = out
            out = _as_list(out)
            done = list(out)
            if added is not None:
                self.added[(s, mb)] = added
                done.append(added)
            if s == self.p - 1:
                self.outputs[mb] = out
                if self.loss_fn is not None:
                    self.losses[mb] = self.loss_fn(out, mb)
                    done.append(self.losses[mb])
            if s in self.splits:
                self.forward_ops[(s, mb)] = graph.get_operations()[first_op:]
        self.stage_in[(s, mb)] = ins
        self.stage_out[(s, mb)] = out
        self._finish(a, start, done)

    def _backward(self, a):
        s, mb = a.stage, a.microbatch
        if s == self.p - 1:
            if self.losses[mb] is None:
                raise ValueError(
                    f"execute: {a} needs a loss; pass loss_fn, or "
                    "forward_only=True.")
            ys, seed = [self.losses[mb]], None
        else:
            ys = self.stage_out[(s, mb)]
            seed = list(self.received.pop((s, "B", mb)))
        deps = self._chain(s) + (seed or [])
        start = None
        if self.times is not None:
            start = self._timestamp(deps)
            deps = [start]
        ins = [] if s == 0 else self.stage_in[(s, mb)]
        stage = self.stages[s]
        added = self.added.pop((s, mb), None)
        with tf.control_dependencies(deps):
            if stage.replay is not None:
                # Recompute the forward now (its ops wait for `deps`), and
                # differentiate the recomputation.
                ins = self.stage_in[(s, mb)]
                last = s == self.p - 1

                def finish(out):
                    out = _as_list(out)
                    return [self.loss_fn(out, mb)] if last else out

                ys = stage.replay(ins, self.snapshots.pop((s, mb)), finish)
                if stage.adds_loss:  # the recomputation's added loss
                    ys, added = ys
                if s == 0:
                    ins = []
            if added is not None:
                # The stage's own loss term: its gradient (1) joins the
                # one received for its outputs.
                ys = list(ys) + [added]
                if seed is not None:
                    seed = seed + [tf.ones_like(added)]
            meetings = None
            if a.kind == "I":
                ops = self.forward_ops.pop((s, mb), None)
                meetings = (weight_meetings(ops, self.stage_in[(s, mb)],
                                            self.tf_vars[s], ys)
                            if stage.replay is None and ops is not None
                            else None)
            if meetings is None:
                in_grads, var_grads = stage_backward(
                    ys, ins, self.tf_vars[s], seed)
                if a.kind == "I":  # cannot split: W has nothing left to do
                    self.split_fallbacks.append(a)
                    self.saved[(s, mb)] = None
            else:
                in_grads, self.saved[(s, mb)] = input_backward(
                    ys, ins, meetings, seed)
                var_grads = []
        self.grad_in[(s, mb)] = in_grads
        summed = self._accumulate(s, var_grads)
        # The received gradients count as done too: a stage with nothing
        # to train (frozen) uses them for nothing else, and TensorFlow
        # would prune the receive, leaving the sender waiting.
        # A split backward's I also computes what its W will need (the
        # gradients reaching the weights' ops), so that W is only the
        # weight-gradient work.
        reaching = [g for _, _, pairs in (self.saved.get((s, mb)) or [])
                    for _, g in pairs]
        self._finish(a, start, [
            g.values if isinstance(g, tf.IndexedSlices) else g
            for g in list(in_grads) + summed + list(seed or [])
            + reaching])

    def _weights(self, a):
        """`W`: the weights' gradients of a microbatch whose `I` ran."""
        s, mb = a.stage, a.microbatch
        saved = self.saved.pop((s, mb))
        deps = self._chain(s)
        start = None
        if self.times is not None:
            start = self._timestamp(deps)
            deps = [start]
        var_grads = []
        if saved is not None:
            with tf.control_dependencies(deps):
                # On the stage's device: the gradient of a variable read
                # is colocated with the variable's captured handle, which
                # has none (the optimizer needs each gradient's device).
                var_grads = [_on_this_device(g) for g in
                             weight_backward(saved, self.tf_vars[s])]
        self._finish(a, start, [
            g.values if isinstance(g, tf.IndexedSlices) else g
            for g in self._accumulate(s, var_grads)])

    def _accumulate(self, s, var_grads):
        """Adds a microbatch's weight gradients to the stage's sums; returns
        the new sums, which the action's completion waits for: each
        microbatch's gradients are added (and freed) within its action,
        not all kept until the end of the step (m times the weights'
        size, with one inter-op thread)."""
        total, summed = self.grads[s], []
        stage = self.stages[s]
        for i, g in enumerate(var_grads):
            # A lookup of distinct ids (a sparse input's): one device's
            # gradient holds each id of the batch once.
            distinct = (isinstance(g, tf.IndexedSlices)
                        and isinstance(total[i], tf.IndexedSlices)
                        and i not in stage.merge_rows
                        and sparse.from_unique(g.indices))
            total[i] = accumulate(
                total[i], g, merge=i in stage.merge_rows,
                what=f"the gradient of {_name(stage.variables[i])}")
            if distinct:
                total[i] = sparse.summed_by_id(total[i])
            elif (isinstance(g, tf.IndexedSlices) and total[i] is not g
                  and not stage.rows_add_up
                  and sparse.distinct_lookups(g.indices) > 1):
                sparse.warn_split_lookups(
                    stage.variables[i], sparse.distinct_lookups(g.indices),
                    "microbatches")
            if g is not None:
                summed.append(total[i])
        return summed

    def _finish(self, a, start, done):
        s = a.stage
        # The stage's previous action too: an action that computes nothing
        # (a frozen stage's backward) must not cut the chain, or TensorFlow
        # prunes what came before it (receives included).
        done = list(done) + self._chain(s)
        self._set_last(s, tf.group(*done) if done else tf.no_op())
        if self.times is not None:
            self.times.append((a, start, self._timestamp(self._chain(s))))

    def result(self, lists):
        finals = [self.last[r] for r in lists if r in self.last]
        with tf.control_dependencies(self.sends + finals):
            done = tf.no_op(name="pipeline_step_done")
        return StepResult(self.losses, self.outputs, self.grads, done,
                          list(self.split_fallbacks))
