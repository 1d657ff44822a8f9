"""Which weights a stage process holds: its own, and shapes of the others.

With one pipeline stage per process, each process holds and trains only
its stage's weights and optimizer slots. Layer weights built inside the
strategy's scope are created deferred (`keras_smp.runtime.deferred`: a
shape, no storage); `StageResidency.materialize()` gives this stage's
weights their initial values when the partition plan is set, and other
stages' weights and their optimizer slots never get storage here:
Keras traces the whole model with them as uninitialised variables
(`symbolic()`), `set_weights`/`load_weights` skip them (`shaped()`).
While the whole model is needed (`get_weights`, `.keras` saves,
`save_model`), `StageResidency.gathered()` fills them from the stages that
own them over the replica's pipeline group and empties them again
afterwards (`save_weights` writes stage by stage: `pipeline/shards.py`).
"""

import contextlib
import warnings
import weakref

import keras
import tensorflow as tf

from keras_smp.runtime import deferred
from keras_smp.runtime import keras_private
from keras_smp.runtime import placement

# optimizer -> {id(slot variable): model variable it was made for}
_SLOT_REFS = weakref.WeakKeyDictionary()


def track_slots(optimizer):
    """Records which model variable each optimizer slot is made for.

    A `LossScaleOptimizer`'s slots are its inner optimizer's, a
    `MultiOptimizer`'s its sub-optimizers' (also those its selector
    function makes when it is built): all are tracked, under the outer
    optimizer.
    """
    if optimizer is None or optimizer in _SLOT_REFS:
        return
    refs = _SLOT_REFS[optimizer] = {}
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if target is not None:
            _track(target, refs)
            if keras_private.is_multi_optimizer(target):
                for sub in target.optimizers:
                    _track(sub, refs)
                _track_chosen(target, refs)
                _apply_held(target)
    _own_finalize(optimizer)


def _apply_held(optimizer):
    """A `MultiOptimizer` applied to some of the weights it was built for:
    a stage process's own (Keras' `apply` wants every weight). Each
    sub-optimizer applies this stage's weights it owns; one with no
    gradient here (its weights on other stages, or none reaching the
    loss here) counts the step in its `iterations`, as on one device.
    Sub-optimizers whose update depends on all their weights together
    (`global_clipnorm`, `use_ema`, `gradient_accumulation_steps`) are
    refused: their reductions across the stages are not made yet."""
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        if trainable_variables is None or not optimizer.built:
            return original(grads, trainable_variables)
        variables = list(trainable_variables)
        index, key = keras_private.sub_optimizer_indices(optimizer)
        if len(variables) == len(index):
            return original(grads, variables)
        from keras_smp.runtime import patches

        subs = patches.sub_optimizers_with_weights(optimizer)
        pairs = {i: [] for i in subs}
        for grad, variable in zip(grads, variables):
            pairs[index[key(variable)]].append((grad, variable))
        for i, own in pairs.items():  # the same order on every stage
            own = [(g, v) for g, v in own if g is not None]
            if own:
                subs[i].apply([g for g, _ in own], [v for _, v in own])
            else:
                subs[i].iterations.assign_add(1)
        optimizer.iterations.assign_add(1)

    object.__setattr__(optimizer, "apply", apply)


def _track_chosen(optimizer, refs):
    """Tracks the sub-optimizers a `MultiOptimizer` picks as it builds."""
    original = optimizer.build

    def build(var_list):
        with keras_private.choosing_sub_optimizers(
                optimizer, lambda sub: _track(sub, refs)):
            return original(var_list)

    object.__setattr__(optimizer, "build", build)


def _track(optimizer, refs):
    if getattr(optimizer, "_smp_slots_tracked", False):
        return
    object.__setattr__(optimizer, "_smp_slots_tracked", True)
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        if is_local(reference_variable):
            # Another stage's weight: its slot is deferred like it (never
            # materialised here). TensorFlow's optimizer would colocate
            # the slot with the weight's (empty) storage.
            with tf.variable_creator_scope(deferred.creator):
                slot = keras_private.BaseOptimizer.add_variable_from_reference(
                    optimizer, reference_variable, *args, **kwargs)
            slot._smp_local = True
        else:
            slot = original(reference_variable, *args, **kwargs)
        refs[id(slot)] = reference_variable
        return slot

    object.__setattr__(optimizer, "add_variable_from_reference",
                       add_variable_from_reference)


