"""Pipeline schedules (pure Python): order, transfers, simulation, pictures."""

import ast
import dataclasses
import doctest
import pathlib
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT
from conftest import env
from keras_smp.config import SMPConfig
from keras_smp.pipeline import schedule as schedule_module
from keras_smp.pipeline.schedule import COMM_KINDS
from keras_smp.pipeline.schedule import KINDS
from keras_smp.pipeline.schedule import SCHEDULES
from keras_smp.pipeline.schedule import Action
from keras_smp.pipeline.schedule import GPipe
from keras_smp.pipeline.schedule import Interleaved1F1B
from keras_smp.pipeline.schedule import ZeroBubbleV
from keras_smp.pipeline.schedule import OneFOneB
from keras_smp.pipeline.schedule import OneFOneBSplit
from keras_smp.pipeline.schedule import ZeroBubbleH1
from keras_smp.pipeline.schedule import Schedule
from keras_smp.pipeline.schedule import get_schedule
from keras_smp.pipeline.schedule import main
from keras_smp.pipeline.schedule import simulate

GRID = [(name, p, m) for name in ("gpipe", "1f1b")
        for p in range(1, 6) for m in range(1, 10)]
EPS = 1e-9


# --------------------------------------------------------------------------
# Built-in schedules on every (p, m) in 1..5 x 1..9
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m", GRID)
def test_builtin_schedules_validate_and_simulation_respects_dependencies(name, p, m):
    sched = get_schedule(name, p, m)
    sched.validate()
    t = simulate(sched, forward_cost=1.0, backward_cost=2.0, comm_cost=0.25)
    span = t.spans
    assert len(span) == 2 * p * m
    for s in range(p):
        # A stage runs one action at a time, in its compute order.
        entries = t.entries[s]
        assert [a for _, _, a in entries] == sched.compute_actions(s)
        for (_, e0, _), (s1, _, _) in zip(entries, entries[1:]):
            assert s1 >= e0 - EPS
        for k in range(m):
            f, b = span[Action(s, "F", k)], span[Action(s, "B", k)]
            assert f[1] <= b[0] + EPS  # F before B on the same stage
            if s > 0:
                assert span[Action(s - 1, "F", k)][1] + 0.25 <= f[0] + EPS
            if s < p - 1:
                assert span[Action(s + 1, "B", k)][1] + 0.25 <= b[0] + EPS


@pytest.mark.parametrize("name,p,m", GRID)
def test_peak_in_flight(name, p, m):
    sched = get_schedule(name, p, m)
    t = simulate(sched)
    for s in range(p):
        expected = m if name == "gpipe" else min(p - s, m)
        assert sched.peak_in_flight(s) == expected
        assert t.peak_in_flight(s) == expected
        assert sched.peak_in_flight(s) <= sched.in_flight_limit(s)
    if name == "1f1b":
        assert max(sched.peak_in_flight(s) for s in range(p)) <= p


@pytest.mark.parametrize("name,p,m", GRID)
def test_equal_costs_bubble_is_ideal(name, p, m):
    # F = B = 1: the last microbatch leaves stage 0's forward at m, reaches
    # the last stage after p - 1 more steps, and its gradient needs p more
    # steps back; every stage is busy 2m of the 2(m + p - 1) units.
    sched = get_schedule(name, p, m)
    t = simulate(sched, forward_cost=1.0, backward_cost=1.0, comm_cost=0.0)
    assert t.makespan == pytest.approx(2 * (m + p - 1), abs=EPS)
    assert abs(t.bubble_fraction() - (p - 1) / (m + p - 1)) < EPS
    assert abs(sched.ideal_bubble_fraction() - (p - 1) / (m + p - 1)) < EPS


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 3.0), (2.0, 1.0), (0.7, 1.9)])
def test_unequal_costs_makespan_is_m_plus_p_minus_1_times_f_plus_b(name, f, b):
    for p in range(1, 6):
        for m in range(1, 10):
            sched = get_schedule(name, p, m)
            t = simulate(sched, forward_cost=f, backward_cost=b)
            assert t.makespan == pytest.approx((m + p - 1) * (f + b))
            assert t.bubble_fraction() == pytest.approx(
                sched.ideal_bubble_fraction())


