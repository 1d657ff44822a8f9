"""DistributedModel: pipelined fit/evaluate/predict equal plain Keras.

Each worker process (tests/workers/pipeline_fit.py) trains a plain Keras
model on one device (the reference) and the same model pipelined with
SMPStrategy on logical CPUs, 3 optimizer steps with a global batch of 32,
and reports the largest deviation from `|got - ref| <= atol + 1e-5 |ref|`
as the `atol` that would be needed. Models: an MLP and a small CNN
(Sequential, automatic partitioning), a functional model whose skip
connection crosses stage boundaries and with sample weights, and the same
skip model subclassed with manual `partition()` scopes, and the skip model
with losses added in `call` on every stage ("penalized": L1 and L2
activity regularizers, a custom layer's `add_loss()`), and an autoencoder
compiled without a loss (its loss is what its layers add), and a model
with two outputs compiled with a loss on one ("two_heads", with weight
decay and a constraint on the other head, which Keras leaves alone), and
a loss per token of padded sequences under the embedding's Keras mask
("tokens": the mask crosses the stage boundaries to the loss and the
metric; Keras divides by the batch's real tokens, so each microbatch's
loss counts by its share of them).

Bounds. SGD: rtol 1e-5, atol 1e-6 (float32 rounding of the same sums in
another order). Adam (lr 1e-3): atol 1e-5 on weights. Adam divides by
sqrt(v) + eps, so a gradient entry whose true value is near zero, rounded
differently (1e-7 relative to the larger entries it is summed with), moves
the weight by up to lr * |rounding| / eps per step; for the entries of
these models that is below 1e-5 after 3 steps. Observed: <= 1e-6.
"""

import json
import os
import re

import numpy as np
import pytest

from conftest import RTOL
from conftest import WORKERS
from conftest import assert_same_training
from conftest import fit_model
from conftest import launch
from conftest import load
from conftest import run_python
from conftest import scaled_atol

SGD_ATOL = 1e-6
ADAM_ATOL = 1e-5
# Loss/evaluate/predict are float32 values computed in microbatches: the
# same bound as weights (rtol 1e-5 is applied in the worker).
OUT_ATOL = 1e-6


def _cases(model, partitions, schedules, microbatches, optimizer,
           devices=None):
    out = []
    for p in partitions:
        for sched in schedules:
            for m in microbatches:
                case = dict(model=model, partitions=p, microbatches=m,
                            pipeline=sched, optimizer=optimizer)
                if devices:
                    case["devices"] = devices
                out.append(case)
    return out


def _picks(model, combos, optimizer, devices=None):
    """Cases of `model` for the given (partitions, schedule, microbatches).

    The matrix covers every pair of those values for a model rather than
    their every combination: each case costs seconds of tracing, the
    factors are independent in the runtime (the schedule is an action list
    whatever the partition count; the microbatch split is the same for
    every schedule), and a combination that once failed on its own is
    listed as its own line below.
    """
    return [c for p, sched, m in combos
            for c in _cases(model, (p,), (sched,), (m,), optimizer, devices)]


# Each of 2 and 4 partitions with each schedule, and each microbatch count
# with both partition counts and both schedules (pairwise).
PAIRWISE = [(2, "gpipe", 1), (4, "1f1b", 1), (2, "1f1b", 2), (4, "gpipe", 2),
            (2, "gpipe", 4), (4, "1f1b", 4), (2, "1f1b", 8), (4, "gpipe", 8)]
