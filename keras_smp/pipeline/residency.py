"""Which weights a stage process holds: its own, and shapes of the others.

With one pipeline stage per process, each process trains only its stage's
weights and optimizer slots. Its copies of other stages' variables are
*emptied* (process-local, zero elements) once the optimizer is built, made
full-size (zeros) while Keras needs shapes (`set_weights`, `load_weights`,
symbolic builds), and filled with the trained values while the whole model
is needed (`get_weights`, saves): `StageResidency.gathered()` collects them
from the stages that own them over the replica's pipeline group.
"""

import contextlib
import weakref

import tensorflow as tf

from keras_smp.runtime import keras_private
from keras_smp.runtime import placement

# optimizer -> {id(slot variable): model variable it was made for}
_SLOT_REFS = weakref.WeakKeyDictionary()


def track_slots(optimizer):
    """Records which model variable each optimizer slot is made for."""
    if optimizer is None or optimizer in _SLOT_REFS:
        return
    refs = _SLOT_REFS[optimizer] = {}
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        if getattr(reference_variable, "_smp_local", False):
            # Another stage's process-local copy: TensorFlow's optimizer
            # would colocate the slot with it, outside the strategy.
            slot = keras_private.BaseOptimizer.add_variable_from_reference(
                optimizer, reference_variable, *args, **kwargs)
        else:
            slot = original(reference_variable, *args, **kwargs)
        refs[id(slot)] = reference_variable
        return slot

    object.__setattr__(optimizer, "add_variable_from_reference",
                       add_variable_from_reference)


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
        """`id(weight) -> [optimizer slots made for it]`."""
        optimizer = getattr(self.model, "optimizer", None)
        refs = _SLOT_REFS.get(optimizer, {}) if optimizer else {}
        by_weight = {}
        for v in (optimizer.variables if optimizer else []):
            ref = refs.get(id(v))
            if ref is not None:
                by_weight.setdefault(id(ref), []).append(v)
        return by_weight

    def foreign(self):
        """Weights and optimizer slots this stage process does not use."""
        graph = self.model.staged_graph
        mine = {id(w) for w in graph.stage_weights(self.links().stage)}
        home = graph.home_stage()
        slots = self.slots_by_weight()
        out = []
        for w in self.model.weights:
            if id(w) in home and id(w) not in mine:
                out += [w] + slots.get(id(w), [])
        return out

    def release(self):
        """Frees this process's copies of other stages' variables."""
        for v in self.foreign():
            if v._value is not None and v._value.shape.num_elements() == 0:
                continue
            set_local(v, tf.zeros([0], v.dtype))

    @contextlib.contextmanager
    def shaped(self):
        """Full-size (zero) local copies of other stages' variables."""
        for v in self.foreign():
            set_local(v, tf.zeros(v.shape, v.dtype))
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def gathered(self):
        """The whole trained model in this process, for the `with` body."""
        self.sync()
        try:
            yield
        finally:
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
        base = links.INSTANCE_WEIGHTS + (self._syncs % 1000) * 10_000
        self._syncs += 1
        key, size = links.keys.replica(links.replica), links.num_stages
        index = 0
        for stage in range(graph.num_stages):
            for w in graph.stage_weights(stage):
                if home[id(w)] != stage:
                    continue
                for v in [w] + slots.get(id(w), []):
                    if links.stage == stage:
                        links.send(v.value, key, size, base + index)
                    elif id(v) in foreign:
                        set_local(v, links.recv(v.shape, v.dtype, key, size,
                                                base + index))
                    else:  # tied: this stage holds its own trained copy
                        links.recv(v.shape, v.dtype, key, size, base + index)
                    index += 1
        # Every process has its copies before any returns (and may exit).
        links.barrier(self.world_size, base + index)