def test_comm_cost_lengthens_the_step():
    sched = OneFOneB(4, 8)
    assert simulate(sched, comm_cost=0.5).makespan > simulate(sched).makespan
    assert simulate(OneFOneB(1, 8), comm_cost=5.0).makespan == 8 * 3.0
    # GPipe pays the hops of the first forward and the last backward only;
    # 1F1B also waits for round trips in its steady state.
    for p, m in [(2, 2), (3, 5), (4, 8)]:
        gpipe = simulate(GPipe(p, m), comm_cost=0.5).makespan
        assert gpipe == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.5)
        assert simulate(OneFOneB(p, m), comm_cost=0.5).makespan >= gpipe
    assert simulate(GPipe(4, 8), comm_cost=0.5).makespan == 36.0
    assert simulate(OneFOneB(4, 8), comm_cost=0.5).makespan == 41.0


def test_documented_orders():
    assert [str(a) for a in GPipe(2, 3).compute_actions(1)] == [
        "1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]
    assert [str(a) for a in OneFOneB(4, 8).compute_actions(1)] == [
        "1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3",
        "1F6", "1B4", "1F7", "1B5", "1B6", "1B7"]
    # Fewer microbatches than stages: warm-up is capped at m.
    assert [OneFOneB(5, 2).warmup(s) for s in range(5)] == [2, 2, 2, 1, 0]
    assert [str(a) for a in OneFOneB(5, 2).compute_actions(0)] == [
        "0F0", "0F1", "0B0", "0B1"]


@pytest.mark.parametrize("name,p,m", [("gpipe", 3, 4), ("1f1b", 4, 5),
                                      ("1f1b", 1, 3), ("gpipe", 2, 1)])
def test_actions_wrap_compute_with_transfers(name, p, m):
    sched = get_schedule(name, p, m)
    everything = sched.all_actions()
    assert sorted(everything) == list(range(p))
    for s, acts in everything.items():
        assert [a for a in acts if a.is_compute] == sched.compute_actions(s)
        assert all(a.stage == s for a in acts)
        expected = []
        for a in sched.compute_actions(s):
            k = a.microbatch
            if a.kind == "F":
                expected += ([Action(s, "RECV_F", k)] if s > 0 else []) + [a] \
                    + ([Action(s, "SEND_F", k)] if s < p - 1 else [])
            else:
                expected += ([Action(s, "RECV_B", k)] if s < p - 1 else []) \
                    + [a] + ([Action(s, "SEND_B", k)] if s > 0 else [])
        assert acts == expected
    if p == 1:
        assert not any(a.kind in COMM_KINDS for a in everything[0])


def test_str_of_schedule_is_the_simulated_grid():
    sched = GPipe(2, 2)
    assert str(sched) == simulate(sched).grid()
    assert repr(sched) == "GPipe(num_stages=2, num_microbatches=2)"


def test_grid_layout():
    grid = simulate(GPipe(2, 2), forward_cost=1, backward_cost=1).grid()
    assert grid.splitlines() == [
        "time     0  1  2  3  4  5",
        "stage 0  F0 F1 .  .  B0 B1",
        "stage 1  .  F0 F1 B0 B1 .",
    ]
    # Default step is the shortest action: a B of cost 2 fills two cells.
    row = simulate(OneFOneB(1, 2)).grid().splitlines()[1].split()
    assert row == ["stage", "0", "F0", "B0", "B0", "F1", "B1", "B1"]
    half = simulate(OneFOneB(1, 1)).grid(step=0.5).splitlines()[1].split()
    assert half[2:] == ["F0", "F0", "B0", "B0", "B0", "B0"]
    with pytest.raises(ValueError, match="received 0"):
        simulate(GPipe(2, 2)).grid(step=0)


# --------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------


def test_action_string_round_trip():
    assert str(Action(2, "F", 0)) == "2F0"
    assert str(Action(1, "RECV_F", 3)) == "1RECV_F3"
    for kind in KINDS:
        for stage, mb in [(0, 0), (3, 12), (15, 7)]:
            a = Action(stage, kind, mb)
            assert Action.parse(str(a)) == a
    for sched in (GPipe(3, 4), OneFOneB(4, 11)):
        for acts in sched.all_actions().values():
            assert [Action.parse(str(a)) for a in acts] == acts
    assert Action.parse(" 10SEND_B11 ") == Action(10, "SEND_B", 11)


def test_action_peer_and_errors():
    assert Action(2, "SEND_F", 0).peer == 3
    assert Action(2, "RECV_F", 0).peer == 1
    assert Action(2, "SEND_B", 0).peer == 1
    assert Action(2, "RECV_B", 0).peer == 3
    assert Action(2, "F", 0).peer is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Action(0, "F", 0).stage = 1
    for bad in ["2X0", "F0", "2F", "", "-1F0", "2f0", "2SEND0"]:
        with pytest.raises(ValueError, match="Cannot parse action.*expected"):
            Action.parse(bad)
    with pytest.raises(ValueError, match="kind: received 'f'.*expected one of"):
        Action(0, "f", 0)
    with pytest.raises(ValueError, match="stage: received -1, expected an int >= 0"):
        Action(-1, "F", 0)
    with pytest.raises(ValueError, match="microbatch: received 1.5"):
        Action(0, "F", 1.5)


# --------------------------------------------------------------------------
# get_schedule
# --------------------------------------------------------------------------


def test_get_schedule_names_and_aliases():
    assert type(get_schedule("1f1b_split", 2, 4)) is OneFOneBSplit
    assert type(get_schedule("ZB_H1", 2, 4)) is ZeroBubbleH1
    assert SMPConfig(pipeline="1F1B_split").pipeline == "1f1b_split"
    assert type(get_schedule("gpipe", 2, 4)) is GPipe
    assert type(get_schedule("simple", 2, 4)) is GPipe
    assert type(get_schedule("1f1b", 2, 4)) is OneFOneB
    assert type(get_schedule("interleaved", 2, 4)) is OneFOneB
    assert type(get_schedule(" GPipe ", 2, 4)) is GPipe
    assert type(get_schedule("1F1B", 2, 4)) is OneFOneB
    sched = get_schedule("interleaved", 3, 5)
    assert (sched.num_stages, sched.num_microbatches, sched.name) == (3, 5, "1f1b")
    # Every name SMPConfig accepts builds the schedule SMPConfig stores.
    for name in SCHEDULES:
        canonical = SMPConfig(pipeline=name).pipeline
        assert type(get_schedule(name, 2, 2)) is type(get_schedule(canonical, 2, 2))


@pytest.mark.parametrize("name,p,m,match", [
    ("pipedream", 2, 4, "received 'pipedream', expected one of 'gpipe'"),
    (None, 2, 4, "received None"),
    ("gpipe", 0, 4, "num_stages .*received 0, expected an int >= 1"),
    ("1f1b", 2, 0, "num_microbatches .*received 0, expected an int >= 1"),
    ("1f1b", "4", 8, "num_stages .*received '4'"),
    ("1f1b", 4, 2.0, "num_microbatches .*received 2.0"),
    ("gpipe", True, 4, "num_stages .*received True"),
])
def test_get_schedule_errors(name, p, m, match):
    with pytest.raises(ValueError, match=match):
        get_schedule(name, p, m)


def test_bad_stage_and_costs():
    with pytest.raises(ValueError, match=r"received 4, expected an int in \[0, 3\]"):
        OneFOneB(4, 8).compute_actions(4)
    with pytest.raises(ValueError, match="forward_cost.*received 0"):
        simulate(GPipe(2, 2), forward_cost=0)
    with pytest.raises(ValueError, match="comm_cost.*received -1"):
        simulate(GPipe(2, 2), comm_cost=-1)


# --------------------------------------------------------------------------
# Broken schedules are caught with the offending action named
# --------------------------------------------------------------------------


class _Custom(Schedule):
    """A schedule whose per-stage order is given as compact strings."""

    name = "custom"

    def __init__(self, orders, num_microbatches):
        super().__init__(len(orders), num_microbatches)
        self.orders = orders

    def _compute_actions(self, stage):
        return [Action.parse(x) for x in self.orders[stage].split()]


def test_backward_before_forward_is_rejected():
    sched = _Custom(["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], 2)
    with pytest.raises(ValueError, match="stage 1 runs 1B0 .*before 1F0"):
        sched.validate()
    with pytest.raises(ValueError, match="deadlocks.*stage 1 is stuck at 1B0, "
                                         "waiting for 1F0"):
        simulate(sched)
    with pytest.raises(ValueError, match="deadlocks"):
        str(sched)


def test_cross_stage_deadlock_names_stuck_actions():
    # Each stage is fine on its own, together they wait on each other.
    sched = _Custom(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], 2)
    with pytest.raises(ValueError) as info:
        simulate(sched)
    msg = str(info.value)
    assert "stage 0 is stuck at 0B0, waiting for 1B0" in msg
    assert "stage 1 is stuck at 1F1, waiting for 0F1" in msg
    # validate() sees the mismatched link order first.
    with pytest.raises(ValueError, match=r"microbatch order \[0, 1\].*order \[1, 0\]"):
        sched.validate()


def test_missing_duplicate_and_foreign_actions_are_rejected():
    with pytest.raises(ValueError, match="stage 0 runs 0B1 0 times, expected exactly once"):
        _Custom(["0F0 0F1 0B0"], 2).validate()
    with pytest.raises(ValueError, match="stage 0 runs 0F0 2 times"):
        _Custom(["0F0 0F0 0F1 0B0 0B1"], 2).validate()
    with pytest.raises(ValueError, match=r"compute_actions\(1\) returned 0F0"):
        _Custom(["0F0 0B0", "0F0 1B0"], 1).validate()
    with pytest.raises(ValueError, match=r"returned 0SEND_F0 .*F or B"):
        _Custom(["0F0 0SEND_F0 0B0"], 1).validate()
    with pytest.raises(ValueError, match="runs 0F2, but microbatches are numbered 0..1"):
        _Custom(["0F0 0F1 0F2 0B0 0B1 0B2"], 2).validate()
    with pytest.raises(ValueError, match=r"stuck at 1B0, waiting for 2B0 "
                                         r"\(stage 2 never runs it\)"):
        simulate(_MissingNextStage())


class _MissingNextStage(Schedule):
    """Stage 1 expects a stage 2 backward that does not exist."""

    def __init__(self):
        super().__init__(3, 1)

    def _compute_actions(self, stage):
        if stage == 2:
            return [Action(2, "F", 0)]
        return [Action(stage, "F", 0), Action(stage, "B", 0)]


def test_in_flight_limit_is_enforced():
    class GreedyOneFOneB(OneFOneB):
        def _compute_actions(self, stage):
            return GPipe(self.num_stages, self.num_microbatches).compute_actions(stage)

    with pytest.raises(ValueError, match="stage 0 holds 8 microbatches in flight, "
                                         "expected at most 4"):
        GreedyOneFOneB(4, 8).validate()


def test_unpaired_transfers_are_rejected():
    class DropsARecv(GPipe):
        def actions(self, stage):
            acts = super().actions(stage)
            return [a for a in acts if str(a) != "1RECV_F1"]

    with pytest.raises(ValueError, match="0SEND_F1 has no matching 1RECV_F1"):
        DropsARecv(2, 2).validate()

    class SendsOffTheEnd(GPipe):
        def actions(self, stage):
            acts = super().actions(stage)
            return acts + [Action(stage, "SEND_F", 0)] if stage == 1 else acts

    with pytest.raises(ValueError, match="1SEND_F0, whose peer stage 2 does not exist"):
        SendsOffTheEnd(2, 1).validate()


# --------------------------------------------------------------------------
# Pictures, command line, layering
# --------------------------------------------------------------------------


def test_draw_writes_a_png(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: skipping the drawing test")
        pytest.skip("matplotlib is not installed (pip install matplotlib)")
    out = tmp_path / "1f1b.png"
    assert simulate(OneFOneB(3, 4)).draw(str(out), title="t") == str(out)
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_without_matplotlib_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        simulate(GPipe(2, 2)).draw(str(tmp_path / "x.png"))


def test_cli_prints_grid_bubble_and_memory(capsys, tmp_path):
    out = tmp_path / "g.png"
    assert main(["--schedule", "simple", "-p", "4", "-m", "8",
                 "--draw", str(out), "--actions"]) == 0
    text = capsys.readouterr().out
    assert "gpipe: p=4 stages, m=8 microbatches" in text
    assert "stage 3  .  .  .  F0 F1" in text
    assert "ideal bubble      27.27%  (p-1)/(m+p-1) = 3/11" in text
    assert "simulated bubble  27.27%  (makespan 33)" in text
    assert "peak in flight    stage 0: 8, stage 1: 8, stage 2: 8, stage 3: 8" in text
    assert "stage 1: 1RECV_F0 1F0 1SEND_F0" in text
    assert out.stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["--schedule", "zb", "-p", "2", "-m", "2"])
    assert "received 'zb'" in capsys.readouterr().err


def test_cli_runs_as_module_without_tensorflow():
    code = ("import sys; from keras_smp.pipeline.schedule import main;"
            "main(['-p', '2', '-m', '3']);"
            "print('tensorflow' in sys.modules, 'keras' in sys.modules,"
            " 'matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env=env(lean=False), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False False False"
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "keras_smp.pipeline.schedule",
         "--schedule", "1f1b", "-p", "2", "-m", "3"],
        env=env(lean=False), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "peak in flight    stage 0: 2, stage 1: 1" in proc.stdout


@pytest.mark.parametrize("path", ["keras_smp/pipeline/schedule.py",
                                  "keras_smp/pipeline/__init__.py"])
def test_schedule_module_does_not_import_tensorflow_or_keras(path):
    tree = ast.parse(pathlib.Path(ROOT, path).read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    assert not [n for n in names if n.split(".")[0] in ("tensorflow", "keras")]
    # matplotlib only inside Timeline.draw(), never at module level.
    top = [n for n in ast.iter_child_nodes(tree)
           if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("matplotlib" in ast.dump(n) for n in top)


def test_docstring_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # their mkdtemp()
    failed, attempted = doctest.testmod(schedule_module, verbose=False)
    assert attempted > 20 and failed == 0


# --------------------------------------------------------------------------
# Split backwards: I (input gradients) then W (weight gradients)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [OneFOneBSplit, ZeroBubbleH1])
@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 10))
def test_split_schedules_validate_and_respect_dependencies(cls, p, m):
    sched = cls(p, m)
    sched.validate()
    comm = 0.25
    t = simulate(sched, forward_cost=1.0, backward_cost=2.0, comm_cost=comm)
    span = t.spans
    assert len(span) == 3 * p * m
    for s in range(p):
        assert [a for _, _, a in t.entries[s]] == sched.compute_actions(s)
        # 1F1B's order of F and I (each B becomes an I).
        assert [a for a in sched.compute_actions(s) if a.kind != "W"] == [
            a if a.kind == "F" else Action(s, "I", a.microbatch)
            for a in OneFOneB(p, m).compute_actions(s)]
        # W of microbatch k right after I of k (1f1b_split), or after I of
        # k + s (zb_h1: deferred by s, the rest at the end).
        order = [str(a) for a in sched.compute_actions(s)]
        delay = 0 if cls is OneFOneBSplit else s
        for k in range(m):
            after = order[order.index(f"{s}W{k}") - 1]
            if k + delay < m:
                assert after == f"{s}I{k + delay}", order
            else:
                assert after in (f"{s}I{m - 1}", f"{s}W{k - 1}"), order
        held = min(p - s, m) if cls is OneFOneBSplit else min(p, m)
        assert sched.peak_in_flight(s) == held == t.peak_in_flight(s)
        assert held <= sched.in_flight_limit(s)
        for k in range(m):
            f, i, w = (span[Action(s, kind, k)] for kind in "FIW")
            assert f[1] <= i[0] + EPS and i[1] <= w[0] + EPS
            assert i[1] - i[0] == pytest.approx(1.0)  # half of B by default
            if s < p - 1:  # I waits for the next stage's I, not its W
                assert span[Action(s + 1, "I", k)][1] + comm <= i[0] + EPS
    # With free transfers (F = I = W = 1): 1F1B costs (m + p - 1)(F + B);
    # 1f1b_split m (F + B) + (p - 1)(F + I); zb_h1 m (F + B) + (p - 1)(F
    # + I - W), the paper's ZB-H1 bubble.
    ones = simulate(sched, 1.0, 2.0)
    assert ones.makespan <= simulate(OneFOneB(p, m), 1.0, 2.0).makespan + EPS
    if m >= p:
        drain = 2.0 if cls is OneFOneBSplit else 1.0
        assert ones.makespan == pytest.approx(m * 3.0 + (p - 1) * drain)
    # A transfer's latency hides behind the W that follows each I.
    assert t.makespan <= simulate(OneFOneB(p, m), 1.0, 2.0, comm).makespan + EPS


def test_1f1b_split_actions_send_after_i_and_w_stays_local():
    acts = [str(a) for a in OneFOneBSplit(2, 2).actions(1)]
    assert acts == ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0", "1RECV_F1",
                    "1F1", "1I1", "1SEND_B1", "1W1"]
    acts = [str(a) for a in OneFOneBSplit(2, 2).actions(0)]
    assert acts == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0I0",
                    "0W0", "0RECV_B1", "0I1", "0W1"]
    grid = simulate(OneFOneBSplit(2, 2), 1, 2).grid()
    assert "I0" in grid and "W1" in grid


