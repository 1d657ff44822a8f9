"""`DistributedModel`: a Keras model whose steps run a microbatch pipeline.

A thin Keras model: `train_step`, `test_step` and `predict_step` (the
public Keras hooks) hand each batch to `keras_smp.pipeline.step.run_step`,
which splits it into `microbatches`, runs the schedule's per-stage action
lists through the one pipeline runtime (`keras_smp.pipeline.runtime`) with
the transport of the setting, and returns the losses, predictions and
gradients; the optimizer applies them once per step. With one stage per
process, `keras_smp.pipeline.residency` keeps only this stage's weights and
optimizer slots here; `keras_smp.pipeline.shards` saves them stage by stage.
"""

import contextlib
import functools
import inspect
import os
import re
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_smp import runtime
from keras_smp import tensor
from keras_smp.pipeline import microbatch
from keras_smp.pipeline import recompute as recompute_lib
from keras_smp.pipeline import shards
from keras_smp.pipeline.backward import accumulate
from keras_smp.pipeline.backward import dense
from keras_smp.pipeline.backward import variable_gradients
from keras_smp.pipeline.graph import StagedGraph
from keras_smp.pipeline.graph import expand_nested_models
from keras_smp.pipeline.graph import mark_fixed_training
from keras_smp.pipeline.graph import record_partitions
from keras_smp.pipeline.partition import COST_METHODS
from keras_smp.pipeline.profiling import executed_timeline
from keras_smp.pipeline.residency import StageResidency
from keras_smp.pipeline.residency import own_averages
from keras_smp.pipeline.residency import track_slots
from keras_smp.pipeline.runtime import on_device
from keras_smp.pipeline.schedule import get_schedule
from keras_smp.pipeline.step import MAX_TIED_SUMS
from keras_smp.pipeline.step import _refuse_state_updated_on_several_ranks
from keras_smp.pipeline.step import _sum_tied
from keras_smp.pipeline.step import boundary_specs
from keras_smp.pipeline.step import run_step
from keras_smp.pipeline.transport import PipelineKeys
from keras_smp.pipeline.transport import StageLinks
from keras_smp.pipeline.transport import is_dynamic
from keras_smp.runtime import deferred
from keras_smp.runtime import keras_private
from keras_smp.runtime import loss_shares
from keras_smp.runtime import patches
from keras_smp.runtime import placement
from keras_smp.runtime import sparse
from keras_smp.runtime import tf_private
from keras_smp.runtime import xla
from keras_smp.smp import comms
from keras_smp.smp import custom_loop
from keras_smp.tensor.layers import current_group_of
from keras_smp.tensor.layers import tensor_parallel_layers

# {traced graph: {id(weight): the sums of its gradient traced into it so
# far}} (`_smp_sum_tied_parts`: each takes its own collective keys).
_TIED_SUMS = weakref.WeakKeyDictionary()


def _validates(freq, epochs):
    """Whether Keras' `fit` validates after any of `epochs` (0-based) with
    `validation_freq=freq` (as `Trainer._should_eval`: an int or a list;
    anything else is Keras' error to raise)."""
    if isinstance(freq, int):
        return bool(freq) and any((e + 1) % freq == 0 for e in epochs)
    if isinstance(freq, list):
        return any(e + 1 in freq for e in epochs)
    return False


# Names of Keras' own model classes (and a functional model's attributes):
# never looked up on a wrapped model (`DistributedModel.__getattr__`), so
# Keras finds what it probes for on this model only.
_KERAS_MODEL_NAMES = keras_private.model_class_names() | {
    "inputs", "outputs", "input_names", "output_names", "inner_model"}


def _own_class_names(cls):
    """Public names the classes of `cls`'s hierarchy that are not Keras',
    keras-smp's or TensorFlow's own define (a user's or a library's
    model class: methods, properties, class attributes)."""
    names = set()
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if klass is object or module.split(".")[0] in (
                "keras", "keras_smp", "tensorflow", "builtins"):
            continue
        names.update(n for n in vars(klass) if not n.startswith("_"))
    return names - _KERAS_MODEL_NAMES


