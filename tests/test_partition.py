"""Automatic and explicit partition plans (pure Python)."""

import itertools
import random

import pytest

from keras_smp.pipeline.partition import LayerInfo
from keras_smp.pipeline.partition import balance
from keras_smp.pipeline.partition import plan_partitions


def _brute_force_best(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b])
                             for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_optimal_and_contiguous(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0, 1, 2, 5, 10, 100]) for _ in range(n)]
    stages = balance(costs, k)
    assert stages[0] == 0 and stages[-1] == k - 1
    assert all(b - a in (0, 1) for a, b in zip(stages, stages[1:]))
    got = max(sum(c for c, s in zip(costs, stages) if s == t)
              for t in range(k))
    assert got == _brute_force_best(costs, k)


def test_uniform_cost_splits_layer_counts_evenly():
    layers = [LayerInfo(f"l{i}", params=i * 100) for i in range(8)]
    plan = plan_partitions(layers, 4, cost="uniform")
    assert [len(plan.layers_of(s)) for s in range(4)] == [2, 2, 2, 2]


def test_parameter_cost_balances_a_heavy_head():
    layers = [LayerInfo("embed", 1000), LayerInfo("h1", 100),
              LayerInfo("h2", 100), LayerInfo("head", 1000)]
    plan = plan_partitions(layers, 2)
    assert plan.stage_of("embed") == 0 and plan.stage_of("head") == 1
    assert plan.stage_params() == [1100, 1100]
    assert "stage" in plan.summary() and "embed" in plan.summary()


def test_flops_cost():
    layers = [LayerInfo("a", 0, 1.0), LayerInfo("b", 0, 1.0),
              LayerInfo("c", 0, 8.0)]
    plan = plan_partitions(layers, 2, cost="flops")
    assert plan.layers_of(1) == ["c"]


def test_split_points():
    layers = [LayerInfo(n) for n in "abcde"]
    plan = plan_partitions(layers, 3, split_points=["c", "e"])
    assert list(plan.stages) == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("points,match", [
    (["c"], "3 stages need 2 split points"),
    (["x", "e"], "'x' is not a layer"),
    (["e", "c"], "in model order"),
    (["a", "c"], "first layer"),
])
def test_bad_split_points(points, match):
    with pytest.raises(ValueError, match=match):
        plan_partitions([LayerInfo(n) for n in "abcde"], 3, split_points=points)


def test_more_partitions_than_layers_is_an_error():
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3"):
        plan_partitions([LayerInfo("a", 1), LayerInfo("b", 1)], 3)


def test_unknown_cost_and_duplicate_names_are_errors():
    with pytest.raises(ValueError, match="'bytes'"):
        plan_partitions([LayerInfo("a", 1)], 1, cost="bytes")
    with pytest.raises(ValueError, match="repeated"):
        plan_partitions([LayerInfo("a"), LayerInfo("a")], 1)


def test_first_stage_keeps_a_prefix_of_layers_on_stage_0():
    # The layers of a sparse model input (moved first by StagedGraph.auto):
    # a stage boundary carries dense tensors only. The heavy first layer
    # alone would be stage 0; the prefix is balanced as one layer.
    layers = [LayerInfo("words", 4096), LayerInfo("ids", 128),
              LayerInfo("h", 800), LayerInfo("out", 50)]
    assert plan_partitions(layers, 2).layers_of(0) == ["words"]
    plan = plan_partitions(layers, 2, first_stage=2)
    assert plan.layers_of(0) == ["words", "ids"]
    assert plan.layers_of(1) == ["h", "out"]
    three = plan_partitions(layers, 3, first_stage=2)
    assert [three.stage_of(n) for n in ("words", "ids", "h", "out")] == [
        0, 0, 1, 2]
    # Too few other layers for the other stages: refused, naming them.
    with pytest.raises(ValueError, match=r"\['words', 'ids'\] read a "
                       r"sparse .* leaves 2 layers for the 3 other stages\. "
                       r"Use partitions <= 3"):
        plan_partitions(layers, 4, first_stage=2)
    # Split points given by the user win.
    assert plan_partitions(layers, 2, split_points=["ids"],
                           first_stage=2).layers_of(0) == ["words"]
