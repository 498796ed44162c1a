"""Pipeline schedules: simulated bubbles against the closed forms, activation peaks, the deadlock
and completeness checks, and the export against torch.distributed.pipelining's own schedules."""
import dataclasses
from fractions import Fraction

import pytest
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

import tailorfx
from tailorfx import compat
from tailorfx.codegen.schedule import (Action, ScheduleDeadlock, ScheduleError, build_schedule, check, simulate,
                                       simulate_schedule, to_pipelining)

GRID = [(p, m) for p in range(2, 9) for m in sorted({1, 3, p - 1, p, 2 * p, 3 * p + 1})]
INTERLEAVED_GRID = [(p, m, v) for p in range(2, 9) for v in range(1, 5) for m in (p, 2 * p, 3 * p)]


# ---- bubbles: exact Fractions against the closed forms (uniform costs F=1, B=2 per rank) ----------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_and_1f1b_bubble_is_the_closed_form(name, p, m):
    sim = simulate_schedule(name, p, m)
    assert sim.bubble == Fraction(p - 1, m + p - 1)
    assert sim.bubble_per_rank == (sim.bubble,) * p        # uniform costs: every rank idles as long
    assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p,m,v", INTERLEAVED_GRID)
def test_interleaved_bubble_is_the_closed_form(p, m, v):
    # each of a rank's v chunks costs F=1/v, B=2/v: a rank does the same work as under 1F1B
    sim = simulate_schedule("interleaved_1f1b", p, m, v)
    assert sim.bubble == Fraction(p - 1, v * m + p - 1)
    assert sim.bubble_per_rank == (sim.bubble,) * p


@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_beats_1f1b_at_1f1b_memory(p, m):
    zb, one = simulate_schedule("zb_h1", p, m), simulate_schedule("1f1b", p, m)
    assert zb.bubble < one.bubble
    # I frees the activation stash where B did, at the same place in each rank's order ...
    assert zb.peak_inflight == one.peak_inflight
    # ... and the inputs deferred W's keep never exceed 1F1B's peak, held by its first stage
    assert max(zb.peak_held) == max(one.peak_held) == one.peak_held[0]
    assert all(zb_s >= one_s for zb_s, one_s in zip(zb.peak_held, one.peak_held))
    if m >= p:   # Qi et al. 2023: ZB-H1's bubble is (p-1)(T_F + T_B - T_W), here T_F = T_I = T_W = 1
        assert zb.bubble == Fraction(p - 1, 3 * m + p - 1)


@pytest.mark.parametrize("p,m", GRID)
def test_peak_inflight(p, m):
    assert simulate_schedule("gpipe", p, m).peak_inflight == (m,) * p
    assert simulate_schedule("1f1b", p, m).peak_inflight == tuple(min(p - s, m) for s in range(p))


def test_simulate_schedule_is_exported():
    assert tailorfx.simulate_schedule is simulate_schedule and "simulate_schedule" in tailorfx.__all__


# ---- the simulator itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 3)])
def test_timeline_respects_order_and_dependencies(name, v):
    sched = build_schedule(name, 4, 8, v)
    sim = simulate(sched)
    end = {t.action: t.end for t in sim.timeline}
    for rank in range(4):
        spans = [t for t in sim.timeline if t.rank == rank]
        assert [t.action for t in spans] == list(sched.actions[rank])        # list order kept
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))      # one action at a time
    for t in sim.timeline:
        a, last = t.action, sched.num_stages - 1
        if a.kind == "F" and a.stage > 0:
            assert t.start >= end[Action("F", a.stage - 1, a.microbatch)]
        if a.kind in "BI":
            assert t.start >= end[Action("F", a.stage, a.microbatch)]
            if a.stage < last:
                assert t.start >= end[Action(a.kind, a.stage + 1, a.microbatch)]
        if a.kind == "W":
            assert t.start >= end[Action("I", a.stage, a.microbatch)]
    assert sim.makespan == max(end.values())


