"""`DistributedModel`: a Keras model whose steps run a microbatch pipeline.

`train_step`, `test_step` and `predict_step` split each (per-replica) batch
into `microbatches` equal parts and run them through the model's pipeline
stages with the configured schedule (GPipe or 1F1B), on one device per
stage (`SMPStrategy` provides them). Gradients are accumulated over the
microbatches, then synced across data-parallel replicas and applied once.
"""

import contextlib
import warnings
import weakref

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.optimizers import base_optimizer
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_smp import state
from keras_smp.pipeline import scope
from keras_smp.pipeline.executor import run_pipeline
from keras_smp.pipeline.graph import StagedGraph
from keras_smp.pipeline.graph import record_partitions
from keras_smp.pipeline.p2p import StageLinks
from keras_smp.pipeline.p2p import run_stage
from keras_smp.pipeline.partition import COST_METHODS
from keras_smp.pipeline.schedule import get_schedule

def _null():
    import contextlib

    return contextlib.nullcontext()


# optimizer -> {id(slot variable): model variable it was made for}
_SLOT_REFS = weakref.WeakKeyDictionary()

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


@keras.saving.register_keras_serializable(package="keras_smp")
class DistributedModel(keras.Model):
    """A Keras model trained, evaluated and run as a microbatch pipeline.

    Three ways to make one:

    - subclass it and write `call`, placing layers with
      `with keras_smp.partition(i):` scopes (used when the config sets
      `auto_partition=False`; otherwise the traced `call` is partitioned
      automatically, as in SageMaker's library);
    - `DistributedModel(inputs, outputs)`, like a functional `keras.Model`;
    - `DistributedModel(model)`, wrapping a built Sequential or functional
      model (its layers and weights are shared, not copied).

    The number of stages (`partitions`), `microbatches` and `pipeline`
    schedule come from the `SMPStrategy` in whose scope the model is built
    (or from `SMP_CONFIG` without a strategy). Automatic partitioning cuts
    the layers, in topological order, into contiguous stages balancing
    `partition_cost`; `model.partition_summary()` shows the plan.

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
        inner = None
        if (len(args) == 1 and isinstance(args[0], keras.Model)
                and set(kwargs) <= {"name"}):
            inner, args = args[0], ()
        elif len(args) == 1 and not functional_init_arguments(args, kwargs):
            raise TypeError(
                "DistributedModel(model) expects a keras.Model (Sequential "
                "or functional) to pipeline; received "
                f"{type(args[0]).__name__} {args[0]!r:.80}. Or subclass "
                "DistributedModel and write `call`, or pass "
                "DistributedModel(inputs=..., outputs=...).")
        elif functional_init_arguments(args, kwargs):
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
        if inner is not None:
            functional = getattr(inner, "_functional", None) or inner
            if not hasattr(functional, "_outputs_struct") or not getattr(
                    inner, "built", False):
                raise ValueError(
                    f"DistributedModel({type(inner).__name__}) needs a built "
                    "functional or Sequential model. Start a Sequential "
                    "model with keras.Input(shape), or pass "
                    "DistributedModel(inputs, outputs).")
            self.inner_model = inner
            self._smp_functional = functional
            self._smp_set_graph(self._smp_plan(
                functional._inputs_struct, functional._outputs_struct, {}))
            self.built = True

    def get_config(self):
        if self._smp_functional is None:
            return super().get_config()
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.inner_model),
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

    # -- configuration ----------------------------------------------------

    def _smp_strategy(self):
        from keras_smp.distribute.strategy import SMPStrategy

        strategy = self.distribute_strategy
        return strategy if isinstance(strategy, SMPStrategy) else None

    def _smp_config(self):
        strategy = self._smp_strategy()
        return strategy.config if strategy is not None else state.config()

    @property
    def num_stages(self):
        """Pipeline stages (the config's `partitions`)."""
        return self._smp_config().partitions

    @property
    def num_microbatches(self):
        """Microbatches per step (the config's `microbatches`)."""
        return self._smp_config().microbatches

    @property
    def schedule(self):
        """The pure-Python `Schedule` the steps run (gpipe or 1f1b)."""
        config = self._smp_config()
        return get_schedule(config.pipeline, config.partitions,
                            config.microbatches)

    @property
    def staged_graph(self):
        """The `StagedGraph` (layers per stage); built on first use."""
        if self._smp_graph is None:
            raise ValueError(
                f"{self.name} has not been built yet: call it on data, call "
                "`model.build(input_shape)`, or start training.")
        return self._smp_graph

    def partition_summary(self):
        """Returns the partition plan: stage, parameters, layers."""
        return self.staged_graph.summary()

    # -- building ---------------------------------------------------------

    def _smp_plan(self, inputs, outputs, recorded):
        config = self._smp_config()
        p = config.partitions
        manual = any(v is not None for v in recorded.values())
        bad = sorted({v for v in recorded.values() if v is not None and v >= p})
        if bad:
            raise ValueError(
                f"keras_smp.partition({bad[0]}) is used in `call`, but there "
                f"are only partitions={p} stages (indices 0 to {p - 1}). Use "
                "a smaller index or raise `partitions`.")
        if manual and not config.auto_partition:
            return StagedGraph.manual(
                inputs, outputs, recorded, p, config.default_partition)
        if manual and p > 1:
            warnings.warn(
                "keras_smp.partition() scopes are ignored because "
                "auto_partition=True; set auto_partition=False in the "
                "SMPStrategy config to place layers manually.", stacklevel=3)
        cost = self._smp_cost or (
            "flops" if config.optimize == "speed" else "parameters")
        return StagedGraph.auto(inputs, outputs, p, cost=cost,
                                split_points=self._smp_split_points)

    def _smp_set_graph(self, graph):
        for node in graph.nodes:
            layer = node.operation
            if getattr(layer, "activity_regularizer", None) is not None:
                raise NotImplementedError(
                    f"Layer '{layer.name}' has an activity_regularizer; "
                    "activity regularization is not supported in pipelined "
                    "models yet. Add the penalty to the loss instead.")
        self._smp_graph = graph
        self._smp_place_variables()

    def _smp_place_variables(self):
        """Puts every weight on the device of the first stage using it."""
        strategy = self._smp_strategy()
        if strategy is None or strategy.num_stages != self._smp_graph.num_stages:
            return
        from tensorflow.python.distribute import device_util

        rows = strategy.stage_devices
        home = self._smp_graph.home_stage()
        with strategy.scope():
            for stage in range(self._smp_graph.num_stages):
                want = [device_util.canonicalize(row[stage]) for row in rows]
                for w in self._smp_graph.stage_weights(stage):
                    if home[id(w)] != stage:
                        continue
                    value = w.value
                    parts = getattr(value, "values", (value,))
                    have = [device_util.canonicalize(v.device) for v in parts]
                    if have == want:
                        continue
                    current = w.numpy()
                    w._value = None
                    with scope.placing(stage):
                        w._initialize(current)

    def build(self, input_shape=None):
        if self._smp_graph is not None:
            self.built = True
            return
        if type(self).call is DistributedModel.call:
            raise ValueError(
                "DistributedModel needs a `call` (subclass it), or "
                "`inputs`/`outputs`, or a model to wrap.")

        def symbolic(shape):
            return keras.Input(batch_shape=(None,) + tuple(shape)[1:])

        if isinstance(input_shape, (list, tuple)) and input_shape and all(
                isinstance(d, int) or d is None for d in input_shape):
            inputs = symbolic(input_shape)
        else:
            inputs = tree.map_shape_structure(symbolic, input_shape)
        self._smp_trace(inputs)

    def _smp_trace(self, inputs):
        # Keras may build the model inside `compute_output_spec` (a scratch
        # graph with stateless/symbolic scopes); the weights must be real,
        # so trace in the outer (eager) context with those scopes lifted.
        from keras.src.backend.common import global_state

        names = ("stateless_scope", "symbolic_scope")
        saved = {n: global_state.get_global_attribute(n) for n in names}
        try:
            for n in names:
                global_state.set_global_attribute(n, None)
            strategy = self._smp_strategy()
            with tf.init_scope(), (
                    strategy.scope() if strategy else _null()), (
                    record_partitions()) as recorded:
                outputs = self.call(inputs)
                self._smp_set_graph(
                    self._smp_plan(inputs, outputs, recorded))
        finally:
            for n in names:
                global_state.set_global_attribute(n, saved[n])
        self.built = True

    def __call__(self, *args, **kwargs):
        from keras_smp.custom_loop import in_step

        if not in_step():
            return super().__call__(*args, **kwargs)
        if self._smp_graph is not None and args:
            result = self._smp_call_staged(args[0], kwargs.get("training"))
        else:
            result = super().__call__(*args, **kwargs)
        if not getattr(self, "_smp_step_ready", False):
            from keras_smp.custom_loop import after_first_call

            self._smp_step_ready = True
            after_first_call(self)
        return result

    def _smp_call_staged(self, inputs, training):
        """Forward pass stage by stage, each on its device (`@smp.step`)."""
        graph = self.staged_graph
        devices = self._smp_devices()
        tensors = self._smp_flat_inputs(inputs)
        for s in range(graph.num_stages):
            with tf.device(devices[s]), tf.name_scope(f"stage{s}"):
                tensors = graph.stage_fn(s, training=training)(tensors)
        return graph.pack_outputs(tensors)

    def call(self, inputs, training=None):
        # Unpipelined forward pass (direct calls); steps use the pipeline.
        return self.inner_model(inputs, training=training)

    # -- weights across stage processes -----------------------------------

    def sync_weights(self):
        """Copies every stage's weights to all processes of its replica.

        With one pipeline stage per process, each process holds and trains
        only its stage's weights and optimizer slots; its copies of the
        other stages' are empty. `get_weights`, `save` and `save_weights`
        gather the whole model (weights and slots) for the duration of the
        call, so checkpoints hold the whole trained model. It is a
        collective: every process of the job must call it (Keras callbacks
        do). No-op otherwise.
        """
        if not self._smp_multi_process():
            return
        links = self._smp_links()
        graph = self.staged_graph
        home = graph.home_stage()
        slots = self._smp_slots_by_weight()
        foreign = self._smp_foreign_ids()
        count = getattr(self, "_smp_sync_count", 0)
        self._smp_sync_count = count + 1
        base = 1_000_000 + (count % 1000) * 10_000
        index = 0
        for stage in range(graph.num_stages):
            for w in graph.stage_weights(stage):
                if home[id(w)] != stage:
                    continue
                for v in [w] + slots.get(id(w), []):
                    key, size = links.pipeline_key(), links.num_stages
                    if links.stage == stage:
                        links.send(v.value, key, size, base + index)
                    elif id(v) in foreign:
                        _set_local(v, links.recv(v.shape, v.dtype, key,
                                                 size, base + index))
                    else:  # tied: this stage holds its own trained copy
                        links.recv(v.shape, v.dtype, key, size, base + index)
                    index += 1
        # Every process has its copies before any returns (and may exit).
        links.barrier(self._smp_strategy().topology.world_size, base + index)

    # -- one stage per process: hold only this stage's variables ----------

    def _smp_slots_by_weight(self):
        optimizer = getattr(self, "optimizer", None)
        refs = _SLOT_REFS.get(optimizer, {}) if optimizer else {}
        by_weight = {}
        for v in (optimizer.variables if optimizer else []):
            ref = refs.get(id(v))
            if ref is not None:
                by_weight.setdefault(id(ref), []).append(v)
        return by_weight

    def _smp_foreign(self):
        """Weights and optimizer slots this stage process does not use."""
        if not self._smp_multi_process() or self._smp_graph is None:
            return []
        graph = self.staged_graph
        mine = {id(w) for w in graph.stage_weights(self._smp_links().stage)}
        home = graph.home_stage()
        slots = self._smp_slots_by_weight()
        foreign = []
        for w in self.weights:
            if id(w) in home and id(w) not in mine:
                foreign += [w] + slots.get(id(w), [])
        return foreign

    def _smp_foreign_ids(self):
        return {id(v) for v in self._smp_foreign()}

    def _smp_release(self):
        """Frees this process's copies of other stages' variables."""
        for v in self._smp_foreign():
            if v._value is not None and v._value.shape.num_elements() == 0:
                continue
            _set_local(v, tf.zeros([0], v.dtype))

    @contextlib.contextmanager
    def _smp_shaped(self):
        """Full-size (zero) local copies of other stages' variables."""
        foreign = self._smp_foreign()
        for v in foreign:
            _set_local(v, tf.zeros(v.shape, v.dtype))
        try:
            yield
        finally:
            self._smp_release()

    @contextlib.contextmanager
    def _smp_gathered(self):
        """The whole trained model in this process, for the `with` body."""
        self.sync_weights()
        try:
            yield
        finally:
            self._smp_release()

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        _track_slots(self.optimizer)

    def _symbolic_build(self, *args, **kwargs):
        # Keras may trace the whole model here (shapes only).
        with self._smp_shaped():
            super()._symbolic_build(*args, **kwargs)

    def get_weights(self):
        with self._smp_gathered():
            return super().get_weights()

    def save(self, *args, **kwargs):
        with self._smp_gathered():
            return super().save(*args, **kwargs)

    def save_weights(self, *args, **kwargs):
        with self._smp_gathered():
            return super().save_weights(*args, **kwargs)

    def save_model(self, save_path="/opt/ml/model"):
        """Writes the whole model as one unpartitioned SavedModel (SMP's).

        Every process must call it (with one stage per process it gathers
        the stages' weights); rank 0 writes `save_path`, the others wait.
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
        np.testing.assert_allclose(served, expected, rtol=1e-6)
        ```
        """
        from keras_smp import comms
        from keras_smp import ranks

        if not self.built or not self.variables:
            raise ValueError(
                "save_model: the model has no weights yet. Train it (fit, "
                "or one @smp.step) or call it on data before saving.")
        with self._smp_gathered():
            if ranks.rank() == 0:
                spec = tree.map_structure(
                    lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]),
                                            t.dtype),
                    self.staged_graph.inputs_struct)
                self.export(str(save_path), format="tf_saved_model",
                            verbose=False, input_signature=[spec])
        comms.barrier()

    def set_weights(self, weights):
        with self._smp_shaped():
            return super().set_weights(weights)

    def load_weights(self, *args, **kwargs):
        with self._smp_shaped():
            return super().load_weights(*args, **kwargs)

    # -- steps -------------------------------------------------------------

    def _smp_devices(self):
        strategy = self._smp_strategy()
        p = self.staged_graph.num_stages
        if strategy is None:
            from keras_smp.custom_loop import stage_devices

            return stage_devices(p)
        if strategy.num_stages != p:
            return [None] * p
        ctx = tf.distribute.get_replica_context()
        rows = strategy.stage_devices
        local = ctx._replica_id_in_sync_group % len(rows) if ctx else 0
        return rows[local]

    def _smp_flat_inputs(self, x):
        if self._smp_functional is not None:
            return list(self._smp_functional._standardize_inputs(x))
        return tree.flatten(x)

    @staticmethod
    def _smp_split(structure, m):
        """Splits every tensor of `structure` into `m` microbatches."""
        if structure is None:
            return [None] * m
        flat = tree.flatten(structure)
        parts = [None if t is None else tf.split(t, m, axis=0) for t in flat]
        return [tree.pack_sequence_as(
            structure, [None if p is None else p[i] for p in parts])
            for i in range(m)]

    def _smp_check_batch(self, flat_x, m):
        first = flat_x[0]
        static = first.shape[0]
        strategy = self._smp_strategy()
        replicas = strategy.num_replicas_in_sync if strategy else 1
        advice = (
            "Use a batch size that is a multiple of "
            f"microbatches x replicas = {m * replicas}, and "
            "`drop_remainder=True` when batching a tf.data dataset (or "
            "`steps_per_epoch` that avoids a partial last batch).")
        if static is not None:
            if static % m:
                raise ValueError(
                    f"The per-replica batch of {static} samples does not "
                    f"divide into microbatches={m}. {advice}")
            return []
        batch = tf.shape(first)[0]
        return [tf.debugging.Assert(
            tf.equal(tf.math.floormod(batch, m), 0),
            ["The per-replica batch of", batch, "samples does not divide "
             f"into microbatches={m}. {advice}"])]

    def _smp_loss_weight(self, m, sample_weight):
        reductions = set()
        compile_loss = self._compile_loss
        for loss in getattr(compile_loss, "_flat_losses", None) or []:
            fn = getattr(loss, "fn", loss)
            reductions.add(getattr(fn, "reduction", None)
                           or getattr(loss, "reduction", None))
        reductions.discard(None)
        if reductions <= {"sum"} and reductions:
            return 1.0
        if reductions <= set(_MEAN_REDUCTIONS):
            if "mean_with_sample_weight" in reductions and (
                    sample_weight is not None):
                raise ValueError(
                    "A loss with reduction='mean_with_sample_weight' cannot "
                    "be split into microbatches exactly (each microbatch "
                    "divides by its own weight sum). Use "
                    "reduction='sum_over_batch_size' or microbatches=1.")
            return 1.0 / m
        raise ValueError(
            f"Compiled losses mix reductions {sorted(reductions)}; a "
            "pipelined model needs all 'sum' or all mean-like "
            "('sum_over_batch_size') reductions.")

    def _smp_microbatches(self, data):
        """Unpacks a batch and splits x, y, sample_weight into microbatches.

        Returns `(x, y, sample_weight, batch, xs, ys, sws)`: `xs` holds per
        microbatch the flat model inputs.
        """
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        m = self.num_microbatches
        flat_x = self._smp_flat_inputs(x)
        checks = self._smp_check_batch(flat_x, m)
        with tf.control_dependencies(checks):
            batch = tf.shape(flat_x[0])[0]
            xs = [list(mb) for mb in zip(*[tf.split(t, m, axis=0)
                                            for t in flat_x])]
            ys = self._smp_split(y, m)
            sws = self._smp_split(sample_weight, m)
        return x, y, sample_weight, batch, xs, ys, sws

    def _smp_loss_fn(self, ys, sws, sample_weight, m, training):
        """The loss of one microbatch (last stage), weighted for the step."""
        graph = self.staged_graph
        weight = self._smp_loss_weight(m, sample_weight)

        def loss_fn(out, mb):
            loss = self._compile_loss(
                ys[mb], graph.pack_outputs(out), sws[mb]) * weight
            if training and self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
            return loss

        return loss_fn

    def _smp_multi_process(self):
        strategy = self._smp_strategy()
        return strategy is not None and strategy.pipeline_mode == (
            "multi_process")

    def _smp_links(self):
        strategy = self._smp_strategy()
        topo = strategy.topology
        if self.staged_graph.num_stages != topo.pp_size:
            raise ValueError(
                f"The model has {self.staged_graph.num_stages} stages but "
                f"the strategy runs {topo.pp_size} stage processes per "
                "replica.")
        return StageLinks(topo.pp_size, topo.pp_rank, topo.dp_rank,
                          strategy.config.collective_timeout_seconds)

    def make_train_function(self, force=False):
        return self._smp_clear_errors(super().make_train_function(force))

    def make_test_function(self, force=False):
        return self._smp_clear_errors(super().make_test_function(force))

    def make_predict_function(self, force=False):
        return self._smp_clear_errors(super().make_predict_function(force))

    def _smp_clear_errors(self, result):
        """A partial batch (no drop_remainder) fails with our words only.

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
        return (self._compile_metrics is not None
                or type(self).compute_metrics is not keras.Model.compute_metrics)

    def _smp_run_process(self, data, training, need_loss=True,
                         need_outputs=True):
        """One stage of the step in this process (one stage per process)."""
        x, y, sample_weight, batch, xs, ys, sws = self._smp_microbatches(data)
        graph = self.staged_graph
        links = self._smp_links()
        s, p = links.stage, links.num_stages
        m = self.num_microbatches
        mb_size = batch // m

        def specs(tensors, rows):
            out = []
            for t in tensors:
                rest = list(t.shape[1:])
                if any(d is None for d in rest):
                    raise ValueError(
                        f"Tensor {t.name} of shape {t.shape} crosses a stage "
                        "boundary between processes; only its batch "
                        "dimension may be unknown.")
                out.append((tf.concat([[rows], tf.constant(rest, tf.int32)],
                                      axis=0), t.dtype))
            return out

        in_specs = specs(graph.carries[s - 1], mb_size) if s > 0 else []
        out_specs = specs(graph.carries[s], mb_size) if s < p - 1 else []
        has_loss = (need_loss and y is not None
                    and self._compile_loss is not None)
        loss_fn = (self._smp_loss_fn(ys, sws, sample_weight, m, training)
                   if has_loss and s == p - 1 else None)

        schedule = get_schedule(self._smp_config().pipeline, p, m)
        stage_vars = [w for w in graph.stage_weights(s) if w.trainable]
        losses, outputs, grads, barrier = run_stage(
            graph.stage_fn(s, training=training),
            stage_vars if training else [], loss_fn, schedule, links, xs,
            in_specs, out_specs, forward_only=not training)
        # The last stage shares the merged outputs and the loss with the
        # other stages, so metrics and logs are identical on every rank.
        # Outputs are only shared when something uses them (metrics,
        # predict): for a 1024 x 1024 batch that is 4 MB per step.
        pred_specs = specs(graph.outputs, batch) if need_outputs else []
        mine = []
        if s == p - 1:
            merged = [tf.concat([o[i] for o in outputs], axis=0)
                      for i in range(len(graph.outputs))]
            mine = list(merged) if need_outputs else []
            if has_loss:
                mine.append(tf.add_n(losses))
        with tf.control_dependencies([barrier]):
            shared = links.share_from_last(
                mine, pred_specs + ([((), tf.float32)] if has_loss else []),
                instance_base=500_000)
        if training:
            grads = self._smp_sum_tied(links, stage_vars, grads)
        # TensorFlow prunes collective ops whose results nobody uses (they
        # are not control outputs, see auto_control_deps.ASYNC_STATEFUL_OPS):
        # a receive left unused on one rank leaves its peer's send waiting.
        # Everything the step uses therefore depends on every shared tensor.
        with tf.control_dependencies(shared):
            shared = [tf.identity(t) for t in shared]
            grads = [None if g is None else tf.identity(g) for g in grads]
        if need_outputs:
            y_pred = graph.pack_outputs(shared[:len(graph.outputs)])
        else:  # unused by the step (no metrics)
            y_pred = graph.pack_outputs(merged) if s == p - 1 else None
        loss = [shared[-1]] if has_loss else [None]
        return x, y, sample_weight, y_pred, loss, [grads], [stage_vars]

    def _smp_sum_tied(self, links, stage_vars, grads):
        """Sums the gradients of weights used by several stages (tied).

        Every stage process using a tied weight holds a copy, computes its
        part of the gradient and receives the sum over the stages using it,
        so all copies take the same optimizer step.
        """
        graph = self.staged_graph
        users = {}
        for stage in range(graph.num_stages):
            for w in graph.stage_weights(stage):
                users.setdefault(id(w), []).append(stage)
        out = list(grads)
        tied_index = 0
        for i, v in enumerate(stage_vars):
            stages = users.get(id(v), [])
            if len(stages) < 2 or out[i] is None:
                continue
            mask = sum(1 << st for st in stages)
            out[i] = tf.raw_ops.CollectiveReduceV2(
                input=out[i], group_size=len(stages),
                group_key=links.tied_key(mask),
                instance_key=700_000 + tied_index, ordering_token=[],
                merge_op="Add", final_op="Id", communication_hint="auto",
                timeout_seconds=links.timeout)
            tied_index += 1
        return out

    def _smp_run(self, data, training, need_loss=True, need_outputs=True,
                 times=None):
        if self._smp_multi_process():
            return self._smp_run_process(data, training, need_loss,
                                         need_outputs)
        x, y, sample_weight, _, xs, ys, sws = self._smp_microbatches(data)
        graph = self.staged_graph
        m = self.num_microbatches
        schedule = get_schedule(self._smp_config().pipeline,
                                graph.num_stages, m)
        devices = self._smp_devices()
        fns = [graph.stage_fn(s, training=training)
               for s in range(graph.num_stages)]
        stage_vars = [[w for w in graph.stage_weights(s) if w.trainable]
                      for s in range(graph.num_stages)]
        loss_fn = None
        if need_loss and y is not None and self._compile_loss is not None:
            loss_fn = self._smp_loss_fn(ys, sws, sample_weight, m, training)

        targets = list(range(m))
        losses, outputs, grads = run_pipeline(
            fns, stage_vars if training else [[]] * graph.num_stages,
            loss_fn, schedule, devices, xs, targets,
            forward_only=not training, times=times)
        with tf.device(devices[-1]):
            flat_pred = [tf.concat([o[i] for o in outputs], axis=0)
                         for i in range(len(graph.outputs))]
            y_pred = graph.pack_outputs(flat_pred)
        return x, y, sample_weight, y_pred, losses, grads, stage_vars

    def executed_timeline(self, x, y=None, sample_weight=None, runs=3):
        """Measures when each stage ran each microbatch, for one batch.

        Runs the pipelined forward and backward pass of the batch `runs`
        times (no weight update; only forward without `y`) and returns the
        last run as a `keras_smp.pipeline.schedule.Timeline` in
        milliseconds: per stage, `(start, end, action)` of every forward
        (`F`, including the copy of its inputs from the previous stage) and
        backward (`B`) action, timed on the stage's device. Draw it with
        `timeline.draw("step.png")`, print `timeline.grid()`, export
        `timeline.to_chrome_trace("step.json")` (chrome://tracing,
        Perfetto), and compare `timeline.bubble_fraction()` with the
        planned schedule's.

        In one process (stages on local devices); the first replica's
        timing when there are several.

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
        from keras_smp.pipeline.schedule import Timeline

        if self._smp_multi_process():
            raise NotImplementedError(
                "executed_timeline() measures pipelines inside one process; "
                "with one stage per process, profile each worker with "
                "tf.profiler (see docs/pipeline.md).")
        if y is not None and self._compile_loss is None:
            raise ValueError("executed_timeline(x, y) needs a compiled loss.")
        training = y is not None
        recorded = []

        def replica(*data):
            times = []
            result = self._smp_run(data, training=training, times=times)
            recorded[:] = [a for a, _, _ in times]
            # TensorFlow prunes work whose results are unused, even with
            # control dependencies on it: fetch a checksum of everything.
            used = [tf.reduce_sum(tf.cast(t, "float64")) for t in
                    tf.nest.flatten((result[3], result[4], result[5]))
                    if t is not None]
            return (tf.stack([tf.stack([s, e]) for _, s, e in times]),
                    tf.add_n(used))

        strategy = self._smp_strategy()
        args = tuple(tf.convert_to_tensor(t) for t in (x, y, sample_weight)
                     if t is not None)

        @tf.function
        def timed(*data):
            if strategy is None:
                return replica(*data)
            out = strategy.run(replica, args=data)
            return tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0], out)

        for _ in range(max(1, runs)):
            spans = timed(*args)[0].numpy()
        t0 = spans[:, 0].min()
        schedule = get_schedule(self._smp_config().pipeline,
                                self.num_stages, self.num_microbatches)
        entries = [[] for _ in range(self.num_stages)]
        for action, (start, end) in zip(recorded, spans):
            entries[action.stage].append(
                (1000.0 * (start - t0), 1000.0 * (end - t0), action))
        return Timeline(schedule, [sorted(e, key=lambda t: t[0])
                                   for e in entries], unit="ms")

    def _smp_extra_losses(self):
        if self._smp_multi_process() and self._get_regularization_losses():
            raise NotImplementedError(
                "Weight regularizers are not supported with one pipeline "
                "stage per process yet; run the pipeline in one process "
                "(local_devices=partitions) or drop the regularizers.")
        own = [loss for layer in self._flatten_layers()
               for loss in layer._get_own_losses()]
        if own:
            raise NotImplementedError(
                "Losses added with `add_loss()` inside `call` are not "
                "supported in pipelined models yet; add them to the "
                "compiled loss instead.")
        return [self._aggregate_additional_loss(loss)
                for loss in self._get_regularization_losses()]

    def _smp_total_loss(self, losses, extra):
        terms = [l for l in losses if l is not None] + list(extra)
        return tf.add_n(terms) if terms else None

    def train_step(self, data):
        x, y, sw, y_pred, losses, grads, stage_vars = self._smp_run(
            data, training=True, need_outputs=self._smp_needs_outputs())
        if losses[0] is None:
            raise ValueError(
                "No loss to compute. Provide `y` and a `loss` argument in "
                "`compile()`.")
        extra = self._smp_extra_losses()
        by_var = {}
        for vs, gs in zip(stage_vars, grads):
            for v, g in zip(vs, gs):
                by_var[id(v)] = g if id(v) not in by_var else by_var[id(v)] + g
        trainable = self.trainable_weights
        if self._smp_multi_process():  # this process trains its stage only
            trainable = [v for v in trainable if id(v) in by_var]
        if extra:
            reg = tf.add_n(extra)
            scaled = (self.optimizer.scale_loss(reg)
                      if self.optimizer is not None else reg)
            tf_vars = [getattr(v, "value", v) for v in trainable]
            reg_grads = tf.gradients(scaled, [
                t._get_on_device_or_primary()
                if isinstance(t, tf.distribute.DistributedValues) else t
                for t in tf_vars], unconnected_gradients="zero")
            for v, g in zip(trainable, reg_grads):
                if id(v) in by_var:
                    by_var[id(v)] = by_var[id(v)] + g
                else:
                    by_var[id(v)] = g
        unscaled = [loss_module.unscale_loss_for_distribution(l) for l in losses]
        total = self._smp_total_loss(
            unscaled, [loss_module.unscale_loss_for_distribution(e)
                       for e in extra])
        batch = tf.shape(self._smp_flat_inputs(x)[0])[0]
        self._loss_tracker.update_state(total, sample_weight=batch)
        gradients = [by_var.get(id(v)) for v in trainable]
        if trainable:
            self.optimizer.apply_gradients(zip(gradients, trainable))
        else:
            warnings.warn("The model does not have any trainable weights.")
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def test_step(self, data):
        x, y, sw, y_pred, losses, _, _ = self._smp_run(
            data, training=False, need_outputs=self._smp_needs_outputs())
        if losses[0] is not None:
            extra = self._smp_extra_losses()
            total = self._smp_total_loss(
                [loss_module.unscale_loss_for_distribution(l) for l in losses],
                [loss_module.unscale_loss_for_distribution(e) for e in extra])
            batch = tf.shape(self._smp_flat_inputs(x)[0])[0]
            self._loss_tracker.update_state(total, sample_weight=batch)
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def predict_step(self, data):
        _, _, _, y_pred, _, _, _ = self._smp_run(
            data, training=False, need_loss=False)
        return y_pred