@contextlib.contextmanager
def own_averages(optimizer):
    """`use_ema` on this stage's weights only, for the body.

    Keras updates (and, with `ema_overwrite_frequency` and at the end of
    `fit`, copies back) the moving average of every weight the optimizer
    was built for; another stage's weight and its average hold no storage
    here (`track_slots`), so those pairs are left out. A no-op without EMA
    or other stages' weights.
    """
    saved = []
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        lists = None if target is None else keras_private.ema_lists(target)
        if lists is None:
            continue
        variables, averages = lists
        keep = [i for i, (v, a) in enumerate(zip(variables, averages))
                if not is_local(v) and (a is None or not is_local(a))]
        if len(keep) == len(variables):
            continue
        saved.append((target, variables, averages))
        keras_private.set_ema_lists(target, [variables[i] for i in keep],
                                    [averages[i] for i in keep])
    try:
        yield
    finally:
        for target, variables, averages in saved:
            keras_private.set_ema_lists(target, variables, averages)


def _own_finalize(optimizer):
    """`finalize_variable_values` (Keras' last EMA copy at the end of
    `fit`) on this stage's weights only."""
    original = optimizer.finalize_variable_values

    def finalize_variable_values(var_list):
        # Another stage's weights have nothing to finalize here (a
        # `MultiOptimizer` also looks each up by its storage's id, which
        # gathers replace).
        var_list = [v for v in var_list if not is_local(v)]
        with own_averages(optimizer):
            # A LossScaleOptimizer hands `var_list` to its inner one.
            for target in (optimizer,
                           getattr(optimizer, "inner_optimizer", None)):
                lists = (None if target is None
                         else keras_private.ema_lists(target))
                if lists is not None:
                    own = {id(v) for v in lists[0]}
                    var_list = [v for v in var_list if id(v) in own]
                    break
            return original(var_list)

    object.__setattr__(optimizer, "finalize_variable_values",
                       finalize_variable_values)


def slot_references(optimizer):
    """`{id(optimizer slot): the model variable it was made for}` (slots
    made after `track_slots`; empty for `None`)."""
    return dict(_SLOT_REFS.get(optimizer, {})) if optimizer is not None else {}


def is_local(variable):
    """Whether a Keras variable is another stage's (no storage here)."""
    return deferred.holds_no_copy(variable)


def _drop_assignment(*args, **kwargs):
    """Stands in for `assign` of another stage's variable."""
    return None


def set_local(variable, value):
    """Replaces a Keras variable's storage with a process-local variable."""
    variable._value = None
    variable._smp_local = True
    with placement.local_variables(), tf.init_scope():
        variable._initialize(value)