def test_per_stage_costs():
    # stage 1 is twice as slow: GPipe is stage 0's first F, then stage 1 busy with m F's and m B's,
    # then stage 0's last B
    m = 5
    sim = simulate(build_schedule("gpipe", 2, m), costs={"F": {0: 1, 1: 2}, "B": {0: 2, 1: 4}})
    assert sim.makespan == 1 + m * (2 + 4) + 2
    assert sim.bubble_per_rank[1] == Fraction(3, 1 + 6 * m + 2)
    scaled = simulate(build_schedule("zb_h1", 4, 8), costs={"F": 3, "I": 3, "W": 3})
    assert scaled.bubble == simulate_schedule("zb_h1", 4, 8).bubble
    assert scaled.makespan == 3 * simulate_schedule("zb_h1", 4, 8).makespan


# ---- bad arguments name the fix -----------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (("pipedream", 4, 8), "unknown pipeline schedule 'pipedream': known ones are gpipe, 1f1b, interleaved_1f1b, zb_h1"),
    (("1f1b", 0, 8), "stages must be a positive int, got 0"),
    (("gpipe", 4, 2.0), "microbatches must be a positive int, got 2.0"),
    (("1f1b", 4, 8, 2), "'1f1b' runs one stage per rank: pass virtual=1, or use 'interleaved_1f1b' for 2 virtual "
                        "stages per rank"),
    (("interleaved_1f1b", 4, 6, 2), "interleaved_1f1b sends microbatches through each chunk in groups of stages=4, "
                                    "so microbatches must be a multiple of 4: got 6; use 4 or 8"),
    (("interleaved_1f1b", 4, 3, 2), "microbatches must be a multiple of 4: got 3; use 4"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError) as err:
        build_schedule(*args)
    assert message in str(err.value)


def test_bad_costs():
    with pytest.raises(ValueError, match="costs keys must be action kinds"):
        simulate(build_schedule("1f1b", 2, 2), costs={"X": 1})
    with pytest.raises(ValueError, match=r"costs\['F'\] gives stages \[0\]; it needs every stage 0..1"):
        simulate(build_schedule("1f1b", 2, 2), costs={"F": {0: 1}})


# ---- the checks reject broken schedules ---------------------------------------------------------------
def _with(sched, **actions):
    """`sched` with some ranks' lists replaced (rank0=..., rank1=...)."""
    new = dict(sched.actions)
    new.update({int(k.removeprefix("rank")): tuple(v) for k, v in actions.items()})
    return dataclasses.replace(sched, actions=new)


def _torch_order(sched):
    return {r: [compat.pipelining_action(a.kind, a.stage, a.microbatch) for a in acts]
            for r, acts in sched.actions.items()}


def test_deadlock_names_the_stuck_ranks():
    sched = build_schedule("1f1b", 2, 2)
    r0, r1 = sched.actions[0], sched.actions[1]
    assert [str(a) for a in r0] == ["F(stage=0, mb=0)", "F(stage=0, mb=1)", "B(stage=0, mb=0)", "B(stage=0, mb=1)"]
    # rank 0 runs its first backward before its second forward, rank 1 the other way round: each
    # waits for what the other has queued behind its own stuck action
    broken = _with(sched, rank0=(r0[0], r0[2], r0[1], r0[3]), rank1=(r1[0], r1[2], r1[1], r1[3]))
    expected = ("schedule '1f1b' deadlocks: rank 0 is stuck on B(stage=0, mb=0), waiting for B(stage=1, mb=0); "
                "rank 1 is stuck on F(stage=1, mb=1), waiting for F(stage=0, mb=1)")
    for run in (check, simulate, to_pipelining):
        with pytest.raises(ScheduleDeadlock) as err:
            run(broken)
        assert str(err.value) == expected
    assert isinstance(err.value, ValueError)
    with pytest.raises(AssertionError, match="can't schedule sends/recvs"):    # torch's lowering agrees
        compat.pipelining_simulate(_torch_order(broken), num_ranks=2, num_stages=2)


def test_weight_gradient_before_its_input_gradient_deadlocks():
    sched = build_schedule("zb_h1", 2, 2)
    r1 = list(sched.actions[1])
    i0, w0 = r1.index(Action("I", 1, 0)), r1.index(Action("W", 1, 0))
    r1[i0], r1[w0] = r1[w0], r1[i0]
    with pytest.raises(ScheduleDeadlock, match=r"rank 1 is stuck on W\(stage=1, mb=0\), waiting for I\(stage=1, mb=0\)"):
        check(_with(sched, rank1=r1))


