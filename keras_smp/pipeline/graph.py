"""Keras model -> staged graph: what every pipeline stage computes.

A `StagedGraph` is a Keras operation graph (the nodes of a functional
model, or of a subclassed model's `call` traced on symbolic inputs) with a
stage for every node. It turns into one function per stage,
`list[Tensor] -> list[Tensor]`, what the pipeline runtime calls:

- stage 0 receives the model inputs (flattened);
- stage s returns the tensors that later stages or the model outputs still
  need (its "carry"): its own outputs and, for skip connections that jump
  over it, tensors it passes through unchanged;
- the last stage returns the model outputs (flattened).

A carried tensor that holds a Keras mask when the model runs
(`Embedding(mask_zero=True)`, `Masking`) carries it too (`MaskOf`, after
the carry's own tensors): Keras passes masks between layers as attributes
of the tensors, which a stage boundary would drop. The receiving stage
attaches it again, so layers and the loss after the boundary see what
they see in the model's own `call` (`pack_outputs` attaches the outputs'
masks). Which tensors hold one is found by tracing the stages once
(`_runtime_masks`): at run time it can differ from the symbolic graph.

Passing skip tensors through intermediate stages keeps every transfer
between neighbouring stages, as the schedules' send/receive actions (and
the collective transport) assume.
"""

import contextlib
import math
import warnings

from keras import backend
from keras import ops
from keras import tree

from keras_smp.pipeline import partition as partition_lib
from keras_smp.pipeline import recompute as recompute_lib
from keras_smp.pipeline.scope import current_partition
from keras_smp.runtime import keras_private
from keras_smp.runtime import patches
from keras_smp.runtime import sparse


def _reads_inputs_only(node, given, some):
    """Whether `node` reads model inputs only (ids in `given`), one of
    them in `some`."""
    xs = [id(x) for x in tree.flatten(node.input_tensors)]
    return bool(xs) and all(x in given for x in xs) and any(
        x in some for x in xs)


def _node_name(node, seen):
    name = node.operation.name
    count = seen.get(name, 0)
    seen[name] = count + 1
    return name if count == 0 else f"{name}#{count}"


def _flops(node, params):
    """Rough forward FLOPs per sample of one node (for cost="flops")."""
    out = 0.0
    for t in tree.flatten(node.outputs):
        dims = [d for d in t.shape[1:] if d is not None]
        size = math.prod(dims) if dims else 1
        spatial = math.prod(dims[:-1]) if len(dims) > 1 else 1
        out += size + 2.0 * params * spatial
    return out


def _operation_weights(operation):
    return list(getattr(operation, "weights", None) or [])


def _paired_inputs(given, inner_inputs):
    """`[(given tensor, nested model input)]` when `given` (what a call
    passed the nested model) maps onto its inputs one to one with the same
    rank, sparseness and raggedness, and the same dtype or floating dtypes
    (its `call` casts those: mixed precision feeds float16 outputs to
    float32 inputs); otherwise None."""
    if isinstance(inner_inputs, dict):
        if not isinstance(given, dict) or set(given) != set(inner_inputs):
            return None
        pairs = [(given[k], inner_inputs[k]) for k in inner_inputs]
    else:
        flat_given, flat_inner = tree.flatten(given), tree.flatten(
            inner_inputs)
        if isinstance(given, dict) or len(flat_given) != len(flat_inner):
            return None
        pairs = list(zip(flat_given, flat_inner))
    for outer, inner in pairs:
        dtype = getattr(outer, "dtype", None)
        if ((dtype != inner.dtype and not (
                dtype is not None and backend.is_float_dtype(dtype)
                and backend.is_float_dtype(inner.dtype)))
                or len(getattr(outer, "shape", ())) != len(inner.shape)
                or any(bool(getattr(outer, a, False))
                       != bool(getattr(inner, a, False))
                       for a in ("sparse", "ragged"))):
            return None
    return pairs


def _expandable(node, keep, used):
    """The functional graph of the nested model `node` calls, when its
    layers can stand in its place; otherwise None. `used`: ids of the
    tensors the enclosing graph uses (an output nothing uses keeps the
    model whole: its branch, and the losses it adds, would be lost)."""
    op = node.operation
    functional = keras_private.plain_functional(op)
    if functional is None or keep(op):
        return None
    args, kwargs = node.arguments.args, node.arguments.kwargs
    if (len(args) != 1 or set(kwargs) - {"training", "mask"}
            or any(m is not None for m in tree.flatten(kwargs.get("mask")))):
        return None
    if any(id(t) not in used for t in tree.flatten(node.outputs)):
        return None
    inner_inputs, _ = keras_private.functional_structs(functional)
    if _paired_inputs(args[0], inner_inputs) is None:
        return None
    return functional


def _layers_of(op):
    """`op` and every layer inside it (an op that is not a layer alone)."""
    return (keras_private.flatten_layers(op)
            if hasattr(op, "_flatten_layers") else [op])


def _used(nodes, outputs):
    return {id(t) for n in nodes for t in tree.flatten(n.input_tensors)} | {
        id(t) for t in tree.flatten(outputs)}


def fixed_training(node):
    """The `training` a subclassed model's `call` fixed for `node` (True
    or False: `self.bn(h, training=False)`), which the step's own
    `training` must not override; None when the step decides
    (`mark_fixed_training`)."""
    return getattr(node, "_smp_fixed_training", None)


def mark_fixed_training(node, training):
    """Marks a node whose `training` a subclassed model's `call` fixed:
    its layer runs with `training` whatever the step's, as in Keras (a
    functional model's recorded `training` is overridden)."""
    node._smp_fixed_training = bool(training)


