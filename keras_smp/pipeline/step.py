"""One pipelined step of a `DistributedModel`, in one process or several.

`run_step(model, data, ...)` splits the batch into microbatches, gives the
pipeline runtime the stages held here and the transport of the setting
(`LocalTransport` for stages on devices of this process,
`CollectiveTransport` for one stage per process), and returns a `StepRun`:
the microbatch losses, the predictions and each variable's gradient summed
over microbatches. `DistributedModel`'s `train_step`, `test_step` and
`predict_step` build on it; nothing here knows the schedule's shape.
A batch that does not divide into the microbatches is split into
unequal microbatches in training (`microbatch.sizes`), each weighted by
its share of the rows (`_microbatch_weights`, `_share_factor`); steps
without a backward pad it instead (`microbatch.pad`) and drop the
padding's outputs.
"""

import collections
import contextlib
import dataclasses
import functools
import warnings

import keras
import tensorflow as tf

from keras_smp import tensor
from keras_smp.pipeline import microbatch
from keras_smp.pipeline import recompute
from keras_smp.pipeline.backward import accumulate
from keras_smp.pipeline.backward import dense
from keras_smp.pipeline.runtime import Stage
from keras_smp.pipeline.runtime import execute
from keras_smp.pipeline.runtime import on_device
from keras_smp.pipeline.transport import CollectiveTransport
from keras_smp.pipeline.transport import Dynamic
from keras_smp.pipeline.transport import LocalTransport
from keras_smp.pipeline.transport import is_dynamic
from keras_smp.runtime import keras_private
from keras_smp.runtime import loss_shares
from keras_smp.runtime import patches
from keras_smp.runtime import split_draws
from keras_smp.runtime import tracing
from keras_smp.runtime import xla
from keras_smp.runtime.loss_shares import reduction_of
from keras_smp.tensor.layers import current_group_of
from keras_smp.tensor.layers import is_tensor_parallel
from keras_smp.tensor.ops import sharable


@dataclasses.dataclass
class StepRun:
    """What one pipelined step computed (in this process).

    Attributes:
        x, y, sample_weight: the unpacked batch.
        y_pred: the model's outputs for the whole batch (on every stage
            process when something uses them), or `None`.
        losses: per microbatch, its weighted loss (not scaled by a loss-
            scale optimizer: what Keras logs), or `None`s (no compiled
            loss to compute; zeros when training a model compiled without
            a loss).
        added: the losses the stages held here added (`add_loss()`,
            activity regularizers), summed over their microbatches as
            Keras logs them, or `None` (none added). With one stage per
            process and no compiled loss, a zero where this stage adds
            none (it orders the step's sends, see `run_step`).
        grads: `{id(variable): gradient summed over microbatches}` for the
            variables trained here (empty when not training).
        variables: those variables, in stage order.
        rows_share: with several replicas and a batch of unknown size,
            this replica's rows over the average replica's (the logged
            loss is divided by it, see `runtime.loss_shares.logged_value`),
            else `None`.
        by_position: with several replicas, the variables whose sparse
            gradients they sum position by position (a position
            embedding's, `runtime.sparse.summed_by_position`).
    """

    x: object
    y: object
    sample_weight: object
    y_pred: object
    losses: list
    grads: dict
    variables: list
    added: object = None
    rows_share: object = None
    by_position: tuple = ()