def test_split_backward_errors_name_the_fix():
    with pytest.raises(ValueError, match="runs 0W0 0 times, expected exactly "
                                         "once .*one I followed by one W"):
        _Custom(["0F0 0I0"], 1).validate()
    with pytest.raises(ValueError, match="runs 0B0 1 times, expected never"):
        _Custom(["0F0 0I0 0B0 0W0"], 1).validate()
    with pytest.raises(ValueError, match="runs 0W0 .*before 0I0.*W needs its I"):
        _Custom(["0F0 0W0 0I0"], 1).validate()
    with pytest.raises(ValueError, match="runs 0I0 .*before 0F0"):
        _Custom(["0I0 0F0 0W0"], 1).validate()
    # A stage may mix whole and split backwards; the neighbour's wait is on
    # whichever produces the input gradients.
    mixed = _Custom(["0F0 0F1 0B0 0I1 0W1", "1F0 1I0 1W0 1F1 1B1"], 2)
    mixed.validate()
    t = simulate(mixed, 1.0, 2.0, comm_cost=0.5)
    assert t.spans[Action(0, "B", 0)][0] >= t.spans[Action(1, "I", 0)][1] + 0.5
    assert t.spans[Action(0, "I", 1)][0] >= t.spans[Action(1, "B", 1)][1] + 0.5
    with pytest.raises(ValueError, match="weight_cost.*less than backward_cost"):
        simulate(OneFOneBSplit(2, 2), 1.0, 2.0, weight_cost=2.0)