def _call_again(nodes, values, training, keep, used, expanded,
                fixed=None):
    """Calls the operations of `nodes` again on the symbolic tensors in
    `values` (`id(old tensor) -> new tensor`, filled in as they run),
    expanding nested models; `training`: what an enclosing nested model's
    call passes its layers (None: each layer's own argument), `fixed`: the
    `training` that call fixed (`fixed_training`), or None. A node whose
    inputs are all unchanged keeps its outputs (not called again)."""
    for node in nodes:
        functional = _expandable(node, keep, used)
        if functional is None and training is None and all(
                values.get(id(t), t) is t
                for t in tree.flatten(node.input_tensors)):
            for t in tree.flatten(node.outputs):
                values[id(t)] = t
            continue
        args, kwargs = node.arguments.fill_in(values)
        if functional is not None:
            inner_inputs, inner_outputs = keras_private.functional_structs(
                functional)
            # (cast as the nested model's call casts its inputs)
            inner = {id(i): o if o.dtype == i.dtype else ops.cast(o, i.dtype)
                     for o, i in _paired_inputs(args[0], inner_inputs)}
            inner_nodes = StagedGraph.topological_nodes(
                inner_inputs, inner_outputs)
            # The outermost explicit `training` wins, as Keras' functional
            # call passes it down (the step's own `training` overrides
            # all of them when the stages run).
            _call_again(
                inner_nodes, inner, training if training is not None
                else kwargs.get("training"), keep,
                _used(inner_nodes, inner_outputs), expanded,
                fixed=fixed if fixed is not None else fixed_training(node))
            outs = [inner[id(t)] for t in tree.flatten(inner_outputs)]
            expanded.append(node.operation)
        else:
            if training is not None and "training" in (
                    keras_private.call_context_arguments(node.operation)):
                kwargs["training"] = training
            outs = tree.flatten(node.operation(*args, **kwargs))
            constant = fixed if fixed is not None else fixed_training(node)
            if constant is not None and outs:
                mark_fixed_training(keras_private.producing_node(outs[0]),
                                    constant)
        for old, new in zip(tree.flatten(node.outputs), outs):
            values[id(old)] = new


def expand_nested_models(inputs, outputs, keep=lambda model: False):
    """A model graph with each nested model's layers in its place, so that
    partitioning can cut inside it.

    A Sequential or functional model used as a layer (a backbone such as
    `keras.applications.ResNet50`, a block built as a `keras.Model`) is one
    node of the graph around it, which automatic partitioning could only
    place whole on one stage. Here its layers are called again, from the
    same symbolic `inputs`, as its own `call` calls them, recursively: a
    `training=` given to the nested model reaches its layers (the
    outermost one given wins, and the step's `training` overrides it, as
    in Keras). They are the same layer objects: weights, names and saving
    do not change.

    Kept whole: models for which `keep(model)` is true (marked for
    recomputation, named as a split point), models with their own `call`,
    calls passing a `mask` or inputs of another dtype, rank, sparseness or
    raggedness than the model's inputs, and calls with an output nothing
    uses. Nothing is expanded in a model with tensor-parallel layers (their
    pairing counts the calls made so far), or when two different layers
    the expanded graph calls would share a name (split points and
    recomputation name layers): a warning names them.

    Returns `(outputs, models)`: the new outputs (the same structure) and
    the nested models expanded, at each call (innermost first);
    `(outputs, [])` unchanged when none is.

    ```python
    import keras
    from keras_smp.pipeline.graph import expand_nested_models

    block_in = keras.Input((4,))
    block = keras.Model(block_in, keras.layers.Dense(4)(
        keras.layers.Dense(4)(block_in)), name="block")
    x = keras.Input((4,))
    y = keras.layers.Dense(2)(block(x))
    new_y, models = expand_nested_models(x, y)
    assert models == [block] and new_y is not y
    ```
    """
    nodes = StagedGraph.topological_nodes(inputs, outputs)
    used = _used(nodes, outputs)
    if not any(_expandable(n, keep, used) is not None for n in nodes):
        return outputs, []
    if any(hasattr(layer, "_smp_tp_mode") for node in nodes
           for layer in _layers_of(node.operation)):
        return outputs, []
    values = {id(t): t for t in tree.flatten(inputs)}
    expanded = []
    _call_again(nodes, values, None, keep, used, expanded)
    new_outputs = tree.map_structure(lambda t: values.get(id(t), t), outputs)
    named = {}
    for node in StagedGraph.topological_nodes(inputs, new_outputs):
        named.setdefault(node.operation.name, set()).add(id(node.operation))
    shared = sorted(name for name, ids in named.items() if len(ids) > 1)
    if shared:
        warnings.warn(
            f"keras-smp: nested models are placed whole (each on one "
            f"stage) because different layers in them share the name(s) "
            f"{shared[:5]}: split points and recomputation name layers. "
            f"Give the layers unique names to let stages cut inside nested "
            f"models.", stacklevel=4)
        return outputs, []
    return new_outputs, expanded


class MaskOf:
    """A carry entry: the Keras mask a carried tensor holds when the
    stages run (its `shape` and `dtype` as traced), sent after the
    stage's tensors and attached to it again by the receiving stage."""

    def __init__(self, owner, shape, dtype):
        self.owner_id = id(owner)
        self.shape = shape
        self.dtype = dtype
        self.name = f"{owner.name}_mask"

    def __repr__(self):
        return f"MaskOf({self.name[:-5]}, shape={self.shape})"