BOTH = ("gpipe", "1f1b")
GROUPS = {
    "mlp": (_picks("mlp", PAIRWISE, "sgd")
            + _picks("mlp", [(2, "1f1b", 4), (4, "gpipe", 4)], "adam")),
    # The mlp covers every microbatch count; the others two each (the
    # model zoo, tests/test_model_zoo.py, covers more architectures).
    "cnn": (_picks("cnn", [(2, "gpipe", 2), (4, "1f1b", 8)], "sgd")
            + _picks("cnn", [(2, "1f1b", 8), (4, "gpipe", 8)], "adam")),
    "skip": (_picks("skip", [(2, "gpipe", 1), (4, "1f1b", 1),
                              (2, "1f1b", 4), (4, "gpipe", 4)], "sgd")
             + _picks("skip", [(2, "1f1b", 2), (4, "gpipe", 2)], "adam")
             # Losses added in `call` (activity regularizers, a layer's
             # add_loss) on every stage.
             + _picks("penalized", [(2, "gpipe", 4), (4, "1f1b", 4)], "sgd")
             + _cases("penalized", (2,), ("1f1b",), (2,), "adam")
             # ... added from a helper function (not seen in the class)
             + _cases("penalized_helper", (2,), ("gpipe",), (4,), "sgd")
             # Compiled without a loss: the loss is what layers add.
             + _cases("autoencoder", (2,), ("gpipe",), (4,), "adam")
             # ... stage 1 of 4 adds none
             + _cases("autoencoder", (4,), ("1f1b",), (4,), "sgd")
             # A loss on one of two outputs, weight decay: the other
             # head (stage 2 of 4, or the last stage) gets no gradient.
             + _picks("two_heads", [(2, "1f1b", 4), (4, "gpipe", 4)],
                      "sgd")
             + _cases("two_heads", (4,), ("1f1b",), (4,), "adam")
             # A loss per token under the embedding's mask (uneven
             # padding: microbatches hold different shares of the real
             # tokens). Its embedding's sparse gradients sit on other
             # devices in turn (a second pipeline of a process once hit a
             # collective instance key of the first's).
             + _picks("tokens", [(2, "gpipe", 4), (4, "1f1b", 4)], "sgd")
             + _cases("tokens", (2,), ("gpipe",), (8,), "adam")
             # A loss with reduction="sum": the microbatch losses add up
             # (each was once weighted 1/m).
             + [dict(c, reduction="sum") for c in
                _cases("mlp", (2,), ("1f1b",), (4,), "sgd")]
             # A last batch of 26 rows: unequal microbatches (7+7+6+6),
             # each counting by its share of the rows (the losses layers
             # add too; evaluate splits it the same way).
             + [dict(c, partial=True) for c in
                _cases("skip", (2,), ("1f1b",), (4,), "sgd")
                + _cases("penalized", (4,), ("gpipe",), (4,), "sgd")
                + _cases("autoencoder", (2,), ("1f1b",), (4,), "sgd")
                + _cases("tokens", (2,), ("1f1b",), (4,), "sgd")
                # (and a "mean_with_sample_weight" loss, divided by the
                # step's entries)
                + _cases("mixed", (2,), ("gpipe",), (4,), "sgd")]
             # Batches of 30 rows of a known size (8+8+7+7).
             + [dict(c, partial="static") for c in
                _cases("tokens", (2,), ("1f1b",), (4,), "adam")]),
    "manual": (_picks("manual", [(2, "gpipe", 1), (4, "1f1b", 1),
                                  (2, "1f1b", 4), (4, "gpipe", 4)], "sgd")
               + _cases("manual", (4,), ("1f1b",), (8,), "adam")
               # Nested models (a backbone holding a Sequential block, an
               # encoder applied twice): their layers placed one by one
               # (the backbone was one node, whole on stage 0), also split
               # backwards and virtual stages; a backbone marked for
               # recomputation stays whole (one recomputed unit).
               + _picks("nested", [(2, "gpipe", 4), (4, "1f1b", 4)], "sgd")
               + _cases("nested", (2,), ("zb_h1",), (4,), "adam")
               + _cases("nested", (2,), ("interleaved_1f1b",), (2,), "sgd")
               + [dict(c, recompute_layers=[1]) for c in _cases(
                   "nested", (2,), ("1f1b",), (4,), "sgd")]
               # ... a BatchNormalization in the block: fit's training=True
               # overrides the backbone's training=False, as in Keras (1
               # microbatch: the batch's statistics).
               + _cases("nested_bn", (2,), ("1f1b",), (1,), "sgd")
               # A subclassed keras.Model (its own call: a skip connection,
               # a keras.ops call, a Sequential block given `training`, a
               # BatchNormalization and a block given training=False, kept
               # in fit as Keras keeps it) wrapped unbuilt: its call traced
               # into layers at the first step (it was refused), the
               # blocks' layers placed one by one.
               + _picks("subclassed", [(2, "gpipe", 4), (4, "1f1b", 4)], "sgd")
               + _cases("subclassed", (2,), ("zb_h1",), (2,), "adam")
               # ... and a Sequential model without an Input (it was
               # refused): built from the data's shapes at the first step.
               + _cases("mlp_unbuilt", (4,), ("1f1b",), (4,), "sgd")),
    # 4 logical CPUs = 2 pipeline replicas x 2 stages (per-replica batch 16).
    "dp_x_pp": (_picks("mlp", [(2, "gpipe", 2), (2, "1f1b", 8)], "sgd",
                       devices=4)
                + _picks("skip", [(2, "gpipe", 4), (2, "1f1b", 1)], "sgd",
                         devices=4)
                + _cases("cnn", (2,), ("1f1b",), (4,), "adam", devices=4)
                + _cases("penalized", (2,), ("1f1b",), (2,), "sgd",
                         devices=4)
                + _cases("two_heads", (4,), ("1f1b",), (4,), "sgd",
                         devices=8)
                # 13 rows per replica in the last batch: 4+3+3+3.
                + [dict(c, partial=True) for c in _cases(
                    "penalized", (2,), ("1f1b",), (4,), "sgd", devices=4)]
                # Replicas of unequal shares, each counting by its share of
                # the step's: a last batch of 27 rows (14 and 13: 4+4+3+3
                # and 4+3+3+3), and masked tokens (each replica's real
                # tokens of the batch's).
                + [dict(c, partial="odd") for c in _cases(
                    "penalized", (2,), ("1f1b",), (4,), "sgd", devices=4)
                   + _cases("mlp", (2,), ("gpipe",), (1,), "sgd",
                            devices=4)]
                + _cases("tokens", (2,), ("1f1b",), (4,), "sgd",
                         devices=4)
                + [dict(c, partial="odd") for c in _cases(
                    "tokens", (2,), ("1f1b",), (1,), "sgd", devices=4)]
                # A "mean_with_sample_weight" loss beside a mean one and
                # an activity regularizer, in parts of unequal rows (14/13
                # over 2 replicas, 4+4+3+3 and 4+3+3+3 microbatches; 4/4/2
                # over 3 replicas, 2+2, 2+2, 1+1): each part's counts by
                # its share of the step's rows (the first divided by all
                # parts' entries).
                + [dict(c, partial="odd") for c in _cases(
                    "mixed", (2,), ("1f1b",), (4,), "sgd", devices=4)]
                + [dict(c, partial="thirds", recompute=r) for c in _cases(
                    "mixed", (2,), ("1f1b",), (2,), "sgd", devices=6)
                   for r in (False, True)]),
    # Random layers on every stage (Dropout, one masking every row alike,
    # AlphaDropout, GaussianNoise, GaussianDropout, noise drawn in
    # inference too): each microbatch, and each replica, draws its rows of
    # the whole batch's numbers; unequal microbatches (a partial batch of
    # unknown and of known size), replicas, recomputed stages and layers,
    # split backwards, virtual stages, XLA (uniform draws only: XLA's
    # normal draws depend on the whole shape).
    "random": (_picks("noisy", [(2, "gpipe", 4), (4, "1f1b", 2)], "sgd")
               + _cases("noisy", (2,), ("1f1b",), (8,), "adam")
               + [dict(c, partial=p) for c in _cases(
                   "noisy", (2,), ("1f1b",), (4,), "sgd")
                   for p in (True, "static")]
               + _cases("noisy", (2,), ("gpipe",), (4,), "sgd", devices=4)
               + [dict(c, recompute=True) for c in _cases(
                   "noisy", (2,), ("1f1b",), (4,), "sgd")]
               + [dict(c, recompute_layers=[2, 6]) for c in _cases(
                   "noisy", (2,), ("1f1b",), (4,), "sgd")]
               + _cases("noisy", (2,), ("zb_h1", "interleaved_1f1b"), (4,),
                        "sgd")
               + [dict(c, xla=True) for c in _cases(
                   "dropouts", (2,), ("1f1b",), (4,), "sgd")]
               # A subclassed model whose call takes no `training`: Keras'
               # fit calls it without, so its Dropout and
               # BatchNormalization infer (keras-smp told them
               # training=True: masks, per-microbatch statistics).
               + _picks("untold", [(2, "1f1b", 4), (4, "gpipe", 2)],
                        "sgd")),
    # Activation checkpointing: every stage (or only stage 1) recomputes its
    # forward in its backward; the same bounds.
    "recompute": [dict(c, recompute=r) for c, r in zip(
        _cases("mlp", (2,), BOTH, (4,), "sgd")
        + _cases("cnn", (2,), ("gpipe",), (8,), "adam")
        + _cases("skip", (4,), ("1f1b",), (4,), "sgd")
        + _cases("penalized", (2,), ("1f1b",), (4,), "sgd"),
        (True, [1], True, True, True))]
    # Per layer (`set_activation_checkpointing`, by index in `model.layers`;
    # the functional "skip" model lists its InputLayer first):
    # layers of one stage, of both, and with stage 1 recomputed whole.
    + [dict(c, recompute_layers=layers, recompute=stages) for c, layers, stages
       in zip(_cases("mlp", (2,), ("1f1b",), (4,), "adam")
              + _cases("cnn", (2,), ("gpipe",), (4,), "sgd")
              + _cases("skip", (2,), ("1f1b",), (2,), "sgd"),
              ([0, 1, 3], [0, 1], [1]), (False, False, [1]))]
    # Layers adding losses in `call` (d1's and d3's activity regularizers,
    # the Penalty layer's add_loss), each recomputed on its own.
    + [dict(c, recompute_layers=[1, 3, 4]) for c in
       _cases("penalized", (2,), ("1f1b",), (4,), "sgd")]
    # The last layer ("out", stage 1) marked while stage 1 is recomputed
    # whole: the stage's replay only (no layer recomputation inside it).
    + [dict(c, recompute_layers=[6], recompute=[1], marks_in_whole_stage=True)
       for c in _cases("skip", (2,), ("gpipe",), (2,), "sgd")]
    + [dict(c, recompute=True) for c in
       _cases("two_heads", (4,), ("1f1b",), (4,), "sgd")
       + _cases("tokens", (2,), ("1f1b",), (4,), "sgd")]
    + [dict(c, recompute=True, partial=True) for c in
       _cases("autoencoder", (2,), ("1f1b",), (4,), "sgd")],
    # XLA (jit_compile=True): each stage's forward and backward compiled,
    # against plain Keras compiling its whole step; the same bounds.
    "xla": [dict(c, xla=True) for c in
            _cases("mlp", (2,), ("gpipe",), (4,), "sgd")
            + _cases("cnn", (2,), ("1f1b",), (8,), "adam")
            + _cases("skip", (4,), ("gpipe",), (4,), "sgd")
            + _cases("mlp", (2,), ("1f1b",), (2,), "sgd", devices=4)
            + _cases("penalized", (2,), ("1f1b",), (4,), "sgd")
            # a compiled stage starting with a keras.ops node
            + _cases("penalized_ops", (2,), ("1f1b",), (2,), "sgd")
            # compiled stages give an unused head zero gradients: none
            + _cases("two_heads", (4,), ("1f1b",), (4,), "sgd")
            + _cases("tokens", (2,), ("1f1b",), (4,), "sgd")
            + _cases("nested", (2,), ("1f1b",), (4,), "adam")]
    # ... a partial last batch (other shapes: compiled again).
    + [dict(c, xla=True, partial=True) for c in
       _cases("mlp", (2,), ("1f1b",), (4,), "sgd")]
    # ... with layers recomputed inside compiled stages.
    + [dict(c, xla=True, recompute_layers=[1, 3])
       for c in _cases("mlp", (2,), ("1f1b",), (4,), "adam")]
    + [dict(c, xla=True, recompute_layers=[1, 3, 4])
       for c in _cases("penalized", (2,), ("1f1b",), (4,), "adam")],
    # 1F1B with split backwards (I: input gradients, W: weight gradients
    # later, from what I saved): every model, 2 and 4 stages, replicas.
    "split": (_picks("mlp", [(2, "1f1b_split", 1), (4, "1f1b_split", 4),
                              (2, "1f1b_split", 8)], "sgd")
              + _cases("mlp", (2,), ("1f1b_split",), (4,), "adam")
              + _cases("cnn", (2,), ("1f1b_split",), (8,), "adam")
              + _cases("skip", (4,), ("1f1b_split",), (4,), "sgd")
              + _cases("manual", (2,), ("1f1b_split",), (4,), "adam")
              + _cases("mlp", (2,), ("1f1b_split",), (8,), "sgd", devices=4)
              # ZB-H1: W deferred by the stage index (into the drain).
              + _picks("mlp", [(2, "zb_h1", 8), (4, "zb_h1", 4)], "adam")
              + _cases("skip", (4,), ("zb_h1",), (8,), "sgd")
              + _cases("penalized", (2,), ("zb_h1",), (4,), "sgd")
              + _cases("two_heads", (4,), ("zb_h1",), (4,), "sgd")
              + _cases("tokens", (2,), ("zb_h1",), (4,), "sgd")
              + [dict(c, partial=True) for c in
                 _cases("tokens", (2,), ("zb_h1",), (4,), "sgd")]

              + _cases("autoencoder", (2,), ("zb_h1",), (2,), "sgd",
                       devices=4)
              + _cases("cnn", (2,), ("zb_h1",), (4,), "sgd", devices=4))
    # Stages that cannot split (a recomputed stage, XLA-compiled stages)
    # run their whole backward in I, with a warning: the same results.
    + [dict(c, recompute=[1]) for c in
       _cases("mlp", (2,), ("1f1b_split",), (4,), "sgd")]
    # A recomputed layer (a custom gradient) in stage 0: that stage falls
    # back, stage 1 splits.
    + [dict(c, recompute_layers=[0]) for c in
       _cases("mlp", (2,), ("zb_h1",), (4,), "adam")]
    + [dict(c, xla=True) for c in
       _cases("mlp", (2,), ("1f1b_split",), (4,), "sgd")],
    # Virtual stages: 2 ranks (logical CPUs) each running 2 of 4 model
    # stages (interleaved_1f1b: 0,2 / 1,3; zb_v: 0,3 / 1,2, split
    # backwards), 3 stages each for the skip model; replicas; a recomputed
    # model stage; XLA-compiled model stages.
    "virtual": (_cases("mlp", (2,), ("interleaved_1f1b",), (2, 8), "sgd")
                + _cases("mlp", (2,), ("interleaved_1f1b", "zb_v"), (4,),
                         "adam")
                + _cases("mlp", (2,), ("zb_v",), (1,), "sgd")
                + _cases("cnn", (2,), ("zb_v",), (4,), "sgd")
                + _cases("skip", (2,), ("zb_v",), (2,), "sgd")
                + _cases("penalized", (2,), ("interleaved_1f1b",), (4,),
                         "adam")
                + _cases("two_heads", (2,), ("zb_v",), (4,), "sgd")
                + _cases("tokens", (2,), ("zb_v",), (4,), "sgd")
                + [dict(c, partial=True) for c in _cases(
                    "cnn", (2,), ("interleaved_1f1b",), (8,), "adam")]
                + [dict(c, virtual_stages=3) for c in _cases(
                    "skip", (2,), ("interleaved_1f1b",), (4,), "sgd")]
                + _cases("manual", (2,), ("interleaved_1f1b", "zb_v"), (2,),
                         "adam")
                + _cases("mlp", (2,), ("zb_v",), (4,), "sgd", devices=4))
    + [dict(c, recompute=[2]) for c in
       _cases("mlp", (2,), ("interleaved_1f1b",), (4,), "sgd")]
    + [dict(c, xla=True) for c in
       _cases("mlp", (2,), ("interleaved_1f1b",), (4,), "sgd")],
}


def _run(cases, timeout=900):
    # Keras refuses XLA while op determinism is on (the worker's default).
    extra = ({"TF_DETERMINISTIC_OPS": "0"} if any(c.get("xla") for c in cases)
             else None)
    proc = run_python([os.path.join(WORKERS, "pipeline_fit.py")]
                      + [json.dumps(c) for c in cases], timeout=timeout,
                      extra_env=extra)
    rows = [json.loads(l) for l in proc.stdout.splitlines()
            if l.startswith("{")]
    assert len(rows) == len(cases), proc.stdout + proc.stderr[-3000:]
    return rows


@pytest.fixture(scope="module", params=sorted(GROUPS))
def group(request):
    return request.param, _run(GROUPS[request.param])


