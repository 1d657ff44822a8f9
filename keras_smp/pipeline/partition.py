"""Partition plans: which layer runs on which pipeline stage (pure Python).

A model is seen as an ordered list of layers (a topological order of the
graph), each with a cost. Automatic partitioning cuts that list into
`num_stages` contiguous, non-empty pieces so that the most expensive stage is
as cheap as possible (the pipeline runs at the pace of its slowest stage),
like DeepSpeed's `partition_method="parameters"`. Explicit split points
(layer names that start a new stage) are also accepted.

The Keras side (reading layers, parameter counts and FLOP estimates from a
model) lives with the pipeline runtime; this module only sees numbers and names.
"""

from dataclasses import dataclass

COST_METHODS = ("parameters", "uniform", "flops")


@dataclass(frozen=True)
class LayerInfo:
    """What the planner needs to know about one layer.

    Args:
        name: unique layer name.
        params: number of parameters (weights) of the layer.
        flops: estimated forward FLOPs per sample (0 when unknown).
    """

    name: str
    params: int = 0
    flops: float = 0.0


@dataclass(frozen=True)
class PartitionPlan:
    """The result of partitioning: a stage for every layer.

    Attributes:
        layers: the `LayerInfo`s in model order.
        stages: the stage of each layer (non-decreasing, starts at 0).
        num_stages: number of stages.
        cost: the cost method the plan balanced.
    """

    layers: tuple
    stages: tuple
    num_stages: int
    cost: str

    def stage_of(self, name):
        """Returns the stage of the layer called `name`."""
        for layer, stage in zip(self.layers, self.stages):
            if layer.name == name:
                return stage
        raise KeyError(
            f"No layer named {name!r} in the plan; layers are "
            f"{[layer.name for layer in self.layers]}.")

    def layers_of(self, stage):
        """Returns the names of the layers on `stage`, in model order."""
        return [l.name for l, s in zip(self.layers, self.stages) if s == stage]

    def stage_costs(self):
        """Returns the balanced cost of every stage."""
        costs = _costs(self.layers, self.cost)
        out = [0.0] * self.num_stages
        for c, s in zip(costs, self.stages):
            out[s] += c
        return out

    def stage_params(self):
        """Returns the parameter count of every stage."""
        out = [0] * self.num_stages
        for layer, s in zip(self.layers, self.stages):
            out[s] += layer.params
        return out

    def summary(self):
        """Returns a printable table: stage, layers, parameters, cost."""
        costs, params = self.stage_costs(), self.stage_params()
        total = sum(costs) or 1.0
        lines = [f"Partition plan ({self.num_stages} stages, cost="
                 f"{self.cost!r})",
                 f"{'stage':>5}  {'params':>10}  {'cost %':>6}  layers"]
        for s in range(self.num_stages):
            names = ", ".join(self.layers_of(s))
            lines.append(f"{s:>5}  {params[s]:>10,}  "
                         f"{100 * costs[s] / total:>6.1f}  {names}")
        return "\n".join(lines)


def _costs(layers, cost):
    if cost == "parameters":
        return [float(l.params) for l in layers]
    if cost == "flops":
        return [float(l.flops) for l in layers]
    if cost == "uniform":
        return [1.0] * len(layers)
    raise ValueError(
        f"Unknown partition cost {cost!r}; expected one of {COST_METHODS}.")