# --------------------------------------------------------------------------
# Virtual stages: interleaved 1F1B and ZB-V (several model stages per rank)
# --------------------------------------------------------------------------


def _check_virtual(sched, comm):
    """Validates, simulates with a transfer delay and checks every
    dependency, the rank's order and the in-flight count."""
    sched.validate()
    p, m, v = sched.num_stages, sched.num_microbatches, sched.virtual_stages
    n = sched.num_model_stages
    assert n == p * v
    assert sorted(s for r in range(p) for s in sched.stages_of(r)) == list(
        range(n))
    t = simulate(sched, 1.0, 2.0, comm_cost=comm)
    span = t.spans
    kinds = "FIW" if isinstance(sched, ZeroBubbleV) else "FB"
    assert len(span) == len(kinds) * n * m
    for r in range(p):
        order = sched.compute_actions(r)
        assert [a for _, _, a in t.entries[r]] == order
        assert {a.stage for a in order} == set(sched.stages_of(r))
        assert all(sched.rank_of(a.stage) == r for a in order)
        for (_, e0, _), (s1, _, _) in zip(t.entries[r], t.entries[r][1:]):
            assert s1 >= e0 - EPS  # one action at a time per rank
        assert t.peak_in_flight(r) <= sched.in_flight_limit(r)
    grad = "I" if kinds == "FIW" else "B"
    for s in range(n):
        for k in range(m):
            f, g = span[Action(s, "F", k)], span[Action(s, grad, k)]
            assert f[1] <= g[0] + EPS
            if s > 0:  # a transfer costs only between ranks
                delay = comm if sched.rank_of(s - 1) != sched.rank_of(s) else 0
                assert span[Action(s - 1, "F", k)][1] + delay <= f[0] + EPS
            if s < n - 1:
                delay = comm if sched.rank_of(s + 1) != sched.rank_of(s) else 0
                assert span[Action(s + 1, grad, k)][1] + delay <= g[0] + EPS
    return t


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("rounds", range(1, 4))
@pytest.mark.parametrize("v", (2, 3))
def test_interleaved_1f1b_validates_and_divides_the_bubble_by_v(p, rounds, v):
    m = p * rounds
    sched = Interleaved1F1B(p, m, virtual_stages=v)
    _check_virtual(sched, comm=0.25)
    assert [sched.rank_of(s) for s in range(p * v)] == [
        s % p for s in range(p * v)]
    # Each action is 1/v of a rank's work: with free transfers and B = 2F
    # the step costs (v m + p - 1)(F + B) / v: 1F1B's fill and drain / v.
    t = simulate(sched, 1.0 / v, 2.0 / v)
    assert t.makespan == pytest.approx((v * m + p - 1) * 3.0 / v)
    assert t.bubble_fraction() == pytest.approx(
        sched.ideal_bubble_fraction())
    if p > 1:
        assert t.makespan < simulate(OneFOneB(p, m), 1.0, 2.0).makespan - EPS
    # Memory: the warm-up forwards, plus one (Megatron's bound).
    for r in range(p):
        assert sched.peak_in_flight(r) == min(
            2 * (p - 1 - r) + (v - 1) * p + 1, v * m)


