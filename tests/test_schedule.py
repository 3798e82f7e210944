"""Schedules as data: compute orders against Megatron's warmup counts and schedule table (computed here
independently), and the dry-run simulator's rejections."""
import pytest

from trainerkit.layout import PipelineLayout
from trainerkit.schedule import Action, ScheduleError, build_schedule, compute_order, schedule_table, simulate


def test_schedule_table_matches_megatron_example():
    """megatron-semantics §4: P=2, V=2, G=3, M=5 -> mb 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1."""
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_warmup_counts(pp, m):
    for rank in range(pp):
        order = compute_order(pp, 1, m, rank)
        warmup = min(pp - rank - 1, m)
        # the first `warmup` steps are forwards, then F/B alternate, then `warmup` backwards
        assert [op for op, _, _ in order[:warmup]] == ["F"] * warmup
        steady = order[warmup:warmup + 2 * (m - warmup)]
        assert [op for op, _, _ in steady] == ["F", "B"] * (m - warmup)
        assert [op for op, _, _ in order[warmup + 2 * (m - warmup):]] == ["B"] * warmup
        assert [mb for op, _, mb in order if op == "F"] == list(range(m))
        assert [mb for op, _, mb in order if op == "B"] == list(range(m))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 4, 4)])
def test_interleaved_warmup_and_order(pp, vpp, m):
    for rank in range(pp):
        order = compute_order(pp, vpp, m, rank)
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)
        assert all(op == "F" for op, _, _ in order[:warmup])
        if warmup < m * vpp:     # steady state starts F(W), B(0) with backward on the last chunk first
            assert order[warmup][0] == "F" and order[warmup + 1] == ("B", vpp - 1, 0)
        # every chunk sees microbatches in ascending order in forward and in backward
        for chunk in range(vpp):
            for kind in "FB":
                assert [mb for op, c, mb in order if op == kind and c == chunk] == list(range(m))
        # forward chunk order for one group of P microbatches: chunk 0 for mb 0..P-1, then chunk 1 ...
        fwd = [(c, mb) for op, c, mb in order if op == "F"]
        assert fwd[:pp] == [(0, mb) for mb in range(pp)]
        if vpp > 1:
            assert fwd[pp:2 * pp] == [(1, mb) for mb in range(pp)]


def _layout(text, pp, layers, mtp):
    return PipelineLayout.from_string(text, pp, layers, mtp)


@pytest.mark.parametrize("text,pp,layers,m", [
    ("Ett|ttmL", 2, 4, 4), ("Et|tt|tm|L", 4, 4, 4), ("Et|tt|t|mL", 2, 4, 4), ("E|t|t|t|t||m|L", 4, 4, 8),
    ("Et*3|(tt|)*29,m|L", 16, 61, 16), ("Et*3|(tt|)*29,m|L", 8, 61, 16), ("Et*4mL", 1, 4, 3)])
def test_real_schedules_simulate_clean(text, pp, layers, m):
    simulate(build_schedule(_layout(text, pp, layers, 1), m, 16, 2, 32))


def test_mtp_boundary_shapes():
    """Stages at/after the standalone MTP stage exchange [(1+D)s, b, h]; all others [s, b, h]."""
    lists = build_schedule(_layout("Et|tt|tm|L", 4, 4, 1), 4, 16, 2, 32)
    sends = {(a.stage, a.op): a.shape for rank in lists for a in rank if a.op.startswith("SEND")}
    assert sends[(0, "SEND_F")] == (16, 2, 32)
    assert sends[(1, "SEND_F")] == (16, 2, 32)
    assert sends[(2, "SEND_F")] == (32, 2, 32)
    assert sends[(3, "SEND_B")] == (32, 2, 32)


def test_simulator_rejects_deadlock():
    """Both ranks receive before sending: a cycle."""
    lists = [[Action("RECV_B", 0, 0, 1, (1,)), Action("F", 0, 0), Action("SEND_F", 0, 0, 1, (1,))],
             [Action("RECV_F", 1, 0, 0, (1,)), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0, 0, (1,))]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at #0 RECV_B0\.0.*rank 1 at #0 RECV_F1\.0"):
        simulate(lists)


def test_simulator_rejects_crossed_send_recv_at_p2():
    """At P=2 prev == next rank: a gradient receive posted where an activation is due never matches."""
    good = build_schedule(_layout("Ett|ttmL", 2, 4, 1), 2, 4, 1, 8)
    bad = [list(good[0]), list(good[1])]
    i = next(i for i, a in enumerate(bad[1]) if a.op == "RECV_F")
    a = bad[1][i]
    bad[1][i] = Action("RECV_B", a.stage - 1, a.microbatch, a.peer, a.shape)   # wrong direction, same peer
    with pytest.raises(ScheduleError, match=r"rank 1"):
        simulate(bad)


def test_simulator_rejects_shape_mismatch():
    good = build_schedule(_layout("Et|tt|tm|L", 4, 4, 1), 2, 4, 1, 8)
    i = next(i for i, a in enumerate(good[3]) if a.op == "RECV_F")
    a = good[3][i]
    good[3][i] = Action(a.op, a.stage, a.microbatch, a.peer, (4, 1, 8))
    with pytest.raises(ScheduleError, match=r"rank 3 action #\d+ \(RECV_F3\.0.*shape mismatch"):
        simulate(good)


def test_simulator_rejects_out_of_order_microbatches():
    good = build_schedule(_layout("Ett|ttmL", 2, 4, 1), 4, 4, 1, 8)
    fwd = [i for i, a in enumerate(good[0]) if a.op == "F"]
    good[0][fwd[1]], good[0][fwd[2]] = good[0][fwd[2]], good[0][fwd[1]]
    with pytest.raises(ScheduleError, match="expects microbatch 1 next in forward"):
        simulate(good)


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ScheduleError, match="divisible"):
        build_schedule(_layout("Et|tt|t|mL", 2, 4, 1), 3, 4, 1, 8)


def test_timeline_bubble_fraction_matches_1f1b_formula():
    """1F1B with forward 1 / backward 2: bubble = (P-1)(1+2) / (M(1+2) + (P-1)(1+2)) = (P-1)/(M+P-1)."""
    from trainerkit.schedule import timeline
    for pp, m in ((2, 4), (4, 8), (4, 4)):
        text = "|".join(["Et"] + ["t"] * (pp - 2) + ["tL"])
        cells, bubble = timeline(build_schedule(_layout(text, pp, pp, 0), m, 1, 1, 1))
        assert bubble == pytest.approx((pp - 1) / (m + pp - 1))
        assert len(cells) == 2 * pp * m
    # interleaving shrinks the bubble (Narayanan et al. 2021): V=2 < V=1 for the same P, M
    _, b1 = timeline(build_schedule(_layout("Et|t|t|tL", 4, 4, 0), 8, 1, 1, 1))
    _, b2 = timeline(build_schedule(_layout("Et|t|t|t|t|t|t|tL", 4, 8, 0), 8, 1, 1, 1))
    assert b2 < b1
