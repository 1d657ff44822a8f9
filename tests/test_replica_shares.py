"""Data-parallel replicas of unequal shares train as one device.

Keras computes each replica's mean loss over its own part of the batch;
summed over replicas, the gradients are one device's only when the parts
hold equal shares of what the loss divides by. keras-smp weighs each
replica's loss by its share (`keras_smp/runtime/loss_shares.py`): a
partial last batch split unevenly (27 rows: 14/13 over a process's two
replicas, 16/11 over two worker processes, as tf.data rebatches), a
masked loss per token whose replicas hold different numbers of real
tokens, a replica left without rows.

Bounds: rtol 1e-5, atol 1e-6 per unit of magnitude (conftest): the same
sums in another order, a few float32 ulps.
"""

import json
import os

import numpy as np
import pytest

from conftest import ATOL
from conftest import RTOL
from conftest import WORKERS
from conftest import assert_same_training
from conftest import fit_model
from conftest import launch
from conftest import load
from conftest import run_python
from conftest import scaled_atol

# guide_steps, own_loss_steps: a model's own train_step / test_step (as
# Keras' guide writes them) logs the single-device loss (it logged half of
# it: a violation of 0.5).
# gan: a model without a call (Keras' GAN example), which fit failed to
# build under the strategy.
# vae: Keras' VAE example's train_step, its loss written by hand: its
# gradients were summed over the replicas (twice one device's), and its
# draws in a 14/13 last batch started at the wrong row.
# ignore_class: a loss masking targets out itself under the embedding's
# mask counted each replica by the Keras mask alone (0.053 from one
# device in test_model_zoo's ignore_class over 2 processes).
# guide_steps_two_losses: the same with a "sum" loss and a
# "mean_with_sample_weight" one (their totals and per-output logs).
CASES = ["custom_loop", "super_train_step", "guide_steps", "own_loss_steps",
         "guide_steps_two_losses",
         "gan", "vae",
         "empty_replica", "two_masks", "ignore_class",
         "mean_with_sample_weight", "mean_with_sample_weight_unweighted"]


@pytest.fixture(scope="module")
def in_process():
    proc = run_python([os.path.join(WORKERS, "replica_shares.py"), *CASES],
                      timeout=600)
    return {r["case"]: r for r in (json.loads(l) for l in
                                   proc.stdout.splitlines()
                                   if l.startswith("{"))}


@pytest.mark.parametrize("case", CASES)
def test_two_local_replicas_match_single_device(in_process, case):
    # See tests/workers/replica_shares.py for each case.
    assert in_process[case]["atol"] <= ATOL, in_process[case]


@pytest.mark.parametrize("case", ["own_values_mask", "two_sparse_lookups",
                                  "dice_without_axis", "circle"])
def test_unsplittable_losses_and_gradients_warn_once_naming_the_fix(case):
    # own_values_mask: a loss whose `call` attaches a Keras mask computed
    # from its predictions: the replicas cannot know the batch's unmasked
    # count (one computed from the targets, `ignore_class`, is counted
    # exactly: above). two_sparse_lookups: one Dense layer called on two
    # sparse inputs (Keras looks up each input's distinct ids once): one
    # device's sparse gradient holds each id once per lookup, which the
    # replicas' parts cannot rebuild (a single lookup's are summed by id:
    # test_model_zoo's sparse_input). dice_without_axis, circle: Keras
    # losses making one value of several rows (a ratio of sums over the
    # batch, pairs of rows), which parts cannot add up to. Training runs;
    # one warning names the loss or weight and the fix.
    proc = run_python([os.path.join(WORKERS, "replica_shares.py"), case],
                      timeout=300)
    row = next(json.loads(l) for l in proc.stdout.splitlines()
               if l.startswith("{"))
    assert row["atol"] == {"warned": 1, "fix": 1}, (row, proc.stderr[-3000:])


@pytest.mark.parametrize("cases", [
    ["pipelined_mean_with_sample_weight"],
    ["pipelined_m4_mean_with_sample_weight",
     "pipelined_m4_mean_with_sample_weight_unweighted"],
    ["pipelined_m4_mean_with_sample_weight_xla",
     "pipelined_m4_mean_with_sample_weight_float16"]])