@pytest.mark.slow
def test_pipelined_training_matches_single_device(group):
    name, rows = group
    for row in rows:
        atol = SGD_ATOL if row["optimizer"] == "sgd" else ADAM_ATOL
        label = json.dumps({k: row.get(k) for k in (
            "model", "partitions", "microbatches", "pipeline", "optimizer",
            "recompute", "recompute_layers")})
        assert row["num_weights"][0] == row["num_weights"][1], label
        assert row["weights"] <= atol, (label, row)
        for key in ("loss", "evaluate", "predict"):
            assert row[key] <= OUT_ATOL, (label, key, row)
        # Guard: training really moved the weights (so equality means
        # something) and every stage got layers.
        assert row["moved"] > 1e-3, (label, row)
        # ... and the losses layers add in `call` count.
        if row["model"].startswith("penalized") or (
                row["model"] == "autoencoder"):
            assert row["added"] > 1e-3, (label, row)
        # ... and the random layers act (training differs from inference
        # in the reference), and the seed generators advanced as often.
        if row["model"] in ("noisy", "dropouts"):
            assert row["noise"] > 1e-2, (label, row)
        assert row["seeds"][0] == row["seeds"][1], (label, row)
        # ... and a head no loss names stays as it was (no gradient: no
        # weight decay, no constraint), as in Keras.
        if row["model"] == "two_heads":
            assert row["unused_moved"] == [0.0, 0.0], (label, row)
        # ... and nested models were expanded (the encoder at both of its
        # calls), except one marked for recomputation.
        if row["model"].startswith("nested"):
            assert row["expanded"] == (
                ["encoder", "encoder"] if row.get("recompute_layers")
                else ["block", "backbone", "encoder", "encoder"]), row
        elif row["model"] == "subclassed":
            assert row["expanded"] == ["sub_block", "frozen_block"], row
        else:
            assert row["expanded"] == [], row
        virtual = row.get("virtual_stages") or (
            2 if row["pipeline"] in ("interleaved_1f1b", "zb_v") else 1)
        assert len(row["stage_layers"]) == row["partitions"] * virtual, row
        assert min(row["stage_layers"]) >= 1, row
        expected_replicas = row.get("devices", row["partitions"]) // row[
            "partitions"]
        assert row["replicas"] == expected_replicas, row
        # Recomputation was built exactly where asked (its backward
        # differentiates the recomputed forward).
        assert (row["replays"] > 0) == bool(row.get("recompute")), row
        assert (row["layer_replays"] > 0) == bool(
            row.get("recompute_layers")
            and not row.get("marks_in_whole_stage")), row
        # Stages were compiled exactly when asked, and the model still
        # says jit_compile=True (the step around them is not compiled).
        assert (row["compiled"] > 0) == bool(row.get("xla")), row
        assert row["jit_compile"] == bool(row.get("xla")), row
        # Each stage's forward was traced once per input shape (2 with
        # unequal microbatches: "partial"), not once per microbatch;
        # stages built inline (compiled, recomputed, split, or where some
        # weight reaches no loss: "two_heads") made no traced function.
        shapes = 2 if row.get("partial") else 1
        assert all(runs <= shapes for _, runs in row["traced"]), (label, row)
        inline = (row.get("xla") or row.get("recompute")
                  or row.get("recompute_layers")
                  or row["pipeline"] in ("1f1b_split", "zb_h1", "zb_v")
                  or row["model"] == "two_heads")
        if not inline:
            assert row["traced"], (label, row)
            calls = sum(c for c, _ in row["traced"])
            runs = sum(r for _, r in row["traced"])
            assert calls >= row["microbatches"] / shapes * runs, (label, row)
        # Backwards were split exactly where the schedule asks for it and
        # the stage allows it; the others fell back with a warning.
        if row["pipeline"] not in ("1f1b_split", "zb_h1", "zb_v"):
            assert row["splits"] == 0 and row["split_fallbacks"] == 0, row
        elif row.get("xla"):
            assert row["splits"] == 0 and row["split_fallbacks"] > 0, row
        elif row.get("recompute") or row.get("recompute_layers"):
            # one stage recomputes (whole or a layer): the other splits
            assert row["splits"] > 0 and row["split_fallbacks"] > 0, row
        else:
            assert row["splits"] > 0 and row["split_fallbacks"] == 0, row


def test_fidelity_detects_a_wrong_gradient():
    # The comparison is sharp: 1 microbatch with the loss weight of 2
    # (the gradient doubled) must be reported as a mismatch.
    rows = _run([dict(model="mlp", partitions=2, microbatches=2,
                      pipeline="1f1b", optimizer="sgd",
                      break_loss_weight=2.0)], timeout=300)
    assert rows[0]["weights"] > 1e-3, rows


def test_nested_models_expand_into_the_layers_their_calls_run():
    # A nested Sequential or functional model is one node of the graph
    # around it; `expand_nested_models` puts its layers in its place (so
    # partitioning can cut inside it). The expanded graph computes what
    # the model computes for training None, True and False: a `training=`
    # given to a nested model reaches its layers, the outermost one given
    # wins, and the call's own `training` overrides them all (Keras'
    # functional call), and the losses its layers add. Its weights are the
    # model's own objects.
    proc = run_python([os.path.join(WORKERS, "nested_models.py")],
                      timeout=300)
    out = json.loads(proc.stdout.splitlines()[-1])
    for name, case in out.items():
        if name == "docstring":
            continue
        assert case["same"] == {"None": True, "True": True, "False": True}, (
            name, case)
        assert case["own_weights"], (name, case)
    # Two levels (a inside the model, b inside a), a sibling, a Sequential.
    assert out["training"]["expanded"] == ["b", "a", "c", "seq"]
    assert out["training"]["layers"] == [
        "add", "mode_a", "mode_b", "mode_c", "sd"]
    # A nested output nothing uses: expanding would drop its branch (and
    # the loss it adds), so that model stays whole; the next one expands.
    assert out["unused_output"]["expanded"] == ["other"]
    assert "two" in out["unused_output"]["layers"]
    # Layers of different nested models named alike: none expands, and a
    # warning says why.
    assert out["same_names"]["unchanged"] and out["same_names"]["warned"]
    # Kept whole: a subclassed model, a call passing a mask, floats into
    # an int input, a model `keep` names; a dict-input model expands.
    assert out["kept"]["expanded"] == ["dict_model"]
    assert {"custom", "masked", "casting", "kept", "dadd"} <= set(
        out["kept"]["layers"]), out["kept"]
    assert out["plain"]["unchanged"] and out["plain"]["expanded"] == []
    # Sublayers named alike inside layers that stay whole (two
    # MultiHeadAttention layers' "query", "key", ...) do not count.
    assert out["sublayer_names"]["expanded"] == ["blk"], out
    # A float16 output into a nested model's float32 input (mixed
    # precision) is cast as its call casts it, and expands.
    assert out["mixed_precision"]["input_dtypes"] == ["float16", "float32"]
    assert out["mixed_precision"]["expanded"] == ["mixed_block"], out
    assert out["docstring"]


def test_keras_applications_backbone_is_split_across_stages():
    # The transfer-learning pattern (a keras.applications backbone called
    # with training=False under a new head): the backbone's layers are
    # spread over both stages, and 2 steps at 2 microbatches match plain
    # Keras on one device within float32 rounding (the bounds of the
    # fidelity groups above).
    proc = run_python([os.path.join(WORKERS, "applications_pipeline.py")],
                      timeout=600)
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["expanded"] == ["vgg16"], row
    assert min(row["backbone_layers_per_stage"]) > 0, row
    assert row["num_weights"][0] == row["num_weights"][1] == 28, row
    assert row["weights"] <= SGD_ATOL, row
    assert row["loss"] <= OUT_ATOL and row["predict"] <= OUT_ATOL, row


