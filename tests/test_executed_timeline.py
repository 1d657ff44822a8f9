"""`DistributedModel.executed_timeline`: the real per-stage timing of a step.

The executed actions must follow the schedule's order on every stage, each
stage's receives come before the action that uses them, actions on a stage
do not overlap, and measuring does not train.
"""

import json

import pytest

from conftest import WORKERS
from conftest import run_python
from keras_smp.pipeline.schedule import get_schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_executed_timeline_follows_the_schedule(schedule, tmp_path):
    out = run_python([f"{WORKERS}/executed_timeline.py", schedule,
                      str(tmp_path)]).stdout
    r = json.loads(out.split("RESULT ", 1)[1])
    assert r["weights_unchanged"]
    plan = get_schedule(schedule, 2, 4)
    for name in ("train", "forward"):
        stages = r[name]["entries"]
        assert r[name]["makespan"] > 0 and 0 <= r[name]["bubble"] < 1
        for s, entries in enumerate(stages):
            for (s0, e0, _), (s1, _, _) in zip(entries, entries[1:]):
                assert e0 <= s1 + 1e-3, entries  # no overlap (ms)
            assert all(e >= b for b, e, _ in entries)
            compute = [a for _, _, a in entries if "RECV" not in a]
            expected = [str(a) for a in plan.compute_actions(s)
                        if name == "train" or a.kind == "F"]
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
        assert recv_f == 4 and recv_b == (4 if name == "train" else 0)
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        trace = json.loads((tmp_path / f"{name}.json").read_text())
        assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == sum(
            len(st) for st in stages)