def test_pipeline_replicas_divide_by_all_sample_weights(cases):
    # tests/workers/replica_shares.py pipelined_*: a 2-stage
    # DistributedModel with 2 replicas, losses of
    # reduction="mean_with_sample_weight" with per-token and per-row
    # sample weights (and without: divided by the masked or all
    # entries), fit and validation against one device. microbatches=1:
    # Keras' own division, by each replica's weights, was off by 1e-2;
    # microbatches=4 (unequal in the 27-row last batch, 14/13 per
    # replica) was refused, each microbatch dividing by its own weights
    # (off by 2.7e-2 and 1.6e-2 when let through). The same compiled with
    # XLA, and under mixed_float16.
    proc = run_python([os.path.join(WORKERS, "replica_shares.py"), *cases],
                      timeout=300)
    rows = [json.loads(l) for l in proc.stdout.splitlines()
            if l.startswith("{")]
    assert [r["case"] for r in rows] == cases, proc.stdout
    for r in rows:
        # mixed_float16: activations rounded to float16; 2e-3 per unit of
        # magnitude is about four times float16's unit roundoff (2^-11),
        # the bound test_model_zoo uses (measured here: 1.4e-4).
        assert r["atol"] <= (2e-3 if r["case"].endswith("_float16")
                             else ATOL), r


@pytest.mark.slow
@pytest.mark.parametrize("model,workers,partitions,microbatches,reduction", [
    ("tokens", 2, None, None, None), ("mlp", 2, None, None, None),
    ("tokens", 4, 2, 2, None), ("mlp", 4, 2, 2, None),
    # One microbatch: the shares come from the outputs' masks as the
    # model makes them (none computed ahead).
    ("tokens", 4, 2, 1, None),
    # Divided by the step's per-token weights under the mask, summed
    # ahead by every stage process (microbatches 8+8 and 6+5).
    ("tokens", 4, 2, 2, "mean_with_sample_weight"),
    # A DistributedModel of one partition (each process a whole-model
    # replica, microbatched): its evaluate failed ("destinations can not
    # be empty": the loss shares' all-reduce ran outside the replica's
    # device).
    ("tokens", 2, 1, 2, None)])
def test_replicas_of_unequal_shares_match_single_device(
        tmp_path, reference, workers, model, partitions, microbatches,
        reduction):
    # Worker processes as data-parallel replicas: 2 plain Keras replicas,
    # or 4 = 2 replicas x 2 pipeline stages, one per process (each
    # stage's data-parallel peers sum among themselves), or 2 replicas of
    # a DistributedModel of one partition. 91 samples in
    # batches of 32: the last, 27, is split 16/11 over the replicas (tf.data
    # rebatches each batch to 16 rows per worker);
    # "tokens": a masked loss per token, the replicas' real tokens
    # differ. Each replica's loss counts by its share of the step's rows
    # or real tokens, so training, the logged loss, evaluate and predict
    # equal one device's (stock Keras averages the replicas' own means).
    flags = ["--model", model, "--partial", "--samples", "91"]
    if reduction:
        flags += ["--reduction", reduction]
    if partitions:
        flags += ["--pipelined", "--config", json.dumps(
            {"partitions": partitions, "microbatches": microbatches,
             "collective_timeout_seconds": 120})]
    launch(workers, fit_model(tmp_path, *flags))
    ref = reference("--model", model, "--partial", "--samples", "91",
                    *(["--reduction", reduction] if reduction else []))
    for r in range(workers):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == 2
        assert_same_training(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("workers,config", [
    (1, {}), (2, {}), (4, {"partitions": 2, "microbatches": 2})],
    ids=["local_replicas", "processes", "pipeline_replicas"])
def test_loss_returning_the_batch_mean_trains_as_on_one_device(
        tmp_path, reference, workers, config):
    # A loss function that reduces over the rows itself (one scalar):
    # Keras divides per-row losses by the replicas, not such a value, so
    # the replicas' gradients summed to twice one device's (stock Keras
    # under MirroredStrategy too; measured: weights off by 0.9x their
    # update after 3 steps). Each part's value now counts as its rows'
    # values, by its share of them: a last batch of 27 rows, 14/13 over
    # local replicas, 16/11 over processes; microbatches of 8/8 and 6/5.
    flags = ["--batch-loss", "--unweighted", "--partial", "--samples", "91"]
    args = fit_model(tmp_path, *flags, "--config", json.dumps(
        dict(config, collective_timeout_seconds=120))) + (
            ["--pipelined"] if "partitions" in config else []) + (
                ["--local-devices", "2"] if workers == 1 else [])
    if workers == 1:
        run_python(args, timeout=300)
    else:
        launch(workers, args)
    ref = reference(*flags)
    for r in range(workers):
        got = load(tmp_path, r)
        assert int(got["replicas"]) == 2
        assert_same_training(got, ref)


@pytest.mark.parametrize("case", ["replicas", "microbatches", "masked"])
def test_loss_returning_the_batch_mean_with_sample_weights_warns(
        tmp_path, case):
    # With sample weights (or a mask) Keras weighs such a value by them,
    # so it is no longer a scalar and is divided by the replicas as per-row
    # losses are; but each part weighs it by its own part's mean weight,
    # one device by the whole batch's: close, not equal. Training runs as
    # before, and a warning (once) says so and names the fix.
    flags = {"replicas": ["--local-devices", "2"],
             "microbatches": ["--pipelined", "--config", json.dumps(
                 {"partitions": 2, "microbatches": 2})],
             "masked": ["--local-devices", "2", "--model", "tokens",
                        "--unweighted"]}[case]
    proc = run_python(fit_model(tmp_path, "--batch-loss", "--epochs", "1",
                                *flags), timeout=300)
    parts = "2 microbatches" if case == "microbatches" else "2 replicas"
    what = ("a Keras mask on its output" if case == "masked"
            else "sample weights (or class_weight)")
    warning = "the loss 'batch_loss' returns one value for the whole batch"
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]
    assert f"splits the batch into {parts} with {what}:" in proc.stderr
    assert "Return one loss per row to train as on one device" in proc.stderr
    got = load(tmp_path)
    assert all(np.all(np.isfinite(got[k])) for k in got if k.startswith("w"))