def test_interleaved_order_goes_round_the_ranks_in_groups_of_p():
    order = [str(a) for a in Interleaved1F1B(2, 4).compute_actions(0)]
    # Forwards: stage 0 for microbatches 0, 1; stage 2 for 0, 1; then 2, 3.
    assert [a for a in order if "F" in a] == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    # Backwards: the later stage first.
    assert [a for a in order if "B" in a] == [
        "2B0", "2B1", "0B0", "0B1", "2B2", "2B3", "0B2", "0B3"]
    acts = [str(a) for a in Interleaved1F1B(2, 2).actions(1)]
    # Rank 1's stages 1 and 3: 3 is the last (no SEND_F, no RECV_B).
    assert acts[:6] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1",
                        "1SEND_F1"]
    assert "3SEND_F0" not in acts and "3RECV_B0" not in acts
    assert "3SEND_B0" in acts and "3RECV_F0" in acts


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 11))
def test_zb_v_validates_and_is_near_zero_bubble(p, m):
    sched = ZeroBubbleV(p, m)
    t = _check_virtual(sched, comm=0.25)
    # A V: rank r runs stage r down and stage 2p - 1 - r back up.
    for r in range(p):
        assert sched.stages_of(r) == sorted([r, 2 * p - 1 - r])
    # Its turn (stages p - 1 and p) is on one rank: the action list still
    # sends and receives there (the runtime hands it over in-process) and
    # the simulation charges no transfer for it (_check_virtual).
    acts = [str(a) for a in sched.actions(p - 1)]
    assert f"{p - 1}SEND_F0" in acts and f"{p}RECV_F0" in acts
    assert sched.rank_of(p - 1) == sched.rank_of(p) == p - 1
    # Activation memory: at most 2p half-size stages' microbatches (1F1B's
    # p whole ones), on every rank.
    assert max(sched.peak_in_flight(r) for r in range(p)) <= min(2 * p, 2 * m)
    # With F = I = W (each 1/2 of a rank's F) and m >= 2p - 1, the bubble
    # is small: below ZB-H1's and well below 1F1B's at equal work.
    ones = simulate(sched, 0.5, 1.0)
    if p > 1 and m >= 2 * p - 1:
        assert ones.bubble_fraction() < simulate(
            ZeroBubbleH1(p, m), 1.0, 2.0).bubble_fraction() - EPS
        assert ones.bubble_fraction() < 0.5 * simulate(
            OneFOneB(p, m), 1.0, 2.0).bubble_fraction()
    assert t.makespan > 0