def test_missing_duplicate_and_misplaced_actions_are_rejected():
    sched = build_schedule("1f1b", 2, 2)
    missing = _with(sched, rank1=sched.actions[1][:-1])
    with pytest.raises(ScheduleError) as err:
        check(missing)
    assert str(err.value) == ("schedule '1f1b': stage 1, microbatch 1 misses B; each (stage, microbatch) needs "
                              "one F and one B, or one F, one I and one W")
    assert not isinstance(err.value, ScheduleDeadlock)
    with pytest.raises(AssertionError, match="expected 2 total backwards"):     # torch's loader agrees
        compat.pipelining_load(_torch_order(missing), num_ranks=2, num_virtual=1, num_microbatches=2)
    with pytest.raises(ScheduleError, match=r"^rank 0: B\(stage=0, mb=1\) appears twice$"):
        check(_with(sched, rank0=sched.actions[0] + (Action("B", 0, 1),)))
    with pytest.raises(ScheduleError, match=r"^rank 0: F\(stage=1, mb=0\) belongs on rank 1"):
        check(_with(sched, rank0=(Action("F", 1, 0),) + sched.actions[0]))
    with pytest.raises(ScheduleError, match=r"stage 0, microbatch 0 has both B and I;"):
        check(_with(sched, rank0=sched.actions[0] + (Action("I", 0, 0),)))


# ---- export: torch.distributed.pipelining's own orders, validator, lowering and dry run ------------
def _compute_only(order):
    """torch's order without idle slots and the REDUCE_GRAD its single-stage schedules append."""
    return {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in order.items()}


@pytest.mark.parametrize("name,torch_class,p,m,v", [
    *[("gpipe", ScheduleGPipe, p, m, 1) for p, m in [(2, 1), (4, 3), (4, 8)]],
    *[("zb_h1", ScheduleInterleavedZeroBubble, p, m, 1) for p, m in [(2, 1), (4, 3), (4, 4), (3, 9)]],
    *[("interleaved_1f1b", ScheduleInterleaved1F1B, p, m, v) for p, m, v in [(2, 2, 1), (4, 8, 2), (3, 6, 3), (4, 4, 4)]],
])
def test_export_equals_torchs_own_schedule(name, torch_class, p, m, v):
    ours = to_pipelining(build_schedule(name, p, m, v))
    theirs = compat.pipelining_reference_order(torch_class, num_ranks=p, num_virtual=v, num_microbatches=m)
    assert ours == _compute_only(theirs), compat.pipelining_format(ours)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 7)])
def test_1f1b_export_matches_torch_up_to_its_last_rank_numbering(p, m):
    ours = to_pipelining(build_schedule("1f1b", p, m))
    theirs = _compute_only(compat.pipelining_reference_order(Schedule1F1B, num_ranks=p, num_virtual=1,
                                                             num_microbatches=m))
    assert {r: ours[r] for r in range(p - 1)} == {r: theirs[r] for r in range(p - 1)}
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m (its
    # step() runs 0..m-1); the F/B pattern and the backward microbatches still agree
    assert [(a.computation_type, a.stage_index) for a in ours[p - 1]] == \
        [(a.computation_type, a.stage_index) for a in theirs[p - 1]]
    assert [a.microbatch_index for a in ours[p - 1] if a.computation_type == "B"] == \
        [a.microbatch_index for a in theirs[p - 1] if a.computation_type == "B"]


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 2, 1), ("1f1b", 3, 6, 1),
                                        ("zb_h1", 4, 6, 1), ("interleaved_1f1b", 2, 4, 3)])
def test_torch_runtime_loads_and_dry_runs_the_export(name, p, m, v):
    order = to_pipelining(build_schedule(name, p, m, v))
    lowered = compat.pipelining_load(order, num_ranks=p, num_virtual=v, num_microbatches=m)
    assert _compute_only(lowered) == order                  # lowering only adds comms around ours
    sends = sum(a.computation_type in ("SEND_F", "SEND_B") for acts in lowered.values() for a in acts)
    assert sends == 2 * m * (p * v - 1)                     # one per stage boundary, each way
    simulated = compat.pipelining_simulate(order, num_ranks=p, num_stages=p * v)
    assert _compute_only(simulated) == order