@pytest.mark.slow
def test_loss_returning_the_batch_mean_of_a_whole_batch_is_keras_own(
        tmp_path, reference):
    # A pipeline of one replica and one microbatch computes the loss on the
    # whole batch: Keras' own reduction, with per-token sample weights and
    # the embedding's mask (a value filled over the rows did not broadcast
    # against [rows, tokens] weights).
    flags = ["--batch-loss", "--model", "tokens", "--partial", "--samples",
             "91"]
    run_python(fit_model(tmp_path, *flags, "--pipelined", "--config",
                         json.dumps({"partitions": 2, "microbatches": 1})),
               timeout=300)
    assert_same_training(load(tmp_path), reference(*flags))


@pytest.mark.slow
def test_own_steps_of_worker_processes_match_single_device(tmp_path):
    # tests/workers/custom_steps_fit.py: models with steps of their own
    # (a GAN without a call, training two parts with two optimizers; a
    # loss object with metrics of its own; Keras' guide's steps; Keras'
    # VAE example, its loss written by hand), as 2 data-parallel worker
    # processes against one device: the same weights and the same logs,
    # the losses included (logged divided by the 2 replicas before; the
    # GAN failed to build; the VAE's gradients were summed: twice one
    # device's).
    worker = os.path.join(WORKERS, "custom_steps_fit.py")
    launch(2, [worker, str(tmp_path / "got")])
    run_python([worker, str(tmp_path / "ref"), "--mode", "plain"])
    with open(tmp_path / "ref" / "rank0.json") as f:
        ref = json.load(f)
    for rank in range(2):
        with open(tmp_path / "got" / f"rank{rank}.json") as f:
            got = json.load(f)
        assert sorted(got) == sorted(ref) == ["gan", "guide", "own_loss",
                                              "vae"]
        for name in ref:
            assert got[name]["history"].keys() == ref[name]["history"].keys()
            for key, want in ref[name]["history"].items():
                np.testing.assert_allclose(
                    got[name]["history"][key], want, rtol=RTOL,
                    atol=scaled_atol(want), err_msg=f"{name} {key}")
            for i, (a, b) in enumerate(zip(got[name]["weights"],
                                           ref[name]["weights"])):
                np.testing.assert_allclose(
                    a, b, rtol=RTOL, atol=scaled_atol(b),
                    err_msg=f"{name} weight {i}")