@keras.saving.register_keras_serializable(package="keras_smp")
class DistributedModel(keras.Model):
    """A Keras model trained, evaluated and run as a microbatch pipeline.

    Four ways to make one:

    - subclass it and write `call`, placing layers with
      `with keras_smp.partition(i):` scopes (used when the config sets
      `auto_partition=False`; otherwise the traced `call` is partitioned
      automatically, as in SageMaker's library);
    - `DistributedModel(inputs, outputs)`, like a functional `keras.Model`;
    - `DistributedModel(model)`, wrapping a Sequential or functional model
      (its layers and weights are shared, not copied; a Sequential model
      without an `Input` is built when this model is, from the data; a
      compiled model's compile is taken over (the wrapped model is left
      uncompiled), so `DistributedModel(keras.models.load_model(path))`
      in the scope trains on with the loaded optimizer state, which
      `iterations` and a save show at once; `compile` replaces it);
    - `DistributedModel(model)`, wrapping a subclassed `keras.Model` (built
      or not): its `call` is traced into layers when the model is built
      (the first `fit` or `evaluate`, or `build(input_shape)`), then
      partitioned automatically. Each layer gets the step's `training`
      when it runs, or the constant `call` gives it (as in Keras); a
      `call` branching on `training` in Python is refused.

    The number of stages (`partitions`), `microbatches` and `pipeline`
    schedule come from the `SMPStrategy` in whose scope the model is built
    (or from `SMP_CONFIG` without a strategy). Automatic partitioning cuts
    the layers, in topological order, into contiguous stages balancing
    `partition_cost`; `model.partition_summary()` shows the plan.

    The pipeline runs its own `train_step` and `test_step`, computing the
    compiled loss per microbatch on the last stage: a wrapped model that
    overrides a step hook (`train_step`, `compute_loss`, ...), or a
    subclass overriding `compute_loss`, is refused with a `ValueError`
    rather than trained without it.

    Args:
        partition_cost: "parameters" (default with `optimize="memory"`),
            "flops" (default with `optimize="speed"`) or "uniform".
        split_points: names of the layers that start stages 1, 2, ...
            (overrides the automatic balance).
        *args: as for `keras.Model` (a model to wrap, or inputs, outputs).
        **kwargs: as for `keras.Model`.

    Example:

    ```python
    import keras, numpy as np, keras_smp

    strategy = keras_smp.SMPStrategy(partitions=2, microbatches=4)
    with strategy.scope():
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1)]))
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=8, verbose=0)
    print(model.partition_summary())
    ```
    """

    def __init__(self, *args, partition_cost=None, split_points=None,
                 **kwargs):
        # Without an SMPStrategy or `smp.init` (the config from
        # `SMP_CONFIG`, or the defaults), keras-smp's hooks still build the
        # model from the data at its first `fit`/`evaluate`/`predict`.
        patches.install()
        inner = None
        if (len(args) == 1 and isinstance(args[0], keras.Model)
                and set(kwargs) <= {"name"}):
            inner, args = args[0], ()
        elif len(args) == 1 and not keras_private.functional_init_arguments(args, kwargs):
            raise TypeError(
                "DistributedModel(model) expects a keras.Model (Sequential, "
                "functional or subclassed) to pipeline; received "
                f"{type(args[0]).__name__} {args[0]!r:.80}. Or subclass "
                "DistributedModel and write `call`, or pass "
                "DistributedModel(inputs=..., outputs=...).")
        elif keras_private.functional_init_arguments(args, kwargs):
            inputs = kwargs.pop("inputs") if "inputs" in kwargs else args[0]
            outputs = (kwargs.pop("outputs") if "outputs" in kwargs
                       else args[1])
            name = kwargs.pop("name", None)
            inner = keras.Model(inputs, outputs)
            args = ()
            if name is not None:
                kwargs["name"] = name
        super().__init__(*args, **kwargs)
        if partition_cost is not None and partition_cost not in COST_METHODS:
            raise ValueError(
                f"partition_cost={partition_cost!r} is not supported; use "
                f"one of {COST_METHODS}.")
        self._smp_cost = partition_cost
        self._smp_split_points = (
            None if split_points is None else list(split_points))
        self._smp_graph = None
        self._smp_functional = None
        if isinstance(inner, DistributedModel):
            raise TypeError(
                f"DistributedModel({inner.name}) wraps a model that is "
                "already a DistributedModel: use it as it is.")
        if inner is not None:
            _check_no_custom_steps(type(inner), keras.Model, wrapped=True)
            self.inner_model = inner
            # A subclassed model's `call` is traced into layers, and a
            # Sequential model without an `Input` is built, when this model
            # is built (the first step, or `build(input_shape)`).
            if not keras_private.is_subclassed_model(inner) and getattr(
                    inner, "built", False):
                self._smp_wrap_functional()
            compiled = keras_private.compile_arguments(inner)
            if compiled is not None:
                # Wrapping keeps the compile (`keras.models.load_model`'s,
                # with the optimizer state it loaded); `compile` again
                # replaces it. (DistributedModel's: a subclass may
                # override `compile`.)
                DistributedModel.compile(self, **compiled)
                keras_private.hand_over_compile(inner)
                self._smp_build_loaded_optimizer()

    def _smp_build_loaded_optimizer(self):
        """Builds the optimizer of a wrapped model that
        `keras.models.load_model` loaded in the scope (its saved state
        waits for a build on partitioned weights: `patches._patch_loading`)
        as soon as the weights are partitioned, so that `iterations`,
        the slots and a save before the first `fit` hold the loaded state
        (they read 0, and a save wrote none). With one stage per process,
        other stages' weights get deferred slots, as `fit` builds it."""
        optimizer = getattr(self, "optimizer", None)
        if (optimizer is None or optimizer.built or self._smp_graph is None
                or "_smp_saved_state" not in vars(optimizer)):
            return
        self._smp_residency()  # (other stages' weights: deferred slots)
        optimizer.build(self.trainable_variables)

    def _smp_wrap_functional(self):
        """Partitions the wrapped Sequential or functional model's graph."""
        functional = keras_private.functional_of(self.inner_model)
        if functional is None:  # pragma: no cover - built, Keras' classes
            raise ValueError(
                f"DistributedModel({type(self.inner_model).__name__}) "
                "found no layer graph in the model it wraps.")
        # Untracked: a Sequential's graph is a second model of the same
        # layers, which `layers` and `summary()` listed beside it.
        object.__setattr__(self, "_smp_functional", functional)
        # Keras maps dict losses and metrics to outputs by these names.
        if getattr(functional, "output_names", None) is not None:
            self.output_names = list(functional.output_names)
        inputs, outputs = keras_private.functional_structs(functional)
        self._smp_set_graph(self._smp_plan(inputs, outputs, {}))
        self.built = True

    def __getattr__(self, name):
        """What the wrapped model's own classes add (`DistributedModel(model)`):
        the methods, properties and class attributes that a user's or a
        library's `keras.Model` subclass defines (a KerasHub task's
        `generate`), and the layers the wrapped model holds as attributes
        (`backbone`, `preprocessor`), looked up on the wrapped model when
        this model has no such attribute. Keras' own attributes (those of
        its model classes, and what Keras sets on a model: `optimizer`,
        `history`, a functional model's `inputs` and `outputs`, ...) never
        are; other attributes of the wrapped model are read on
        `model.inner_model` (the error names it).

        With one stage per process, a method found there runs the whole
        model in this process: called once the model is partitioned (other
        stages' weights have no copy here), it raises an error naming
        `sync_weights()` (as `model(x)` does) instead of failing inside a
        layer. (Layers and `tf.function`s reached so are not checked.)

        Example:

        ```python
        import keras, numpy as np, keras_smp

        class Scorer(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(1)

            def call(self, x):
                return self.dense(x)

            def score(self, x):
                return float(keras.ops.sum(self(x)))

        plain = Scorer()
        model = keras_smp.DistributedModel(plain)
        x = np.ones((2, 3), "float32")
        assert model.score(x) == plain.score(x)
        assert model.dense is plain.dense

        # Keras' own attributes of the wrapped model: an error naming it
        graph = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        try:
            keras_smp.DistributedModel(graph).inputs
        except AttributeError as e:
            assert "read `model.inner_model.inputs`" in str(e)
        else:
            raise AssertionError("no AttributeError")
        ```
        """
        if hasattr(type(self), name):
            # A property of this model raised AttributeError: its own
            # error, not a lookup elsewhere.
            return object.__getattribute__(self, name)
        missing = f"{type(self).__name__!r} object has no attribute {name!r}"
        inner = self.__dict__.get("inner_model")
        if inner is None or name.startswith("_"):
            raise AttributeError(missing)
        if name in _KERAS_MODEL_NAMES:
            # Keras' own (`inputs`, `outputs`, `output_shape` of a
            # functional model): not this model's, but named.
            try:  # (found without running a property)
                inspect.getattr_static(inner, name)
            except AttributeError:
                raise AttributeError(missing) from None
            raise AttributeError(
                f"{missing}; the model it wraps has one: read "
                f"`model.inner_model.{name}`")
        own = name in _own_class_names(type(inner))
        held = isinstance(vars(inner).get(name), keras.layers.Layer)
        if not (own or held):
            if hasattr(inner, name):
                raise AttributeError(
                    f"{missing}; the model it wraps has one: read "
                    f"`model.inner_model.{name}`")
            raise AttributeError(
                f"{missing} (nor has the model it wraps, a "
                f"{type(inner).__name__})")
        value = getattr(inner, name)
        if not inspect.ismethod(value):
            return value

        def method(*args, **kwargs):
            self._smp_check_direct_call(what=f"`model.{name}()`")
            return value(*args, **kwargs)

        return functools.wraps(value)(method)

    def get_layer(self, name=None, index=None):
        """Keras' `get_layer`, also finding the wrapped model's layers.

        `DistributedModel(model)` and `DistributedModel(inputs, outputs)`
        hold the model they wrap as their one layer (`model.layers`, as a
        Keras model holding another); a `name` not found there is looked
        up among the wrapped model's layers, so `get_layer("dense")` finds
        what it found on the model before wrapping.

        Example:

        ```python
        import keras, keras_smp

        plain = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(2, name="head")])
        model = keras_smp.DistributedModel(plain)
        assert model.get_layer("head") is plain.get_layer("head")
        ```
        """
        inner = getattr(self, "inner_model", None)
        if (inner is not None and name is not None and index is None
                and all(layer.name != name for layer in self.layers)):
            return inner.get_layer(name)
        return super().get_layer(name, index)

    def get_config(self):
        if getattr(self, "inner_model", None) is None:
            return super().get_config()
        inner = keras.saving.serialize_keras_object(self.inner_model)
        if keras_private.is_subclassed_model(self.inner_model):
            # Loaded unbuilt: this model traces it (Keras would build it
            # whole, with float inputs, in every process).
            inner = {k: v for k, v in inner.items() if k != "build_config"}
        return {
            "name": self.name,
            "model": inner,
            "partition_cost": self._smp_cost,
            "split_points": self._smp_split_points,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        if "model" not in config:
            return super().from_config(config, custom_objects=custom_objects)
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects)
        return cls(inner, **config)

    #: Recognised by keras-smp's Keras patches (no import needed).
    _smp_pipelined = True

    # -- configuration ----------------------------------------------------

    def _smp_runtime(self):
        """The strategy's keras-smp `Runtime`, or `None` without one."""
        return runtime.of(self.distribute_strategy)

    def _smp_config(self):
        rt = self._smp_runtime()
        return (rt or runtime.current()).config

    @property
    def num_stages(self):
        """Pipeline stages (the config's `partitions`): ranks (processes
        or devices) of a pipeline."""
        return self._smp_config().partitions

    @property
    def num_model_stages(self):
        """Pieces the model is cut into: `partitions * virtual_stages`
        (the config's); `num_stages` without virtual stages."""
        return self._smp_config().num_model_stages

    @property
    def num_microbatches(self):
        """Microbatches per step (the config's `microbatches`)."""
        return self._smp_config().microbatches

    @property
    def schedule(self):
        """The pure-Python `Schedule` the steps run (the config's
        `pipeline`, `partitions`, `microbatches`, `virtual_stages`)."""
        config = self._smp_config()
        return get_schedule(config.pipeline, config.partitions,
                            config.microbatches, config.virtual_stages)

    @property
    def staged_graph(self):
        """The `StagedGraph` (layers per stage); built on first use."""
        if self._smp_graph is None:
            raise ValueError(
                f"{self.name} has not been built yet: call it on data, call "
                "`model.build(input_shape)`, or start training.")
        return self._smp_graph

    def partition_summary(self):
        """Returns the partition plan: stage, parameters, layers (and the
        rank running each stage, with virtual stages). With tensor
        parallelism, the layers split across the tensor-parallel ranks and
        how (the others run whole on every rank); parameters are then this
        rank's."""
        schedule = self.schedule
        text = self.staged_graph.summary(
            schedule.rank_of if schedule.virtual_stages > 1 else None)
        group = current_group_of(self)
        split = tensor_parallel_layers(self)
        if group is not None and split:
            text += (f"\nTensor parallel (tp={group.size}; params above are "
                     f"tp rank {group.rank}'s): "
                     + ", ".join(f"{k} [{v}]" for k, v in split.items())
                     + "; every other layer whole on each tp rank")
        return text

    # -- building ---------------------------------------------------------

    def _smp_plan(self, inputs, outputs, recorded):
        config = self._smp_config()
        p = config.num_model_stages
        manual = any(v is not None for v in recorded.values())
        bad = sorted({v for v in recorded.values() if v is not None and v >= p})
        stages = (f"partitions={config.partitions} x virtual_stages="
                  f"{config.virtual_stages} = {p}"
                  if config.virtual_stages > 1 else f"partitions={p}")
        if bad:
            raise ValueError(
                f"keras_smp.partition({bad[0]}) is used in `call`, but there "
                f"are only {stages} stages (indices 0 to {p - 1}). Use "
                "a smaller index or raise `partitions`.")
        if manual and not config.auto_partition:
            return StagedGraph.manual(
                inputs, outputs, recorded, p, config.default_partition)
        if manual and p > 1:
            warnings.warn(
                "keras_smp.partition() scopes are ignored because "
                "auto_partition=True; set auto_partition=False in the "
                "config (SMPStrategy or smp.init) to place layers "
                "manually.", stacklevel=3)
        cost = self._smp_cost or (
            "flops" if config.optimize == "speed" else "parameters")
        # Nested models' layers are placed one by one, except a model
        # recomputed as one unit or named as a split point.
        whole = {re.sub(r"#\d+$", "", str(name))
                 for name in self._smp_split_points or ()}
        if isinstance(config.activation_checkpointing, tuple):
            whole |= {c for c in config.activation_checkpointing
                      if isinstance(c, str)}
        outputs, expanded = expand_nested_models(
            inputs, outputs,
            keep=lambda layer: recompute_lib.marked(layer, whole))
        graph = StagedGraph.auto(
            inputs, outputs, p, cost=cost,
            split_points=self._smp_split_points,
            stages_name=stages if config.virtual_stages > 1 else None)
        graph.expanded_models = expanded
        return graph

    def _smp_set_graph(self, graph):
        if self._smp_multi_process():
            # String model inputs cannot cross to another stage's process
            # (TensorFlow's collectives carry numbers: it failed inside the
            # first step). Only inputs: Keras gives some layers' string
            # outputs another dtype (`StringLookup(invert=True)`: int64).
            # (Checked before the graph is set: a retried build checks
            # again.)
            rank_of = self.schedule.rank_of
            inputs = {id(t) for t in graph.inputs}
            graph.refuse_carried(
                lambda t: "string" if id(t) in inputs and str(getattr(
                    t, "dtype", "")) in ("string", "str") else None,
                [s for s in range(graph.num_stages - 1)
                 if rank_of(s) != rank_of(s + 1)],
                "stage processes exchange numeric tensors only",
                "turn it into numbers (a `StringLookup` layer on it)")
        self._smp_graph = graph
        # Its one-off trace of the stages (which tensors hold masks) reads
        # other stages' weights: as shapes only, with one stage per process.
        graph.trace_scope = self._smp_symbolic
        self._smp_place_variables()
        if self._smp_multi_process():
            self._smp_allocate_keys()
            # This stage's weights get storage; other stages' never do.
            self._smp_residency().materialize()

    def _smp_allocate_keys(self):
        """Collective keys of the model's pipeline groups.

        Allocated once, when the partition plan is set (model construction
        or first build), the same point of the program on every rank, so
        every rank gets the same keys.
        """
        rt = self._smp_runtime()
        topo = rt.topology
        rank_of = self.schedule.rank_of
        tied = [tuple(sorted({rank_of(s) for s in u}))
                for u in self._smp_graph.weight_users().values()]
        # Each tensor-parallel rank index runs its own pipeline (its
        # stages' shards): a pipeline per (replica, tp rank).
        self._smp_keys = PipelineKeys(
            topo.dp_size * topo.tp_size, self._smp_graph.num_stages,
            [t for t in tied if len(t) > 1], allocator=rt.keys)

    def _smp_place_variables(self):
        """Puts every weight on the device of the first stage using it.

        Weights built in the scope are still deferred (shapes): each is
        created there, with its initial value; weights made elsewhere are
        moved there."""
        rt = self._smp_runtime()
        layout = rt.layout if rt is not None else None
        if (layout is None or layout.mode != "in_process"
                or layout.num_stages != self.num_stages):
            if layout is not None and layout.mode == "in_process":
                with self.distribute_strategy.scope():
                    for w in self.weights:
                        deferred.materialize(w)
            return
        rows = [layout.stage_devices(r)
                for r in range(layout.num_local_replicas)]
        home = self._smp_graph.home_stage()
        rank_of = self.schedule.rank_of
        with self.distribute_strategy.scope():
            for stage in range(self._smp_graph.num_stages):
                rank = rank_of(stage)  # with virtual stages, its rank's
                want = [tf_private.canonical_device(row[rank]) for row in rows]
                for w in self._smp_graph.stage_weights(stage):
                    if home[id(w)] != stage:
                        continue
                    if deferred.is_pending(w):
                        with placement.placing(rank):
                            deferred.materialize(w)
                        continue
                    value = w.value
                    parts = getattr(value, "values", (value,))
                    have = [tf_private.canonical_device(v.device)
                            for v in parts]
                    # A weight of the scope given its values in this
                    # process before the plan (read or assigned while
                    # deferred: `set_weights`, `load_weights` before
                    # wrapping) is a process-local variable, even where
                    # it belongs: made again under the strategy. (One made
                    # outside the scope is refused before the first step.)
                    local = (not hasattr(value, "values") and self.
                             distribute_strategy.extended.
                             variable_created_in_scope(value))
                    if have == want and not local:
                        continue
                    current = w.numpy()
                    w._value = None
                    with placement.placing(rank):
                        w._initialize(current)
            for w in self.weights:  # used by no stage
                deferred.materialize(w)

    def build(self, input_shape=None):
        if self._smp_graph is not None:
            self.built = True
            return
        if (type(self).call is DistributedModel.call
                and getattr(self, "inner_model", None) is None):
            raise ValueError(
                "DistributedModel needs a `call` (subclass it), or "
                "`inputs`/`outputs`, or a model to wrap.")

        def symbolic(shape):
            return keras.Input(batch_shape=(None,) + tuple(shape)[1:])

        if isinstance(input_shape, (list, tuple)) and input_shape and all(
                isinstance(d, int) or d is None for d in input_shape):
            inputs = symbolic(input_shape)
        else:
            inputs = keras.tree.map_shape_structure(symbolic, input_shape)
        # The data's dtypes, when a step builds the model (int token ids,
        # strings); float32 otherwise, as Keras' own build.
        dtypes = getattr(self, "_smp_input_dtypes", None)
        flat = keras.tree.flatten(inputs)
        if dtypes is not None and len(dtypes) == len(flat):
            inputs = keras.tree.pack_sequence_as(inputs, [
                keras.Input(batch_shape=t.shape, dtype=d)
                for t, d in zip(flat, dtypes)])
        self._smp_trace(inputs)

    def get_build_config(self):
        # Keras keeps the input shapes; the data's dtypes (int token ids,
        # strings) are kept too, so a loaded model is traced as it was.
        config = super().get_build_config()
        dtypes = getattr(self, "_smp_input_dtypes", None)
        if config is not None and dtypes is not None:
            config = dict(config, input_dtypes=list(dtypes))
        return config

    def build_from_config(self, config):
        if "input_dtypes" in config:
            self._smp_input_dtypes = list(config["input_dtypes"])
            config = {k: v for k, v in config.items() if k != "input_dtypes"}
        return super().build_from_config(config)

    def _smp_trace(self, inputs):
        # Keras may build the model inside `compute_output_spec` (a scratch
        # graph with stateless/symbolic scopes); the weights must be real,
        # so trace in the outer (eager) context with those scopes lifted.
        rt = self._smp_runtime()
        with keras_private.outside_symbolic_scopes(), tf.init_scope(), (
                self.distribute_strategy.scope() if rt
                else contextlib.nullcontext()), (
                record_partitions()) as recorded:
            inner = getattr(self, "inner_model", None)
            if inner is not None and not keras_private.is_subclassed_model(
                    inner):
                # A wrapped Sequential model without an `Input`: built
                # here, from the data's shapes, then partitioned.
                inner.build(keras.tree.map_structure(
                    lambda t: tuple(t.shape), inputs))
                self._smp_wrap_functional()
                return
            # A subclass's call, or a wrapped subclassed model's, layer by
            # layer.
            owner = self if inner is None else inner
            shapes = keras.tree.map_structure(lambda t: tuple(t.shape),
                                              inputs)
            if inner is not None and not inner.built and (
                    keras_private.overrides_build(inner)):
                inner.build(shapes)  # its own build() makes its layers
            outputs = _traced_call(owner, inputs)
            _mark_fixed_training(owner, inputs, outputs)
            _check_own_weights(owner)
            if inner is not None:
                # Built, for the shapes it was traced with (kept in its
                # `.keras` files' build config, as Keras' build does).
                keras_private.record_build_shapes(inner, shapes)
                inner.built = True
            self._smp_set_graph(self._smp_plan(inputs, outputs, recorded))
        self.built = True

    def __call__(self, *args, **kwargs):
        if not custom_loop.in_step():
            self._smp_check_direct_call(inputs=(args, kwargs))
            return super().__call__(*args, **kwargs)
        first = list(inspect.signature(self.call).parameters)[:1]
        if not args and first and first[0] in kwargs:
            # The inputs by keyword: `model(inputs=x)`.
            kwargs = dict(kwargs)
            args = (kwargs.pop(first[0]),)
        extra = [f"positional argument {i + 2} ({a!r})"
                 for i, a in enumerate(args[1:])] + sorted(
                     k for k in kwargs if k != "training")
        if extra:
            # The stages are traced once, from `call(inputs, training)`:
            # other arguments would keep their first values (or be lost).
            raise TypeError(
                f"Inside @smp.step a DistributedModel is called as "
                f"model(inputs, training=...); received also "
                f"{', '.join(map(str, extra))}. Pass `training` by "
                "keyword; give other values as part of `inputs` (a "
                "tuple or dict of tensors) or set them on a layer "
                "before the step.")
        if args and self._smp_multi_process():
            # One stage per process: built from the data first (shapes
            # only), never run whole here.
            self._smp_build_from_data((args[0],))
            custom_loop.seeds_as_in_first_microbatch(
                self, self.staged_graph.stage_layers(self._smp_links().rank))
            result = self._smp_call_across(args[0], kwargs.get("training"))
        elif self._smp_graph is not None and args:
            custom_loop.seeds_as_in_first_microbatch(self, [self])
            result = self._smp_call_staged(args[0], kwargs.get("training"))
        else:
            custom_loop.seeds_as_in_first_microbatch(self, [self])
            result = super().__call__(*args, **kwargs)
        if self._smp_graph is not None and args:
            # Its position embeddings' gradients add up by position.
            free = self._smp_graph.batch_free_sparse()
            custom_loop.note_step_variables(
                [v for v in self.trainable_weights if id(v) in free])
        if not getattr(self, "_smp_step_ready", False):
            self._smp_step_ready = True
            custom_loop.after_first_call(self)
        return result

    def _smp_check_direct_call(self, what="`model(x)`", inputs=()):
        """Raises a clear error for a direct call (`model(x)`, or a method
        of the wrapped model: `what`) in a stage process that holds no
        copy of other stages' weights (one stage per process, once the
        model is partitioned): the whole model would run with empty
        weights (TensorFlow failed inside a layer: "In[1] ndims must be
        >= 2"). Symbolic calls (`model(keras.Input(...))`, nesting it in
        another model) read shapes only and pass."""
        residency = self._smp_residency()
        if residency is None or keras_private.in_stateless_scope() or any(
                isinstance(t, keras.KerasTensor)
                for t in keras.tree.flatten(inputs)):
            return
        unheld = [v for v in residency.foreign()
                  if getattr(v, "_smp_unheld", False)]
        if not unheld:
            return
        rank = self._smp_runtime().topology.pp_rank
        raise ValueError(
            f"DistributedModel {self.name!r} was called directly "
            f"({what}) in pipeline rank {rank}, which holds only its "
            "own stage's weights (one stage per process; e.g. "
            f"{unheld[0].path!r} has no copy here). Use `model.predict(x)` "
            "or `model.predict_on_batch(x)` (pipelined; every process calls "
            "them), or first call `model.sync_weights()` (a collective: "
            "every process calls it): each process then holds the whole "
            "model, and may call it directly, until keras-smp frees the "
            "copies again (the next `fit`, `evaluate`, `*_on_batch`, "
            "`get_weights` or save that gathers the model).")

    def _smp_call_staged(self, inputs, training):
        """Forward pass stage by stage, each on its device (`@smp.step`).

        The layers run in one Keras call context, as in `model(x)`:
        afterwards `model.losses` holds the losses they added in this call
        (activity regularizers, `add_loss()`), a layer called twice
        included, and the weight regularizers'.
        """
        graph = self.staged_graph
        devices = self._smp_devices()
        tensors = self._smp_flat_inputs(inputs)
        rank_of = self.schedule.rank_of
        with keras_private.call_context(self, training):
            keras_private.clear_added_losses([self])
            for s in range(graph.num_stages):  # model stages
                # Tensor-parallel collectives: the group of the stage's
                # device.
                with on_device(devices[s]), tf.name_scope(f"stage{s}"), \
                        tensor.stage(rank_of(s)):
                    tensors = graph.stage_fn(s, training=training)(tensors)
        return graph.pack_outputs(tensors)

    def _smp_call_across(self, inputs, training):
        """Forward pass of `@smp.step` with one stage per process.

        This process runs its own stage only: the first stage on the
        inputs, the others on what the previous stage's process sends;
        the last stage's outputs are then broadcast to every process of
        the pipeline, so the step's own code (its loss, metrics, the
        values it returns) runs alike on all of them. The stage is one
        `tf.custom_gradient` function of the inputs and this stage's
        weights: differentiating the step's loss (`get_gradients`, a
        tape) runs the stage's backward from the gradient its next
        stage's process sends (the last: from the loss), and sends the
        gradient of its inputs to the previous one. Every process thus
        gets the gradients of its own weights (other stages' are
        `None`), and TensorFlow's executor overlaps the microbatches
        across the processes (each call is one microbatch).
        """
        graph = self.staged_graph
        links = self._smp_links()
        stage, p = links.rank, graph.num_stages
        first, last = stage == 0, stage == p - 1
        self._smp_check_across_step(graph, training)
        custom_loop.note_model_across(self)
        flat = [tf.convert_to_tensor(t)
                for t in self._smp_flat_inputs(inputs)]
        slot = custom_loop.call_slot(self)
        rows = links.checked_rows(tf.shape(flat[0])[0])
        carry_in = graph.inputs if first else graph.carries[stage - 1]
        carry_out = graph.carries[stage]
        fn = graph.stage_fn(stage, training=training)
        layers = graph.stage_layers(stage)
        # Losses the layers add (the same answer on every rank): this
        # stage's part is one more output of its function, summed over the
        # stages below (`model.losses` in the step).
        adds = self._smp_adds_losses() or self._smp_regularized()
        floatx = keras.config.floatx()
        # A stage's backward runs where it or an earlier stage trains a
        # weight (`_smp_check_across_step`: every such stage trains one).
        backward = self._smp_across_backward(graph)
        regularized = [w for w in links.held_weights(graph)
                       if w.trainable and getattr(w, "regularizer", None)]

        def floating(carry):
            return [i for i, t in enumerate(carry)
                    if tf.as_dtype(graph.dtype_of(t)).is_floating]

        def sent(carry):
            specs = boundary_specs(carry, rows, dtype_of=graph.dtype_of)
            return specs, [is_dynamic(shape) for shape, _ in specs]

        @tf.custom_gradient
        def run(*xs):
            if first:
                ins = list(xs)
            else:
                ins = links.receive_from(stage, stage - 1, "F", slot,
                                         boundary_specs(
                                             carry_in, rows,
                                             dtype_of=graph.dtype_of), rows)
            with keras_private.call_context(self, training):
                keras_private.clear_added_losses(layers)
                outs = fn(ins)
                added = keras_private.added_losses(layers)
            if added and not adds:
                names = [layer.name for layer in layers
                         if keras_private.added_losses([layer])]
                raise NotImplementedError(
                    f"Layer(s) {names} of pipeline stage {stage} added a "
                    "loss (`add_loss()`) from code outside their class's "
                    "methods (a helper function), in a `@smp.step` with one "
                    "stage per process: the other stages' processes cannot "
                    "foresee it (they wait for this one until "
                    "collective_timeout_seconds). Call add_loss() in the "
                    "layer's own `call` (or a method of its class).")
            extra = []
            if adds:
                terms = [tf.cast(loss, floatx) for loss in added] + [
                    tf.cast(w.regularizer(w), floatx) for w in regularized]
                extra = [tf.add_n(terms) if terms else tf.zeros([], floatx)]
            sends = []
            if not last:
                specs, dynamic = sent(carry_out)
                sends = links.send_to(stage, stage + 1, "F", slot,
                                      [dense(t) for t in outs], rows,
                                      dynamic=dynamic)
            specs, _ = sent(graph.carries[-1])
            with tf.control_dependencies(sends):
                shared = links.share_from_last(
                    outs if last else None, specs,
                    [links.call_position("F", slot, i)
                     for i in range(len(specs))], rows)

            def grad(*upstream, variables=None):
                custom_loop.note_backward(self, slot)
                variables = list(variables or [])
                out_float = floating(carry_out)
                received = []
                if last:
                    d_outs = [tf.zeros_like(outs[i]) if upstream[i] is None
                              else upstream[i] for i in out_float]
                else:
                    # (every carry, as `fit` sends them: the same keys)
                    specs, _ = sent(carry_out)
                    received = links.receive_from(stage, stage + 1, "B",
                                                  slot, specs, rows)
                    d_outs = [received[i] for i in out_float]
                d_extra = [tf.zeros_like(e) if g is None else g
                           for e, g in zip(extra, upstream[len(shared):])]
                in_float = ([] if first or not backward[stage - 1]
                            else floating(carry_in))
                targets = [ins[i] for i in in_float] + variables
                grads = tf.gradients(
                    [outs[i] for i in out_float] + extra, targets,
                    grad_ys=d_outs + d_extra) if targets else []
                d_ins, d_vars = grads[:len(in_float)], grads[len(in_float):]
                sends = []
                if not first and backward[stage - 1]:
                    _, dynamic = sent(carry_in)
                    d_in = dict(zip(in_float, d_ins))
                    sends = links.send_to(
                        stage, stage - 1, "B", slot,
                        [tf.zeros_like(t) if d_in.get(i) is None
                         else dense(d_in[i]) for i, t in enumerate(ins)],
                        rows, dynamic=dynamic)
                # Every gradient received waits here, also those nothing
                # uses (the zeros sent for integer carries, such as token
                # ids a later stage reads; a float carry this stage's
                # outputs do not depend on): otherwise the next stage's
                # send blocked until the collective timeout while this
                # process went on.
                with tf.control_dependencies(sends + received):
                    d_vars = [None if g is None else
                              tf.IndexedSlices(tf.identity(g.values),
                                               g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices)
                              else tf.identity(g) for g in d_vars]
                return [None] * len(xs), d_vars

            return shared + extra, grad

        results = run(*flat)
        if adds:
            total = self._smp_sum_over_stages(results[-1], links, slot)
            results = results[:-1]
            # `model.losses` after this call, in this trace.
            object.__setattr__(self, "_smp_across_losses", (weakref.ref(
                tf.compat.v1.get_default_graph()), [total]))
        return graph.pack_outputs(results)

    def _smp_sum_tied_parts(self, grads, variables):
        """`@smp.step` with one stage per process: the optimizer's
        gradients with those of weights several stage processes use (tied,
        or a layer called in two stages) summed over those processes.

        Each such process holds a copy of the weight, and its step gives
        the gradient of its own stages' uses only (its part); every
        process applying the sum, its copies take the same steps as the
        single device's one weight. A weight sparse wherever it is read
        (an `Embedding` looked up in two stages) gets the parts' rows
        gathered, as one device's gradient holds them; otherwise the sum
        is dense (a missing part counts as zeros).

        Returns `(grads, counted_elsewhere)`: the new list, and the ids of
        the tied weights whose norm another process counts (their first
        stage's), for `global_clipnorm`."""
        links = self._smp_links()
        graph = self.staged_graph
        ranks = links.weight_ranks(graph)
        tied = [i for i, v in enumerate(variables)
                if len(ranks.get(id(v), ())) > 1]
        if not tied:
            return grads, ()
        # Each sum of a weight traced into one function (a step unrolled
        # twice) takes its own collective keys; counted per weight, which
        # every process using it applies alike (whatever else it holds).
        calls = {}
        if not tf.executing_eagerly():
            graph_sums = _TIED_SUMS.setdefault(
                tf.compat.v1.get_default_graph(), {})
            for i in tied:
                key = id(variables[i])
                calls[key] = graph_sums.get(key, 0)
                graph_sums[key] = calls[key] + 1
                if calls[key] >= MAX_TIED_SUMS:
                    raise NotImplementedError(
                        f"More than {MAX_TIED_SUMS} optimizer steps applying "
                        f"{variables[i].path!r}, a weight several pipeline "
                        f"stages of DistributedModel {self.name!r} use, "
                        "traced into one tf.function: each needs collective "
                        "keys of its own. Apply the gradients once per "
                        "traced function (loop over steps in Python, "
                        "outside it).")
        summed = _sum_tied(self, links, [variables[i] for i in tied],
                           [grads[i] for i in tied], calls=calls)
        out = list(grads)
        for i, g in zip(tied, summed):
            out[i] = g
        home = links.home_ranks(graph)
        return out, [id(variables[i]) for i in tied
                     if home[id(variables[i])] != links.rank]

    @staticmethod
    def _smp_across_backward(graph):
        """Per model stage, whether its backward runs in `@smp.step` with
        one stage per process: where it or an earlier stage has a
        trainable weight (a frozen first part of the model, a fine-tuned
        backbone, needs none)."""
        out, any_before = [], False
        for s in range(graph.num_stages):
            any_before = any_before or any(
                w.trainable for w in graph.stage_weights(s))
            out.append(any_before)
        return out

    @staticmethod
    def _smp_sum_over_stages(value, links, slot):
        """The sum of a scalar over this replica's stage processes; its
        gradient is the upstream one, to this stage's own part."""

        @tf.custom_gradient
        def summed(t):
            total = links.reduce(t, links.keys.replica(links.replica),
                                 links.num_ranks,
                                 links.INSTANCE_ADDED_LOSSES + slot)
            return total, lambda dy: dy

        return summed(value)

    @property
    def losses(self):
        # Inside @smp.step with one stage per process: every stage's added
        # losses and weight regularizers, summed over the stage processes
        # (`_smp_call_across`); other stages' weights have no values here.
        stored = self.__dict__.get("_smp_across_losses")
        if (stored is not None and custom_loop.in_step()
                and stored[0]() is tf.compat.v1.get_default_graph()):
            return list(stored[1])
        return super().losses

    def _smp_check_gradient_sources(self, ids):
        """Refuses a gradient call in `@smp.step` with one stage per
        process whose sources (`ids`, of variables) hold some of this
        model's trainable weights but none of a stage that builds its
        backward: that stage's process would build none, and its
        neighbours would wait for its transfers. Every process sees the
        same sources, so every process raises."""
        graph = self.staged_graph
        trained = [[w for w in graph.stage_weights(s) if w.trainable]
                   for s in range(graph.num_stages)]
        if not any(id(w) in ids for weights in trained for w in weights):
            return  # not this model's gradient
        # (A stage with a trainable weight always builds its backward.)
        missing = [s for s, weights in enumerate(trained)
                   if weights and not any(id(w) in ids for w in weights)]
        if missing:
            raise ValueError(
                f"A gradient in @smp.step with one stage per process "
                f"(smp.init's local_devices=1) leaves out every trainable "
                f"weight of pipeline stage(s) {missing} of DistributedModel "
                f"{self.name!r} (such as {trained[missing[0]][0].path!r}): "
                "their processes would build no backward, and the other "
                "stages would wait for them until the collective timeout. "
                "Take the gradient of `model.trainable_variables` in one "
                "call; to leave weights untrained, set `layer.trainable = "
                "False` before the first step.")

    def _smp_check_across_step(self, graph, training=True):
        """What `@smp.step` with one stage per process does not carry yet,
        refused on every rank as the step is traced (decided from the
        model, which every rank holds): a stage training nothing after one
        that trains (its process would build no backward to relay the
        gradient), and a layer called on several stage processes whose
        calls update its weights in training (moving statistics): each
        process would update only its own copy."""
        backward = self._smp_across_backward(graph)
        relays = [s for s in range(graph.num_stages) if backward[s] and not
                  any(w.trainable for w in graph.stage_weights(s))]
        if relays:
            raise NotImplementedError(
                f"Pipeline stage(s) {relays} of DistributedModel "
                f"{self.name!r} train no weight (frozen, or weightless "
                "layers) but sit after a stage that trains one, so their "
                "process would have to pass gradients on without "
                "differentiating anything of its own: @smp.step with one "
                "stage per process (smp.init's local_devices=1) does not "
                "support that yet. Keep a trainable weight in every such "
                "stage (or freeze only a first part of the model), train "
                "with `model.fit` under SMPStrategy, or leave local_devices "
                "unset.")
        # Weights several stages use (tied, a layer called in two
        # stages) are trained: each process using one holds a copy, and
        # the optimizer sums their gradient's parts over those processes
        # (`_smp_sum_tied_parts`); a layer whose calls also update its
        # weights (moving statistics) cannot be kept in step so (in a
        # forward in inference mode they stay as they are).
        training = keras_private.effective_training(training)
        if training is not None and (tf.is_tensor(training)
                                     or bool(training)):
            _refuse_state_updated_on_several_ranks(self, self._smp_links())

    def _smp_step_training(self, training):
        """The `training` a `fit`, `evaluate` or `predict` step gives the
        layers: Keras' own steps call a model whose `call` takes no
        `training` argument without one (`self(x)`), so its layers use
        their defaults (`Dropout` and `BatchNormalization` infer, in `fit`
        too): `None` then, else `training`."""
        owner = self.__dict__.get("inner_model")
        owner = self if owner is None else owner
        if "training" in inspect.signature(owner.call).parameters:
            return training
        if training and not self.__dict__.get("_smp_warned_training"):
            told = sorted({
                layer.name for layer in keras_private.flatten_layers(owner)
                if layer is not owner and "training" in inspect.signature(
                    layer.call).parameters})
            if told:
                object.__setattr__(self, "_smp_warned_training", True)
                warnings.warn(
                    f"{type(owner).__name__}.call takes no `training` "
                    "argument: as Keras' fit does, keras-smp calls it "
                    f"without one, so its layers {told[:5]} run in inference "
                    "mode in fit too (Dropout off, BatchNormalization's "
                    "moving statistics used and not updated). Add "
                    "`training=None` to `call` and pass it on to train "
                    "them.", stacklevel=3)
        return None

    def call(self, inputs, training=None):
        # Unpipelined forward pass (direct calls); steps use the pipeline.
        return self.inner_model(inputs, training=training)

    # -- weights across stage processes -----------------------------------

    def sync_weights(self):
        """Copies every stage's weights to all processes of its replica.

        With one pipeline stage per process, each process holds and trains
        only its stage's weights and optimizer slots; its copies of the
        other stages' are empty. `get_weights` gathers the whole model
        (weights and slots) for the duration of the call; `save_weights`
        writes one shard per stage instead, and `save` (`.keras`) and
        `save_model` write their files from those shards
        (`keras_smp.pipeline.shards`). It is a collective: every
        process of the job must call it (Keras callbacks do). No-op
        otherwise.

        Afterwards every process holds the whole model, so it may call it
        directly (`model.sync_weights(); y = model(x)` runs the whole
        model, unpipelined, in this process), until keras-smp frees the
        other stages' copies again: the next `fit`, `evaluate`,
        `train_on_batch`, `test_on_batch`, `get_weights`, or a save that
        gathers the whole model. Called directly without it, the model
        raises an error naming this.
        """
        residency = self._smp_residency()
        if residency is not None:
            residency.sync()

    def _smp_residency(self):
        """The `StageResidency` with one stage per process, else `None`."""
        if not self._smp_multi_process() or self._smp_graph is None:
            return None
        if getattr(self, "_smp_resident", None) is None:
            self._smp_resident = StageResidency(
                self, self._smp_links,
                self._smp_runtime().topology.world_size)
        return self._smp_resident

    def _smp_ema_scope(self):
        """The context in which Keras callbacks swap or copy the moving
        averages of `use_ema` (`SwapEMAWeights`): this stage's weights
        only."""
        return own_averages(self.optimizer)

    def _smp_symbolic(self):
        residency = self._smp_residency()
        return (residency.symbolic() if residency
                else contextlib.nullcontext())

    def _smp_shaped(self):
        residency = self._smp_residency()
        return residency.shaped() if residency else contextlib.nullcontext()

    def _smp_gathered(self):
        residency = self._smp_residency()
        return residency.gathered() if residency else contextlib.nullcontext()

    def fit(self, *args, **kwargs):
        """Keras' `fit`, checking array data first: a last batch too
        small for the microbatches (of each replica) is an error before
        the first step rather than at the end of the first epoch."""
        self._smp_check_last_batch(args, kwargs)
        return super().fit(*args, **kwargs)

    fit.__signature__ = inspect.signature(keras.Model.fit)

    def _smp_check_last_batch(self, args, kwargs):
        """Raises when array data's last batch would certainly fail in
        `run_step` (`microbatch.check_last_batch`), before training."""
        import math

        import numpy as np

        try:
            given = inspect.signature(keras.Model.fit).bind(
                self, *args, **kwargs).arguments
        except TypeError:
            return  # Keras will say what is wrong

        def rows(data):
            first = next(iter(keras.tree.flatten(data)), None)
            if not (isinstance(first, np.ndarray) or tf.is_tensor(first)) or (
                    not first.shape or first.shape[0] is None):
                return None  # datasets, generators: their batches are theirs
            return int(first.shape[0])

        m = self.num_microbatches
        replicas = self.distribute_strategy.num_replicas_in_sync
        # With targets, a "mean_with_sample_weight" loss overriding
        # `Loss.__call__` needs equal microbatches (`run_step`).
        mws = loss_shares.custom_mean_with_sample_weight(self)
        batch_size = given.get("batch_size") or 32
        samples = rows(given.get("x"))
        validation = given.get("validation_data")
        split = given.get("validation_split") or 0.0
        val_samples, val_y = None, given.get("y") is not None
        if samples is not None and split and validation is None:
            train = int(math.floor(samples * (1.0 - split)))  # as Keras
            samples, val_samples = train, samples - train
        elif validation is not None:
            parts = (validation if isinstance(validation, (tuple, list))
                     else (validation,))
            val_samples = rows(parts[0])
            val_y = len(parts) > 1 and parts[1] is not None
        if samples is not None and given.get("steps_per_epoch") is None:
            microbatch.check_last_batch(
                samples, batch_size, m, replicas,
                divisible=mws and given.get("y") is not None,
                trim=not split)
        # Evaluation pads a batch to whole microbatches, except when layers
        # add losses (the padding's would count): then it splits as
        # training does. (Not known before a subclassed model is built.)
        validates = _validates(given.get("validation_freq", 1), range(
            given.get("initial_epoch", 0), given.get("epochs", 1)))
        if (val_samples and validates and given.get("validation_steps") is None
                and self._smp_graph is not None and self._smp_adds_losses()):
            microbatch.check_last_batch(
                val_samples, given.get("validation_batch_size") or batch_size,
                m, replicas, what="validation data", divisible=mws and val_y,
                batch_arg="validation_batch_size", trim=not split,
                fails="the first validation would fail")

    def compile(self, *args, jit_compile="auto", **kwargs):
        """Keras' `compile`; `jit_compile=True` compiles stage by stage.

        With `jit_compile=True` each stage's forward and backward of a
        microbatch are XLA computations (`keras_smp.runtime.xla`), while
        transfers, gradient accumulation, all-reduce and the optimizer run
        around them (plain Keras would compile its whole step, which
        cannot hold keras-smp's collectives). A stage holding a layer XLA
        cannot compile (`supports_jit=False`) runs uncompiled, with a
        warning naming the layer. `jit_compile="auto"` is off under a
        strategy, as in Keras.

        Example (2 stages on logical CPUs of one process):

        ```python
        import numpy as np
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras
        import keras_smp

        strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                         local_devices=2)
        with strategy.scope():
            model = keras_smp.DistributedModel(keras.Sequential([
                keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1)]))
            model.compile("sgd", "mse", jit_compile=True)
        x = np.random.RandomState(0).randn(64, 8).astype("float32")
        history = model.fit(x, x[:, :1], batch_size=16, epochs=3, verbose=0)
        assert model.jit_compile
        assert history.history["loss"][-1] < history.history["loss"][0]
        ```
        """
        self._smp_check_created_in_scope()
        if (type(self).train_step is DistributedModel.train_step
                or type(self).test_step is DistributedModel.test_step):
            _check_no_custom_steps(type(self), DistributedModel,
                                   wrapped=False)
        super().compile(*args, jit_compile=xla.stage_by_stage(
            self, jit_compile), **kwargs)
        track_slots(self.optimizer)

    def _smp_check_created_in_scope(self):
        """Stages on devices of this process need their weights created by
        the strategy (placed on their stage's device, mirrored over its
        replicas): weights made outside its scope fail early, with the fix.
        (One stage per process handles them: see `StageResidency`.)"""
        rt = self._smp_runtime()
        if rt is None or self._smp_multi_process():
            return
        strategy = self.distribute_strategy
        outside = [w for w in self.weights
                   if not strategy.extended.variable_created_in_scope(
                       getattr(w, "value", w))]
        if outside:
            raise ValueError(
                f"{len(outside)} weight(s) of the model (first: "
                f"{outside[0].path!r}) were created outside the scope of "
                "the SMPStrategy its pipeline stages run under, so they are "
                "not placed on their stages' devices. Create the layers "
                "(keras.Input(...) and every layer call, or the Sequential) "
                "inside `with strategy.scope():`, as well as "
                "DistributedModel and compile.")

    def compile_from_config(self, config):
        """Keras' `compile_from_config` (what `keras.models.load_model`
        calls): compiles through `DistributedModel.compile`, and builds the
        optimizer so that the saved optimizer state loads."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def _smp_build_from_data(self, data_batch):
        """Builds a model not traced yet (a subclass, a wrapped subclassed
        or unbuilt Sequential model) on inputs of the shapes and dtypes of
        `data_batch`'s `x` (arrays, tensors or `tf.TensorSpec`s); nothing
        when built or when they are not known. Whatever call comes first
        (`fit`, `evaluate`, `predict`, `*_on_batch`) builds it so."""
        if self._smp_graph is not None:
            return
        x = keras.utils.unpack_x_y_sample_weight(data_batch)[0]
        flat = keras.tree.flatten(x)
        if flat and all(isinstance(t, (tf.Tensor, tf.TensorSpec,
                                       np.ndarray)) for t in flat):
            # (floating data as floatx, as Keras casts it for a model)
            dtypes = [keras.backend.standardize_dtype(t.dtype)
                      for t in flat]
            self._smp_input_dtypes = [
                keras.backend.floatx()
                if keras.backend.is_float_dtype(d) else d for d in dtypes]
            self.build(keras.tree.map_structure(
                lambda t: tuple(t.shape), x))

    def _symbolic_build(self, iterator=None, data_batch=None):
        # Keras may trace the whole model here (shapes only).
        if data_batch is not None:
            # (with one stage per process, the trace below then reads
            # other stages' weights as shapes)
            self._smp_build_from_data(data_batch)
        kwargs = dict(iterator=iterator, data_batch=data_batch)
        residency = self._smp_residency()
        if residency is None:
            return super()._symbolic_build(**kwargs)
        if self.optimizer is not None and not self.optimizer.built:
            # Other stages' weights get deferred slots (no storage).
            self.optimizer.build(self.trainable_variables)
        with residency.symbolic():
            super()._symbolic_build(**kwargs)

    def get_weights(self):
        with self._smp_gathered():
            return super().get_weights()

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the model (Keras' `save`).

        With one stage per process, a `.keras` file is streamed: each stage
        writes its own weights and optimizer state and rank 0 copies them
        into the archive one weight at a time (`shards.save_keras`), so no
        process ever holds the whole model, and the file is what Keras
        would write for the trained model (`keras.models.load_model` loads
        it, with its optimizer state; `keras.saving.save_model` and
        `ModelCheckpoint` take the same path). Other formats (a `.h5` file,
        `zipped=False`) gather the whole model into every process for the
        call. A collective: every process of the job calls it.

        Example:

        ```python
        import os, tempfile
        import keras, numpy as np, keras_smp
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2)]))
        model.compile(optimizer="adam", loss="mse")
        model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        np.testing.assert_array_equal(loaded.get_weights()[0],
                                      model.get_weights()[0])
        assert int(loaded.optimizer.iterations) == 1
        ```
        """
        if self._smp_streams_keras(filepath, zipped):
            path = os.fspath(filepath)
            # Rank 0 decides for all (hosts may see the file differently).
            rank = self._smp_runtime().topology.rank
            if not overwrite and comms.share(
                    os.path.exists(path) if rank == 0 else None):
                raise FileExistsError(
                    f"save: {path!r} exists; pass overwrite=True to "
                    "replace it.")
            if kwargs:
                raise ValueError(
                    "The following argument(s) are not supported: "
                    f"{list(kwargs)}")
            return shards.save_keras(self, path)
        with self._smp_gathered():
            return super().save(filepath, overwrite=overwrite, zipped=zipped,
                                **kwargs)

    def _smp_streams_keras(self, filepath, zipped):
        """Whether saving to `filepath` streams a `.keras` file from the
        stages (one stage per process) instead of gathering the model."""
        return (self._smp_residency() is not None
                and isinstance(filepath, (str, os.PathLike))
                and os.fspath(filepath).endswith(".keras")
                and not keras_private.is_remote_path(os.fspath(filepath))
                and zipped is not False)

    def _smp_keep_backup(self, filepath, backup_path):
        """`BackupAndRestore(double_checkpoint=True)`'s copy of its last
        backup, on the chief, before the next: a sharded checkpoint is
        kept with its own index and shards (`shards.keep_as_backup`:
        "kept", "unchanged" for a damaged one); False for a plain file
        (Keras' copy)."""
        return shards.keep_as_backup(filepath, backup_path)

    def _smp_loads_as_is(self, filepath):
        """Whether `load_weights` takes `filepath` whatever its name (the
        `.bkp` of a sharded checkpoint's `.weights.h5`)."""
        return shards.is_pointer(filepath)

    def _smp_save_model(self, original, filepath, *args, **kwargs):
        """Keras' `saving_lib.save_model(self, ...)` (what
        `keras.saving.save_model` calls): streamed or gathered, as `save`.
        """
        zipped = kwargs.get("zipped", args[1] if len(args) > 1 else True)
        weights_format = kwargs.get("weights_format",
                                    args[0] if args else "h5")
        if weights_format == "h5" and self._smp_streams_keras(filepath,
                                                              zipped):
            return shards.save_keras(self, filepath)
        with self._smp_gathered():
            return original(self, filepath, *args, **kwargs)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Saves the weights and optimizer state (Keras' `save_weights`).

        The file is laid out as the wrapped Keras model's own: a plain
        Keras model of the same architecture loads it. A path ending in
        `.weights.json`, and any path with one stage per process, gives a
        sharded checkpoint: each stage writes its own shard and no process
        gathers the whole model (`keras_smp.pipeline.shards`; with
        `.weights.h5`, that file points to the shards, for
        `ModelCheckpoint` and `BackupAndRestore`). It is a collective:
        every process of the job calls it (Keras callbacks do).

        Example:

        ```python
        import os, tempfile
        import keras, numpy as np, keras_smp
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2)]))
        path = os.path.join(tempfile.mkdtemp(), "w.weights.h5")
        model.save_weights(path)
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        plain.load_weights(path)
        np.testing.assert_array_equal(plain.get_weights()[0],
                                      model.get_weights()[0])
        ```
        """
        if max_shard_size is not None:
            raise ValueError(
                "DistributedModel.save_weights shards by pipeline stage, "
                f"not by size: drop max_shard_size={max_shard_size!r} and "
                "give a path ending in '.weights.json' (one shard per "
                "stage, Keras' sharded format).")
        if not isinstance(filepath, (str, os.PathLike)):
            with self._smp_gathered():
                return super().save_weights(filepath, overwrite=overwrite)
        path = os.fspath(filepath)
        if not path.endswith((".weights.h5", ".weights.json")):
            raise ValueError(
                "DistributedModel.save_weights: the filename must end in "
                f"'.weights.h5' (one file) or '.weights.json' (one shard "
                f"per stage); received filepath={path!r}.")
        if not self.built:
            raise ValueError(
                "save_weights: the model has no weights yet. Train it or "
                "call it on data first.")
        if not overwrite and os.path.exists(path):
            raise FileExistsError(
                f"save_weights: {path!r} exists; pass overwrite=True to "
                "replace it.")
        if path.endswith(".weights.json") or self._smp_residency() is not None:
            return shards.save(self, path)
        return shards.save_one_file(self, path)

    def save_model(self, save_path="/opt/ml/model"):
        """Writes the whole model as one unpartitioned SavedModel (SMP's).

        Every process must call it; rank 0 writes `save_path`, the others
        wait. With one stage per process, a wrapped Sequential or
        functional model is not gathered into every process: the stages
        write their weights into shards, from which rank 0 alone builds
        the plain model and exports it (rank 0 then holds the whole
        model's weights, which serving needs, but no other stage's
        optimizer state); a subclassed model is gathered for the call.
        The SavedModel's `serve` signature runs the plain, unpipelined
        forward pass: load it with `tf.saved_model.load` or
        `keras.layers.TFSMLayer` anywhere, without keras-smp.

        Example:

        ```python
        import tempfile
        import keras, numpy as np, tensorflow as tf
        import keras_smp as smp
        model = smp.DistributedModel(keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2)]))
        x = np.ones((3, 4), "float32")
        expected = model.predict(x, verbose=0)
        path = tempfile.mkdtemp()
        model.save_model(path)
        loaded = tf.saved_model.load(path)
        served = loaded.serve(x)
        np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
        ```
        """
        self._smp_export("save_model", str(save_path), verbose=False)

    def export(self, filepath, format="tf_saved_model", verbose=None,
               input_signature=None, **kwargs):
        """Keras' `export`: the whole, unpipelined model as an inference
        artifact (any format Keras exports; `"tf_saved_model"` by
        default), loadable anywhere without keras-smp.

        Every process must call it; rank 0 writes `filepath`, the others
        wait. `input_signature` defaults to the model's inputs with any
        batch size (Keras would need the model called directly first; a
        `DistributedModel` trains through its pipeline). With one stage
        per process, a wrapped Sequential or functional model is not
        gathered into every process: the stages write their weights into
        shards, from which rank 0 alone builds the plain model and exports
        it (`save_model`, SMP's name, does the same). A subclassed model
        (wrapped, or a `DistributedModel` subclass) is gathered for the
        call: its class may not be loadable from a file.

        Example:

        ```python
        import tempfile
        import keras, numpy as np, tensorflow as tf
        import keras_smp
        model = keras_smp.DistributedModel(keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2)]))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
        path = tempfile.mkdtemp()
        model.export(path, verbose=False)
        loaded = tf.saved_model.load(path)
        served = loaded.serve(np.ones((3, 4), "float32"))
        np.testing.assert_allclose(
            served, model.predict(np.ones((3, 4)), verbose=0),
            rtol=1e-5, atol=1e-6)  # float32 rounding of other kernels
        ```
        """
        self._smp_export("export", filepath, format=format, verbose=verbose,
                         input_signature=input_signature, **kwargs)

    def _smp_export(self, what, filepath, format="tf_saved_model",
                    verbose=None, input_signature=None, **kwargs):
        if not self.built or not self.variables:
            raise ValueError(
                f"{what}: the model has no weights yet. Train it (fit, "
                "or one @smp.step) or call it on data before saving.")
        if current_group_of(self) is not None:
            raise ValueError(
                f"{what}: the model has tensor-parallel layers, whose "
                "forward pass needs every tensor-parallel rank; an "
                "inference artifact is exported by one process. Save whole "
                "weights with `model.save_weights(path)` (every rank calls "
                "it), load them into the same model built without "
                "`keras_smp.tensor_parallelism()` (plain Keras layers) and "
                "export that: `plain.export(dir)`.")
        if input_signature is None:
            input_signature = [keras.tree.map_structure(
                lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]),
                                        t.dtype),
                self.staged_graph.inputs_struct)]
        filepath = str(filepath)
        if (self._smp_residency() is not None and self._smp_functional
                is not None and not keras_private.is_remote_path(filepath)):
            shards.export_from_shards(self, filepath, input_signature,
                                      format=format, verbose=verbose,
                                      **kwargs)
            return
        error = None
        with self._smp_gathered():
            if (self._smp_runtime() or runtime.current()).topology.rank == 0:
                try:
                    super().export(filepath, format=format, verbose=verbose,
                                   input_signature=input_signature, **kwargs)
                except Exception as e:  # pylint: disable=broad-except
                    error = e
        # Rank 0's outcome, on every process (the others would wait).
        message = comms.share(
            None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"{what} of {filepath!r} failed on rank 0: "
                               f"{message}")

    def set_weights(self, weights):
        with self._smp_shaped():
            return super().set_weights(weights)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads weights (Keras' `load_weights`) saved with any number of
        stages and replicas: a sharded checkpoint (`.weights.json`, or the
        `.weights.h5` pointing to one), a plain Keras model's
        `.weights.h5`, or a `.keras` file. With one stage per process,
        each process reads only its stage's weights; a process failing
        to load its stage's (a shape that does not match) fails the
        others too."""
        if self._smp_residency() is None:
            return self._smp_load_weights(filepath, skip_mismatch, **kwargs)
        # Each process assigns only its stage's weights, so only the one
        # holding a mismatched weight saw the error: all raise.
        error = None
        try:
            result = self._smp_load_weights(filepath, skip_mismatch,
                                            **kwargs)
        except Exception as e:  # pylint: disable=broad-except
            error = e
        rank = self._smp_runtime().topology.rank
        failed = [e for e in comms.allgather(
            None if error is None
            else f"rank {rank}: {type(error).__name__}: {error}") if e]
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                f"load_weights({str(filepath)!r}) failed on another "
                f"process, so this one stops too: {'; '.join(failed)}")
        return result

    def _smp_load_weights(self, filepath, skip_mismatch, **kwargs):
        path = (os.fspath(filepath)
                if isinstance(filepath, (str, os.PathLike)) else None)
        with self._smp_shaped():
            if path is not None and os.path.isfile(path) and (
                    path.endswith(".weights.json")
                    or (path.endswith(".weights.h5")
                        and not shards.is_wrapper_layout(path))
                    # (`BackupAndRestore`'s `.weights.h5.bkp` of one)
                    or shards.is_pointer(path)):
                if not self.built:
                    raise ValueError(
                        "load_weights: the model has no weights yet to load "
                        "into. Call it on data (or build it) first.")
                if kwargs:
                    raise TypeError(
                        f"load_weights of {path!r} takes no "
                        f"{', '.join(sorted(kwargs))} argument.")
                return shards.load(self, path, skip_mismatch=skip_mismatch)
            return super().load_weights(filepath,
                                        skip_mismatch=skip_mismatch, **kwargs)

    # -- steps -------------------------------------------------------------

    def _smp_devices(self):
        """The device of each model stage for the current replica (its
        rank's, with virtual stages)."""
        p = self.staged_graph.num_stages
        rt = self._smp_runtime() or runtime.current()
        layout = rt.layout
        if (layout is None or layout.mode != "in_process"
                or layout.num_stages != self.num_stages):
            return [None] * p
        local = 0
        if self._smp_runtime() is not None:
            local = tf_private.local_replica_index(layout.num_local_replicas)
        ranks = layout.stage_devices(local)
        rank_of = self.schedule.rank_of
        return [ranks[rank_of(s)] or None for s in range(p)]

    def _smp_flat_inputs(self, x):
        if self._smp_functional is not None:
            return keras_private.standardize_inputs(self._smp_functional, x)
        return keras.tree.flatten(x)

    def _smp_multi_process(self):
        rt = self._smp_runtime()
        return rt is not None and rt.mode == "multi_process"

    def _smp_links(self):
        """This stage process's `StageLinks` (one pipeline rank per
        process, running one model stage, or several with virtual
        stages)."""
        rt = self._smp_runtime()
        topo = rt.topology
        schedule = self.schedule
        if self.staged_graph.num_stages != schedule.num_model_stages or (
                schedule.num_stages != topo.pp_size):
            raise ValueError(
                f"The model has {self.staged_graph.num_stages} stages but "
                f"the strategy runs {topo.pp_size} stage processes per "
                f"replica with {schedule.virtual_stages} stage(s) each.")
        if getattr(self, "_smp_keys", None) is None:
            self._smp_allocate_keys()
        return StageLinks(topo.pp_size, topo.pp_rank,
                          topo.dp_rank * topo.tp_size + topo.tp_rank,
                          self._smp_keys,
                          rt.config.collective_timeout_seconds,
                          placement=[schedule.rank_of(s) for s in
                                     range(schedule.num_model_stages)])

    def make_train_function(self, force=False):
        return self._smp_clear_errors(super().make_train_function(force))

    def make_test_function(self, force=False):
        return self._smp_clear_errors(super().make_test_function(force))

    def make_predict_function(self, force=False):
        return self._smp_clear_errors(super().make_predict_function(force))

    def _smp_clear_errors(self, result):
        """A batch too small for the microbatches (a partial last batch,
        no drop_remainder) fails with our words only.

        Batches of unknown size are checked inside the step (an Assert);
        TensorFlow wraps its message in a graph traceback. Re-raise it as
        the `ValueError` it is.
        """
        for attr in ("train_function", "test_function", "predict_function"):
            fn = getattr(self, attr, None)
            if fn is not None and not getattr(fn, "_smp_clear", False):
                setattr(self, attr, _clear_batch_errors(fn))
        return result

    def _smp_needs_outputs(self):
        """Whether train/test steps use `y_pred` beyond the loss."""
        return (keras_private.compiled_metrics(self) is not None
                or type(self).compute_metrics is not keras.Model.compute_metrics)

    def _smp_extra_losses(self, reduce_sum=None, added=None):
        """Losses beyond the compiled one: `(logged, differentiated)`.

        `differentiated`: weight-regularization losses, differentiated
        here (the losses layers add in `call`, `added`, were differentiated
        by their stages' backwards). In one process both are every layer's
        regularization losses, and `logged` also has `added`. With one stage
        per process (`reduce_sum` given) each process differentiates the
        losses of its own stage's weights and logs the sum over the stages
        of those (a tied weight's by its first stage) and of `added`.
        """
        aggregate = keras_private.aggregate_additional_loss
        if reduce_sum is None:
            losses = [aggregate(self, loss) for loss in
                      keras_private.regularization_losses(self)]
            return losses + ([added] if added is not None else []), losses
        graph = self.staged_graph
        # The same answer on every stage process (`run_step` refuses added
        # losses it could not foresee): they all sum, or none.
        if not self._smp_regularized() and not self._smp_adds_losses():
            return [], []
        links = self._smp_links()
        home = links.home_ranks(graph)
        local = [(v, aggregate(self, v.regularizer(v)))
                 for v in links.held_weights(graph)
                 if v.trainable and getattr(v, "regularizer", None) is not None]
        # A tied weight's copies each take its regularizer's gradient (so
        # they stay equal); its loss is logged once, by its first stage.
        logged = [loss for v, loss in local if home[id(v)] == links.rank]
        if added is not None:
            logged.append(added)
        total = reduce_sum(tf.add_n(logged) if logged else tf.zeros([]))
        return [total], [loss for _, loss in local]

    def _smp_adds_losses(self):
        """Whether layers of the model may add losses in `call` (the same
        answer on every stage process)."""
        graph = self.staged_graph
        return keras_private.may_add_losses(
            layer for s in range(graph.num_stages)
            for layer in graph.stage_layers(s))

    def _smp_regularized(self):
        """Whether a trainable weight has a regularizer."""
        return any(getattr(v, "regularizer", None) is not None
                   for v in self.trainable_weights)

    def _smp_added_loss_only(self):
        """Whether the model's loss is only what its layers add and its
        weights' regularizers: compiled without a loss, as Keras allows
        for such models."""
        return (keras_private.compiled_loss(self) is None
                and (self._smp_adds_losses() or self._smp_regularized()))

    def _smp_track_loss(self, run, extra):
        """Updates Keras' loss tracker with the step's total loss."""
        unscale = keras_private.unscale_loss_for_distribution
        terms = [unscale(l) for l in run.losses if l is not None]
        terms += [unscale(e) for e in extra]
        if terms:
            batch = tf.shape(self._smp_flat_inputs(run.x)[0])[0]
            total = tf.add_n(terms)
            if run.rows_share is not None:
                # Replicas of unequal rows: weighted by its rows, the
                # replica's part of the global loss, over its share.
                total = loss_shares.logged_value(total, run.rows_share)
            keras_private.loss_tracker(self).update_state(
                total, sample_weight=batch)

    def _smp_stage_reducer(self):
        """One stage per process: `reduce_sum(tensor)`, the sum over this
        replica's stage processes (every call its own collective, in the
        same order on every stage); `None` otherwise."""
        if not self._smp_multi_process():
            return None
        links = self._smp_links()
        calls = iter(range(links.INSTANCE_STAGE_SUM,
                           links.INSTANCE_TIED))

        def reduce_sum(tensor):
            return links.reduce(
                tf.cast(tensor, loss_shares.share_dtype()),
                links.keys.replica(links.replica), links.num_ranks,
                next(calls))

        return reduce_sum

    def _smp_across_stages(self, reduce_sum):
        """Optimizer steps that need the other stages' gradients (global
        norm, loss-scale finite check) sum over the stage processes."""
        if reduce_sum is None:
            return contextlib.nullcontext()
        links = self._smp_links()
        graph = self.staged_graph
        home = links.home_ranks(graph)
        elsewhere = [w for w, ranks in links.weight_ranks(graph).items()
                     if len(ranks) > 1 and home[w] != links.rank]
        return patches.across_stages(self.optimizer, reduce_sum, elsewhere)

    def _smp_after_previous_step(self, step):
        """Runs `step()` after the previous step traced into the same
        function has shared its results (one stage per process).

        Keras traces `steps_per_execution > 1` steps into one function,
        and every step's transfers use the same collective keys: without
        this order a stage could send (or post a receive of) the next
        step's tensor before its peer took this step's ("BufRendezvous::
        ProvideBuf already called for key")."""
        if not self._smp_multi_process():
            return step()
        # Kept on the graph (a cycle the garbage collector frees with it).
        graph = tf.compat.v1.get_default_graph()
        if not hasattr(graph, "_smp_last_steps"):
            graph._smp_last_steps = {}
        previous = graph._smp_last_steps
        with tf.control_dependencies(previous.get(id(self), [])):
            out = step()
        previous[id(self)] = [t for t in tf.nest.flatten(out)
                              if isinstance(t, tf.Tensor)]
        return out

    def train_step(self, data):
        return self._smp_after_previous_step(
            lambda: self._smp_train_step(data))

    def _smp_train_step(self, data):
        run = run_step(self, data, training=True,
                       need_outputs=self._smp_needs_outputs())
        reduce_sum = self._smp_stage_reducer()
        extra, differentiated = self._smp_extra_losses(reduce_sum, run.added)
        grads = dict(run.grads)
        trainable = self.trainable_weights
        if self._smp_multi_process():  # this process trains its stage only
            trainable = [v for v in trainable if id(v) in grads]
        if differentiated:
            reg = tf.add_n(differentiated)
            if self.optimizer is not None:
                reg = self.optimizer.scale_loss(reg)
            for v, g in zip(trainable, variable_gradients(reg, trainable)):
                grads[id(v)] = accumulate(grads.get(id(v)), g)
        self._smp_track_loss(run, extra)
        with self._smp_across_stages(reduce_sum), own_averages(
                self.optimizer), sparse.summed_by_position(run.by_position):
            # A weight the loss does not depend on has no gradient
            # (`None`): the optimizer leaves it alone, as Keras does (and
            # raises "No gradients provided" when no weight has one).
            present = any(grads.get(id(v)) is not None for v in trainable)
            if present or (trainable and not self._smp_multi_process()):
                self.optimizer.apply_gradients(
                    [(grads.get(id(v)), v) for v in trainable])
            elif self._smp_multi_process():
                # A stage with nothing to train (frozen, or none of its
                # weights reaches the loss).
                patches.step_without_gradients(self.optimizer)
            else:
                warnings.warn(
                    "The model does not have any trainable weights.")
        return self.compute_metrics(run.x, run.y, run.y_pred,
                                    sample_weight=run.sample_weight)

    def test_step(self, data):
        return self._smp_after_previous_step(
            lambda: self._smp_test_step(data))

    def _smp_test_step(self, data):
        run = run_step(self, data, training=False,
                       need_outputs=self._smp_needs_outputs())
        if run.losses[0] is not None or self._smp_added_loss_only():
            self._smp_track_loss(run, self._smp_extra_losses(
                self._smp_stage_reducer(), run.added)[0])
        return self.compute_metrics(run.x, run.y, run.y_pred,
                                    sample_weight=run.sample_weight)

    def predict_step(self, data):
        return self._smp_after_previous_step(lambda: run_step(
            self, data, training=False, need_loss=False).y_pred)

    def executed_timeline(self, x, y=None, sample_weight=None, runs=3):
        """Measures when each stage ran each microbatch, for one batch.

        Runs the pipelined forward and backward pass of the batch `runs`
        times (no weight update; only forward without `y`, except for a
        model compiled without a loss, whose layers add it: `x` alone
        trains it, as in `fit`) and returns the
        last run as a `keras_smp.pipeline.schedule.Timeline` in
        milliseconds: per stage, `(start, end, action)` of every forward
        (`F`, including the copy of its inputs from the previous stage) and
        backward (`B`) action, timed on the stage's device. Draw it with
        `timeline.draw("step.png")`, print `timeline.grid()`, export
        `timeline.to_chrome_trace("step.json")` (chrome://tracing,
        Perfetto), and compare `timeline.bubble_fraction()` with the
        planned schedule's.

        In one process (stages on local devices), the first replica's
        timing when there are several. With one stage per process, call it
        on every process (as `fit`): each stage process times its own
        actions and every rank returns its replica's whole timeline, in
        wall-clock time shared by the processes of one host (across hosts,
        as far as their clocks agree); the receives (posted ahead, not
        chained, there) are not drawn, so the gap between an action and the
        neighbour's action that waits for its output is the transfer.

        Example:

        ```python
        import keras, numpy as np, keras_smp
        model = keras_smp.DistributedModel(keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)]),
            split_points=["dense_1"])
        model.compile(optimizer="sgd", loss="mse")
        x, y = np.ones((8, 8), "float32"), np.ones((8, 2), "float32")
        timeline = model.executed_timeline(x, y)
        assert timeline.num_stages == 2 and timeline.makespan > 0
        ```
        """
        return executed_timeline(self, x, y, sample_weight, runs)


# Keras' step hooks a DistributedModel runs its own pipelined versions
# of. `compute_metrics` is kept on a DistributedModel subclass (its
# `train_step` calls it with the whole batch's outputs).
_WRAPPED_STEP_HOOKS = ("train_step", "test_step", "predict_step",
                       "compute_loss", "compute_metrics")
_SUBCLASS_STEP_HOOKS = ("compute_loss",)


def _check_no_custom_steps(cls, base, wrapped):
    """Raises if `cls` overrides a Keras step hook the pipeline would skip:
    training would silently differ from the model's own."""
    hooks = _WRAPPED_STEP_HOOKS if wrapped else _SUBCLASS_STEP_HOOKS
    overridden = [h for h in hooks
                  if getattr(cls, h, None) is not getattr(base, h, None)]
    if not overridden:
        return
    names = ", ".join(f"`{h}`" for h in overridden)
    what = (f"DistributedModel({cls.__name__}) wraps a model that overrides"
            if wrapped else f"{cls.__name__} overrides")
    raise ValueError(
        f"{what} {names}: a DistributedModel runs its own pipelined "
        "`train_step`, `test_step` and `predict_step` (the compiled loss "
        "per microbatch on the last stage), so the override would be "
        "skipped and the model would train or predict differently from "
        "its own. Give the loss to `compile(loss=...)` (a Keras loss or a "
        "function of `y_true, y_pred`; `loss_weights` and per-output "
        "dicts work; override `compute_metrics` on a DistributedModel "
        "subclass for custom metrics), or write the step with the SMP "
        "custom-loop API (`@smp.step`, docs/custom-loop.md), or train "
        "the model unwrapped with data parallelism (`SMPStrategy()` "
        "without `partitions`).")


def _call_kwargs(owner):
    """What tracing `owner.call` must pass besides the inputs: `None` for
    a `training` or `mask` argument without a default (Keras' `__call__`
    fills them in)."""
    return {name: None for name, p in
            inspect.signature(owner.call).parameters.items()
            if name in ("training", "mask") and p.default is p.empty
            and p.kind is not p.VAR_KEYWORD}


def _traced_call(owner, inputs, **kwargs):
    """`owner.call` on symbolic `inputs`: the layer graph to partition.

    Keras refuses `add_loss` on symbolic tensors (a model's own
    `self.add_loss(...)` in `call`, outside any layer): said here with the
    fix."""
    try:
        with patches.variable_reads() as reads:
            outputs = owner.call(inputs, **{**_call_kwargs(owner), **kwargs})
    except ValueError as e:
        if "`add_loss()` can only be called" not in str(e):
            raise
        raise ValueError(
            f"{type(owner).__name__}.call calls `self.add_loss(...)` on the "
            "model itself: a DistributedModel traces `call` once into the "
            "layers it calls and runs them stage by stage, so a loss the "
            "model adds outside its layers cannot be placed. Add it in a "
            "layer: a custom `keras.layers.Layer` whose `call` calls "
            "`self.add_loss(...)` (it runs on its stage, and its loss "
            "counts as in Keras), or give the loss to `compile(loss=...)`."
        ) from e
    if reads:
        names = ", ".join(sorted({repr(v.path) for v in reads}))
        raise ValueError(
            f"{type(owner).__name__}.call reads the weight(s) {names} "
            "outside the layers' symbolic calls (`keras.ops.transpose(self."
            "emb.embeddings)`, `keras.ops.shape(w)`, or a layer called on "
            "values that are not the model's inputs, such as "
            "`ops.arange(n)`): a DistributedModel traces `call` once into "
            "the layers and operations it runs, so such a use would keep "
            "the value the weight had at the trace and never train it. Use "
            "the weight inside a layer's `call` (a custom layer holding the "
            "layer whose weight it uses, like keras_hub's "
            "ReversibleEmbedding for a tied output projection), compute "
            "from the inputs (`ops.arange` of `ops.shape(x)`), and read "
            "shapes as `w.shape`.")
    return outputs


_ABSENT = object()


def _operation_key(op, arguments, layers):
    """What identifies a traced call across traces: one of the model's
    `layers` by identity; a layer made in `call` by its type; a
    `keras.ops` operation by its type, settings and non-tensor
    arguments (`h * (0.0 if training else 1.0)` differs)."""
    if isinstance(op, keras.layers.Layer):
        return op if id(op) in layers else type(op)

    def plain(value):
        if keras.backend.is_keras_tensor(value):
            return "<tensor>"
        if keras_private.is_variable(value):
            return f"<weight {value.path}>"
        return value

    def text(value):  # (functions made in `call` differ in address only)
        return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(
            keras.tree.map_structure(plain, value)))

    settings = {k: v for k, v in vars(op).items()
                if not k.startswith("_") and k != "name"}
    return (type(op), text(settings), text(arguments.args),
            text(arguments.kwargs))


def _mark_fixed_training(owner, inputs, outputs):
    """Marks the layer calls whose `training` the traced `owner.call`
    fixed (`self.bn(h, training=False)`), which the step's `training` must
    not override; raises if `call` depends on `training` otherwise.

    A DistributedModel runs the layers one trace of `call` made
    (`outputs`) and tells each the step's `training` when it runs. So
    `call` is traced again as Keras runs it with `training=True` and with
    `False` (a call context holding it, and the argument when `call` names
    one): the same layers and operations must be called (a Python `if
    training:` would be frozen by one trace), each given the step's
    `training` (True, then False: the step decides) or one constant in
    both (kept, as Keras keeps an explicit argument).
    """
    nodes = StagedGraph.topological_nodes(inputs, outputs)
    named = "training" in inspect.signature(owner.call).parameters
    traces = {}
    layers = keras_private.flatten_layers(owner)
    with keras_private.graph_nodes_kept(layers):
        for training in (True, False):
            with keras_private.training_context(training):
                traces[training] = StagedGraph.topological_nodes(
                    inputs, _traced_call(
                        owner, inputs,
                        **({"training": training} if named else {})))
        ids = {id(layer) for layer in layers}
        keys = {t: [_operation_key(n.operation, n.arguments, ids)
                    for n in trace]
                for t, trace in [(None, nodes), *traces.items()]}
    name = type(owner).__name__

    def names(ops):
        return ", ".join(sorted({getattr(op, "name", None) or str(op)
                                 for op in ops})) or "none"

    for training in (True, False):
        if keys[training] == keys[None]:
            continue
        other = [n.operation for n in traces[training]]
        called = [n.operation for n in nodes]
        raise ValueError(
            f"{name}.call calls other layers or operations with training="
            f"{training} (only then: "
            f"{names([op for op in other if op not in called])}; not then: "
            f"{names([op for op in called if op not in other])}): it "
            "branches on `training` in Python. A DistributedModel runs the "
            "layers one trace of `call` makes and tells each the step's "
            "`training` when it runs (as a functional model does), so such "
            "a branch would be frozen. Move the branch into a layer (a "
            "custom `keras.layers.Layer` whose `call` takes `training`), "
            "or call the layers unconditionally and pass them `training` "
            "(`Dropout`, `BatchNormalization` and the noise layers decide "
            "by it).")
    for i, node in enumerate(nodes):
        given = [traces[t][i].arguments.kwargs.get("training", _ABSENT)
                 for t in (True, False)]
        if given == [_ABSENT, _ABSENT]:
            continue  # a layer without `training`
        if all(isinstance(g, (bool, np.bool_)) for g in given):
            if bool(given[0]) and not bool(given[1]):
                continue  # it gets the step's `training`
            if bool(given[0]) == bool(given[1]):
                mark_fixed_training(node, given[0])
                continue
        raise ValueError(
            f"{name}.call gives layer '{node.operation.name}' training="
            + " and ".join(repr(g) for g in given if g is not _ABSENT)
            + " when it runs with training=True and False: a "
            "DistributedModel keeps a constant `training` (True or False) "
            "a call passes a layer, or lets the step's `training` decide "
            "when the layer is given `call`'s own `training` (or none); "
            "other values (`not training`, computed flags) cannot be run "
            "layer by layer. Pass `training` on unchanged, or a constant.")


def _check_own_weights(owner):
    """Raises if `owner` made variables itself (`self.add_weight` in the
    model, a model's `SeedGenerator`) that its `call` uses outside its
    layers: no stage would train or hold them."""
    own = keras_private.own_variables(owner)
    if not own:
        return
    names = ", ".join(repr(v.path) for v in own[:3])
    raise ValueError(
        f"{type(owner).__name__} holds weights of its own ({names}"
        f"{', ...' if len(own) > 3 else ''}), made with `self.add_weight` "
        "(or a SeedGenerator) on the model rather than in a layer: a "
        "DistributedModel trains the weights of the layers its `call` "
        "runs, stage by stage, so these would be left out. Move them into "
        "a layer: a custom `keras.layers.Layer` that makes them in "
        "`build` and uses them in its `call`.")


def _clear_batch_errors(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            text = e.message or str(e)
            if (microbatch.BATCH_ERROR not in text
                    and microbatch.FEW_ERROR not in text):
                raise
            # TensorFlow prints the Assert's parts as "[a] [b] [c]".
            start = text.rfind("The per-replica batch of")
            message = " ".join(text[start:].split()).split(" [[")[0]
            raise ValueError(message.replace("] [", " ").rstrip("]")) from e

    run._smp_clear = True
    run.__wrapped__ = fn
    return run