@pytest.fixture(scope="module", params=["1f1b", "zb_v"])
def placement(request):
    # zb_v: 4 model stages, rank 0 running stages 0 and 3, rank 1 1 and 2.
    proc = run_python([os.path.join(WORKERS, "pipeline_placement.py"),
                       "2", "4", request.param], timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def _suffix(device):
    return device.split("device:")[-1]


def test_every_variable_lives_on_its_stage_device(placement):
    rows, rank_of = placement["stage_devices"], placement["rank_of"]
    for var in placement["variables"]:
        got = [_suffix(d) for d in var["devices"]]
        if var["stage"] is None:
            continue
        want = [_suffix(row[rank_of[var["stage"]]]) for row in rows]
        assert got == want, var
    # Optimizer slots follow their variable.
    # (dense_2 is the last layer: the last stage, on rank 1 of each
    # replica for 1F1B, on rank 0 for ZB-V, which ends where it starts.)
    last = ["CPU:1", "CPU:3"] if rank_of[-1] == 1 else ["CPU:0", "CPU:2"]
    slots = [v for v in placement["variables"]
             if v["path"].startswith("optimizer/") and "dense_2" in v["path"]]
    assert slots and all(
        [_suffix(d) for d in s["devices"]] == last for s in slots), slots


def test_weights_are_created_on_their_stage_device_only(placement):
    # Layer weights built in the scope are created where they live: no
    # full-size copy first made on another device (the first GPU) and
    # moved, so device 0 never holds the whole model.
    assert placement["discarded"] == [], placement["discarded"]


def test_forward_and_backward_ops_run_on_their_stage_device(placement):
    rows, rank_of = placement["stage_devices"], placement["rank_of"]
    ops = placement["ops"]
    expected = {
        f"{r}/{s}/{kind}": [_suffix(rows[r][rank_of[s]])]
        for r in range(len(rows)) for s in range(len(rank_of))
        for kind in ("fwd", "bwd")}
    got = {k: sorted({_suffix(d) for d in v}) for k, v in ops.items()}
    assert got == expected
    assert placement["unscoped"] == [], (
        "compute ops outside any pipeline stage", placement["unscoped"])


ERROR_CASES = {
    # A stateful RNN keeps one state row per batch row: every part of a
    # split batch would start from the whole batch's states (Keras failed
    # inside the first step; with one stage per process, a graph error).
    **{case: ("ValueError", [
        "Layer 'lstm' (LSTM)", "is stateful=True", f"into {parts}, each",
        "Use stateful=False", "run it with microbatches=1 and one replica"])
       for case, parts in (
           ("stateful_rnn_in_microbatches", "2 microbatches"),
           ("stateful_rnn_in_replicas", "2 replicas"),
           ("stateful_rnn_in_pipeline_replicas", "2 replicas"))},
    "compiled_to_run_eagerly": ("ValueError", [
        "is a DistributedModel compiled with run_eagerly=True",
        "Compile without run_eagerly", "run the plain Keras model"]),
    "batch_smaller_than_microbatches": ("ValueError", [
        "batch of 3 samples is smaller than microbatches=4",
        "drop_remainder=True"]),
    "static_batch_smaller_than_microbatches": ("ValueError", [
        "3 samples is smaller than microbatches=4"]),
    # Found inside the step (unknown batch size), re-raised as ValueError.
    "last_batch_smaller_than_microbatches": ("ValueError", [
        "batch of 4 samples is smaller than microbatches=5",
        "drop_remainder=True"]),
    # Array data whose last batch is too small: refused before training.
    "array_last_batch_smaller_than_microbatches": ("ValueError", [
        "last batch has 4 samples", "smaller than microbatches=5",
        "end of the first epoch", "batch_size that divides the 120",
        "leave the last 4 samples out"]),
    # A "mean_with_sample_weight" loss overriding Loss.__call__ needs
    # equal microbatches: a last batch of 22 rows cannot divide into 4
    # (however the replicas split it).
    "array_last_batch_mean_with_sample_weight": ("ValueError", [
        "last batch has 22 samples", "does not divide into microbatches=4",
        "mean_with_sample_weight", "overrides `Loss.__call__`",
        "batch_size that divides the 118"]),
    # Layers add losses: validation batches split too, checked as well.
    "validation_last_batch_with_added_losses": ("ValueError", [
        "validation data's last batch has 4 samples",
        "smaller than microbatches=5", "the first validation would fail",
        "validation_batch_size that divides the 34"]),
    "indivisible_batch_mean_with_sample_weight": ("ValueError", [
        "30 samples does not divide into microbatches=4",
        "mean_with_sample_weight", "overrides `Loss.__call__`"]),
    "nested_model_marked_after_wrapping": ("ValueError", [
        "Nested model(s) ['block'] were marked",
        "after DistributedModel placed their layers one by one",
        "Mark them before wrapping the model",
        "name them in the config's activation_checkpointing"]),
    "subclassed_call_branching_on_training": ("ValueError", [
        "Noisy.call calls other layers or operations with training=True",
        "only then: noise", "branches on `training` in Python",
        "Move the branch into a layer"]),
    "subclassed_model_adds_its_own_loss": ("ValueError", [
        "Regularized.call calls `self.add_loss(...)` on the model itself",
        "Add it in a layer", "compile(loss=...)"]),
    "subclassed_model_with_its_own_weight": ("ValueError", [
        "Scaled holds weights of its own", "self.add_weight",
        "Move them into a layer"]),
    "subclassed_call_negating_training": ("ValueError", [
        "Negated.call gives layer 'drop' training=False and True when it "
        "runs with training=True and False",
        "Pass `training` on unchanged, or a constant"]),
    "subclassed_call_reading_a_weight": ("ValueError", [
        "Tied.call reads the weight(s)", "embeddings",
        "outside the layers' symbolic calls",
        "Use the weight inside a layer's `call`"]),
    "operation_takes_a_weight_of_another_stage": ("ValueError", [
        "(stage 1) takes the weight", "emb/embeddings",
        "on stage(s) [0]", "gradient would be lost"]),
    "partition_index_out_of_range": ("ValueError", [
        "partition(2)", "partitions=2"]),
    "empty_stage": ("ValueError", ["[1]", "no layers"]),
    "more_partitions_than_layers": ("ValueError", [
        "partitions=4", "only 2 layers"]),
    "backward_data_flow": ("ValueError", ["partition 1", "partition 0"]),
    "plain_model_under_pipeline": ("ValueError", [
        "keras_smp.DistributedModel(model)", "partitions=2"]),
    "unknown_split_point": ("ValueError", ["no_such_layer"]),
    # Keras' own error (and words), before a step.
    "no_trainable_weight_reaches_the_loss": ("ValueError", [
        "No gradients provided for any variable", "aux/kernel",
        "reaches a loss", "compile(loss=...)"]),
    # Under XLA a loss added from a helper function (unseen before the
    # stage is compiled) is refused by name (it was TensorFlow's "out of
    # scope" error); so is an assignment a compiled stage would lose.
    "xla_stage_with_helper_add_loss": ("NotImplementedError", [
        "jit_compile=True", "stage 1", "helper function",
        "jit_compile=False"]),
    "xla_stateful_stage_assigning_a_weight": ("NotImplementedError", [
        "jit_compile=True", "assigns_its_kernel/kernel",
        "would be lost", "jit_compile=False"]),
    "added_loss_outside_class_with_unused_head": ("NotImplementedError", [
        "outside its class's methods", "some weights reach no loss",
        "Call add_loss() in the layer's own call"]),
    "devices_not_divisible": ("ValueError", ["partitions=3", "4 local"]),
    # A mask the loss's call attaches to its values (Keras divides by the
    # weights under it): unknown before the step's microbatches.
    "values_masked_mean_with_sample_weight": ("ValueError", [
        "mean_with_sample_weight", "not computed ahead",
        "microbatches=1"]),
    "masked_mean_with_sample_weight": ("ValueError", [
        "SelfReducingSCCE", "mean_with_sample_weight", "overrides",
        "masked entries left out", "microbatches=1"]),
    # Stages on devices of one process: weights made outside the scope are
    # not on their stages' devices (once an AssertionError in the update).
    "layers_built_outside_the_scope": ("ValueError", [
        "created outside the scope", "inside `with strategy.scope():`"]),
}


# Data that trains: fit's early checks refuse only certain failures.
ACCEPTED_CASES = ["unbuilt_subclass_with_validation",
                  # a stateful RNN in a pipeline of whole batches: equal to
                  # plain Keras (its states carried batch to batch)
                  "stateful_rnn_in_one_microbatch",
                  "validation_not_run_is_not_checked",
                  # a compiled stage assigning its weight (without state):
                  # equal to plain Keras compiled whole
                  "xla_stage_assigning_a_trainable_weight",
                  # Keras-reduced "mean_with_sample_weight" losses: unequal
                  # microbatches, a mask and sample weights
                  "mean_with_sample_weight_reduced_by_keras"]


@pytest.fixture(scope="module")
def errors():
    proc = run_python([os.path.join(WORKERS, "pipeline_errors.py"),
                       *ERROR_CASES, *ACCEPTED_CASES], timeout=300)
    rows = [json.loads(l) for l in proc.stdout.splitlines()
            if l.startswith("{")]
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bad_input_is_a_clear_error(errors, case):
    kind, fragments = ERROR_CASES[case]
    row = errors[case]
    assert row["type"] == kind, row
    for fragment in fragments:
        assert fragment in row["message"], (fragment, row["message"])


@pytest.mark.parametrize("case", ACCEPTED_CASES)
def test_data_that_trains_is_not_refused(errors, case):
    assert errors[case]["type"] is None, errors[case]


@pytest.mark.slow
def test_no_weight_reaching_a_loss_fails_on_every_stage_process():
    # Plain Keras raises "No gradients provided for any variable"; with one
    # stage per process each stage would otherwise step without gradients
    # and fit would silently train nothing. Every rank raises, before a
    # step (found from the graph each process holds whole).
    # (Each rank reports the error and exits 0: none hangs after it.)
    proc = launch(2, [os.path.join(WORKERS, "unreached.py")], timeout=240)
    rows = [json.loads(l.split("ROW ", 1)[1]) for l in proc.stdout.splitlines()
            if "ROW {" in l]
    assert sorted(r["rank"] for r in rows) == [0, 1], proc.stdout[-3000:]
    for row in rows:
        assert row["type"] == "ValueError", row
        assert "No gradients provided for any variable" in row["message"]
        assert "aux/kernel" in row["message"], row
        assert row["iterations"] == 0, row


@pytest.mark.slow
def test_state_a_layer_updates_on_two_stage_processes_is_refused():
    # A BatchNormalization called in two stages on two processes: each
    # process would update only its own copy of the moving statistics (on
    # one device both calls update one copy in turn); it trained silently,
    # moving variances 0.057 and predictions 0.08 from plain Keras, the two
    # ranks' get_weights disagreeing. Now fit fails on every rank before a
    # step, naming the layer, its weights and the fixes; predict (no
    # update) runs. Frozen (no update) or with both calls on one rank, it
    # trains as plain Keras in the same process (float32 bounds: 1e-6 x
    # magnitude; observed 0).
    proc = launch(2, [os.path.join(WORKERS, "shared_state.py")], timeout=240)
    rows = {(r["case"], r["rank"]): r for r in (
        json.loads(l.split("ROW ", 1)[1]) for l in proc.stdout.splitlines()
        if "ROW {" in l)}
    cases = ("across", "frozen", "one_stage", "unfrozen")
    assert sorted(rows) == [(c, r) for c in sorted(cases) for r in (0, 1)], \
        proc.stdout[-3000:]
    for r in (0, 1):
        # (unfrozen: frozen when the plan was set, unfrozen before fit)
        for row in (rows[("across", r)], rows[("unfrozen", r)]):
            assert row["type"] == "ValueError", row
            for words in ("Layer 'bn' is called on pipeline ranks [0, 1]",
                          "bn/moving_mean", "bn/moving_variance",
                          "Put its calls in one stage", "local_devices"):
                assert words in row["message"], row
            assert row["iterations"] == 0, row
            assert row["diff"] <= 1e-6 * max(1.0, row["scale"]), row
            assert 0 < row["evaluate"] < 10, row  # (runs: a loss)
        for case in ("frozen", "one_stage"):
            row = rows[(case, r)]
            assert row["type"] is None and row["iterations"] == 8, row
            assert row["diff"] <= 1e-6 * max(1.0, row["scale"]), row


@pytest.mark.slow
def test_two_workers_each_running_a_pipeline_match_single_device(
        tmp_path, reference):
    # 2 worker processes x (1 replica x 2 stages on 2 logical CPUs): the
    # re-placed weights start equal on both workers (broadcast from the
    # chief), each stage's gradients are all-reduced across the workers,
    # and Keras callbacks (checkpoints of the pipelined model, backup,
    # TensorBoard) behave as in single-process Keras.
    config = json.dumps({"partitions": 2, "microbatches": 4})
    proc = launch(2, fit_model(tmp_path, "--pipelined", "--local-devices",
                               "2", "--config", config, "--callbacks"))
    ref = reference()
    for r in range(2):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == 2
        assert int(got["buckets_traced"]) > 0
        assert_same_training(got, ref)
    assert "[0] Epoch 1/3" in proc.stdout and "[1] Epoch" not in proc.stdout
    assert (tmp_path / "files" / "ckpt.keras").is_file()
    assert (tmp_path / "files" / "best.weights.h5").is_file()


def test_saved_pipelined_model_loads_back_pipelined(tmp_path):
    script = tmp_path / "save_load.py"
    script.write_text(
        "import sys, keras_smp\n"
        "strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2)\n"
        "import keras, numpy as np\n"
        "x = np.random.RandomState(0).randn(32, 8).astype('float32')\n"
        "y = np.random.RandomState(1).randn(32, 2).astype('float32')\n"
        "with strategy.scope():\n"
        "    model = keras_smp.DistributedModel(keras.Sequential([\n"
        "        keras.Input((8,)), keras.layers.Dense(16, activation='tanh'),\n"
        "        keras.layers.Dense(2)]), split_points=['dense_1'])\n"
        "    model.compile(optimizer='adam', loss='mse')\n"
        "model.fit(x, y, batch_size=16, epochs=1, verbose=0)\n"
        f"model.save(r'{tmp_path}/m.keras')\n"
        "with strategy.scope():\n"
        f"    loaded = keras.saving.load_model(r'{tmp_path}/m.keras')\n"
        "diff = np.abs(loaded.predict(x, batch_size=16, verbose=0)\n"
        "              - model.predict(x, batch_size=16, verbose=0)).max()\n"
        "print('TYPE', type(loaded).__name__, loaded._smp_split_points)\n"
        "print('DIFF', diff)\n"
        "print('DEVICE', loaded.weights[-1].value.values[0].device)\n")
    out = run_python([str(script)], timeout=300).stdout
    assert "TYPE DistributedModel ['dense_1']" in out, out
    assert "DIFF 0.0" in out, out
    assert out.split("DEVICE ")[1].strip().endswith("CPU:1"), out
    # In a fresh process, `import keras, keras_smp` is enough for Keras to
    # find the class (it raised "Could not locate class
    # 'DistributedModel'" until keras_smp.DistributedModel was touched).
    fresh = tmp_path / "fresh_load.py"
    fresh.write_text(
        "import keras, numpy as np\n"
        "import keras_smp\n"
        f"loaded = keras.models.load_model(r'{tmp_path}/m.keras')\n"
        "x = np.random.RandomState(0).randn(32, 8).astype('float32')\n"
        "print('TYPE', type(loaded).__name__)\n"
        "print('SHAPE', loaded.predict(x, verbose=0).shape)\n")
    out = run_python([str(fresh)], timeout=300, extra_env={
        "SMP_CONFIG": '{"partitions": 2, "microbatches": 2}'}).stdout
    assert "TYPE DistributedModel" in out and "SHAPE (32, 2)" in out, out


def test_model_compiled_before_wrapping_saves_the_wrappers_optimizer(
        tmp_path):
    # A model compiled before it is wrapped (KerasHub tasks compile
    # themselves), the DistributedModel compiled again: save_weights wrote
    # both optimizers into the one "optimizer" group and failed ("Unable to
    # create link (name already exists)"). The file holds the wrapper's
    # (the one training), as the model's own save_weights lays it out:
    # plain Keras loads weights and SGD momentum, equal.
    script = tmp_path / "compiled_inner.py"
    path = tmp_path / "ci.weights.h5"
    script.write_text(
        "import keras, numpy as np, keras_smp\n"
        "strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,\n"
        "                                 local_devices=2)\n"
        "x = np.random.RandomState(0).randn(16, 8).astype('float32')\n"
        "y = np.random.RandomState(1).randn(16, 3).astype('float32')\n"
        "def net():\n"
        "    return keras.Sequential([keras.Input((8,)),\n"
        "        keras.layers.Dense(8), keras.layers.Dense(3)])\n"
        "with strategy.scope():\n"
        "    inner = net()\n"
        "    inner.compile(optimizer='adam', loss='mse')\n"
        "    model = keras_smp.DistributedModel(inner)\n"
        "    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),\n"
        "                  loss='mse')\n"
        "model.fit(x, y, batch_size=8, verbose=0)\n"
        f"model.save_weights(r'{path}')\n"
        "plain = net()\n"
        "plain.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),\n"
        "              loss='mse')\n"
        "plain.optimizer.build(plain.trainable_variables)\n"
        f"plain.load_weights(r'{path}')\n"
        "pairs = list(zip(plain.get_weights(), model.get_weights()))\n"
        "pairs += [(a.numpy(), b.numpy()) for a, b in zip(\n"
        "    plain.optimizer.variables, model.optimizer.variables)]\n"
        "print('STEPS', int(plain.optimizer.iterations.numpy()))\n"
        "print('DIFF', max(float(np.abs(a - b).max()) for a, b in pairs))\n"
        f"model.load_weights(r'{path}')\n"
        "print('LOADED')\n")
    out = run_python([str(script)], timeout=300).stdout
    assert "STEPS 2" in out and "DIFF 0.0" in out and "LOADED" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("workers,pipeline,variant", [
    # (Each schedule, variant and process count once: the stage processes
    # run the schedule's action lists whatever the model or callbacks.)
    (2, "gpipe", "callbacks"), (4, "1f1b", ""),
    (2, "gpipe", "loss-only"), (2, "1f1b", "manual"),
    (2, "gpipe", "recompute"), (2, "1f1b", "xla"), (2, "zb_h1", ""),
    # Virtual stages: each process runs 2 of the 4 model stages (rank 0
    # stages 0 and 2 / 0 and 3), one collective group per boundary; ZB-V's
    # turn (stages 1 -> 2) stays in rank 1, and rank 0 computes the loss.
    (2, "interleaved_1f1b", "callbacks"), (4, "zb_v", "deep"),
    # A backbone model holding a Sequential block, called with
    # training=False: its layers split between the two stage processes.
    (2, "1f1b", "nested"),
    # A subclassed keras.Model (its own call) wrapped unbuilt: its call is
    # traced into layers at the first step, its weights made only on their
    # stage's process.
    (2, "1f1b", "subclassed")])
def test_one_stage_per_process_matches_single_device(
        tmp_path, reference, workers, pipeline, variant):
    # partitions=2 over 2 or 4 worker processes (1 or 2 replicas x 2
    # stages): activations and gradients travel between the stage
    # processes through collective send/recv; each stage's gradients are
    # summed among its data-parallel peers only. Logs are identical on
    # every rank; weights (gathered from the stages for get_weights and
    # checkpoints) equal single-device training.
    config = json.dumps({"partitions": 2, "microbatches": 4,
                         "pipeline": pipeline,
                         "collective_timeout_seconds": 120})
    flags = ["--pipelined", "--config", config]
    ref_flags = ()
    if variant == "callbacks":
        flags.append("--callbacks")
    if variant == "loss-only":
        # No metrics: the steps use the loss but not y_pred. TensorFlow
        # prunes unused collective receives, which once left the last
        # stage's send waiting and hung the job at the next fit() call.
        ref_flags = ("--no-metrics", "--split-fit")
        flags += ref_flags
    if variant == "recompute":  # activation checkpointing on every stage
        flags = ["--pipelined", "--config", json.dumps(
            dict(json.loads(config), activation_checkpointing=True))]
    if variant == "xla":  # stages compiled; plain Keras compiled whole
        ref_flags = ("--xla",)
        flags += ref_flags
    if pipeline in ("interleaved_1f1b", "zb_v"):  # 4 model stages
        flags += ["--model", "deep"]
        ref_flags = ("--model", "deep")
    if variant == "nested":
        flags += ["--model", "nested"]
        ref_flags = ("--model", "nested")
    if variant == "subclassed":  # against the plain mlp's training
        flags += ["--model", "subclassed"]
    if variant == "manual":
        # Subclassed DistributedModel placed with partition scopes.
        flags = ["--pipelined", "--model", "manual", "--config", json.dumps(
            dict(json.loads(config), auto_partition=False))]
    proc = launch(workers, fit_model(tmp_path, *flags))
    ref = reference(*ref_flags)
    for r in range(workers):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == workers // 2
        assert_same_training(got, ref)
    # Each process holds only its stage's weights and optimizer slots (the
    # two stages together: the whole model, plus a few optimizer scalars
    # such as the iteration count that every process keeps).
    held = [int(load(tmp_path, r)["held_elements"]) for r in range(2)]
    full = int(load(tmp_path, 0)["full_elements"])
    assert max(held) < full and full <= sum(held) <= full + 16, (held, full)
    if workers == 4:
        assert int(load(tmp_path, 0)["buckets_traced"]) > 0
    if variant != "manual":  # a wrapped model: get_layer finds its layers
        found = load(tmp_path, 0)["get_layer"]
        assert found.size and found.all(), found
        *layers, inner = load(tmp_path, 0)["layers"]
        assert list(layers) == [inner[1:]], (layers, inner)
    compiled = [int(load(tmp_path, r)["compiled_calls"]) for r in range(2)]
    assert (min(compiled) > 0) == (variant == "xla"), compiled
    assert "[0] Epoch 3/3" in proc.stdout and "[1] Epoch" not in proc.stdout
    if variant == "callbacks":
        assert (tmp_path / "files" / "ckpt.keras").is_file()
    if variant == "nested":  # the backbone's layers on both stages
        got = load(tmp_path, 0)
        assert list(got["expanded"]) == ["block", "backbone"], got
        assert list(got["stage_layers"]) == ["d1", "d2 out"], got
        assert str(got["summary"]).endswith(
            "Nested models placed layer by layer: block, backbone"), got
    if variant == "subclassed":  # its layers split between the processes
        got = load(tmp_path, 0)
        assert list(got["stage_layers"]) == ["d1", "d2 head"], got



def test_wrapped_subclassed_call_keeps_keras_training_semantics(tmp_path):
    # In a subclassed model's own call, a layer given no `training`
    # (Dropout) follows fit/evaluate, and one given a constant
    # (`self.bn(h, training=False)`) keeps it, as in Keras. A first version
    # froze the Dropout at its default (off in fit), and let fit turn the
    # BatchNormalization on (its moving statistics moved). Learning rate 0:
    # the weights stay, so fit's loss shows dropout and evaluate equals
    # plain Keras exactly.
    script = tmp_path / "semantics.py"
    script.write_text(
        "import json, keras_smp\n"
        "strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,\n"
        "                                 local_devices=2)\n"
        "import keras, numpy as np\n"
        "from keras_smp.pipeline.graph import fixed_training\n"
        "class Net(keras.Model):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.d1 = keras.layers.Dense(16, name='d1')\n"
        "        self.drop = keras.layers.Dropout(0.5, name='drop')\n"
        "        self.bn = keras.layers.BatchNormalization(name='bn')\n"
        "        self.d2 = keras.layers.Dense(1, name='d2')\n"
        "    def call(self, x, training=None):\n"
        "        h = self.bn(self.drop(self.d1(x)), training=False)\n"
        "        return self.d2(h)\n"
        "x = np.random.RandomState(0).randn(64, 8).astype('float32')\n"
        "y = np.random.RandomState(1).randn(64, 1).astype('float32')\n"
        "def run(pipelined):\n"
        "    keras.utils.set_random_seed(7)\n"
        "    with strategy.scope() if pipelined else "
        "keras.name_scope('plain'):\n"
        "        model = Net()\n"
        "        if pipelined:\n"
        "            model = keras_smp.DistributedModel(model)\n"
        "        model.compile(optimizer=keras.optimizers.SGD(0.0), "
        "loss='mse')\n"
        "    fit = model.fit(x, y, batch_size=32, epochs=2, verbose=0,\n"
        "                    shuffle=False).history['loss']\n"
        "    ev = model.evaluate(x, y, batch_size=32, verbose=0)\n"
        "    bn = [w.numpy().tolist() for w in model.get_layer('bn').weights\n"
        "          if 'moving' in w.path] if not pipelined else [\n"
        "          w.numpy().tolist() for w in model.inner_model.bn.weights\n"
        "          if 'moving' in w.path]\n"
        "    fixed = ({n.operation.name: fixed_training(n)\n"
        "              for n in model.staged_graph.nodes} if pipelined\n"
        "             else None)\n"
        "    return dict(fit=fit, evaluate=ev, bn=bn, fixed=fixed)\n"
        "print('RESULT', json.dumps({'plain': run(False), "
        "'pipe': run(True)}))\n")
    out = run_python([str(script)], timeout=300).stdout
    result = json.loads(out.split("RESULT ", 1)[1])
    plain, pipe = result["plain"], result["pipe"]
    assert pipe["fixed"]["drop"] is None, pipe  # the step decides
    assert pipe["fixed"]["bn"] is False, pipe  # kept
    # Dropout on in fit (a loss other than evaluate's), off in evaluate.
    assert min(abs(f - pipe["evaluate"]) for f in pipe["fit"]) > 1e-3, pipe
    np.testing.assert_allclose(pipe["evaluate"], plain["evaluate"],
                               rtol=RTOL)
    # The BatchNormalization stayed in inference mode: moving statistics
    # untouched, as in plain Keras.
    np.testing.assert_array_equal(pipe["bn"], plain["bn"])


def test_wrapped_subclassed_model_with_string_inputs_saves_and_loads(
        tmp_path):
    # Traced on the data's dtypes (a string input through StringLookup);
    # the .keras file keeps them, so the loaded model is traced the same
    # way (it failed to build with float inputs) and predicts the same.
    script = tmp_path / "strings.py"
    script.write_text(
        "import keras_smp\n"
        "strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,\n"
        "                                 local_devices=2)\n"
        "import keras, numpy as np, tensorflow as tf\n"
        "@keras.saving.register_keras_serializable(package='t')\n"
        "class Words(keras.Model):\n"
        "    def __init__(self, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.lookup = keras.layers.StringLookup(\n"
        "            vocabulary=['a', 'b', 'c'])\n"
        "        self.emb = keras.layers.Embedding(5, 4)\n"
        "        self.flat = keras.layers.Flatten()\n"
        "        self.out = keras.layers.Dense(1)\n"
        "    def call(self, s):\n"
        "        return self.out(self.flat(self.emb(self.lookup(s))))\n"
        "x = tf.constant(np.random.RandomState(0).choice(\n"
        "    ['a', 'b', 'c', 'd'], size=(16, 2)))\n"
        "y = np.random.RandomState(1).rand(16, 1).astype('float32')\n"
        "with strategy.scope():\n"
        "    model = keras_smp.DistributedModel(Words())\n"
        "    model.compile(optimizer='sgd', loss='mse')\n"
        "model.fit(x, y, batch_size=8, verbose=0)\n"
        f"model.save(r'{tmp_path}/m.keras')\n"
        "with strategy.scope():\n"
        f"    loaded = keras.models.load_model(r'{tmp_path}/m.keras')\n"
        "print('DTYPES', model.staged_graph.inputs[0].dtype,\n"
        "      loaded.staged_graph.inputs[0].dtype)\n"
        "print('DIFF', float(np.abs(loaded.predict(x, batch_size=8, "
        "verbose=0) - model.predict(x, batch_size=8, verbose=0)).max()))\n")
    out = run_python([str(script)], timeout=300).stdout
    assert "DTYPES string string" in out, out
    assert "DIFF 0.0" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sequential", "subclassed"])
def test_weights_given_before_wrapping_train_as_on_one_device(tmp_path,
                                                              model):
    # Fine-tuning: the model is built in the scope and loads its weights
    # (`load_weights`) before it is wrapped, so they hold values in the
    # process before any plan exists. In one process the stage-0 weights
    # stayed process-local variables (already on the right device) and
    # fit failed with a bare AssertionError; a wrapped subclassed model
    # (traced at its first step) read the other stage's freed weights when
    # Keras traced it for shapes, with one stage per process. Also the
    # order that never holds the whole model (one stage per process):
    # wrap, build from shapes, then load (each process reads its own
    # stage's weights). All: 2 steps, = plain Keras from the same weights
    # (float32 bounds).
    worker = os.path.join(WORKERS, "weights_before_wrapping.py")
    ref_dir, one, two, after = (tmp_path / d
                                for d in ("ref", "one", "two", "after"))
    for d in (ref_dir, one, two, after):
        d.mkdir()
    run_python([worker, "--out", str(ref_dir), "--model", model,
                "--mode", "reference"], timeout=300)
    given = ["--model", model, "--mode", "pipeline",
             "--weights", str(ref_dir / "initial.weights.h5")]
    run_python([worker, "--out", str(one), "--local-devices", "2", *given],
               timeout=300)
    launch(2, [worker, "--out", str(two), *given])
    launch(2, [worker, "--out", str(after), "--after", *given])
    ref = load(ref_dir)
    for got in (load(one), load(two, 0), load(two, 1), load(after, 0),
                load(after, 1)):
        assert list(got["stage_layers"]) == (
            [1, 2] if model == "sequential" else [2, 2]), got
        assert_same_training(got, ref, keys=("predict",))
    held = [int(load(after, r)["held"]) for r in range(2)]
    assert max(held) < int(ref["held"]) == sum(held), (held, ref["held"])


@pytest.mark.slow
def test_plain_keras_file_loaded_in_the_scope_trains_on_as_on_one_device(
        tmp_path):
    # A compiled plain model saved mid-training (2 Adam steps), loaded
    # with keras.models.load_model inside the scope and wrapped, trains 4
    # more steps without a new compile: the wrapper keeps the loaded
    # compile and the optimizer state waits for the pipeline's build
    # (TensorFlow failed: "colocate_vars_with must only be passed a
    # variable created in this tf.distribute.Strategy.scope()"). Equal to
    # plain Keras after load_model (float32 bounds); Adam's moments and
    # step count carry over (dropped: 4 steps counted, not 6, and the
    # weights differ by ~3e-3 at lr 1e-3).
    worker = os.path.join(WORKERS, "load_model_in_scope.py")
    ref_dir, one, two = (tmp_path / d for d in ("ref", "one", "two"))
    for d in (ref_dir, one, two):
        d.mkdir()
    run_python([worker, "--out", str(ref_dir), "--mode", "reference"],
               timeout=300)
    given = ["--mode", "pipeline", "--file", str(ref_dir / "plain.keras")]
    run_python([worker, "--out", str(one), "--local-devices", "2", *given],
               timeout=300)
    launch(2, [worker, "--out", str(two), *given])
    ref = load(ref_dir)
    assert int(ref["iterations"]) == 6
    for got in (load(one), load(two, 0), load(two, 1)):
        assert list(got["stage_layers"]) == [1, 2], got
        assert int(got["loaded_iterations"]) == 2  # loaded state, at once
        assert int(got["iterations"]) == 6
        np.testing.assert_array_equal(got["accuracy"], ref["accuracy"])
        assert_same_training(got, ref, keys=("loss", "predict"))
    # Saved again, the DistributedModel's file holds the optimizer state
    # (Keras saved the optimizer once, under the wrapped model's path,
    # and load_model dropped it: "Skipping variable loading for
    # optimizer"): before its first fit, the loaded state (2 steps), and
    # after it the trained one, equal to plain Keras' (Adam's moments in
    # float32 bounds; one stage per process: rank 0's streamed file).
    code = (
        "import json, sys, keras, keras_smp\n"
        "for path in sys.argv[1:]:\n"
        "    o = keras.models.load_model(path).optimizer\n"
        "    print('OPT', json.dumps([v.numpy().tolist()"
        " for v in o.variables]))\n")
    out = run_python(["-c", code] + [str(d / f) for d in (one, two)
                                      for f in ("wrapped.keras",
                                                "trained.keras")]).stdout
    states = [json.loads(line[4:]) for line in out.splitlines()
              if line.startswith("OPT ")]
    assert len(states) == 4, out[-3000:]
    want = [ref[f"o{i}"] for i in range(len(states[1]))]
    for wrapped, trained in (states[:2], states[2:]):
        assert wrapped[0] == 2 and trained[0] == 6, (wrapped[0], trained[0])
        assert any(np.any(np.array(v)) for v in wrapped[2:])  # moments
        assert len(trained) == len(want)
        for got_v, want_v in zip(trained, want):
            np.testing.assert_allclose(got_v, want_v, rtol=RTOL,
                                       atol=scaled_atol(want_v))
    # Left unwrapped: fit, and building its optimizer, name the fix.
    fit_error, build_error = load(one)["errors"]
    assert "plain Sequential under an SMPStrategy with partitions=2" in (
        fit_error) and "DistributedModel(model)" in fit_error, fit_error
    assert "no DistributedModel has partitioned (first: 'd1/kernel')" in (
        build_error), build_error


def test_one_stage_per_process_takes_any_batch_size_in_turn(tmp_path):
    # fit (batch 8, loss only), predict with 8, 32, 16, 8, 4, 7, 9,
    # evaluate with 16, 8, 7, 9, fit with 16: each batch size crosses the stage
    # boundary with its own shapes. TensorFlow keeps the shape of each
    # collective (group, instance key) for the life of the process, so
    # sizes must not share keys: this once failed at the first predict
    # ("Shape mismatch in the collective instance").
    launch(2, [os.path.join(WORKERS, "batch_sizes.py"), str(tmp_path)],
           timeout=240)
    got = [load(tmp_path, r) for r in range(2)]
    for r in range(2):
        # Every process returns the whole model's outputs.
        for key in got[0]:
            np.testing.assert_array_equal(got[r][key], got[0][key])
        # The same weights predict the same, whatever the batch size
        # (float32 matmuls of different row counts may round differently).
        for b in (32, 16, 4):
            np.testing.assert_allclose(got[r][f"predict{b}"],
                                       got[r]["predict8"], rtol=1e-5,
                                       atol=1e-6 * np.abs(
                                           got[r]["predict8"]).max())
        np.testing.assert_allclose(got[r]["evaluate16"],
                                   got[r]["evaluate8"], rtol=1e-5)
        assert not np.allclose(got[r]["after"], got[r]["predict8"])
        # Batches of 7 and 9 rows (last batches of 4 and 5) do not divide
        # into 2 microbatches: padded, they give plain Keras' predictions
        # and losses (the same float32 bounds).
        plain = got[r]["plain_predict"]
        for b in (7, 9):
            np.testing.assert_allclose(
                got[r][f"predict{b}"], plain, rtol=1e-5,
                atol=1e-6 * np.abs(plain).max())
            np.testing.assert_allclose(
                got[r][f"evaluate{b}"], got[r][f"plain_evaluate{b}"],
                rtol=1e-5, atol=1e-6)

XLA_FALLBACK = """
import warnings
import numpy as np
import keras_smp
strategy = keras_smp.SMPStrategy(partitions=2, microbatches=2,
                                 local_devices=2)
import keras
import compiled

class Host(keras.layers.Dense):  # a layer XLA cannot compile (say)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_jit = False

x = np.random.RandomState(0).randn(32, 4).astype("float32")
with strategy.scope():
    model = keras_smp.DistributedModel(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(4, name="fast"),
        Host(4, name="host_only")]))
    model.compile("sgd", "mse", jit_compile=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, x, batch_size=16, epochs=1, verbose=0)
print("WARN", [str(w.message) for w in caught if "XLA" in str(w.message)])
print("COMPILED", compiled.count[0])
# What the compiled stage 0's backward returns: its weights' gradients,
# not the batch's (TensorFlow differentiates a function call with respect
# to every input it is given).
from tensorflow.python.eager import context
ctx = context.context()
print("BACKWARD_OUTPUTS", sorted(
    len(ctx.get_function_def(name).signature.output_arg)
    for name in ctx.list_function_names()
    if "__backward_run_" in name or "__backward_pure_" in name))
"""


def test_a_stage_xla_cannot_compile_runs_uncompiled_with_a_warning():
    # jit_compile=True: stage 1 holds a layer with supports_jit=False
    # (Keras' flag): it runs uncompiled with a warning naming the layer;
    # stage 0 is still compiled.
    out = run_python(["-c", XLA_FALLBACK], extra_env={
        "TF_DETERMINISTIC_OPS": "0",
        "PYTHONPATH": WORKERS + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }).stdout
    warned = out.split("WARN ")[1].splitlines()[0]
    assert "stage 1 runs without XLA" in warned and "host_only" in warned, out
    assert "stage 0" not in warned, out
    assert int(out.split("COMPILED ")[1].split()[0]) > 0, out
    # Stage 0's compiled backward returns the gradients of "fast"'s kernel
    # and bias only: nothing differentiates the model's inputs.
    assert out.split("BACKWARD_OUTPUTS ")[1].splitlines()[0] == "[2]", out


@pytest.mark.parametrize("where", ["pipeline", "data_parallel"])
def test_loops_run_uncompiled_in_training_with_a_warning(tmp_path, reference,
                                                         where):
    # jit_compile=True with while loops (an LSTM; an RNN of a cell
    # without a seed generator, its stage without state): keras-smp compiles a stage's (or, data
    # parallel, the model call's) forward and backward as two XLA
    # computations, and TensorFlow cannot pass a loop's per-iteration
    # values between them ("Support for TensorList crossing the XLA/TF
    # boundary is not implemented" at the first step). A call holding one
    # now runs uncompiled in training, with a warning naming the loop;
    # the unrolled GRU's stage stays compiled. 3 stages (or 2 replicas) on
    # logical devices of one process, against plain Keras compiled whole
    # (no random layer: the uncompiled calls compute what XLA does within
    # float32 rounding); suite bounds (rtol 1e-5).
    pipeline = where == "pipeline"
    config = {"partitions": 3, "microbatches": 2} if pipeline else {}
    flags = ["--model", "loops", "--config", json.dumps(config),
             "--local-devices", "3" if pipeline else "2", "--xla"]
    if pipeline:
        flags.append("--pipelined")
    err = run_python(fit_model(tmp_path, *flags)).stderr
    ref = reference("--model", "loops", "--xla")
    assert_same_training(load(tmp_path, 0), ref)
    warned = [line for line in err.splitlines()
              if "runs without XLA in training" in line]
    if pipeline:  # stage 0 has state (the LSTM's seed generator), 2 none
        assert len(warned) == 2, err
        assert "stage 0" in warned[0] and "d1" in warned[0], warned
        assert "stage 2" in warned[1] and "d3" in warned[1], warned
    else:
        assert len(warned) == 1 and "model" in warned[0], err
        assert "d1" in warned[0] and "d3" in warned[0], warned
    assert not any("d2" in line or "stage 1" in line for line in warned), (
        warned)


def test_recomputation_keeps_dropout_and_batchnorm_training_unchanged():
    # Dropout draws the forward's masks again and BatchNormalization's
    # moving statistics update once: training with activation
    # checkpointing equals training without (same pipeline, same seeds).
    # Bounds: the recomputation repeats the same kernels on the same
    # inputs; observed bitwise equal, asserted to the suite's float32
    # bounds (rtol 1e-5, atol 1e-6 x magnitude).
    out = run_python([os.path.join(WORKERS, "recompute_stateful.py")]).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert row["replays"] > 0, row
    assert row["moving_stats_changed"], row
    assert row["weights"] <= 1e-6 * max(1.0, row["scale"]) + 1e-5 * row["scale"], row
    assert row["loss"] <= 1e-6, row
    # Random numbers a recomputation cannot draw again: a clear error.
    assert "stage 1 draws random numbers the recomputation cannot draw " \
        "again (RandomUniform)" in row["random_error"], row
    assert "turn activation_checkpointing off for stage 1" in \
        row["random_error"], row
    # Per layer (Dropout, BatchNormalization and Dense layers recomputed
    # one by one): the same, and the same clear errors.
    assert row["layer_replays"] > 0, row
    assert row["layer_weights"] <= 1e-6 * max(1.0, row["scale"]) + 1e-5 * row[
        "scale"], row
    assert row["layer_loss"] <= 1e-6, row
    # Self-attention called as (h, h) and a Dense between a masking
    # Embedding and a masked pooling, recomputed: the same training
    # (h's gradient counted once, the padding mask kept).
    assert row["attention_weights"] <= 1e-6 * max(
        1.0, row["attention_scale"]) + 1e-5 * row["attention_scale"], row
    assert row["attention_loss"] <= 1e-6, row
    assert "layer 'noise' draws random numbers the recomputation cannot " \
        "draw again (RandomUniform)" in row["layer_random_error"], row
    assert "set_activation_checkpointing(layer, False)" in row[
        "layer_random_error"], row
    # A layer assigning a trainable weight in training (SpectralNormalization
    # normalises its kernel in place): recomputing would assign it again.
    assert re.search(r"stage 1 assigns weights \['\S*sn/dense\w*/kernel'\] in "
                     r"its training call", row["spectral_error"]), row
    assert "turn activation_checkpointing off for stage 1" in row[
        "spectral_error"], row
    assert re.search(r"layer 'sn' assigns weights \['\S*sn/dense\w*/kernel'\]",
                     row["layer_spectral_error"]), row
    assert "set_activation_checkpointing(layer, False)" in row[
        "layer_spectral_error"], row
    assert "names layer(s) ['d9'] that the model does not have" in row[
        "unknown_error"] and "d1, d2, drop1" in row["unknown_error"], row


@pytest.mark.slow
def test_one_stage_per_process_resumes_from_backup(tmp_path, reference):
    # Each process holds only its stage's weights and optimizer slots; the
    # backups gather the whole model and the SGD momentum of every stage.
    # Rank 1 fails at epoch 2; the re-run restores the backup (each
    # process takes its stage's part) and ends where an uninterrupted run
    # ends - which needs the restored momentum to be right.
    config = json.dumps({"partitions": 2, "microbatches": 4,
                         "collective_timeout_seconds": 120})
    flags = ["--pipelined", "--config", config, "--callbacks"]
    proc = launch(2, fit_model(tmp_path, *flags, "--fail-at-epoch", "2"),
                  check=False)
    assert proc.returncode != 0 and "fails on purpose" in proc.stdout
    proc = launch(2, fit_model(tmp_path, *flags))
    assert "Epoch 3/3" in proc.stdout and "Epoch 1/3" not in proc.stdout
    for r in range(2):
        assert_same_training(load(tmp_path, r), reference(),
                             keys=("evaluate", "predict"))


def _reference_then_run_dir(tmp_path, worker_name, *flags):
    """`(worker path, its reference results, an empty run folder)`: the
    worker's `--mode reference` (plain Keras, one device) run first, with
    `flags`."""
    worker = os.path.join(WORKERS, worker_name)
    ref_dir, run = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run.mkdir()
    run_python([worker, "--out", str(ref_dir), "--mode", "reference",
                *flags])
    return worker, load(ref_dir), run


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    "1f1b",
    # ZB-H1: each backward split into input gradients (I, sent to the
    # previous stage with their shapes) and weight gradients (W) later.
    "zb_h1",
    # 4 model stages on the 2 processes (stages 0 and 2 on rank 0): each
    # of the 3 boundaries crosses between them, the first with a mask;
    # XLA compiles each stage (the reference's step too).
    "interleaved-xla"])