def balance(costs, num_stages):
    """Splits `costs` into contiguous non-empty groups minimising the max sum.

    Args:
        costs: non-negative cost of each item, in order.
        num_stages: number of groups, 1 <= num_stages <= len(costs).

    Returns:
        The stage index of every item (non-decreasing, 0 .. num_stages-1).
        Among optimal splits, ties go to the split whose stages are most
        even in item count.

    Example:

    >>> balance([1, 1, 1, 3], 2)
    [0, 0, 0, 1]
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; received {num_stages}.")
    if num_stages > n:
        raise ValueError(
            f"Cannot split {n} layers into {num_stages} non-empty stages: "
            f"every stage needs at least one layer. Use partitions <= {n}.")
    if any(c < 0 for c in costs):
        raise ValueError(f"Costs must be >= 0; received {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ideal = n / num_stages
    inf = float("inf")
    # best[k][i] = (max stage cost, unevenness) for the first i items in k
    # stages; cut[k][i] = where stage k-1 starts.
    best = [[(inf, inf)] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev_cost, prev_uneven = best[k - 1][j]
                if prev_cost == inf:
                    continue
                cand = (max(prev_cost, prefix[i] - prefix[j]),
                        prev_uneven + abs((i - j) - ideal))
                if cand < best[k][i]:
                    best[k][i] = cand
                    cut[k][i] = j
    stages = [0] * n
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        for t in range(j, i):
            stages[t] = k - 1
        i = j
    return stages


def plan_partitions(layers, num_stages, cost="parameters", split_points=None,
                    first_stage=0):
    """Assigns every layer to a pipeline stage.

    Args:
        layers: `LayerInfo`s in model (topological) order.
        num_stages: number of pipeline stages (`partitions`).
        cost: "parameters" (default), "uniform" (layer count) or "flops".
        split_points: optional names of the layers that start stages
            1, 2, ... (exactly `num_stages - 1` names, in model order).
            Overrides the automatic balance.
        first_stage: how many of the first layers the automatic balance
            keeps on stage 0 (layers of a sparse model input: a stage
            boundary carries dense tensors only); an error when too few
            other layers are left for the other stages.

    Returns:
        A `PartitionPlan`.

    Example:

    >>> plan = plan_partitions(
    ...     [LayerInfo("a", 10), LayerInfo("b", 10), LayerInfo("c", 20)], 2)
    >>> plan.layers_of(0), plan.layers_of(1)
    (['a', 'b'], ['c'])
    >>> plan = plan_partitions(
    ...     [LayerInfo("a", 30), LayerInfo("b", 1), LayerInfo("c", 20)], 2,
    ...     first_stage=2)
    >>> plan.layers_of(0), plan.layers_of(1)
    (['a', 'b'], ['c'])
    """
    layers = tuple(layers)
    names = [l.name for l in layers]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"Layer names must be unique; repeated: {dup}.")
    costs = _costs(layers, cost)
    if split_points is None:
        if cost != "uniform" and sum(costs) == 0:
            costs = [1.0] * len(layers)  # nothing to weigh: balance counts
        pinned = first_stage if first_stage > 1 else 0
        if pinned and len(costs) - pinned < num_stages - 1:
            raise ValueError(
                f"The layers {names[:pinned]} read a sparse or ragged model "
                "input, so they share stage 0 (a stage boundary carries "
                f"dense tensors only), which leaves {len(costs) - pinned} "
                f"layers for the {num_stages - 1} other stages. Use "
                f"partitions <= {len(costs) - pinned + 1}, or make the "
                "input dense.")
        if pinned:
            # The pinned layers balanced as one.
            merged = balance([sum(costs[:pinned])] + list(costs[pinned:]),
                             num_stages)
            stages = [merged[0]] * pinned + merged[1:]
        else:
            stages = balance(costs, num_stages)
    else:
        stages = _stages_from_split_points(names, num_stages, split_points)
    return PartitionPlan(layers, tuple(stages), num_stages, cost)


def _stages_from_split_points(names, num_stages, split_points):
    split_points = list(split_points)
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"{num_stages} stages need {num_stages - 1} split points; "
            f"received {len(split_points)}: {split_points}.")
    positions = []
    for point in split_points:
        if point not in names:
            raise ValueError(
                f"Split point {point!r} is not a layer of the model; "
                f"layers are {names}.")
        positions.append(names.index(point))
    if positions != sorted(set(positions)) or (positions and positions[0] == 0):
        raise ValueError(
            f"Split points must be distinct, in model order, and not the "
            f"first layer (that would leave stage 0 empty); received "
            f"{split_points}.")
    stages, stage = [], 0
    for i in range(len(names)):
        if stage < len(positions) and i == positions[stage]:
            stage += 1
        stages.append(stage)
    return stages