def test_virtual_schedules_grid_names_stages_and_ranks():
    grid = simulate(ZeroBubbleV(2, 2), 0.5, 1.0).grid()
    lines = grid.splitlines()
    assert lines[1].startswith("rank 0") and lines[2].startswith("rank 1")
    assert "0F0" in lines[1] and "3F0" in lines[1] and "2F0" in lines[2]
    assert repr(Interleaved1F1B(2, 4, 3)) == (
        "Interleaved1F1B(num_stages=2, num_microbatches=4, virtual_stages=3)")


def test_virtual_stage_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of num_stages=2.*"
                                         "microbatches=2 or microbatches=4"):
        Interleaved1F1B(2, 3)
    with pytest.raises(ValueError, match=r"Use microbatches=4\."):
        Interleaved1F1B(4, 2)
    with pytest.raises(ValueError, match="virtual_stages.*received 1.*"
                                         "pipeline='1f1b'"):
        Interleaved1F1B(2, 4, virtual_stages=1)
    with pytest.raises(ValueError, match="'zb_h1'.*received 2.*"
                                         "interleaved_1f1b"):
        get_schedule("zb_h1", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="model stage.*received 4.*0, 3"):
        ZeroBubbleV(2, 2).rank_of(4)
    # A rank running another rank's stage is refused by validate().
    class Wrong(ZeroBubbleV):
        def _compute_actions(self, rank):
            return [Action(1 - rank, a.kind, a.microbatch) if a.stage == rank
                    else a for a in super()._compute_actions(rank)]
    with pytest.raises(ValueError, match="of a stage rank 0 runs"):
        Wrong(2, 2).validate()