def run_step(model, data, training, need_loss=True, need_outputs=True,
             times=None):
    """Builds one pipelined step of `model` on `data` (inside a tf.function).

    Args:
        model: a built `DistributedModel`.
        data: a batch as Keras gives it (`x`, `(x, y)`, `(x, y, w)`).
        training: run backward actions and return gradients.
        need_loss: compute the compiled loss (when `y` is given).
        need_outputs: one stage per process: share the last stage's outputs
            with every stage (metrics and predict use them).
        times: optional list for the executed timeline (one process only).

    Returns:
        A `StepRun`.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    # This rank's own batch, which the receives wait for
    # (`CollectiveTransport`'s `after`).
    local = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
    m = model.num_microbatches
    links = model._smp_links() if model._smp_multi_process() else None
    from_first = []
    if links is not None and training:
        _refuse_state_updated_on_several_ranks(model, links)
    if links is not None:
        x, y, sample_weight, from_first = _from_first_rank(
            model, links, x, y, sample_weight)
    flat_x = model._smp_flat_inputs(x)
    # (the tensor whose rows count the batch: a dense one, if any)
    lead = flat_x[microbatch.lead(flat_x)]
    replicas = model.distribute_strategy.num_replicas_in_sync
    compiled = keras_private.compiled_loss(model) is not None
    has_loss = need_loss and y is not None and compiled
    # Without a backward (evaluate, predict) any batch runs: it is padded
    # to a multiple of `m` (the padding's outputs are dropped, the loss is
    # the compiled loss of the whole batch). Not for an evaluation whose
    # layers add losses (the padding's would count).
    pads = not training and not (need_loss and model._smp_adds_losses())
    # Training (and an evaluation whose layers add losses) splits such a
    # batch into unequal microbatches (`microbatch.sizes`, at least one
    # row each), each counting by its share of the batch's rows; a loss
    # with reduction="mean_with_sample_weight" overriding `Loss.__call__`
    # cannot be shared so.
    uneven = not pads and not (
        has_loss and loss_shares.custom_mean_with_sample_weight(model))
    advice = (
        "Use a batch size that is a multiple of microbatches x replicas "
        f"= {m * replicas}, and `drop_remainder=True` when batching a "
        "tf.data dataset (or `steps_per_epoch` that avoids a partial "
        "last batch).")
    checks = ([] if pads else
              microbatch.check_enough(lead, m, advice=(
                  "Use a batch size of at least microbatches x replicas = "
                  f"{m * replicas} samples, and `drop_remainder=True` when "
                  "the last batch of the data is smaller (tf.data), or "
                  "`steps_per_epoch` that leaves it out.")) if uneven
              else microbatch.check_divisible(lead, m, advice=advice + (
                  " (a loss with reduction='mean_with_sample_weight' "
                  "that overrides `Loss.__call__` needs equal "
                  "microbatches)")))
    with tf.control_dependencies(checks):
        true_batch = microbatch.rows(lead)
        padded = [microbatch.pad(t, m) for t in flat_x] if pads else flat_x
        batch = microbatch.batch_rows(padded)
        static = lead.shape[0]
        # Each microbatch's rows, or None: equal microbatches.
        rows = (microbatch.sizes(true_batch if static is None else static, m)
                if uneven and (static is None or static % m) else None)
        # Several replicas and a batch of unknown size (maybe a partial
        # one, split unevenly): each replica's rows count against the
        # global batch (`share_batch`: its average per replica).
        # Its first row in the global batch too (`replica_part`): its
        # random layers draw its rows of the global batch's draws (the
        # strategy's part assumes equal shares: a partial batch of 27 rows
        # is split 14 and 13, and the second replica's Dropout masks were
        # rows 13..25 of one device's).
        context = loss_shares.replica_context(model.distribute_strategy)
        share_batch = true_batch
        replica_part = contextlib.nullcontext()
        if context is not None and static is None and (training
                                                       or need_loss):
            offset, total = (model.distribute_strategy.extended
                             ._smp_share_bounds(true_batch))
            share_batch = (tf.cast(total, loss_shares.share_dtype())
                           / float(replicas))
            replica_part = split_draws.exactly((offset, true_batch))
        xs = [list(mb) for mb in zip(*[
            microbatch.split_rows(t, m, rows) for t in padded])]
        ys = microbatch.split(y, m, sizes=rows) if training else None
        sws = (microbatch.split(sample_weight, m, sizes=rows) if training
               else None)
    if training and not has_loss and not model._smp_added_loss_only():
        raise ValueError(
            "The model is compiled with a loss, which needs targets: pass "
            "`y` to fit (or compile without a loss to train on the losses "
            "its layers add)." if compiled else
            "No loss to compute. Provide `y` and a `loss` argument in "
            "`compile()`, or add losses in layers' `call` (`add_loss()`).")
    loss_fn = (_loss_fn(model, ys, sws, sample_weight, m, training, flat_x,
                        rows, share_batch, context, static is not None)
               if has_loss and training else None)
    if training and loss_fn is None:
        # The loss is what the layers add (compile() without a loss, as
        # Keras allows): the last stage's own part of it is what it adds.
        loss_fn = _no_loss
    graph = model.staged_graph
    p = graph.num_stages  # model stages (p x v with virtual stages)
    schedule = model.schedule
    ranks = [links.rank] if links else list(range(schedule.num_stages))
    held = list(links.held) if links else list(range(p))
    devices = ([None] * p) if links else model._smp_devices()
    stage_vars = {s: [w for w in graph.stage_weights(s) if w.trainable]
                  for s in held}
    checkpointing = model._smp_config().activation_checkpointing
    layer_names = graph.checkpointed_names(checkpointing)
    compiles = xla.wanted(model)
    # In one process, a weight several stages use (tied) lives on one
    # stage's device; the other stages' compiled forwards take its value.
    shared = _weights_of_several_stages(graph, stage_vars) if (
        compiles and links is None) else {}
    unreached, covered = (_reaching_no_loss(model, graph, has_loss)
                          if training else (set(), None))
    if unreached:
        _check_some_weight_trains(model, unreached)
    stages = {}
    # What the layers are told, as Keras' own steps tell them.
    mode = model._smp_step_training(training)

    def by_position(variables):
        return tuple(v for v in variables
                     if id(v) in batch_free) if replicas > 1 else ()

    # Sparse gradients whose ids do not depend on the batch (a position
    # embedding's): the microbatches' rows (and the replicas') are added
    # position by position, as one device's lookup for the whole batch
    # gives them.
    batch_free = (graph.batch_free_sparse(held)
                  if training and (m > 1 or replicas > 1) else set())
    added = []  # the forwards' added losses, as logged
    # Between processes sends block until the peer posts the receive:
    # receives are moved to their posting points.
    lists = schedule.posted_actions if links else schedule.actions
    split = ({a.stage for r in ranks for a in lists(r) if a.kind == "I"}
             if training else set())
    for s in held:
        whole = training and (checkpointing is True
                              or s in (checkpointing or ()))
        fn = graph.stage_fn(s, training=mode, recompute=(
            layer_names if training and not whole else None))
        if unreached:
            fn = _refusing_unforeseen_losses(fn, graph, s, covered)
        if compiles:
            if s == 0:
                fn = _model_inputs_constant(fn)
            fn = xla.compiled(fn, f"stage {s}", graph.stage_layers(s),
                              read_outside=shared.get(s, ()),
                              differentiated=training and not whole)
        elif not whole and s not in split and not unreached and not any(
                recompute.marked(node.operation, layer_names)
                for node in graph.stage_nodes(s)) and not any(
                is_tensor_parallel(layer) for layer in graph.stage_layers(s)):
            # One trace per stage, called per microbatch (not m copies of
            # its ops). Inline where the backward needs the forward's ops
            # (split, recomputed), where the check for unforeseen losses
            # must see which layer added one, and around tensor-parallel
            # collectives (keys fixed when traced).
            if s == 0:
                fn = _model_inputs_constant(fn)
            fn = tracing.once_per_shape(fn, f"stage {s}",
                                        graph.stage_layers(s))
        # Unequal microbatches, or replicas' batches of unknown size whose
        # rows were all-reduced above (a custom "mean_with_sample_weight"
        # loss keeps equal microbatches, `rows` None, but the replicas'
        # rows may still differ).
        batch_rows = (share_batch if rows is not None
                      or share_batch is not true_batch else None)
        stages[s] = Stage(s, _adding_losses(model, graph, s, fn, training,
                                            m, added, batch_rows, mode),
                          stage_vars[s] if training else [],
                          devices[s], adds_loss=True,
                          merge_rows=frozenset(
                              i for i, v in enumerate(stage_vars[s])
                              if id(v) in batch_free and m > 1),
                          rows_add_up=getattr(model, "optimizer", None)
                          is not None
                          and patches.rows_sum_linearly(model.optimizer))
        if whole:
            stages[s].snapshot, stages[s].replay = _replay(
                model, graph, s, m, batch_rows, mode)
    around = _microbatch_draws(graph, m, rows, batch)
    for s in held:
        stages[s].around = around(s)
    # (Models with tensor-parallel layers: their collectives' keys are
    # fixed when traced, so a length unknown there is refused.)
    tp = links is not None and graph.has_tensor_parallel_layers()
    if links is None:
        transport = LocalTransport()
    else:
        specs, sends = {}, {}
        for s in held:
            if s > 0 and not links.holds(s - 1):
                specs[("F", s)] = sends[("B", s)] = functools.partial(
                    boundary_specs, graph.carries[s - 1], tp=tp,
                    dtype_of=graph.dtype_of)
            if s < p - 1 and not links.holds(s + 1):
                specs[("B", s)] = sends[("F", s)] = functools.partial(
                    boundary_specs, graph.carries[s], tp=tp,
                    dtype_of=graph.dtype_of)
        transport = CollectiveTransport(
            links, specs, batch // m if rows is None else
            [rows[i] for i in range(m)], send_specs=sends, after=local)
        if not links.holds(p - 1):
            loss_fn = None  # only the last stage computes the loss
    trackers = []
    if links is not None and has_loss:
        # The compiled loss (last stage only) also updates per-output loss
        # metrics ("cls_loss"): their state before the step, to share the
        # step's change with the other stages (see `_share`).
        trackers = [(v, tf.identity(v.value)) for m in
                    keras_private.loss_output_trackers(model)
                    for v in m.variables]
    with replica_part:
        result = execute({r: lists(r) for r in ranks}, stages,
                         transport, p, xs, loss_fn,
                         forward_only=not training, times=times)
    if from_first:
        # Whatever the step returns waits for `done`: the batch shared by
        # the first rank is then never pruned, even where nothing uses it
        # (a middle stage without metrics), which would leave the
        # broadcast waiting for this rank.
        result = dataclasses.replace(
            result, done=tf.group(result.done, *from_first))
    if result.split_fallbacks:
        warnings.warn(
            f"pipeline={schedule.name!r}: stage(s) "
            f"{sorted({a.stage for a in result.split_fallbacks})} cannot "
            "split their backward into input and weight gradients and run "
            "it whole in I (same results, no speed-up): a weight there "
            "reaches its op through a function (jit_compile=True compiles "
            "each stage as one), a custom gradient (activation "
            "checkpointing of the stage or of a layer in it) or a sparse "
            "read, or a stage output is made of weights alone. Use "
            "jit_compile=False and no activation checkpointing for those "
            "stages, or pipeline='1f1b'.",
            stacklevel=2)
    # A weight used by several stages here (tied) is trained once, with
    # the sum of their gradients.
    variables = list({id(v): v for s in held for v in stage_vars[s]}.values()
                     ) if training else []
    grads = {}
    if training:
        for s in held:
            for v, g in zip(stage_vars[s], result.grads[s]):
                if id(v) in unreached:
                    g = None  # as Keras: no gradient (XLA computes zeros)
                grads[id(v)] = accumulate(grads.get(id(v)), g)
    if links is None:
        with on_device(devices[-1]):
            y_pred = graph.pack_outputs(
                [t[:true_batch] for t in _merged(graph, result)])
            losses = (_logged(loss_fn, result.losses) if training else
                      [_whole_batch_loss(model, y, y_pred, sample_weight,
                                         context, static,
                                         _rows_share(true_batch,
                                                     share_batch))
                       if has_loss else None])
        total = _total(added)
        if pads and need_loss and total is not None:
            # Losses added from helper code (not foreseen): the padding's
            # would count, so such an evaluation needs dividing batches.
            total = _after(microbatch.check_divisible(
                lead, m, advice=(
                    "A layer adds losses from code outside its class's "
                    "methods, so evaluate cannot pad partial batches: use "
                    "a batch size that divides into the microbatches.")),
                total)
        return StepRun(x, y, sample_weight, y_pred, losses, grads, variables,
                       total, _rows_share(true_batch, share_batch),
                       by_position(variables))
    # What the last stage shares has the shape of a batch of m equal
    # microbatches (`transport.rows` each: the first, the largest): a
    # partial batch's is padded, so that its keys fit one shape.
    run = _share(model, links, result, x, y, sample_weight,
                 transport.rows * m, transport.rows, has_loss, need_outputs,
                 training,
                 variables, [grads.get(id(v)) for v in variables],
                 trackers, loss_fn, true_batch, unreached, context, static,
                 _rows_share(true_batch, share_batch), tp)
    run.rows_share = _rows_share(true_batch, share_batch)
    run.by_position = by_position(variables)
    if added and not model._smp_adds_losses():
        raise NotImplementedError(
            "A layer added a loss (add_loss()) from code outside its "
            "class's methods; with one stage per process every stage must "
            "know that losses are added, to sum them in the logged loss. "
            "Call add_loss() in the layer's own call (or a method of its "
            "class).")
    total = _total(added)
    if total is None and model._smp_added_loss_only():
        total = tf.zeros([], keras.config.floatx())  # this stage adds none
    if total is not None:
        # After the whole step: when the loss is only what layers add, an
        # evaluation step shares nothing else, and TensorFlow would prune
        # this rank's sends (the peer would wait forever).
        total = _after([result.done], total)
    run.added = total
    return run


def _microbatch_draws(graph, m, rows, batch):
    """`stage -> Stage.around`: each microbatch's forward draws its rows
    of the batch's random numbers (`runtime.split_draws`; a recomputation
    takes the part from its snapshot) from the seeds the whole batch's
    call uses: the stage's seed generators are given, before each
    microbatch's forward, the states they held before its first, so they
    advance once per step, as on one device. A generator of layers in
    several stages is left to advance per call (which of the stages'
    forwards comes first depends on the schedule).

    `rows`: the microbatches' rows (a list of ints, an int32 tensor) or
    `None` (equal microbatches of a batch of `batch` rows)."""
    states = {s: keras_private.once_per_step_states(graph.stage_layers(s))
              for s in range(graph.num_stages)}
    uses = collections.Counter(id(v) for own in states.values()
                               for v in own)
    before = {}

    def bounds(mb):
        if rows is None:
            size = batch // m
            return mb * size, size
        if isinstance(rows, (list, tuple)):
            return sum(rows[:mb]), rows[mb]
        return tf.reduce_sum(rows[:mb]), rows[mb]

    def around(s):
        own = [v for v in states[s] if uses[id(v)] == 1]

        @contextlib.contextmanager
        def scope(mb):
            if own:
                split_draws.remembered_seeds(own, before, s)
            with split_draws.part(*bounds(mb)):
                yield

        return scope

    return around


def _refuse_state_updated_on_several_ranks(model, links):
    """A clear error for a layer called on several stage processes whose
    calls assign its weights in training (a `BatchNormalization` applied in
    two stages: its moving statistics). On one device the calls update one
    copy in turn; each process would update only its own copy, and the
    processes' copies, and the model's, would differ (measured: moving
    variances 0.057 apart after 2 epochs, predictions 0.08)."""
    graph = model.staged_graph
    ranks = links.weight_ranks(graph)
    names = {id(v): v.path for v in model.weights}
    bad = {}
    for w, layer in graph.updated_weights().items():
        if len(ranks.get(w, ())) > 1:
            bad.setdefault(layer, (ranks[w], []))[1].append(
                names.get(w, "?"))
    if bad:
        layer, (where, weights) = next(iter(bad.items()))
        raise ValueError(
            f"Layer '{layer}' is called on pipeline ranks {where} and its "
            f"calls update its weights {weights} in training; with one "
            "stage per process each rank would update only its own copy "
            "(on one device the calls update one copy in turn). Put its "
            "calls in one stage (`split_points`, or `partition(i)` "
            "scopes), use a layer of its own for each call, or run the "
            "stages in one process (`local_devices`)."
            + (f" So are: {[n for n in sorted(bad) if n != layer]}."
               if len(bad) > 1 else ""))


def _from_first_rank(model, links, x, y, sample_weight):
    """One stage per process: `(x, y, sample_weight, done)`, the targets
    and sample weights of the replica's first stage's rank on every rank
    (with the inputs too, where the last stage computes the outputs' Keras
    masks from them), and the transfers' ops the step must wait for.

    Every rank of a replica reads the data, but the first stage's inputs
    are that rank's: another rank's batch may hold other rows (its own
    shuffle order, a `PyDataset` or generator of its own), whose targets
    would silently train the first rank's inputs' outputs. With tensor
    parallelism the first stage's ranks take their group's rank 0's batch
    (`TensorGroup.from_first`) first. Strings and composite tensors
    (sparse, ragged) stay each rank's own.
    """
    group = current_group_of(model)
    if group is not None and links.rank == links.rank_of(0):
        # Tensor-parallel ranks of the first stage: their group's rank
        # 0's batch (each pipeline's later stages get it from its first).
        x, y, sample_weight = group.from_first((x, y, sample_weight))
    if links.num_ranks == 1:
        return x, y, sample_weight, []
    parts = {"y": y, "sample_weight": sample_weight}
    if any(model.staged_graph.output_masks()):
        parts["x"] = x
    flat = {role: tf.nest.flatten(part) for role, part in parts.items()}
    sent = {role: [t for t in leaves if sharable(t)]
            for role, leaves in flat.items()}
    got, done = links.share_from_first(
        sent, model.num_microbatches,
        lengths=model.staged_graph.has_unknown_lengths())
    for role, leaves in flat.items():
        received = iter(got[role])
        parts[role] = tf.nest.pack_sequence_as(parts[role], [
            next(received) if sharable(t) else t for t in leaves])
    return parts.get("x", x), parts["y"], parts["sample_weight"], done


def _reaching_no_loss(model, graph, has_loss):
    """`(unreached, covered)`: the weights no loss depends on
    (`graph.weights_reaching_no_loss`; usually none) and, when there are
    some, the layers (`id`s) of the nodes seen to add losses: a loss
    added by any other layer is an error (it could reach those
    weights)."""
    def layers_of(op):  # a node's layer and the layers inside it
        return (keras_private.flatten_layers(op)
                if hasattr(op, "_flatten_layers") else [op])

    def adds_loss(op):
        return keras_private.may_add_losses(layers_of(op))

    flat = len(graph.outputs)
    has = (keras_private.outputs_with_loss(model, graph.outputs_struct)
           if has_loss else [False] * flat)
    unreached = graph.weights_reaching_no_loss(has, adds_loss)
    if not unreached:
        return unreached, None
    covered = set()
    for node in graph.nodes:
        op = node.operation
        if adds_loss(op):
            covered.update(id(layer) for layer in layers_of(op))
    return unreached, covered


def _check_some_weight_trains(model, unreached):
    """Raises with Keras' words ("No gradients provided for any variable")
    when the model has trainable weights and none reaches a loss (the
    compiled loss, a loss a layer adds, a weight regularizer): Keras
    raises it in its optimizer, but with one stage per process every
    stage would take a step without gradients and training would
    silently change nothing. The same answer on every stage process
    (each holds the whole graph), so every one raises before a
    collective."""
    trainable = model.trainable_weights
    if not trainable or any(
            id(w) not in unreached
            or getattr(w, "regularizer", None) is not None
            for w in trainable):
        return
    names = ", ".join(sorted({getattr(w, "path", w.name) for w in trainable}))
    if len(names) > 200:
        names = names[:200] + "..."
    raise ValueError(
        "No gradients provided for any variable: no trainable weight of "
        f"the model ({names}) reaches a loss (the compiled loss's "
        "outputs, a loss a layer adds in its class's code, a weight "
        "regularizer), so training would change nothing (plain Keras "
        "raises the same words). Name in `compile(loss=...)` an output "
        "those weights compute, or make trainable the layers the loss "
        "depends on. If a layer adds its loss from a helper function "
        "outside its class's methods (which the pipeline cannot see "
        "before the step), call add_loss() in the layer's own call.")


def _refusing_unforeseen_losses(fn, graph, stage, covered):
    """Stage `stage`'s function, raising if a layer whose node was not
    seen to add losses (from its class's code) adds one: the weights
    found to reach no loss (which get no gradient) were found without
    it. Checked inside an XLA-compiled stage too (before its losses are
    collected)."""
    others = [layer for layer in graph.stage_layers(stage)
              if id(layer) not in covered]

    def run(tensors):
        out = fn(tensors)
        if any(keras_private.added_losses([layer]) for layer in others):
            raise NotImplementedError(
                f"A layer of pipeline stage {stage} added a loss "
                "(add_loss()) from code outside its class's methods, in a "
                "model where some weights reach no loss: the pipeline "
                "decides before the step which weights get gradients. Call "
                "add_loss() in the layer's own call (or a method of its "
                "class).")
        return out

    return run


def _whole_batch_loss(model, y, y_pred, sample_weight, context=None,
                      static=None, rows_share=None):
    """The compiled loss of a forward-only step, on the whole batch (as
    Keras' `test_step` computes it); with several replicas (`context`)
    each mean loss counts by the replica's share of its divisor (see
    `runtime.loss_shares`; `rows_share`: the replica's share of the rows,
    `None` when they are equal)."""
    loss_shares.count_batch_values_per_row(model, y, y_pred)
    divisors = (loss_shares.replica_divisors(model, y, y_pred,
                                             static is not None,
                                             sample_weight is not None)
                if context is not None else None)
    with loss_shares.computing_parts(
            None if context is None else
            f"{context.num_replicas_in_sync} replicas",
            {} if context is None else loss_shares.weighted_or_masked(
                model, y, y_pred, sample_weight)):
        if divisors is None:
            return keras_private.compiled_loss(model)(y, y_pred,
                                                      sample_weight)
        loss, _ = loss_shares.shared_loss(
            model, context, divisors, y, y_pred, sample_weight, None,
            rows_share=1.0 if rows_share is None else rows_share)
    return loss


def _rows_share(rows, share_batch):
    """This replica's rows over the average replica's (what a logged
    loss, weighted by the rows, is divided by), or `None` (equal)."""
    if share_batch is rows:
        return None
    return tf.cast(rows, share_batch.dtype) / share_batch


def _no_loss(out, mb):
    """The last stage's loss when the model's loss is only what its layers
    add (their terms join each stage's backward)."""
    del out, mb
    return tf.zeros([], keras.config.floatx())


def _total(added):
    return tf.add_n(added) if added else None


def _adding_losses(model, graph, stage, fn, training, m, logged=None,
                   batch=None, mode=None):
    """Stage `stage`'s function returning `(outputs, added)`: `added` is
    the sum of the losses its layers add while it runs (`add_loss()`,
    activity regularizers; `None` if none), each as Keras adds it to the
    model's loss (`_aggregate_additional_loss`), weighted 1/m per
    microbatch (exact for batch means: an activity regularizer divides by
    the batch size; a batch sum counts 1/m, as Keras averages added
    losses over data-parallel replicas) and scaled by a loss-scale
    optimizer when training. Each forward's unscaled term is appended to
    `logged`. `batch`: the batch's rows when its microbatches are unequal:
    a microbatch's weight is then its share of them (its rows / `batch`,
    from the stage inputs' rows).

    The layers run in one Keras call context, as in the model's own
    `call`: their losses accumulate over the stage's layers, a layer
    called twice included. `mode`: the `training` the context holds
    (`DistributedModel._smp_step_training`).
    """
    calls = [node.operation for node in graph.stage_nodes(stage)]
    layers = graph.stage_layers(stage)

    def run(tensors):
        with keras_private.call_context(model, mode):
            keras_private.clear_added_losses(calls)
            out = fn(tensors)
            losses = keras_private.added_losses(layers)
        if not losses:
            return out, None
        total = tf.add_n([
            tf.cast(keras_private.aggregate_additional_loss(model, loss),
                    keras.config.floatx()) for loss in losses]) * (1.0 / m)
        if batch is not None:  # (m x its share: 1 for equal microbatches)
            total = total * _share_factor(tf.shape(tensors[0])[0], m, batch)
        if logged is not None:
            logged.append(total)
        if training and model.optimizer is not None:
            total = model.optimizer.scale_loss(total)
        return out, total

    return run


def _model_inputs_constant(fn):
    """Stage 0's function with the model's inputs held constant inside it.

    Nothing differentiates the batch itself, but TensorFlow differentiates
    a call of a compiled (or traced-once) function with respect to every
    input of the call: its backward would compute the first layer's input
    gradient (one matmul per microbatch for a `Dense` layer) and throw it
    away (XLA cannot prune it).
    """

    def run(tensors):
        return fn([tf.stop_gradient(t) for t in tensors])

    return run


def boundary_specs(tensors, rows, split=1, tp=False, dtype_of=None):
    """`(shape, dtype)` of tensors crossing a process boundary (`split`:
    their last axis is split in that many slices).

    A tensor whose symbolic shape leaves a dimension other than the rows
    unknown (a sequence length: `keras.Input((None,))`) gets a `Dynamic`
    shape: it travels with its shape (`StageLinks.send_dynamic`), whatever
    the length of this step's batch, so sender and receiver decide alike
    from the graph they both hold (each rank's batch may differ). `tp`:
    the model has tensor-parallel layers, whose collectives need every
    size known: such a tensor is refused. `dtype_of(t)`: the dtype it
    travels as (default `t.dtype`; `StagedGraph.dtype_of`)."""
    out = []
    for t in tensors:
        dtype = t.dtype if dtype_of is None else dtype_of(t)
        rest = list(t.shape[1:])
        if split > 1 and rest and rest[-1] is not None:
            rest[-1] //= split
        if any(d is None for d in rest):
            if tp:
                raise ValueError(
                    f"Tensor {t.name} of shape {t.shape} crosses a stage "
                    "boundary between processes in a model with "
                    "tensor-parallel layers; there only the batch "
                    "dimension may be unknown. Declare the inputs' length "
                    "(`keras.Input((128,))` for `keras.Input((None,))`) "
                    "and pad the data to it, or run the stages in one "
                    "process (`local_devices`).")
            out.append((Dynamic([None] + rest), dtype))
            continue
        out.append((tf.concat([[rows], tf.constant(rest, tf.int32)], axis=0),
                    dtype))
    return out


def _share(model, links, result, x, y, sample_weight, batch, rows,
           has_loss, need_outputs, training, variables, grads, trackers,
           loss_fn, true_batch, unreached, context=None, static=None,
           rows_share=None, tp=False):
    """One stage per process: the last stage's outputs and loss to all.

    The last stage shares the merged outputs, the loss and the step's
    change of the per-output loss metrics with the other stages, so
    metrics and logs are identical on every rank. Outputs are shared only
    when something uses them (metrics, predict): for a 1024 x 1024 batch
    that is 4 MB per step.
    """
    graph = model.staged_graph
    last = links.rank == links.last_rank
    # A vocabulary-parallel loss keeps the logits split: each stage
    # process shares its tensor-parallel rank's slice.
    group = current_group_of(model) if tensor.logits_kept_split() else None
    # (with their Keras masks, which are not split)
    pred_specs = (boundary_specs(graph.outputs, batch,
                                 split=group.size if group is not None
                                 else 1, tp=tp, dtype_of=graph.dtype_of)
                  + boundary_specs(graph.carries[-1][graph.num_outputs:],
                                   batch, tp=tp)
                  if need_outputs else [])
    tracked = ([v for m in keras_private.loss_output_trackers(model)
                for v in m.variables] if has_loss else [])
    mine, merged = [], None
    if last:
        merged = _merged(graph, result)
        mine = ([_pad_rows(t, batch) for t in merged] if need_outputs
                else [])
        if has_loss:
            loss = (tf.add_n(_logged(loss_fn, result.losses)) if training
                    else _whole_batch_loss(model, y, graph.pack_outputs(
                        [t[:true_batch] for t in merged]), sample_weight,
                        context, static, rows_share))
            mine.append(tf.cast(loss, loss_shares.share_dtype()))
            with tf.control_dependencies([result.done]):
                mine += [v.value - before for v, before in trackers]
    specs = pred_specs + ([((), loss_shares.share_dtype())] if has_loss
                         else [])
    specs += [((), v.dtype) for v in tracked]
    # One instance key per role (outputs, loss, trackers) and batch size.
    shares = links.SHARE_OUTPUTS if group is None else \
        links.SHARE_SPLIT_OUTPUTS  # (another shape: its own keys)
    dynamic = (links.SHARE_DYNAMIC_OUTPUTS if group is None else
               links.SHARE_DYNAMIC_SPLIT_OUTPUTS)
    positions = ([(dynamic if is_dynamic(shape) else shares) + i
                  for i, (shape, _) in enumerate(pred_specs)]
                 + ([links.SHARE_LOSS] if has_loss else [])
                 + [links.SHARE_TRACKED + i for i in range(len(tracked))])
    with tf.control_dependencies([result.done]):
        shared = links.share_from_last(mine, specs, positions, rows)
    if tracked:
        changes, shared = shared[-len(tracked):], shared[:-len(tracked)]
        if not last:
            shared.append(_after(
                [v.assign_add(c) for v, c in zip(tracked, changes)],
                shared.pop()))
    grads = [_after([result.done], g) for g in grads]
    if training:
        grads = _sum_tied(model, links, variables, grads, unreached)
    # TensorFlow prunes collective ops whose results nobody uses (they are
    # not control outputs, see auto_control_deps.ASYNC_STATEFUL_OPS): a
    # receive left unused on one rank leaves its peer's send waiting.
    # Everything the step uses therefore depends on every shared tensor.
    with tf.control_dependencies(shared):
        shared = [tf.identity(t) for t in shared]
    grads = [_after(shared, g) for g in grads]
    # The padding of a partial batch (forward-only steps) is dropped.
    if need_outputs:
        y_pred = graph.pack_outputs(
            [t[:true_batch] for t in shared[:len(pred_specs)]])
    else:  # unused by the step (no metrics)
        y_pred = (graph.pack_outputs([t[:true_batch] for t in merged])
                  if last else None)
    losses = [shared[-1]] if has_loss else [None]
    by_var = {id(v): g for v, g in zip(variables, grads)} if training else {}
    return StepRun(x, y, sample_weight, y_pred, losses, by_var, variables)


def _pad_rows(tensor, rows):
    """`tensor` with zero rows appended up to `rows` rows."""
    extra = rows - tf.shape(tensor)[0]
    return tf.pad(tensor, [[0, extra]] + [[0, 0]] * (tensor.shape.rank - 1))


def _merged(graph, result):
    """The last stage's tensors (the flattened outputs, then their Keras
    masks) of the whole batch, merged from the microbatches."""
    return [microbatch.merge([o[i] for o in result.outputs])
            for i in range(len(graph.carries[-1]))]


def _weights_of_several_stages(graph, stage_vars):
    """`{stage: [weight]}`: the trainable weights of each stage in
    `stage_vars` that another stage of the model also uses."""
    users = {}
    for s in range(graph.num_stages):
        for w in graph.stage_weights(s):
            users.setdefault(id(w), set()).add(s)
    return {s: [w for w in ws if len(users.get(id(w), ())) > 1]
            for s, ws in stage_vars.items()}


# Sums of one tied weight's gradient one traced function may hold (a
# custom loop applying it twice): each takes its own instance keys.
MAX_TIED_SUMS = 16


def _sum_tied(model, links, stage_vars, grads, unreached=(), calls=None):
    """Sums the gradients of weights used by several stage processes (tied).

    Every stage process using a tied weight holds a copy, computes its part
    of the gradient and receives the sum over the processes using it, so
    all copies take the same optimizer step. A weight whose gradient is
    sparse wherever it is read (`StagedGraph.sparse_weights`) gets the
    parts' rows gathered instead, as Keras concatenates them. `calls`:
    `{id(weight): earlier sums of it in this traced function}` (below
    `MAX_TIED_SUMS`; none: 0), for instance keys of its own; the same on
    every process using the weight.
    """
    users = links.weight_ranks(model.staged_graph)
    sparse = model.staged_graph.sparse_weights()
    # Instance keys from each tied weight's place in the model's weight
    # order (`weight_users` is the same dict, in the same order, on every
    # rank), so every stage uses the same key for the same weight.
    position = {w: i for i, w in enumerate(
        w for w, ranks in users.items() if len(ranks) > 1)}

    def call(v):
        return (calls or {}).get(id(v), 0)

    out = list(grads)
    for i, v in enumerate(stage_vars):
        ranks = users.get(id(v), [])
        if len(ranks) < 2 or id(v) in unreached:  # (the same on every rank)
            continue
        key = links.keys.tied(links.replica, ranks)
        if id(v) in sparse:
            # Sparse wherever it is read (an Embedding looked up in two
            # stages): the parts' rows are gathered, as Keras keeps them
            # (an optimizer such as Adam squares repeated rows one by one).
            out[i] = links.gather_rows(
                _as_rows(out[i], v), key, len(ranks),
                position[id(v)] + call(v) * len(position),
                len(position) * MAX_TIED_SUMS)
            continue
        # Every user takes part in the sum, with zeros where its stage's
        # loss does not depend on the weight.
        mine = (tf.zeros(v.shape, v.dtype) if out[i] is None
                else dense(out[i]))
        out[i] = links.reduce(mine, key, len(ranks),
                              links.INSTANCE_TIED + position[id(v)]
                              + call(v) * len(position))
    return out


def _as_rows(grad, variable):
    """`grad` of `variable` as `tf.IndexedSlices`: none for no gradient,
    every row once for a dense one."""
    shape = tf.constant(list(variable.shape), tf.int64)
    if grad is None:
        return tf.IndexedSlices(
            tf.zeros([0] + list(variable.shape[1:]), variable.dtype),
            tf.zeros([0], tf.int64), shape)
    if isinstance(grad, tf.IndexedSlices):
        return grad
    return tf.IndexedSlices(grad, tf.range(variable.shape[0], dtype=tf.int64),
                            shape)


def _after(deps, grad):
    """`grad` (dense or sparse) once `deps` have run."""
    if grad is None:
        return None
    with tf.control_dependencies(deps):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(grad.values),
                                    tf.identity(grad.indices),
                                    grad.dense_shape)
        return tf.identity(grad)


def loss_weight(compiled_losses, m, sample_weight, masked=False):
    """Weight of each microbatch's compiled loss in the step: `1/m`.

    Each output's loss is then scaled through its sample weights
    (`_microbatch_weights`): a `"sum"` loss by `m` (its microbatch sums
    add up), a mean-like one by `m` times the microbatch's share of what
    Keras divides by when the shares are unequal (a partial batch, a
    mask: `masked`). `compiled_losses`: the compiled Keras loss objects.
    A `"mean_with_sample_weight"` loss is divided by the step's weights
    (`loss_shares.divided_by`), except one overriding `Loss.__call__`:
    it divides by each microbatch's own weight sum, refused with sample
    weights or a mask.
    """
    custom = [loss for loss in compiled_losses
              if reduction_of(loss) == "mean_with_sample_weight"
              and not loss_shares.divides_by_weights(loss)]
    if custom and m > 1 and (sample_weight is not None or masked):
        raise ValueError(
            f"The loss {type(custom[0]).__name__} (reduction="
            "'mean_with_sample_weight') overrides `Loss.__call__`, so it "
            "cannot be split into microbatches exactly (each microbatch "
            "would divide by its own weight sum" + (
                ", masked entries left out" if masked else "") + "). "
            "Compute the loss in `call` and let `Loss.__call__` reduce it, "
            "or use reduction='sum_over_batch_size' or microbatches=1.")
    return 1.0 / m


def _share_factor(rows, m, batch):
    """`m x rows / batch`: how much more than `1/m` of the batch a
    microbatch of `rows` holds (exactly 1.0 when they are equal)."""
    share = (tf.cast(rows * m, loss_shares.share_dtype())
             / tf.cast(batch, loss_shares.share_dtype()))
    return tf.cast(share, keras.config.floatx())


def _replay(model, graph, stage, m, batch=None, mode=True):
    """`(snapshot, replay)` of a stage, for activation checkpointing.

    The recomputation sees the stage's non-trainable variables (random
    seeds, moving statistics) as read before the microbatch's forward
    (`keras_smp.pipeline.recompute`). Trainable weights are read as they
    are (the optimizer changes them only after the step). It returns
    `(finished outputs, added loss)` (see `_adding_losses`; the forward
    logged the loss).
    """
    fn = _adding_losses(model, graph, stage,
                        graph.stage_fn(stage, training=mode), True, m,
                        batch=batch, mode=mode)
    layers = [node.operation for node in graph.stage_nodes(stage)]
    state = recompute.state_of(layers)
    weights = [w for layer in layers for w in getattr(layer, "weights", [])]

    def snapshot():
        return recompute.snapshot(state)

    def again(inputs, finish):
        out, added = fn(inputs)
        return finish(out), added

    def replay(inputs, snap, finish):
        return recompute.rerun(
            state, snap, lambda: again(inputs, finish), f"stage {stage}",
            f"turn activation_checkpointing off for stage {stage}",
            collect_losses=True, weights=weights)

    return snapshot, replay


def _loss_fn(model, ys, sws, sample_weight, m, training, flat_x, rows,
             batch, context=None, static=True):
    """The loss of one microbatch (last stage), weighted for the step.

    `rows`: each microbatch's rows when they may be unequal (else None:
    equal microbatches, as a custom "mean_with_sample_weight" loss
    needs), of a batch of `batch` rows (with replicas, the average
    replica's).
    `context`: the replica context when the step has several replicas
    (their masked losses count by their shares).
    `static`: whether the batch's size is known (the same in every
    replica)."""
    graph = model.staged_graph
    loss_shares.count_batch_values_per_row(model, ys[0],
                                           graph.outputs_struct)
    compiled = keras_private.compiled_loss(model)
    entries = keras_private.compiled_loss_entries(model, ys[0],
                                                  graph.outputs_struct)
    masked = m > 1 and any(graph.output_masks())
    weight = loss_weight([loss for _, loss in entries], m, sample_weight,
                         masked)
    checks, step_divisors = [], None
    if m > 1:
        sws, checks, step_divisors = _microbatch_weights(
            model, entries, flat_x, m, ys, sws, rows, batch, context,
            static)
    # One microbatch and several replicas: the replica's shares, from the
    # outputs' masks as the model made them (nothing computed ahead).
    once = m == 1 and context is not None
    parts = " on ".join(
        ([f"{m} microbatches"] if m > 1 else [])
        + ([f"{context.num_replicas_in_sync} replicas"] if context is not None
           else [])) or None

    def loss_fn(out, mb):
        if parts is None:
            return microbatch_loss(out, mb)
        with loss_shares.computing_parts(parts, loss_shares.weighted_or_masked(
                model, ys[mb], graph.pack_outputs(out), sample_weight)):
            return microbatch_loss(out, mb)

    def microbatch_loss(out, mb):
        if isinstance(rows, list):
            # Keras weights its per-output loss metrics by the static
            # rows of the predictions: unknown, as for a partial batch of
            # unknown size, every microbatch counts alike (what the
            # weights above assume).
            out = [tf.raw_ops.PlaceholderWithDefault(
                input=t, shape=[None] + t.shape[1:].as_list())
                if t.shape.rank else t for t in out]
        y_pred = graph.pack_outputs(out)
        divisors = (loss_shares.replica_divisors(model, ys[mb], y_pred,
                                                 static, sws[mb] is not None)
                    if once else None)
        if divisors is not None:
            # The replica's share of the rows (its one microbatch is its
            # batch): a batch of unknown size may be split unevenly.
            share = (1.0 if static else tf.cast(
                microbatch.batch_rows(flat_x), loss_shares.share_dtype())
                / tf.cast(batch, loss_shares.share_dtype()))
            loss, _ = loss_shares.shared_loss(
                model, context, divisors, ys[mb], y_pred, sws[mb], None,
                rows_share=share)
            loss = loss * weight
        else:
            # "mean_with_sample_weight" losses: divided by the step's
            # weights, not the microbatch's.
            this = (compiled if step_divisors is None else
                    keras_private.compiled_loss_replacing(
                        model, loss_shares.divided_by(step_divisors[mb]),
                        loss_shares.divides_by_weights))
            with tf.control_dependencies(checks[mb](y_pred) if checks
                                         else []):
                loss = this(ys[mb], y_pred, sws[mb]) * weight
        if loss_fn.logged[mb] is None:  # not a recomputation's
            loss_fn.logged[mb] = loss
        if training and model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        return loss

    loss_fn.logged = [None] * m
    return loss_fn


def _microbatch_weights(model, entries, flat_x, m, ys, sws, rows, batch,
                        context=None, static=True):
    """`(sample weights, checks, divisors)` per microbatch that make each
    output's microbatch losses, weighted `1/m`, sum to Keras' loss of the
    batch.

    - A `"sum"` loss: its sample weights scaled by `m`.
    - A mean loss divides by the batch's entries, a masked one by its
      unmasked entries (`apply_mask`; also those its targets leave,
      `keras_private.label_mask`, from each microbatch's `ys`, e.g.
      `ignore_class`): by the whole batch's in one step,
      by each microbatch's own here. A microbatch holding the share `c` of
      them (unequal microbatches, `rows` of `batch`; or masks) has the
      output's sample weights scaled by `m * c`. The outputs' masks are
      computed from the inputs for the whole batch first
      (`StagedGraph.output_mask_fn`: 1F1B runs the first microbatch's
      backward before the last one's forward); `checks[i](y_pred)` gives
      the assertions that microbatch `i`'s masks are those.
    - A `"mean_with_sample_weight"` loss divides by its sample weights'
      sum (the mask's product with them; without either, its entries):
      scaling the weights cancels out, so the microbatch's weighted sum
      is divided by `1/m` of the step's (`divisors[i]`, for
      `loss_shares.divided_by`), summed ahead from the given weights and
      the masks computed ahead (without weights or masks: the
      microbatch's entries per row times the step's rows). None when the
      model has no such loss.

    With several replicas (`context`) the shares are of the whole
    step's: a masked output's unmasked entries (and the weights' sums)
    are summed across the replicas (one all-reduce), and `batch` is the
    average replica's rows (a batch of unknown size, `static` False, may
    be split unevenly over the replicas even when its microbatches are
    equal).

    Per-output losses ("cls_loss") then log Keras' values too. The
    weights are laid out as Keras' compiled loss looks them up (by each
    loss's path in the outputs as it was built); a scalar scales any
    loss shape. Without a change (equal microbatches, mean losses, no
    mask) the given weights are kept.
    """
    graph = model.staged_graph
    floatx = keras.config.floatx()
    index = keras_private.compiled_loss_output_index(
        model, graph.outputs_struct, len(graph.outputs))
    divides = {path for path, loss in entries
               if loss_shares.divides_by_weights(loss)}
    # (the masks of the outputs whose loss is a mean or divides by them)
    means = {index[path] for path, loss in entries if reduction_of(loss)
             in ("sum_over_batch_size", "mean") or path in divides}
    masks = (graph.output_mask_fn(model._smp_multi_process(), means)(flat_x)
             if any(graph.output_masks()[k] for k in means)
             else [None] * len(graph.outputs))

    def split(t):
        return microbatch.split_rows(t, m, rows)

    # (each microbatch's targets of the losses that mask targets out)
    targets = ([keras_private.compiled_loss_targets(model, y,
                                                    graph.outputs_struct)
                for y in ys]
               if any(keras_private.masks_by_labels(loss)
                      for _, loss in entries) else None)
    labelled = set()  # the paths whose losses' label masks are planned

    factors = {}  # path -> per microbatch, its factor
    parts = {}  # output index -> its mask's microbatch parts
    totals = {}  # (kind, path) -> summed over microbatches (and replicas)
    for path, loss in entries:
        k = index[path]
        reduction = reduction_of(loss)
        labels = ([keras_private.label_mask(loss, t[path]) for t in targets]
                  if targets is not None
                  and keras_private.masks_by_labels(loss) else None)

        def masked(i):
            return keras_private.merged_masks(
                parts[k][i] if k in parts else None,
                labels[i] if labels else None)

        if reduction == "sum":
            factors[path] = [float(m)] * m
        elif path in divides:
            given = [loss_shares.weights_at(path, sw) for sw in sws]
            if masks[k] is not None:
                parts[k] = split(masks[k])
            if labels:
                labelled.add(path)
            if masks[k] is not None or given[0] is not None or labels:
                totals[("weights", path)] = tf.add_n([tf.reduce_sum(tf.cast(
                    keras_private.merged_loss_weights(loss, w, masked(i)),
                    loss_shares.share_dtype())) for i, w in enumerate(given)])
        elif reduction == "mean_with_sample_weight":
            continue  # (a custom one: equal microbatches, no weights, no
            # mask: checked)
        elif masks[k] is not None or labels:
            if masks[k] is not None:
                parts[k] = split(masks[k])
            counts = [tf.reduce_sum(tf.cast(masked(i),
                                            loss_shares.share_dtype()))
                      for i in range(m)]
            factors[path] = counts
            totals[("mask", path)] = tf.add_n(counts)
        elif rows is not None:
            factors[path] = [_share_factor(rows[i], m, batch)
                             for i in range(m)]
        elif context is not None and not static:
            # Equal microbatches (beside a custom "mean_with_sample_weight"
            # loss) of this replica's rows, which may differ from the
            # others'.
            factors[path] = [_share_factor(
                microbatch.batch_rows(flat_x) // m, m, batch)] * m
    replicas = 1
    if totals and context is not None:
        keys = sorted(totals, key=repr)
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                    tf.stack([totals[key] for key in keys]))
        totals = {key: summed[i] for i, key in enumerate(keys)}
    if context is not None:
        replicas = context.num_replicas_in_sync
    for (kind, path), total in totals.items():
        if kind == "mask":
            # m x each microbatch's share of the step's unmasked entries
            # (with replicas: x replicas, of all replicas' entries).
            scale = float(m * replicas)
            factors[path] = [
                tf.cast(scale * tf.math.divide_no_nan(c, total), floatx)
                for c in factors[path]]
    divisors = None
    if divides:
        # The step's rows (all replicas'): `batch` is the average's.
        step_rows = (tf.cast(batch, loss_shares.share_dtype())
                     * float(replicas))
        divisors = [functools.partial(
            _step_divisor, {path: total for (kind, path), total
                            in totals.items() if kind == "weights"},
            divides, labelled, m, step_rows,
            rows[i] if rows is not None
            else microbatch.batch_rows(flat_x) // m)
            for i in range(m)]
    checks = [_mask_checks(graph, parts, i) for i in range(m)]
    if not factors:
        return sws, (checks if parts else []), divisors
    out = [loss_shares.scaled_sample_weights(
        model, entries, graph.outputs_struct, given,
        {path: f[i] for path, f in factors.items()})
        for i, given in enumerate(sws)]
    return out, checks, divisors


def _step_divisor(weighted, divides, labelled, m, step_rows, mb_rows, path,
                  values, weights, values_masked=False):
    """`1/m` of what a `"mean_with_sample_weight"` loss at `path` divides
    the step's batch by (`loss_shares.divided_by`'s `divisor` for one
    microbatch of `mb_rows` rows): its weights' sum over the step
    (`weighted[path]`, summed ahead) or, without weights or masks, the
    microbatch's entries per row times the step's rows."""
    if path not in divides:
        raise AssertionError(f"no divisor planned for the loss at {path}")
    if ((values_masked and path not in labelled)
            or (path in weighted) != (weights is not None)):
        where = ("output " + "/".join(map(str, path)) if path
                 else "the model's output")
        raise ValueError(
            f"The loss at {where} (reduction="
            "'mean_with_sample_weight') is masked by a Keras mask that was "
            "not computed ahead of the microbatches (one its `call` "
            "attached to the loss values, or one the output got only when "
            "the model ran), so the step's weight sum is unknown before "
            "the first microbatch's backward: use microbatches=1, or "
            "return unmasked values and give sample weights.")
    if weights is not None:
        return weighted[path] / float(m)
    per_row = tf.cast(tf.size(values), step_rows.dtype) / tf.cast(
        tf.maximum(mb_rows, 1), step_rows.dtype)
    return per_row * step_rows / float(m)


def _mask_checks(graph, parts, i):
    """Assertions that microbatch `i`'s outputs hold the masks computed
    ahead (`parts`: output index -> microbatch masks)."""
    def check(y_pred):
        flat = keras.tree.flatten(y_pred)
        return [tf.debugging.Assert(
            tf.reduce_all(tf.equal(
                tf.cast(keras_private.keras_mask(flat[k]), tf.bool),
                tf.cast(p[i], tf.bool))),
            [f"keras-smp: the Keras mask of model output {k} when the "
             "model runs differs from the one computed ahead from the "
             "inputs (a layer's compute_mask depends on more than its "
             "inputs' masks and shapes); use microbatches=1."])
            for k, p in parts.items()]

    return check


def _logged(loss_fn, losses):
    """The microbatch losses Keras logs: before any loss scaling (the
    pipeline differentiates the scaled ones)."""
    logged = getattr(loss_fn, "logged", None)
    if logged is None:
        return losses
    return [l if l is not None else s for l, s in zip(logged, losses)]