_BATCH_ERROR = "does not divide into microbatches"


def _clear_batch_errors(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            text = e.message or str(e)
            if _BATCH_ERROR not in text:
                raise
            # TensorFlow prints the Assert's parts as "[a] [b] [c]".
            start = text.rfind("The per-replica batch of")
            message = " ".join(text[start:].split()).split(" [[")[0]
            raise ValueError(message.replace("] [", " ").rstrip("]")) from e

    run._smp_clear = True
    run.__wrapped__ = fn
    return run


def _set_local(variable, value):
    """Replaces a Keras variable's storage with a process-local variable."""
    variable._value = None
    variable._smp_local = True
    with scope.local_variables(), tf.init_scope():
        variable._initialize(value)


def _track_slots(optimizer):
    """Records which model variable each optimizer slot is made for."""
    if optimizer is None or optimizer in _SLOT_REFS:
        return
    refs = _SLOT_REFS[optimizer] = {}
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        if getattr(reference_variable, "_smp_local", False):
            # Another stage's process-local copy: TensorFlow's optimizer
            # would colocate the slot with it, outside the strategy.
            slot = base_optimizer.BaseOptimizer.add_variable_from_reference(
                optimizer, reference_variable, *args, **kwargs)
        else:
            slot = original(reference_variable, *args, **kwargs)
        refs[id(slot)] = reference_variable
        return slot

    object.__setattr__(optimizer, "add_variable_from_reference",
                       add_variable_from_reference)


def check_pipelined(model):
    """Raises if `model` would train unpipelined under `partitions > 1`."""
    from keras_smp.distribute.strategy import SMPStrategy

    strategy = model.distribute_strategy
    if (isinstance(strategy, SMPStrategy) and strategy.num_stages > 1
            and not isinstance(model, DistributedModel)):
        raise ValueError(
            f"Model '{model.name}' is a plain {type(model).__name__} under an "
            f"SMPStrategy with partitions={strategy.num_stages}; it would "
            "train without pipelining. Wrap it before compiling: "
            "`model = keras_smp.DistributedModel(model)` (or subclass "
            "keras_smp.DistributedModel).")


def install_guard():
    """Makes plain Keras models fail fast under `partitions > 1`."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    for name in ("make_train_function", "make_test_function",
                 "make_predict_function"):
        original = getattr(TensorFlowTrainer, name)
        if getattr(original, "_smp_guarded", False):
            continue

        def guarded(self, *args, _original=original, **kwargs):
            check_pipelined(self)
            return _original(self, *args, **kwargs)

        guarded._smp_guarded = True
        setattr(TensorFlowTrainer, name, guarded)
