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

A carried tensor with a Keras mask (`Embedding(mask_zero=True)`, `Masking`)
carries its mask too, as an extra tensor after the carry's own: Keras
passes masks between layers as attributes of the tensors, which a stage
boundary would drop. The receiving stage attaches it again, so layers and
the loss after the boundary see the mask they see in the model's own
`call` (`pack_outputs` attaches the outputs' masks).

Passing skip tensors through intermediate stages keeps every transfer
between neighbouring stages, as the schedules' send/receive actions (and
the collective transport) assume.
"""

import contextlib
import math

from keras import tree

from keras_smp.pipeline import partition as partition_lib
from keras_smp.pipeline import recompute as recompute_lib
from keras_smp.pipeline.scope import current_partition
from keras_smp.runtime import keras_private


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
        self._validate()
        self._compute_carries()

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
        seen, names, infos, counted = {}, {}, [], set()
        for node in nodes:
            name = _node_name(node, seen)
            names[id(node)] = name
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
            infos, num_stages, cost=cost, split_points=split_points)
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
        used = set(self.stage_of.values())
        empty = [s for s in range(self.num_stages) if s not in used]
        if empty:
            raise ValueError(
                f"Pipeline stage(s) {empty} of partitions={self.num_stages} "
                "have no layers. Put at least one layer in every "
                "keras_smp.partition(i) scope, or lower `partitions`.")

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
        self.carries = []
        for s in range(last):
            keep = [
                v for key, v in sorted(order.items(), key=lambda kv: kv[1][:2])
                if produced_at.get(key, last + 1) <= s
                and (any(c > s for c in needed_at.get(key, ()))
                     or any(key == id(o) for o in self.outputs))]
            self.carries.append(self._with_masks([t for _, _, t in keep]))
        self.carries.append(self._with_masks(self.outputs))
        #: How many of the last stage's tensors are the model outputs (the
        #: rest are their masks).
        self.num_outputs = len(self.outputs)

    def _with_masks(self, tensors):
        """`tensors` followed by their Keras masks (each mask once),
        recording which tensors each mask belongs to."""
        if not hasattr(self, "_mask_of"):
            self._mask_of = {}  # id(mask) -> the tensors it masks
        out = list(tensors)
        have = {id(t) for t in out}
        for t in tensors:
            mask = keras_private.keras_mask(t)
            if mask is None:
                continue
            owners = self._mask_of.setdefault(id(mask), [])
            if all(o is not t for o in owners):
                owners.append(t)
            if id(mask) not in have:
                have.add(id(mask))
                out.append(mask)
        return out

    def output_masks(self):
        """The symbolic Keras mask of each flattened model output, or
        None."""
        return [keras_private.keras_mask(t) for t in self.outputs]

    def output_mask_fn(self):
        """`flat inputs -> [the Keras mask of each flattened output, or
        None]` for a whole batch, computed from the model inputs alone
        (`None` when no output has a mask).

        A pipeline weights each microbatch's masked loss by its share of
        the batch's unmasked entries, which it needs before the first
        microbatch's backward. Masks made from the inputs
        (`Embedding(mask_zero=True)`, `Masking` on an input) are cheap to
        compute ahead; a mask computed from weights' results is refused.
        """
        masks = self.output_masks()
        wanted = [mask for mask in masks if mask is not None]
        if not wanted:
            return None
        nodes, _ = keras_private.build_graph_map(self.inputs, wanted)
        weighted = sorted({n.operation.name for n in nodes
                           if n.operation is not None and not n.is_input
                           and _operation_weights(n.operation)})
        if weighted:
            raise NotImplementedError(
                "The Keras mask of a model output is computed from the "
                f"results of layers with weights ({', '.join(weighted)}). "
                "A pipeline weights each microbatch's masked loss by its "
                "share of the batch's unmasked entries, so it computes the "
                "outputs' masks from the model inputs before the step. "
                "Compute the mask from the inputs (Embedding(mask_zero=True)"
                " or Masking applied to an input), or use microbatches=1.")
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
            op = node.operation
            for layer in (keras_private.flatten_layers(op)
                          if hasattr(op, "_flatten_layers") else [op]):
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
                for owner in self._mask_of.get(id(t), ()):
                    if id(owner) in values:
                        keras_private.set_keras_mask(values[id(owner)], v)
            for node in nodes:
                args, kwargs = node.arguments.fill_in(values)
                op = keras_private.operation_fn(
                    node.operation, training=training)
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
        """The value of carried tensor `t` (a mask: its tensors' mask as
        the layers attached it)."""
        if id(t) in values:
            return values[id(t)]
        for owner in self._mask_of.get(id(t), ()):
            if id(owner) in values:
                mask = keras_private.keras_mask(values[id(owner)])
                if mask is not None:
                    return mask
        raise ValueError(
            f"Pipeline stage {stage}: the Keras mask {t.name} of "
            f"{[o.name for o in self._mask_of.get(id(t), ())]} was not "
            "attached when the stage ran (a layer's `compute_mask` gave "
            "None where the model's symbolic call gave a mask). Make the "
            "layer's compute_mask return the same at run time.")

    def checkpointed_names(self, checkpointing):
        """The layer names in a config's `activation_checkpointing` (a set),
        checked against the model's layers."""
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
        masks = dict(zip((id(t) for t in self.carries[-1][self.num_outputs:]),
                         flat[self.num_outputs:]))
        for t, v in zip(self.outputs, outputs):
            mask = keras_private.keras_mask(t)
            if mask is not None and id(mask) in masks:
                keras_private.set_keras_mask(v, masks[id(mask)])
        return tree.pack_sequence_as(self.outputs_struct, outputs)

    # -- variables and summaries ------------------------------------------

    def stage_weights(self, stage):
        """Distinct weights used by the layers of `stage` (model order)."""
        out, seen = [], set()
        for node in self.stage_nodes(stage):
            for w in _operation_weights(node.operation):
                if id(w) not in seen:
                    seen.add(id(w))
                    out.append(w)
        return out

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
