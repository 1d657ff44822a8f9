"""`DistributedModel.executed_timeline`: the real per-stage timing of a step.

The executed actions must follow the schedule's order on every stage, each
stage's receives come before the action that uses them, actions on a stage
do not overlap, and measuring does not train. With one stage per process
(2 real worker processes), every rank returns the same whole timeline, and
the stages' clocks agree: a stage's forward of a microbatch starts only
after the previous stage's forward of it started (it needs its output).
"""

import json

import pytest

from conftest import WORKERS
from conftest import launch
from conftest import run_python
from keras_smp.pipeline.schedule import get_schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_executed_timeline_follows_the_schedule(schedule, tmp_path):
    out = run_python([f"{WORKERS}/executed_timeline.py", schedule,
                      str(tmp_path)], lean=False).stdout  # draws
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["weights_unchanged"]
    plan = get_schedule(schedule, 2, 4)
    for name in ("train", "forward", "added_loss_only"):
        stages = r[name]["entries"]
        assert r[name]["makespan"] > 0 and 0 <= r[name]["bubble"] < 1
        for s, entries in enumerate(stages):
            for (s0, e0, _), (s1, _, _) in zip(entries, entries[1:]):
                assert e0 <= s1 + 1e-3, entries  # no overlap (ms)
            assert all(e >= b for b, e, _ in entries)
            compute = [a for _, _, a in entries if "RECV" not in a]
            # A model compiled without a loss (its layers add it): x
            # alone times its training step, as fit(x) trains it.
            expected = [str(a) for a in plan.compute_actions(s)
                        if name != "forward" or a.kind == "F"]
            assert compute == expected
            # Each receive (the copy from the neighbour) right before its use.
            kinds = [a for _, _, a in entries]
            for i, a in enumerate(kinds):
                if "RECV_F" in a:
                    assert kinds[i + 1] == a.replace("RECV_F", "F")
                if "RECV_B" in a:
                    assert kinds[i + 1] == a.replace("RECV_B", "B")
        recv_f = sum("RECV_F" in a for _, _, a in stages[1])
        recv_b = sum("RECV_B" in a for _, _, a in stages[0])
        assert recv_f == 4 and recv_b == (0 if name == "forward" else 4)
        if name == "added_loss_only":
            continue
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        trace = json.loads((tmp_path / f"{name}.json").read_text())
        assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == sum(
            len(st) for st in stages)


@pytest.mark.slow
# 1F1B, and ZB-V: split backwards (I and W actions) and virtual stages
# (each process runs 2 of the 4 model stages; a timeline row is a rank,
# holding the actions of both). ZB-H1 and interleaved 1F1B are other action
# lists for the same runtime (tests/test_schedule.py checks them as lists).
@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_executed_timeline_across_stage_processes(schedule, tmp_path):
    out = launch(2, [f"{WORKERS}/executed_timeline.py", schedule,
                     str(tmp_path)], lean=False).stdout  # draws
    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in out.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1], out[-2000:]
    r = results[0]
    assert r["weights_unchanged"] and results[1]["weights_unchanged"]
    plan = get_schedule(schedule, 2, 4)
    for name in ("train", "forward"):
        # Every rank returns the replica's whole timeline, the same one.
        assert r[name] == results[1][name]
        stages = r[name]["entries"]
        assert r[name]["makespan"] > 0 and 0 <= r[name]["bubble"] < 1
        spans = {}
        for s, entries in enumerate(stages):
            for (s0, e0, _), (s1, _, _) in zip(entries, entries[1:]):
                assert e0 <= s1 + 1e-3, entries  # no overlap (ms)
            assert all(e >= b for b, e, _ in entries)
            # Between processes the receives are posted at the step's
            # start (not timed): only compute actions, in the plan's order.
            assert [a for _, _, a in entries] == [
                str(a) for a in plan.compute_actions(s)
                if name == "train" or a.kind == "F"]
            spans.update({a: (b, e) for b, e, a in entries})
        # Clocks of the two processes agree (same host): stage 1 starts
        # microbatch k only after stage 0 started it (it needs its output),
        # and (training) stage 0's backward of k only after stage 1's
        # backward of k started. (Not "after it ended": an action's end is
        # stamped when its stage gets to it, which may be after its output
        # was already sent.)
        grad = "I" if schedule in ("zb_h1", "zb_v") else "B"  # input grads
        for k in range(4):
            for s in range(1, plan.num_model_stages):
                assert spans[f"{s}F{k}"][0] >= spans[f"{s - 1}F{k}"][0], spans
                if name == "train":
                    assert (spans[f"{s - 1}{grad}{k}"][0]
                            >= spans[f"{s}{grad}{k}"][0]), spans
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