def test_cli_prints_virtual_stage_schedules(capsys, tmp_path):
    out_png = tmp_path / "zbv.png"
    assert main(["--schedule", "zb_v", "-p", "2", "-m", "4", "--actions",
                 "--draw", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "p=2 ranks x v=2 virtual stages" in out
    assert "rank 0: 0F0 0SEND_F0" in out
    assert "1F1B's, for comparison" in out
    assert out_png.stat().st_size > 0
    assert main(["--schedule", "interleaved_1f1b", "-p", "2", "-m", "4",
                 "-v", "3"]) == 0
    out = capsys.readouterr().out
    assert "(p-1)/(vm+p-1) = 1/13" in out
    assert "simulated bubble  7.69%" in out


# --------------------------------------------------------------------------
# Where receives are posted between processes (sends block until then)
# --------------------------------------------------------------------------


def _outstanding(acts, rank_of):
    """Most receives from other ranks posted and not yet consumed."""
    held, peak = set(), 0
    for a in acts:
        if a.kind.startswith("RECV") and rank_of(a.peer) != rank_of(a.stage):
            held.add((a.stage, a.kind, a.microbatch))
            peak = max(peak, len(held))
        elif a.is_compute:
            held.discard((a.stage, "RECV_F" if a.kind == "F" else "RECV_B",
                          a.microbatch))
    return peak


# interleaved_1f1b needs m to be a multiple of p: only those.
POSTED_GRID = [(name, p, m) for name in ("gpipe", "1f1b", "1f1b_split",
                                         "zb_h1", "interleaved_1f1b", "zb_v")
               for p in range(1, 5) for m in (1, 2, 3, 4, 8)
               if name != "interleaved_1f1b" or m % p == 0]


@pytest.mark.parametrize("name,p,m", POSTED_GRID)
def test_posted_receives_never_deadlock_and_hold_few_buffers(name, p, m):
    sched = get_schedule(name, p, m)
    lists = {r: sched.posted_actions(r) for r in range(p)}
    # Played with blocking sends (a send waits for its posted receive),
    # every rank finishes.
    assert schedule_module._blocked_sends(lists, sched.rank_of) == []
    for r in range(p):
        plain = sched.actions(r)
        # The same actions, the same compute order, sends where they were
        # (after their compute); only receives from other ranks moved, and
        # only earlier.
        assert sorted(map(str, lists[r])) == sorted(map(str, plain))
        assert [a for a in lists[r] if a.is_compute] == [
            a for a in plain if a.is_compute]
        def computes_before(acts, a):
            return sum(1 for b in acts[:acts.index(a)] if b.is_compute)
        for a in lists[r]:
            if a.kind.startswith("RECV"):
                assert computes_before(lists[r], a) <= computes_before(
                    plain, a), (a, lists[r])
        # Fewer buffers than posting every receive at the start (one per
        # microbatch and link); 1F1B's last rank holds at most 2 inputs.
        start = sum(1 for a in plain if a.kind.startswith("RECV")
                    and sched.rank_of(a.peer) != r)
        assert _outstanding(lists[r], sched.rank_of) <= start
        if name == "1f1b" and p > 1 and r == p - 1:
            assert _outstanding(lists[r], sched.rank_of) <= 2


def test_receives_posted_just_before_their_use_would_deadlock():
    # actions() puts each receive right before its consumer; with blocking
    # sends 1F1B deadlocks (stage 0 blocks sending F1, stage 1 sending B0);
    # posted_actions() moves the receive of F1 before 1SEND_B0.
    sched = OneFOneB(2, 2)
    plain = {r: sched.actions(r) for r in range(2)}
    stuck = schedule_module._blocked_sends(plain, sched.rank_of)
    assert stuck and {str(recv) for recv, _, _ in stuck} <= {"1RECV_F1",
                                                             "0RECV_B0"}
    posted = [str(a) for a in sched.posted_actions(1)]
    assert posted.index("1RECV_F1") < posted.index("1SEND_B0")
    # The 8-microbatch 1F1B's last rank: 2 inputs posted at a time, not 8.
    deep = OneFOneB(2, 8)
    assert _outstanding(deep.posted_actions(1), deep.rank_of) == 2
    assert _outstanding(deep.actions(1), deep.rank_of) == 1