def test_one_stage_per_process_takes_inputs_of_unknown_length(tmp_path,
                                                              variant):
    # keras.Input((None,)), as every KerasHub backbone declares: the tensor
    # crossing the stage boundary is (batch, None, 16), with its Keras
    # mask. The receiving process needs its shape: it was refused ("only
    # its batch dimension may be unknown"); now the shapes come from the
    # step's batch (sequences of 12 tokens). A later batch of another
    # length was refused ("had shape (None, 12, 16) in an earlier step"),
    # and so was a `padded_batch` dataset (each batch its own length): now
    # such tensors travel with their shapes (`transport.Dynamic`). Rank 1
    # reads the dataset in another order (other lengths): its batches must
    # not be used, nor their shapes (the targets, per token, come from
    # rank 0; `predict` traces each rank's own first batch, so whether a
    # tensor travels with its shape is decided from the model alone). Weights after each fit, losses, evaluate and predictions =
    # plain Keras (float32 bounds: rtol 1e-5, atol 1e-6 x magnitude).
    jit = ["--jit"] if variant.endswith("xla") else []
    flags = {"1f1b": [],
             "zb_h1": ["--config", '{"pipeline": "zb_h1"}'],
             "interleaved-xla": ["--config", '{"pipeline": "interleaved_1f1b", '
                             '"virtual_stages": 2}',
                             "--split", "d1,d2,head"]}[variant]
    worker, ref, run = _reference_then_run_dir(tmp_path, "dynamic_length.py",
                                               *jit)
    launch(2, [worker, "--out", str(run), "--mode", "pipeline", *jit,
               *flags])
    assert ref["pob_long"].shape == (16, 14, 5), ref["pob_long"].shape
    for r in range(2):
        got = load(run, r)
        assert_same_training(got, ref, keys=(
            "loss", "predict", "predict10", "ds_loss", "ds_evaluate",
            "ds_predict",
            "pob_long", "pob_short") + tuple(f"x{i}" for i in range(7)))