class StageResidency:
    """The weights one stage process holds, for a `DistributedModel`.

    Args:
        model: the `DistributedModel` (built, one stage per process).
        links: a callable returning the model's `StageLinks`.
        world_size: processes in the job (for the closing barrier).
    """

    def __init__(self, model, links, world_size):
        self.model = model
        self.links = links
        self.world_size = world_size
        self._syncs = 0

    def slots_by_weight(self):
        """`id(weight) -> [optimizer slots made for it]` (also state Keras
        makes per weight without a slot: Adafactor's factors)."""
        optimizer = getattr(self.model, "optimizer", None)
        refs = slot_references(optimizer)
        refs.update(keras_private.per_weight_state(optimizer))
        by_weight = {}
        for v in (optimizer.variables if optimizer else []):
            ref = refs.get(id(v))
            if ref is not None:
                by_weight.setdefault(id(ref), []).append(v)
        return by_weight

    def foreign(self):
        """Weights and optimizer slots this stage process does not use."""
        graph = self.model.staged_graph
        mine = {id(w) for w in self.links().held_weights(graph)}
        home = graph.home_stage()
        slots = self.slots_by_weight()
        out = []
        for w in self.model.weights:
            if id(w) in home and id(w) not in mine:
                out += [w] + slots.get(id(w), [])
        return out

    def release(self):
        """Frees this process's copies of other stages' variables; reading
        one (`numpy()`, a layer's `get_weights()`, NumPy conversion) then
        raises a clear error instead of giving an empty array
        (`runtime.patches`)."""
        for v in self.foreign():
            if v._value is None or v._value.shape.num_elements() != 0:
                set_local(v, tf.zeros([0], v.dtype))
            v._smp_unheld = True

    def materialize(self):
        """Creates this stage's deferred weights; marks the others foreign.

        Called once, when the partition plan is set (the same point of
        the program on every process). Each weight this stage uses gets
        its initial value through the strategy (mirrored; broadcast from
        the first replica of the stage's data-parallel group); a weight
        several stages use (tied) is then copied from its first stage, so
        every copy starts equal. Other stages' weights keep no storage
        here. Weights created outside the strategy's scope already hold
        their values everywhere: a warning names the fix.
        """
        links = self.links()
        graph = self.model.staged_graph
        mine = links.held_weights(graph)
        eager = [w for w in self.model.weights if not is_local(w)
                 and w.value.shape.num_elements() > 0
                 and id(w) not in {id(v) for v in mine}]
        if eager:
            warnings.warn(
                f"{len(eager)} weights of other pipeline stages (e.g. "
                f"'{eager[0].path}') were created outside the scope of the "
                "one-stage-per-process SMPStrategy (or given values before "
                "the model was partitioned), so this process already held "
                "them. Build the model inside "
                "`strategy.scope()` and give it its weights after wrapping "
                "it (`model = DistributedModel(model)`, `model.build("
                "input_shape)`, then `model.load_weights(path)`): each "
                "stage process then only ever holds its own stage's "
                "weights.", stacklevel=4)
        with self.model.distribute_strategy.scope():
            for w in mine:
                if deferred.is_pending(w):
                    deferred.materialize(w)
                elif not isinstance(w.value, tf.distribute.DistributedValues):
                    # Made outside the scope (or read before the plan):
                    # the strategy's copy, with the same values.
                    value = tf.convert_to_tensor(w.value)
                    w._value = None
                    w._initialize(value)
        self._copy_tied(graph, links)
        for v in self.foreign():
            v._smp_local = True
        self.release()

    def _copy_tied(self, graph, links):
        """Copies each tied weight from its first stage's rank to the
        other ranks using it."""
        home = links.home_ranks(graph)
        users = links.weight_ranks(graph)
        mine = {id(w): w for w in links.held_weights(graph)}
        index = 0
        for w in self.model.weights:
            ranks = users.get(id(w), [])
            if len(ranks) < 2:
                continue
            if links.rank in ranks:
                key = links.keys.tied(links.replica, ranks)
                instance = links.INSTANCE_INIT + index
                if home[id(w)] == links.rank:
                    links.send(mine[id(w)].value, key, len(ranks), instance)
                else:
                    mine[id(w)].assign(links.recv(w.shape, w.dtype, key,
                                                  len(ranks), instance))
            index += 1

    @contextlib.contextmanager
    def symbolic(self):
        """Other stages' weights as Keras' uninitialised variables (shapes
        only) for the body: Keras traces the whole model in a scratch
        graph to build metrics, losses and the optimizer; no storage is
        made for them."""
        saved = []
        for v in self.foreign():
            saved.append((v, v._value, v._initializer))
            v._value, v._initializer = None, keras.initializers.Zeros()
        try:
            yield
        finally:
            for v, value, initializer in saved:
                v._value, v._initializer = value, initializer
            self.release()

    @contextlib.contextmanager
    def shaped(self):
        """Assignments to other stages' weights are dropped for the body
        (`set_weights`, `load_weights` assign every weight; this stage
        keeps its own)."""
        foreign = self.foreign()
        for v in foreign:
            object.__setattr__(v, "assign", _drop_assignment)
        try:
            yield
        finally:
            for v in foreign:
                vars(v).pop("assign", None)

    @contextlib.contextmanager
    def gathered(self):
        """The whole trained model in this process, for the `with` body
        (nested uses gather once)."""
        self._gathered = getattr(self, "_gathered", 0) + 1
        try:
            if self._gathered == 1:
                self.sync()
            yield
        finally:
            self._gathered -= 1
            if self._gathered == 0:
                self.release()

    def sync(self):
        """Copies every stage's weights and slots to all stages of a replica.

        A collective: every process of the job must call it.
        """
        links = self.links()
        graph = self.model.staged_graph
        home = graph.home_stage()
        slots = self.slots_by_weight()
        foreign = {id(v) for v in self.foreign()}
        # Keys between INSTANCE_WEIGHTS and BATCHED_BASE: 100 rotating
        # ranges of 190,000 (weights and slots, plus the closing barrier).
        base = links.INSTANCE_WEIGHTS + (self._syncs % 100) * 190_000
        self._syncs += 1
        key, size = links.keys.replica(links.replica), links.num_ranks
        index = 0
        for stage in range(graph.num_stages):
            for w in graph.stage_weights(stage):
                if home[id(w)] != stage:
                    continue
                for v in [w] + slots.get(id(w), []):
                    if links.holds(stage):
                        links.send(v.value, key, size, base + index)
                    elif id(v) in foreign:
                        set_local(v, links.recv(v.shape, v.dtype, key, size,
                                                base + index))
                        v._smp_unheld = False  # readable until release
                    else:  # tied: this stage holds its own trained copy
                        links.recv(v.shape, v.dtype, key, size, base + index)
                    index += 1
        # Every process has its copies before any returns (and may exit).
        links.barrier(self.world_size, base + index)