class StagedGraph:
    """A Keras operation graph with a pipeline stage for every node.

    Args:
        inputs: the model's symbolic inputs (a structure of KerasTensors).
        outputs: the model's symbolic outputs (a structure).
        stage_of_node: dict `id(node) -> stage`.
        num_stages: number of stages.
        names: dict `id(node) -> unique name` (for summaries and errors).
    """

    def __init__(self, inputs, outputs, stage_of_node, num_stages, names):
        self.inputs_struct = inputs
        self.outputs_struct = outputs
        self.inputs = tree.flatten(inputs)
        self.outputs = tree.flatten(outputs)
        self.num_stages = num_stages
        nodes, _ = keras_private.build_graph_map(self.inputs, self.outputs)
        self.nodes = [n for n in nodes if n.operation and not n.is_input]
        self.stage_of = {id(n): stage_of_node[id(n)] for n in self.nodes}
        self.names = names
        #: Nested models whose layers were placed one by one, at each call
        #: (`expand_nested_models`).
        self.expanded_models = []
        self._validate()
        self._compute_carries()

    @property
    def expanded(self):
        """Names of the nested models placed layer by layer (one per call
        of each)."""
        return [m.name for m in self.expanded_models]

    # -- construction -----------------------------------------------------

    @classmethod
    def topological_nodes(cls, inputs, outputs):
        nodes, _ = keras_private.build_graph_map(
            tree.flatten(inputs), tree.flatten(outputs))
        return [n for n in nodes if n.operation and not n.is_input]

    @classmethod
    def auto(cls, inputs, outputs, num_stages, cost="parameters",
             split_points=None, stages_name=None):
        """Partitions the graph into contiguous stages balancing `cost`.

        `stages_name`: how errors name the stage count (default
        `partitions=<num_stages>`)."""
        nodes = cls.topological_nodes(inputs, outputs)
        # Layers reading only model inputs, one of them sparse or ragged:
        # first, and kept on stage 0 (a stage boundary carries dense
        # tensors only). Split points name stages' first layers in the
        # model's order: kept as given.
        given = {id(t) for t in tree.flatten(inputs)}
        unsplit = {id(t) for t in tree.flatten(inputs)
                   if getattr(t, "sparse", False)
                   or getattr(t, "ragged", False)}
        first = [n for n in nodes if unsplit and split_points is None
                 and _reads_inputs_only(n, given, unsplit)]
        seen, names, infos, counted = {}, {}, [], set()
        for node in nodes:  # (named in the model's order: "dense#1")
            names[id(node)] = _node_name(node, seen)
        if first:
            chosen = {id(n) for n in first}
            nodes = first + [n for n in nodes if id(n) not in chosen]
        for node in nodes:
            name = names[id(node)]
            params = 0
            for w in _operation_weights(node.operation):
                if id(w) not in counted:
                    counted.add(id(w))
                    params += math.prod(w.shape)
            infos.append(partition_lib.LayerInfo(
                name, params, _flops(node, params)))
        if num_stages > len(infos):
            raise ValueError(
                f"{stages_name or f'partitions={num_stages}'} but the model "
                f"has only {len(infos)} layers to place; every stage needs "
                f"at least one layer. Use "
                + ("partitions x virtual_stages" if stages_name
                   else "partitions") + f" <= {len(infos)}.")
        plan = partition_lib.plan_partitions(
            infos, num_stages, cost=cost, split_points=split_points,
            first_stage=len(first))
        stages = {id(n): s for n, s in zip(nodes, plan.stages)}
        graph = cls(inputs, outputs, stages, num_stages, names)
        graph.plan = plan
        return graph

    @classmethod
    def manual(cls, inputs, outputs, recorded, num_stages, default_partition):
        """Stages from `partition()` scopes recorded while tracing."""
        nodes = cls.topological_nodes(inputs, outputs)
        seen, names, stages = {}, {}, {}
        for node in nodes:
            names[id(node)] = _node_name(node, seen)
            stage = recorded.get(id(node))
            stages[id(node)] = default_partition if stage is None else stage
            if stages[id(node)] >= num_stages:
                raise ValueError(
                    f"Layer '{names[id(node)]}' is called inside "
                    f"keras_smp.partition({stages[id(node)]}), but there are "
                    f"only {num_stages} stages (indices 0 to "
                    f"{num_stages - 1}). Use a smaller index or raise "
                    "`partitions`.")
        return cls(inputs, outputs, stages, num_stages, names)

    def _validate(self):
        producer = {}
        for node in self.nodes:
            for t in tree.flatten(node.outputs):
                producer[id(t)] = node
        for node in self.nodes:
            s = self.stage_of[id(node)]
            for t in tree.flatten(node.input_tensors):
                src = producer.get(id(t))
                if src is not None and self.stage_of[id(src)] > s:
                    raise ValueError(
                        f"Layer '{self.names[id(node)]}' (partition {s}) "
                        f"consumes the output of layer "
                        f"'{self.names[id(src)]}' (partition "
                        f"{self.stage_of[id(src)]}): data must flow from "
                        "lower to higher partitions. Reorder the "
                        "keras_smp.partition() scopes in `call`.")
        self._check_weights_given_to_operations()
        used = set(self.stage_of.values())
        empty = [s for s in range(self.num_stages) if s not in used]
        if empty:
            raise ValueError(
                f"Pipeline stage(s) {empty} of partitions={self.num_stages} "
                "have no layers. Put at least one layer in every "
                "keras_smp.partition(i) scope, or lower `partitions`.")

    def _check_weights_given_to_operations(self):
        """Raises if a graph node (a `keras.ops` call such as
        `keras.ops.einsum("bd,vd->bv", h, emb.embeddings)`, a tied output
        projection, or a layer given a weight as an argument) takes a
        weight of a layer on another stage: its stage's backward would not
        give the weight this use's gradient (its own layers' weights
        only)."""
        weights = {}
        for node in self.nodes:
            for w in _operation_weights(node.operation):
                weights.setdefault(id(w), set()).add(self.stage_of[id(node)])
        for node in self.nodes:
            stage = self.stage_of[id(node)]
            for value in tree.flatten((node.arguments.args,
                                       node.arguments.kwargs)):
                holders = (weights.get(id(value), ())
                           if keras_private.is_variable(value) else ())
                # (a variable no layer holds, read for its value, is
                # left as Keras leaves it)
                if holders and stage not in holders:
                    raise ValueError(
                        f"'{self.names[id(node)]}' (stage {stage}) takes "
                        f"the weight {value.path!r} as an argument, but the "
                        "layer holding it is on stage(s) "
                        f"{sorted(holders)}: this use's gradient would be "
                        "lost (and with one stage per process the weight "
                        "is not held there). Use the "
                        "weight inside a layer on the same stage (a custom "
                        "layer that holds the layer whose weight it uses, "
                        "like keras_hub's ReversibleEmbedding for a tied "
                        "output projection), or keep both on one stage "
                        "(`split_points`).")

    def _compute_carries(self):
        order = {}
        for i, t in enumerate(self.inputs):
            order.setdefault(id(t), (-1, i, t))
        for k, node in enumerate(self.nodes):
            for j, t in enumerate(tree.flatten(node.outputs)):
                order.setdefault(id(t), (k, j, t))
        produced_at = {id(t): -1 for t in self.inputs}
        for node in self.nodes:
            for t in tree.flatten(node.outputs):
                produced_at[id(t)] = self.stage_of[id(node)]
        needed_at = {}
        for node in self.nodes:
            s = self.stage_of[id(node)]
            for t in tree.flatten(node.input_tensors):
                needed_at.setdefault(id(t), set()).add(s)
        last = self.num_stages - 1
        self._plain_carries = []
        for s in range(last):
            keep = [
                v for key, v in sorted(order.items(), key=lambda kv: kv[1][:2])
                if produced_at.get(key, last + 1) <= s
                and (any(c > s for c in needed_at.get(key, ()))
                     or any(key == id(o) for o in self.outputs))]
            self._plain_carries.append([t for _, _, t in keep])
        self._plain_carries.append(list(self.outputs))
        self._carries = None
        self._dtypes = None
        # Sparse and ragged model inputs (sending one failed in
        # `tf.control_dependencies` in one process and in the collective
        # across processes). Only inputs: Keras marks some dense results
        # sparse (`x * 0.5` of a Dense layer's output).
        inputs = {id(t) for t in self.inputs}
        self.refuse_carried(
            lambda t: None if id(t) not in inputs else (
                "sparse" if getattr(t, "sparse", False) else "ragged"
                if getattr(t, "ragged", False) else None),
            range(last), "a stage boundary carries dense tensors only",
            "make it dense (a `Dense` layer on it)")
        #: A context manager factory for `_runtime_masks`' trace (the
        #: model's: other stages' weights as shapes only).
        self.trace_scope = contextlib.nullcontext
        #: How many of the last stage's tensors are the model outputs (the
        #: rest are their masks).
        self.num_outputs = len(self.outputs)

    def refuse_carried(self, kind_of, stages, why, fix):
        """Raises for the first tensor that a stage in `stages` (not the
        last) hands on to the next and `kind_of(tensor)` names (e.g.
        "sparse"), naming it, the later layers that use it, `why` and `fix`
        (what to make of it on its stage)."""
        producer = {id(t): node for node in self.nodes
                    for t in tree.flatten(node.outputs)}
        for s in stages:
            for t in self._plain_carries[s]:
                kind = kind_of(t)
                if kind is None:
                    continue
                made = (f"input '{t.name}'" if id(t) not in producer else
                        f"the output of layer "
                        f"'{self.names[id(producer[id(t)])]}'")
                users = sorted({self.names[id(n)] for n in self.nodes
                                if self.stage_of[id(n)] > s and any(
                                    x is t for x in tree.flatten(
                                        n.input_tensors))})
                use = (f"is used on a later pipeline stage than {s} (by "
                       f"layer(s) {users})" if users else "is a model output "
                       f"made before the last pipeline stage (stage {s})")
                move = ("the layers that use it on " + (
                    f"stage {s} or earlier" if s else "the first stage")
                    if users else "the layer that makes it on the last stage")
                raise ValueError(
                    f"The {kind} tensor {made} {use}: {why}. Put {move} "
                    "(`split_points`, or `keras_smp.partition()` scopes), "
                    f"or {fix} there.")

    @property
    def carries(self):
        """Per stage, the tensors it hands on (the last: the outputs),
        each followed by the Keras masks (`MaskOf`) those tensors carry
        when the stages run (found once, `_runtime_masks`)."""
        if self._carries is None:
            masked = self._runtime_masks()
            self._carries = [
                list(plain) + [MaskOf(t, *masked[s][id(t)]) for t in plain
                               if id(t) in masked[s]]
                for s, plain in enumerate(self._plain_carries)]
        return self._carries

    def dtype_of(self, tensor):
        """The dtype `tensor` (a carried tensor: one a stage hands on, or
        a model output) has when the stages run, which the transfers
        between stage processes send it as.

        Keras gives a layer whose class defines `compute_output_shape`
        (and not `compute_output_spec`) outputs of its compute dtype
        whatever its `call` returns: a `Lambda` returning
        `ops.argmax(...)` (int32) is float32 in the graph, and with one
        stage per process the receiving rank waited for a float32 tensor
        while the sender sent int32 ("expected ... data_type 1 but got
        ... data_type 3"); so do the layers that give their outputs
        their input's graph dtype (`Reshape`, `Flatten` after such a
        `Lambda`), and `Concatenate` of int inputs (the compute dtype).
        The stages are traced once (`_runtime_dtypes`); only called with
        stages in different processes."""
        if self._dtypes is None:
            self._dtypes = self._runtime_dtypes()
        return self._dtypes.get(id(tensor), getattr(tensor, "dtype", None))

    def _runtime_dtypes(self):
        """`{id(tensor): dtype}` of the carried tensors whose dtype when
        the stages run is not the graph's (`dtype_of`), from one trace of
        the stages (about 20 ms for a model of a few layers); `{}` in a
        model with tensor-parallel layers (their collectives are traced
        per stage), which keeps the graph's dtypes."""
        carried = {id(t): t for carry in self._plain_carries for t in carry}
        if self.has_tensor_parallel_layers():
            return {}
        found = {}

        def stage_done(s, values):
            for t in self._plain_carries[s]:
                value = values.get(id(t))
                if value is not None and hasattr(value, "dtype"):
                    found[id(t)] = backend.standardize_dtype(value.dtype)

        try:
            self._trace_stages([(t.shape, t.dtype) for t in self.inputs],
                               stage_done)
        except Exception as e:  # noqa: BLE001 - the graph's dtypes then
            warnings.warn(
                "keras-smp: tracing the pipeline stages to find the dtypes "
                "of the tensors crossing stage boundaries failed "
                f"({type(e).__name__}: {e}); they travel as the dtypes "
                "of Keras' graph (a layer returning another dtype than "
                "its compute dtype then fails in the transfer).",
                stacklevel=2)
            return {}
        return {i: d for i, d in found.items()
                if d != backend.standardize_dtype(carried[i].dtype)}

    def _runtime_masks(self):
        """Per stage, `{id(tensor): (shape, dtype)}` of its carried tensors
        that hold a Keras mask when the stages run.

        Keras passes masks as attributes of the tensors at run time, and
        they can differ from the symbolic graph's: `MultiHeadAttention`
        clears its inputs' masks (so a residual `Add` after it has none),
        a nested model's layers attach masks its symbolic outputs lack.
        The stages are traced once, in order, into a graph that is never
        run (inference mode, one shared set of tensors, as when the
        stages hand their masks on), to see which carried tensors hold
        one at the end of their stage. Skipped (no masks) for models with
        no mask anywhere in the graph; tensor-parallel layers (their
        collectives are traced per stage) keep the symbolic masks.
        """
        plain = self._plain_carries
        symbolic = any(keras_private.keras_mask(t) is not None
                       for node in self.nodes
                       for t in tree.flatten(node.outputs))
        nested = any(hasattr(n.operation, "_run_through_graph")
                     for n in self.nodes)
        if not symbolic and not nested:
            return [{} for _ in plain]
        if self.has_tensor_parallel_layers():
            return [{id(t): (keras_private.keras_mask(t).shape, "bool")
                     for t in carry
                     if keras_private.keras_mask(t) is not None}
                    for carry in plain]
        found = []

        def stage_done(s, values):
            found.append({})
            for t in plain[s]:
                mask = keras_private.keras_mask(values[id(t)])
                if mask is not None:
                    found[-1][id(t)] = (mask.shape, mask.dtype)

        self._trace_stages([(t.shape, t.dtype) for t in self.inputs],
                           stage_done)
        return found

    def _trace_stages(self, input_specs, stage_done, training=False,
                      reads=None, scoped=True, updates=None, free=None,
                      until=None):
        """Runs the stages in order, in inference mode (or `training`),
        into a graph that is never run, on inputs of `input_specs`
        (`(shape, dtype)`); `stage_done(stage, values)` sees
        `{id(graph tensor): value}` after each stage. `reads`: `{id(node):
        dict}` of nodes whose calls note the weights they read (`id(weight)
        -> whether its gradient there is sparse`, `sparse.note_reads`);
        `updates`: a dict taking, for those calls, `id(node) -> {id(weight)
        the call assigns}` (in training: moving statistics). `free`: a
        dict taking, for the weights those calls read, their sparse
        gradients' ids' shapes where they are computed from constants and
        shapes alone (`sparse.note_reads`). `until`: ids of nodes after
        whose calls the trace may stop.
        `scoped`: inside `trace_scope` (other stages' weights as
        shapes)."""
        import keras
        import tensorflow as tf

        reads = reads or {}
        scope = keras.StatelessScope(collect_losses=bool(reads))

        left = None if until is None else set(until)

        def trace(*tensors):
            values = {id(t): v for t, v in zip(self.inputs, tensors)}
            for s in range(self.num_stages):
                if left is not None and not left:
                    break
                for node in self.stage_nodes(s):
                    if left is not None:
                        if not left:
                            break
                        left.discard(id(node))
                    args, kwargs = node.arguments.fill_in(values)
                    call = keras_private.operation_fn(node.operation,
                                                      training=training)
                    before = len(scope.losses)
                    state = dict(scope.state_mapping)
                    with (patches.variable_reads(stateless=True)
                          if id(node) in reads else
                          contextlib.nullcontext([])) as seen:
                        outs = call(*args, **kwargs)
                    if updates is not None and id(node) in reads:
                        updates.setdefault(id(node), set()).update(
                            w for w, v in scope.state_mapping.items()
                            if state.get(w) is not v)
                    if seen:
                        # (the losses it added count as its outputs)
                        sparse.note_reads(reads[id(node)], seen,
                                    [outs, scope.losses[before:]], training,
                                    free)
                    for x, y in zip(tree.flatten(node.outputs),
                                    tree.flatten(outs)):
                        values[id(x)] = y
                stage_done(s, values)
            if reads:  # (the layers keep no trace of the losses collected)
                keras_private.clear_added_losses(
                    n.operation for n in self.nodes)
            return []

        specs = [tf.TensorSpec(shape, dtype) for shape, dtype in input_specs]
        # Stateless: no state changes, added losses dropped; weights this
        # process does not hold (other stages') read as placeholders.
        within = self.trace_scope if scoped else contextlib.nullcontext
        with tf.init_scope(), within(), scope, \
                keras_private.call_context(None, training):
            tf.function(trace, autograph=False).get_concrete_function(*specs)

    def batch_free_sparse(self, stages=None):
        """Ids of the trainable weights, read in `stages` (default: all),
        whose gradient is sparse wherever they are read in training, with
        ids that neither come from the model inputs' values nor change
        with the batch size: a position embedding (`Embedding(maxlen)`
        looked up at `ops.arange(length)` and added to every row). One
        device's gradient then holds the same ids for any batch, each row
        summed over it, so the microbatches' rows are added position by
        position (`keras_smp.runtime.sparse`); other sparse gradients
        (token ids, position ids broadcast over the batch) concatenate.

        Traced in training (into graphs never run, up to the last such
        call) for the calls of layers holding an `Embedding`, at batch
        sizes 2 and 3 (other unknown dimensions 8): a weight qualifies
        when every read's ids are computed from constants and shapes
        alone (`sparse.from_shapes`: not from values, variables or random
        draws) and have the same fully known shape at both. A gather of a
        layer holding no `Embedding` keeps concatenating. Traced again
        when such a layer's `trainable` changed. When the trace fails,
        none (with a warning).
        """
        import keras

        def holds_embedding(node):
            op = node.operation
            return hasattr(op, "_flatten_layers") and any(
                isinstance(layer, keras.layers.Embedding)
                for layer in keras_private.flatten_layers(op))

        wanted = set(range(self.num_stages) if stages is None else stages)
        calls = [n for n in self.nodes if holds_embedding(n)
                 and self.stage_of[id(n)] in wanted]
        key = (tuple(sorted(wanted)), self._trainable_key(calls))
        cached = self.__dict__.get("_batch_free")
        if cached is not None and cached[0] == key:
            return cached[1]
        calls = [n for n in calls if any(
            w.trainable for w in _operation_weights(n.operation))]
        found = None
        if calls and not self.has_tensor_parallel_layers():
            traces = []
            try:
                for rows in (2, 3):
                    free = {}
                    self._trace_stages(
                        [((rows,) + tuple(8 if d is None else d
                                          for d in tuple(t.shape)[1:]),
                          t.dtype) for t in self.inputs],
                        lambda s, values: None, training=True,
                        reads={id(n): {} for n in calls}, free=free,
                        until={id(n) for n in calls})
                    traces.append(free)
            except Exception as e:  # pylint: disable=broad-except
                # (the same on every rank: the same model, traced alike)
                warnings.warn(
                    "keras-smp traced the model at batch sizes 2 and 3 "
                    "(unknown lengths as 8) to find embedding lookups whose "
                    "ids do not depend on the batch (a position "
                    "embedding's), and the trace failed "
                    f"({type(e).__name__}: {e}). Each such lookup's "
                    "gradient is concatenated over the microbatches, which "
                    "Adam-like optimizers apply otherwise than one device "
                    "(token lookups are exact either way). Declaring the "
                    "inputs' lengths (keras.Input((128,))) may let the "
                    "trace run.", stacklevel=3)
            else:
                found = sparse.batch_free(*traces)
        self._batch_free = (key, found or set())
        return self._batch_free[1]

    def has_unknown_lengths(self):
        """Whether an input leaves a dimension other than the batch
        unknown (`keras.Input((None,))`): batches may come in several
        lengths."""
        return any(d is None for t in self.inputs
                   for d in tuple(t.shape)[1:])

    def has_tensor_parallel_layers(self):
        """Whether a stage holds a tensor-parallel layer."""
        return any(hasattr(layer, "_smp_tp_mode")
                   for s in range(self.num_stages)
                   for layer in self.stage_layers(s))

    def output_masks(self):
        """Whether each flattened model output holds a Keras mask when the
        model runs (its mask then reaches the loss and the metrics)."""
        masked = {c.owner_id for c in self.carries[-1][self.num_outputs:]}
        return [id(t) in masked for t in self.outputs]

    def output_mask_fn(self, multi_process=False, wanted_outputs=None):
        """`flat inputs -> [the Keras mask of each flattened output that
        holds one when the model runs, else None]` for a whole batch,
        computed ahead from the model inputs by the symbolic graph's mask
        computations (inference mode); only those of `wanted_outputs`
        (flat indices) when given.

        A pipeline weights each microbatch's masked loss by its share of
        the batch's unmasked entries, which it needs before the first
        microbatch's backward (the step checks that each microbatch's mask
        is the one computed here). With one stage per process
        (`multi_process`), a mask computed from weights' results (held
        by other processes) is refused.
        """
        asked = [masked and (wanted_outputs is None or k in wanted_outputs)
                 for k, masked in enumerate(self.output_masks())]
        masks = [keras_private.keras_mask(t) if masked else None
                 for t, masked in zip(self.outputs, asked)]
        if any(masked and mask is None for mask, masked in
               zip(masks, asked)):
            raise NotImplementedError(
                "A model output holds a Keras mask when the model runs but "
                "not in its symbolic graph (a nested model's layers attach "
                "it); a pipeline with microbatches > 1 computes the outputs' "
                "masks ahead from that graph. Apply the masking layers in "
                "the outer model, or use microbatches=1.")
        wanted = [mask for mask in masks if mask is not None]
        if not wanted:
            return lambda flat_inputs: [None] * len(masks)
        nodes, _ = keras_private.build_graph_map(self.inputs, wanted)
        weighted = sorted({n.operation.name for n in nodes
                           if n.operation is not None and not n.is_input
                           and _operation_weights(n.operation)})
        if weighted and multi_process:
            raise NotImplementedError(
                "The Keras mask of a model output is computed from the "
                f"results of layers with weights ({', '.join(weighted)}), "
                "which other stage processes hold. A pipeline weights each "
                "microbatch's masked loss by its share of the batch's "
                "unmasked entries, so it computes the outputs' masks from "
                "the model inputs before the step. Compute the mask from "
                "the inputs (Embedding(mask_zero=True) or Masking applied "
                "to an input), or use microbatches=1.")
        fn = keras_private.operations_function(list(self.inputs), wanted)

        def run(flat_inputs):
            got = iter(fn(list(flat_inputs)))
            return [None if mask is None else next(got) for mask in masks]

        return run

    def weights_reaching_no_loss(self, output_has_loss, adds_loss):
        """The weights no loss depends on (`id`s): Keras gives them no
        gradient, and the optimizer leaves them alone.

        Args:
            output_has_loss: per flattened model output, whether the
                compiled loss uses it.
            adds_loss: `operation -> bool`: whether a node's operation may
                add a loss when called (it and its inputs then reach the
                loss).

        A node is taken to use all its inputs and weights for all its
        outputs, so a weight in the result certainly reaches no loss
        (an output's head when the loss names only the other outputs).
        """
        reaching = {id(t) for t, has in zip(self.outputs, output_has_loss)
                    if has}
        used = set()
        for node in reversed(self.nodes):  # consumers before producers
            if adds_loss(node.operation) or any(
                    id(t) in reaching for t in tree.flatten(node.outputs)):
                reaching.update(
                    id(t) for t in tree.flatten(node.input_tensors))
                used.update(id(w) for w in _operation_weights(node.operation))
        return {id(w) for s in range(self.num_stages)
                for w in self.stage_weights(s)} - used

    # -- execution --------------------------------------------------------

    def stage_nodes(self, stage):
        return [n for n in self.nodes if self.stage_of[id(n)] == stage]

    def stage_layers(self, stage):
        """The layers stage `stage` runs (nested layers included)."""
        out, seen = [], set()
        for node in self.stage_nodes(stage):
            for layer in _layers_of(node.operation):
                if id(layer) not in seen:
                    seen.add(id(layer))
                    out.append(layer)
        return out

    def stage_fn(self, stage, training=None, recompute=None):
        """Returns stage `stage`'s function `list[Tensor] -> list[Tensor]`.

        `recompute`: layer names (a set) whose forward passes are
        recomputed in the backward (`keras_smp.pipeline.recompute`), with
        the layers marked by `set_activation_checkpointing`; `None`: none.
        """
        carry_in = self.inputs if stage == 0 else self.carries[stage - 1]
        carry_out = self.carries[stage]
        nodes = self.stage_nodes(stage)

        def run(tensors):
            values = {id(t): v for t, v in zip(carry_in, tensors)}
            for t, v in zip(carry_in, tensors):  # masks back on their tensors
                if isinstance(t, MaskOf):
                    keras_private.set_keras_mask(values[t.owner_id], v)
            for node in nodes:
                args, kwargs = node.arguments.fill_in(values)
                # (a `training` a subclassed call fixed is kept)
                fixed = fixed_training(node)
                op = keras_private.operation_fn(
                    node.operation,
                    training=training if fixed is None else fixed)
                if recompute is not None and recompute_lib.marked(
                        node.operation, recompute):
                    op = recompute_lib.checkpointed(op, node.operation)
                outs = op(*args, **kwargs)
                for x, y in zip(tree.flatten(node.outputs),
                                tree.flatten(outs)):
                    values[id(x)] = y
            return [self._carried(values, t, stage) for t in carry_out]

        return run

    def _carried(self, values, t, stage):
        """The value of carried tensor `t` (a `MaskOf`: its owner's mask
        as the layers left it)."""
        if not isinstance(t, MaskOf):
            return values[id(t)]
        mask = keras_private.keras_mask(values[t.owner_id])
        if mask is None:
            raise ValueError(
                f"Pipeline stage {stage}: tensor {t.name[:-5]} held a Keras "
                "mask when the stages were first traced but has none now; "
                "a layer's masking changed between traces. Make its "
                "compute_mask deterministic.")
        return mask

    def checkpointed_names(self, checkpointing):
        """The layer names in a config's `activation_checkpointing` (a set),
        checked against the model's layers."""
        late = sorted({m.name for m in self.expanded_models
                       if getattr(m, "_smp_recompute", False)})
        if late:
            raise ValueError(
                f"Nested model(s) {late} were marked with "
                "keras_smp.set_activation_checkpointing after "
                "DistributedModel placed their layers one by one (they can "
                "sit on different stages), so they cannot be recomputed as "
                "one unit. Mark them before wrapping the model "
                "(set_activation_checkpointing(layer), then "
                "DistributedModel(model)), name them in the config's "
                "activation_checkpointing, or mark layers inside them.")
        if not isinstance(checkpointing, tuple):
            return set()
        names = {c for c in checkpointing if isinstance(c, str)}
        known = {getattr(n.operation, "name", None)
                 for s in range(self.num_stages) for n in self.stage_nodes(s)}
        unknown = sorted(names - known)
        if unknown:
            shown = ", ".join(sorted(k for k in known if k)[:20])
            raise ValueError(
                f"activation_checkpointing names layer(s) {unknown} that "
                f"the model does not have. Its layers: {shown}"
                f"{', ...' if len(known) > 20 else ''}. Use the names of "
                "layers of the model given to DistributedModel (or stage "
                "indices).")
        return names

    def pack_outputs(self, flat):
        """The model's output structure from the last stage's tensors:
        the flattened outputs, optionally followed by their masks (as
        `carries[-1]` lists them), which are attached to the outputs."""
        flat = list(flat)
        outputs = flat[:self.num_outputs]
        at = {id(t): i for i, t in enumerate(self.outputs)}
        for t, mask in zip(self.carries[-1][self.num_outputs:],
                           flat[self.num_outputs:]):
            keras_private.set_keras_mask(outputs[at[t.owner_id]], mask)
        return tree.pack_sequence_as(self.outputs_struct, outputs)

    # -- variables and summaries ------------------------------------------

    def stage_weights(self, stage):
        """Distinct weights used by the layers of `stage` (model order).

        A layer called in several stages (keras_hub's
        `ReversibleEmbedding`: the lookup in the first, the output
        projection in the last) counts, for each call, the weights that
        call reads (`_call_reads`): an untied projection's weight and the
        lookup's then each belong to one stage, trained as on one device,
        not as a weight two stages share.
        """
        reads = self._call_reads()
        out, seen = [], set()
        for node in self.stage_nodes(stage):
            read = reads.get(id(node))
            for w in _operation_weights(node.operation):
                if read is not None and id(w) not in read:
                    continue
                if id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
        return out

    def sparse_weights(self):
        """Ids of the weights, among those layers of several stages hold,
        whose gradient is sparse (`tf.IndexedSlices`) wherever they are
        read in training: an `Embedding` looked up in two stages (an
        encoder-decoder's shared embedding). Keras keeps their parts'
        rows as they come, repeated ids included; a weight with a
        regularizer (a dense part) is not one. (Only those several stage
        processes use, `weight_users`, are exchanged.)"""
        self._call_reads()
        return self._sparse

    def updated_weights(self):
        """`{id(weight): layer name}` of the weights, among those layers of
        several stages hold, that a call assigns in training (a shared
        `BatchNormalization`'s moving statistics): on one device the
        calls update one copy in turn, which copies in several stage
        processes cannot do (`step.run_step` refuses to train them).

        Traced again when a layer of those calls has changed `trainable`
        since (a `BatchNormalization` frozen or unfrozen after the plan
        was set: a frozen one updates nothing)."""
        self._call_reads()
        calls = self.__dict__.get("_shared_calls") or []
        key = self._trainable_key(calls)
        if calls and key != self._updated_key:
            updates = {}
            try:
                self._trace_stages(
                    [(t.shape, t.dtype) for t in self.inputs],
                    lambda s, values: None, training=True,
                    reads={id(n): {} for n in calls}, updates=updates)
            except Exception as e:  # pylint: disable=broad-except
                warnings.warn(
                    "keras-smp could not trace which weights the calls of "
                    "a layer used by several pipeline stages update "
                    f"({type(e).__name__}: {e}); a layer updating its "
                    "state on several stage processes is not refused.",
                    stacklevel=3)
                updates = {}
            self._updated = self._assigned(calls, updates)
            self._updated_key = key
        return self._updated

    @staticmethod
    def _trainable_key(calls):
        return tuple(bool(layer.trainable) for n in calls
                     for layer in keras_private.flatten_layers(n.operation)
                     if hasattr(n.operation, "_flatten_layers"))

    def _assigned(self, calls, updates):
        """`{id(weight): layer name}` of `calls`' own weights that layers
        of several stages hold and the traced calls assign (`updates`)."""
        users = self._shared_users
        return {w: n.operation.name for n in calls
                for w in updates.get(id(n), ())
                if w in {id(v) for v in _operation_weights(n.operation)}
                and len(users.get(w, ())) > 1}

    def _call_reads(self):
        """`{id(node): {id(weight)}}` for the calls of layers holding a
        weight that layers of several stages hold (a layer called in
        several stages; one layer held by two): the layer's weights the
        call reads, traced in training and in inference
        (`_trace_stages`), plus those none of these calls reads (a weight
        read only in code the traces do not reach counts for every call,
        as its layers' weights did). Empty for models without such
        layers and for tensor-parallel stages
        (their collectives are traced per stage). Found once, when the
        partition plan is set."""
        cached = self.__dict__.get("_reads_by_call")
        if cached is not None:
            return cached
        users = {}  # by the layers holding each weight
        for node in self.nodes:
            for w in _operation_weights(node.operation):
                users.setdefault(id(w), set()).add(self.stage_of[id(node)])
        calls = [n for n in self.nodes if any(
            len(users[id(w)]) > 1 for w in _operation_weights(n.operation))]
        self._sparse, self._updated = set(), {}
        self._shared_calls, self._updated_key = [], ()
        if not calls or self.has_tensor_parallel_layers():
            self._reads_by_call = {}
            return self._reads_by_call
        reads = {id(n): {} for n in calls}
        updates = {}
        specs = [(t.shape, t.dtype) for t in self.inputs]
        try:
            for training in (True, False):
                # First asked for when the plan is set, before any weight
                # is given storage or released: read as Keras' placeholders
                # (not through `trace_scope`, which asks for the plan).
                self._trace_stages(specs, lambda s, values: None,
                                   training=training, reads=reads,
                                   scoped=False, updates=updates)
        except Exception as e:  # pylint: disable=broad-except
            # (the same on every rank: the same model, traced alike)
            warnings.warn(
                "keras-smp could not trace which weights each call of a "
                "layer used by several pipeline stages reads "
                f"({type(e).__name__}: {e}); all its weights count as used "
                "by every stage calling it (tied: their gradients are "
                "summed densely, which optimizers such as Adam treat "
                "otherwise than a sparse gradient), and such a layer "
                "updating its state (a BatchNormalization) on several "
                "stage processes is not refused.", stacklevel=4)
            self._reads_by_call = {}
            return self._reads_by_call
        # Each call counts the reads of its layer's own weights; a weight
        # no call of a layer holding it reads counts for all of them.
        own = {id(n): {id(w) for w in _operation_weights(n.operation)}
               for n in calls}
        read = {w for n in calls for w in reads[id(n)] if w in own[id(n)]}
        self._reads_by_call = {
            id(n): {w for w in own[id(n)] if w in reads[id(n)]
                    or w not in read}
            for n in calls}
        sparse_reads = {}
        for n in calls:
            for w, is_sparse in reads[id(n)].items():
                if is_sparse is not None and w in own[id(n)]:
                    sparse_reads[w] = sparse_reads.get(w, True) and is_sparse
        regularized = {id(w) for n in calls
                       for w in _operation_weights(n.operation)
                       if getattr(w, "regularizer", None) is not None}
        self._sparse = {w for w, is_sparse in sparse_reads.items()
                        if is_sparse and w not in regularized}
        self._shared_calls, self._shared_users = calls, users
        self._updated = self._assigned(calls, updates)
        self._updated_key = self._trainable_key(calls)
        return self._reads_by_call

    def weight_users(self):
        """`id(weight) -> [stages using it]` (tied weights have several)."""
        users = {}
        for s in range(self.num_stages):
            for w in self.stage_weights(s):
                users.setdefault(id(w), []).append(s)
        return users

    def home_stage(self):
        """`id(weight) -> first stage using it` (where it is placed)."""
        home = {}
        for s in range(self.num_stages):
            for w in self.stage_weights(s):
                home.setdefault(id(w), s)
        return home

    def summary(self, rank_of=None):
        """A printable table: stage, parameters, layers (and, with virtual
        stages, `rank_of(stage)`: the pipeline rank running each)."""
        home = self.home_stage()
        ranks = rank_of is not None
        lines = [f"Partition plan ({self.num_stages} stages)",
                 f"{'stage':>5}  " + (f"{'rank':>4}  " if ranks else "")
                 + f"{'params':>10}  layers"]
        for s in range(self.num_stages):
            params = sum(math.prod(w.shape) for w in self.stage_weights(s)
                         if home[id(w)] == s)
            names = ", ".join(self.names[id(n)] for n in self.stage_nodes(s))
            lines.append(f"{s:>5}  " + (f"{rank_of(s):>4}  " if ranks else "")
                         + f"{params:>10,}  {names}")
        if self.expanded_models:
            lines.append("Nested models placed layer by layer: "
                         + ", ".join(dict.fromkeys(self.expanded)))
        return "\n".join(lines)


@contextlib.contextmanager
def record_partitions():
    """Records the active `partition()` of every Keras node created inside.

    Yields a dict `id(node) -> partition index or None`.
    """
    recorded = {}
    original = keras_private.Node.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        recorded[id(self)] = current_partition()

    keras_private.Node.__init__ = init
    try:
        yield recorded
    finally:
        keras_private.Node.__init__ = original