@pytest.mark.slow
def test_one_stage_per_process_falls_back_to_the_previous_backup(tmp_path):
    # BackupAndRestore(double_checkpoint=True): the last backup damaged
    # (a stage's shard truncated), the re-run resumes from the one before
    # and ends as an uninterrupted run. Keras' copy of the last backup's
    # `.weights.h5` only named the sharded index the next save replaced
    # (no second state), and a damaged shard was a ValueError inside
    # Keras' loading, where its fallback expects an OSError.
    worker, ref, run = _reference_then_run_dir(tmp_path, "double_backup.py")
    given = [worker, "--out", str(run), "--mode", "pipeline"]
    proc = launch(2, given + ["--fail-at-epoch", "2"], check=False)
    assert proc.returncode != 0 and "fails on purpose" in proc.stdout
    folder = run / "backup"
    with open(folder / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 2
    with open(folder / "training_metadata.json.bkp") as f:
        assert json.load(f)["epoch"] == 1
    last = json.loads((folder / "latest.weights.json").read_text())
    kept = json.loads((folder / "latest-backup.weights.json").read_text())
    names = [set(f for g in i["weight_map"].values()
                 for f in ([g] if isinstance(g, str) else g))
             for i in (last, kept)]
    assert len(names[0]) == len(names[1]) == 2 and not names[0] & names[1]
    for name in names[1]:
        assert (folder / name).is_file(), name
    damaged = folder / sorted(names[0])[-1]
    with open(damaged, "r+b") as f:
        f.truncate(200)
    proc = launch(2, given)
    assert "Epoch 2/3" in proc.stdout and "Epoch 1/3" not in proc.stdout
    for r in range(2):
        assert_same_training(load(run, r), ref, keys=("predict",))
    # The re-run saved twice more: each backup's shards replaced the
    # previous backup's, none left behind (placeholder _00000 aside).
    kept = json.loads((folder / "latest-backup.weights.json").read_text())
    named = {f for g in kept["weight_map"].values()
             for f in ([g] if isinstance(g, str) else g)}
    on_disk = {p.name for p in folder.glob("latest-backup_*.weights.h5")}
    assert on_disk == named | {"latest-backup_00000.weights.h5"}, (
        on_disk, named)
    with open(folder / "training_metadata.json.bkp") as f:
        assert json.load(f)["epoch"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("where,pipeline", [
    ("in_process", "1f1b"), ("multi_process", "1f1b"),
    # Virtual stages (4 model stages, the tied layer's calls in stages 0
    # and 3): zb_v holds both on rank 0 (its two stages share the copy, no
    # collective), interleaved_1f1b on ranks 0 and 1 (summed across them).
    ("in_process", "zb_v"), ("multi_process", "zb_v"),
    ("multi_process", "interleaved_1f1b")])
def test_tied_weights_match_single_device(tmp_path, reference, where,
                                          pipeline):
    # One Dense layer applied at both ends of the model, so with 2 stages
    # both use its weights: their gradients are summed across the stages
    # (without it, or counting the first stage's part twice, weights were
    # off by 0.3 to 0.5 after 3 epochs). In one process the stages share the
    # variable; with one stage per process each holds a copy and the copies
    # take the same steps.
    config = json.dumps({"partitions": 2, "microbatches": 4,
                         "pipeline": pipeline,
                         "collective_timeout_seconds": 120})
    flags = ["--pipelined", "--model", "tied", "--config", config]
    if where == "in_process":
        run_python(fit_model(tmp_path, *flags, "--local-devices", "2"))
        ranks = [0]
    else:
        launch(2, fit_model(tmp_path, *flags))
        ranks = [0, 1]
    ref = reference("--model", "tied")
    for r in ranks:
        got = load(tmp_path, r)
        assert_same_training(got, ref, keys=("loss", "evaluate"))
        # Outputs pass the tied layer twice, which amplifies the float32
        # rounding of its weights (equal within 6e-7) to ~1.4e-5 in logits
        # of magnitude up to 3.6.
        np.testing.assert_allclose(got["predict"], ref["predict"],
                                   rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("model,pipeline", [
    ("tied", "interleaved_1f1b"), ("shared_lookup", "1f1b"),
    ("reversible_tied", "1f1b_recomputed")])
def test_weights_several_stages_use_compile_with_xla_in_one_process(
        tmp_path, reference, model, pipeline):
    # jit_compile=True, 2 stages on 2 logical devices of one process: a
    # weight the stages share (a Dense applied at both ends, its calls in
    # model stages 0 and 3 of 2 virtual stages each, on ranks 0 and 1; an
    # Embedding looked up in both; a tied ReversibleEmbedding, its stages
    # recomputed)
    # lives on one stage's device, and XLA cannot read a variable of
    # another device: TensorFlow's "tfvariable_on_a_different_device"
    # error at the first step. The compiled stages now take its value,
    # read outside them. Against plain Keras compiled whole; suite bounds
    # on training (float32 rounding, rtol 1e-5); outputs of the tied
    # model pass its Dense twice, which amplifies its weights' rounding
    # (observed 4.2e-6 of the outputs' magnitude on AMD EPYC): 1e-5 of it.
    recomputed = pipeline.endswith("_recomputed")
    config = json.dumps({"partitions": 2, "microbatches": 4,
                         "pipeline": pipeline.replace("_recomputed", ""),
                         "activation_checkpointing": recomputed})
    run_python(fit_model(tmp_path, "--pipelined", "--model", model,
                         "--config", config, "--local-devices", "2",
                         "--xla"))
    ref = reference("--model", model, "--xla")
    got = load(tmp_path, 0)
    assert_same_training(got, ref, keys=("loss", "evaluate"))
    np.testing.assert_allclose(got["predict"], ref["predict"], rtol=RTOL,
                               atol=scaled_atol(ref["predict"], 1e-5))


@pytest.mark.parametrize("model", ["reversible", "reversible_tied",
                                   "reversible_frozen", "shared_lookup"])
def test_layer_called_in_two_stage_processes_trains_as_on_one_device(
        tmp_path, reference, model):
    # A layer called in both stages of 2 stage processes, trained with
    # Adam (whose second moment squares a sparse gradient's rows one by
    # one, repeated ids included, as Keras passes them):
    # - Keras' ReversibleEmbedding, untied: the lookup in the first stage,
    #   the projection in the last, each reading one of the layer's
    #   weights, which then belongs to its stage alone (all the layer's
    #   weights once counted as used by both, the lookup's sparse gradient
    #   was summed with the other process's zeros into a dense one: loss
    #   0.79 vs Keras' 0.61 after 3 epochs);
    # - tied: the embeddings' lookup (sparse) and projection (dense) parts
    #   are summed across the processes, dense, as Keras sums them;
    # - frozen (untied): each stage's step takes only the layer's weights
    #   it holds as state (it once took the other's too, released here:
    #   "Invalid variable value in StatelessScope");
    # - one Embedding looked up in both stages (an encoder-decoder's shared
    #   embedding), the second time 5 of the 8 tokens: both parts sparse,
    #   of different row counts, their rows gathered (summed densely they
    #   gave loss 0.75 vs 0.21).
    # Each with a last batch of other size (26 rows: other row counts).
    # Suite bounds (float32 rounding, rtol 1e-5).
    config = json.dumps({"partitions": 2, "microbatches": 4})
    flags = ["--model", model, "--optimizer", "adam", "--partial",
             "--samples", "250"]
    launch(2, fit_model(tmp_path, *flags, "--pipelined", "--config", config))
    ref = reference(*flags)
    got = [load(tmp_path, r) for r in range(2)]
    for r in range(2):
        assert_same_training(got[r], ref)
    # Untied: no weight held by both processes (the whole model once,
    # plus the optimizer's scalars every process keeps); otherwise the
    # embeddings and their two Adam slots on both.
    held = sum(int(g["held_elements"]) for g in got)
    full = int(got[0]["full_elements"])
    twice = 3 * 20 * 8 if model in ("reversible_tied", "shared_lookup") else 0
    assert full + twice <= held <= full + twice + 16, (held, full)


@pytest.mark.parametrize("where", ["in_process", "multi_process",
                                   "data_parallel", "local_replicas",
                                   "local_replicas_xla",
                                   "pipeline_replicas"])
def test_position_embedding_trains_as_on_one_device(tmp_path, reference,
                                                    where):
    # keras.io's TokenAndPositionEmbedding: a position embedding looked up
    # at ops.arange(length) and added to every row. One device's gradient
    # holds each position once, its rows summed over the batch; each
    # microbatch gave its own rows for the same positions, concatenated,
    # and Adam (which adds each row's square to its second moment) then
    # stepped otherwise: weights 1e-3 from plain Keras after one step on
    # a seq2seq Transformer (docs/what-works.md). The microbatches' rows
    # of such a lookup (ids neither from the data nor growing with the
    # batch) are now added position by position. Beside it, in the same
    # layer: a table looked up at arange(length) // 2 (each id twice: the
    # repeats must stay) and one at the positions broadcast over the batch
    # (a row per sample, as token ids: concatenated, as are the tokens').
    # Adam, 4 microbatches, a last batch of 26 rows (unequal
    # microbatches), per-token weights under the tokens' mask.
    # Data-parallel replicas (plain Keras in 2 worker processes, or 2
    # replicas of one process; 2 pipeline replicas of 2 stage processes):
    # TensorFlow gathered the replicas' rows of such a lookup (weights 0.009
    # from plain Keras after 3 epochs), and where the gathered rows were at
    # least the table's rows with static shapes (2 local replicas: the
    # token table too) summed them densely, merging repeated ids' rows
    # (0.59): the replicas' rows are now added position by position, and
    # summed densely only for SGD. Suite bounds (float32 rounding, rtol
    # 1e-5).
    config = {"partitions": 2, "microbatches": 4,
              "collective_timeout_seconds": 120}
    flags = ["--model", "positions", "--optimizer", "adam", "--partial",
             "--samples", "250"]
    pipelined = ["--pipelined", "--config", json.dumps(config)]
    if where == "in_process":
        run_python(fit_model(tmp_path, *flags, *pipelined,
                             "--local-devices", "2"))
        ranks = [0]
    elif where == "local_replicas":
        # Whole batches (static shapes: the dense sum's condition), and a
        # loss-scale optimizer (it applies the gradients in threads of its
        # own).
        flags.remove("--partial")
        flags[flags.index("adam")] = "adam_loss_scale"
        run_python(fit_model(tmp_path, *flags, "--local-devices", "2"))
        ranks = [0]
    elif where == "local_replicas_xla":
        # compile(jit_compile=True): the step calls the model's compiled
        # call, inside whose function graph the trace that finds such
        # lookups found no gradient, so the replicas' rows were gathered
        # (weights 0.017 from plain Keras with XLA, by hand); and its
        # outputs lost their Keras masks, so the loss counted the padding
        # (the padding id's row 1.28 from plain Keras, also with one
        # replica).
        flags.append("--xla")
        run_python(fit_model(tmp_path, *flags, "--local-devices", "2"))
        ranks = [0]
    elif where == "data_parallel":
        # With norm clipping (the replicas' gradients summed before it).
        flags[flags.index("adam")] = "adam_clipnorm"
        launch(2, fit_model(tmp_path, *flags))
        ranks = [0, 1]
    else:
        workers = 4 if where == "pipeline_replicas" else 2
        launch(workers, fit_model(tmp_path, *flags, *pipelined))
        ranks = list(range(workers))
    ref = reference(*flags)
    for r in ranks:
        got = load(tmp_path, r)
        if where in ("data_parallel", "local_replicas",
                     "local_replicas_xla", "pipeline_replicas"):
            assert int(got["replicas"]) == 2
        assert_same_training(got, ref)


def test_xla_with_batchnorm_and_dropout_in_every_mode(tmp_path):
    # jit_compile=True with BatchNormalization (moving statistics) and
    # Dropout (a seed generator): their state is read and assigned outside
    # the compiled functions, which once failed in every mode ("merge_call
    # called while defining a new graph"; in one process, XLA reading the
    # seed generator of another stage's device). Pipelines (1 microbatch:
    # BatchNormalization sees the whole batch) equal plain Keras compiled
    # whole, Dropout masks included (XLA draws the same numbers from the
    # same seeds); data parallelism equals itself without XLA (no Dropout:
    # each replica would draw its own masks; a functional model whose
    # layers add losses inside the compiled call, an activity regularizer
    # and a helper function's add_loss, which once failed: Keras'
    # functional models do not implement add_loss). Suite bounds (rtol
    # 1e-5, atol 1e-6 x magnitude).
    worker = os.path.join(WORKERS, "xla_stateful.py")
    run_python([worker, "plain", str(tmp_path)])
    run_python([worker, "local", str(tmp_path)])
    launch(2, [worker, "pp", str(tmp_path)], timeout=240)
    launch(2, [worker, "dp", str(tmp_path), "--no-dropout"], timeout=240)
    launch(2, [worker, "dp", str(tmp_path), "--no-dropout", "--no-xla"],
           timeout=240)

    def check(got, ref):
        got, ref = np.load(tmp_path / got), np.load(tmp_path / ref)
        assert sorted(got.files) == sorted(ref.files)
        for key in ref.files:
            np.testing.assert_allclose(got[key], ref[key], rtol=RTOL,
                                       atol=scaled_atol(ref[key]),
                                       err_msg=key)
        return ref

    for mode in ("local", "pp"):
        ref = check(f"{mode}.npz", "plain.npz")
    # The moving statistics moved (mean from 0, variance from 1).
    assert np.any(ref["w4"] != 0) and np.any(ref["w5"] != 1)
    check("dp.npz", "dp-noxla.npz")


def test_dict_losses_and_metrics_keyed_by_output_name():
    # Keras maps dict losses, loss weights and metrics to outputs by
    # `model.output_names`; a DistributedModel once had none and failed at
    # its first step ("'NoneType' object is not iterable"). Suite bounds.
    # Then batches of a known size that do not divide into the
    # microbatches: every logged value (per-output losses: Keras weights
    # them by the static batch size) equals Keras'.
    out = run_python([os.path.join(WORKERS, "dict_losses.py")]).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert row["keys"][0] == row["keys"][1] == row["keys"][3], row
    assert "reg_loss" in row["keys"][3], row
    assert row["logged"] <= 1e-5 * max(1.0, row["logged_scale"]), row
    assert "cls_accuracy" in row["keys"][1], row
    assert row["weights"] <= 1e-6 * max(1.0, row["scale"]) + 1e-5 * row[
        "scale"], row
    assert row["loss"] <= 1e-5, row


PREDICT_FIRST_CASES = ["sequential:predict", "sequential:dataset",
                       "sequential:on_batch", "subclassed:predict",
                       "subclassed:on_batch"]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_predict_builds_a_model_not_built_yet(tmp_path, processes):
    # A Sequential without an Input and a subclassed keras.Model, wrapped,
    # with `predict` (of arrays, of a dataset) or `predict_on_batch` as
    # their first call: plain Keras builds a model in any first call; here
    # predict raised "has not been built yet" (fit and evaluate built it),
    # in one process and with one stage per process. Its outputs, and the
    # fit after it, equal plain Keras from the same initial weights.
    got = tmp_path / "got"
    cases = (PREDICT_FIRST_CASES if processes == 1
             else PREDICT_FIRST_CASES[::2])
    worker = os.path.join(WORKERS, "predict_first.py")
    if processes == 1:
        run_python([worker, str(got), *cases], timeout=300)
    else:
        launch(2, [worker, str(got), *cases])
    ref = tmp_path / "ref"
    run_python([worker, str(ref), "--mode", "reference", "--initial",
                str(got / "rank0.json"), *cases], timeout=300)
    with open(ref / "rank0.json") as f:
        expected = json.load(f)
    for rank in range(processes):
        with open(got / f"rank{rank}.json") as f:
            results = json.load(f)
        for case in cases:
            result, plain = results[case], expected[case]
            assert "error" not in result, (rank, case, result)
            assert "error" not in plain, (case, plain)
            # The reference starts from rank 0's weights: every rank built
            # the same ones.
            for w, v in zip(result["initial"], plain["initial"]):
                np.testing.assert_array_equal(w, v, err_msg=case)
            for key in ("first", "loss", "after"):
                np.testing.assert_allclose(
                    result[key], plain[key], rtol=RTOL,
                    atol=scaled_atol(plain[key]), err_msg=f"{case} {key}")
