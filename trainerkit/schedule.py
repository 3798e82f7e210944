"""Pipeline schedules as data: per-rank ordered action lists, a grid printer and a dry-run simulator.

The executor only runs these lists (modelled on torch.distributed.pipelining's ``_Action`` lists).
Compute orders mirror ``megatron/core/pipeline_parallel/schedules.py`` (megatron-semantics §4):

* no pipelining (P=1): F0 B0 F1 B1 ...;
* 1F1B (P>1, V=1): warmup ``W = min(P - rank - 1, M)`` forwards, steady state F(i+W) B(i), cooldown;
* interleaved (P>1, V>1): Megatron's ``get_schedule_table(M, V, G=P)`` maps virtual microbatch ids to
  (microbatch, chunk); warmup ``W = min(2(P - rank - 1) + (V - 1)·G, M·V)``; steady state F(k+W) B(k);
  backward ids visit chunks in reverse.

With ``overlap_moe_expert_parallel_comm`` (Megatron's 1F1B overlap, ``combined_1f1b.py``) every steady-state
pair becomes one merged action ``FB`` (forward of one microbatch and backward of another, run node by node,
`model/plan.py`): P=1 runs F0, F1+B0, ..., F(M-1)+B(M-2), B(M-1); the interleaved schedule's warmup gains one
microbatch (``W + 1``) so that a pair never holds the same chunk and microbatch.  Megatron has no overlap
path for P>1 with V=1 (`check_sizes` rejects it).

Communication actions are inserted around compute: ``RECV_F`` before the forward of a non-first stage,
``SEND_F`` after the forward of a non-last stage, and mirrored for backward.  A SEND never blocks; a RECV
blocks until its message (matched by direction, stage and microbatch) has been sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMPUTE = ("F", "B", "FB")


class ScheduleError(ValueError):
    """A schedule that cannot run (deadlock, send/recv mismatch, out-of-order microbatches, bad sizes)."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's list.  `stage` is the flat stage index (global), `peer` the other pp rank of a
    send/recv, `shape` the tensor shape [s, b, h] sent or received.  ``FB`` (1F1B overlap): forward of
    (`stage`, `microbatch`) merged with backward of (`b_stage`, `b_microbatch`)."""

    op: str                      # F, B, FB, SEND_F, RECV_F, SEND_B, RECV_B
    stage: int
    microbatch: int
    peer: Optional[int] = None
    shape: Optional[tuple] = None
    b_stage: Optional[int] = None
    b_microbatch: Optional[int] = None

    def parts(self) -> list[tuple[str, int, int]]:
        """The (op, stage, microbatch) compute steps of a compute action: two for ``FB``."""
        if self.op == "FB":
            return [("F", self.stage, self.microbatch), ("B", self.b_stage, self.b_microbatch)]
        return [(self.op, self.stage, self.microbatch)]

    def __str__(self) -> str:
        if self.op == "FB":
            return f"F{self.stage}.{self.microbatch}+B{self.b_stage}.{self.b_microbatch}"
        if self.op in COMPUTE:
            return f"{self.op}{self.stage}.{self.microbatch}"
        arrow = "->" if self.op.startswith("SEND") else "<-"
        dims = "x".join(map(str, self.shape or ()))
        return f"{self.op}{self.stage}.{self.microbatch}{arrow}r{self.peer}[{dims}]"


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: virtual id -> (microbatch, chunk), groups of `group` microbatches."""
    table = []
    for start in range(0, num_microbatches, group):
        members = range(start, min(start + group, num_microbatches))
        table += [(mb, chunk) for chunk in range(vpp) for mb in members]
    return table


def check_sizes(pp: int, vpp: int, num_microbatches: int, overlap: bool = False) -> None:
    """Megatron's constraints on (P, V, M) and the 1F1B overlap.  Raises `ScheduleError` with one line."""
    if overlap and pp > 1 and vpp == 1:
        raise ScheduleError("overlap_moe_expert_parallel_comm with pipeline_model_parallel_size > 1 needs an "
                            "interleaved layout (virtual_pipeline_model_parallel_size > 1), as in Megatron")
    if pp == 1 and vpp > 1:
        raise ScheduleError(f"layout has {vpp} stages per rank but pipeline_model_parallel_size is 1: "
                            "the no-pipelining schedule runs one chunk")
    if vpp > 1 and num_microbatches % pp:
        raise ScheduleError(f"interleaved schedule needs num_microbatches ({num_microbatches}) divisible by "
                            f"pipeline_model_parallel_size ({pp})")


def compute_order(pp: int, vpp: int, num_microbatches: int, rank: int,
                  overlap: bool = False) -> list[tuple]:
    """Ordered compute steps of `rank`: (op, chunk, microbatch) with chunk = virtual stage index on that
    rank, or with `overlap` also ("FB", (chunk, mb) forward, (chunk, mb) backward) for merged pairs."""
    m = num_microbatches
    if pp == 1:
        fwd = [("F", 0, mb) for mb in range(m)]
        bwd = [("B", 0, mb) for mb in range(m)]
        warmup = 1 if overlap else 0         # overlap pairs F(i+1) with B(i); plain runs F(i) B(i)
        if not overlap:
            return [step for mb in range(m) for step in (fwd[mb], bwd[mb])]
    elif vpp == 1:
        fwd = [("F", 0, mb) for mb in range(m)]
        bwd = [("B", 0, mb) for mb in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        table = schedule_table(m, vpp, pp)
        fwd = [("F", chunk, mb) for mb, chunk in table]
        bwd = [("B", vpp - 1 - chunk, mb) for mb, chunk in table]
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp + (1 if overlap else 0), m * vpp)
    order = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        f, b = fwd[k + warmup], bwd[k]
        order += [("FB", f[1:], b[1:])] if overlap else [f, b]
    return order + bwd[len(fwd) - warmup:]


def build_schedule(layout, num_microbatches: int, seq_length: int, micro_batch_size: int,
                   hidden_size: int, overlap: bool = False) -> list[list[Action]]:
    """Per-rank action lists for `layout` (a `PipelineLayout`).  Stages at or after the MTP stage send
    [(1+D)·s, b, h]; all others [s, b, h]; gradients mirror the forward shape (megatron-semantics §3).
    `overlap`: Megatron's 1F1B overlap (merged ``FB`` actions: receives of both halves, the merged compute,
    then the sends of both halves)."""
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    check_sizes(pp, vpp, num_microbatches, overlap)
    last = layout.num_stages - 1
    mtp = layout.mtp_stage

    def shape(stage: int) -> tuple:
        factor = 1 + layout.mtp_num_layers if mtp is not None and stage >= mtp else 1
        return (factor * seq_length, micro_batch_size, hidden_size)

    lists = []
    for rank in range(pp):
        actions: list[Action] = []
        for step in compute_order(pp, vpp, num_microbatches, rank, overlap):
            op = step[0]
            if op == "FB":
                (fc, fm), (bc, bm) = step[1], step[2]
            elif op == "F":
                (fc, fm), (bc, bm) = step[1:], (None, None)
            else:
                (fc, fm), (bc, bm) = (None, None), step[1:]
            f = fc * pp + rank if fc is not None else None
            b = bc * pp + rank if bc is not None else None
            if f is not None and f > 0:
                actions.append(Action("RECV_F", f, fm, (f - 1) % pp, shape(f - 1)))
            if b is not None and b < last:
                actions.append(Action("RECV_B", b, bm, (b + 1) % pp, shape(b)))
            if op == "FB":
                actions.append(Action("FB", f, fm, b_stage=b, b_microbatch=bm))
            else:
                actions.append(Action(op, f if op == "F" else b, fm if op == "F" else bm))
            if f is not None and f < last:
                actions.append(Action("SEND_F", f, fm, (f + 1) % pp, shape(f)))
            if b is not None and b > 0:
                actions.append(Action("SEND_B", b, bm, (b - 1) % pp, shape(b - 1)))
        lists.append(actions)
    return lists


def _message(a: Action, rank: int) -> tuple:
    """Key of the message a SEND produces or a RECV consumes: (src, dst, direction, sender stage, mb)."""
    if a.op == "SEND_F":
        return (rank, a.peer, "F", a.stage, a.microbatch)
    if a.op == "RECV_F":
        return (a.peer, rank, "F", a.stage - 1, a.microbatch)
    if a.op == "SEND_B":
        return (rank, a.peer, "B", a.stage, a.microbatch)
    return (a.peer, rank, "B", a.stage + 1, a.microbatch)


def simulate(lists: list[list[Action]]) -> int:
    """Dry-run all ranks' lists against each other without a model; return the number of rounds.

    Rejects: a RECV whose message is never sent (deadlock), a message whose shape differs between sender
    and receiver, messages left unreceived, a stage fed microbatches out of ascending order in forward or
    backward, and a backward before its forward (an ``FB`` is checked as its forward, then its backward, so
    a pair holding the same chunk and microbatch is rejected).  Raises `ScheduleError` naming rank, index and action.
    """
    pc = [0] * len(lists)
    sent: dict[tuple, tuple] = {}
    next_mb: dict[tuple, int] = {}
    rounds = 0
    while any(pc[r] < len(lists[r]) for r in range(len(lists))):
        progressed = False
        for r, actions in enumerate(lists):
            while pc[r] < len(actions):
                a = actions[pc[r]]
                where = f"rank {r} action #{pc[r]} ({a})"
                if a.op.startswith("SEND"):
                    key = _message(a, r)
                    if key in sent:
                        raise ScheduleError(f"{where}: message sent twice")
                    sent[key] = a.shape
                elif a.op.startswith("RECV"):
                    key = _message(a, r)
                    if key not in sent:
                        break                       # blocked; another rank may unblock it
                    if sent.pop(key) != a.shape:
                        raise ScheduleError(f"{where}: shape mismatch with the sender's {key}")
                else:
                    if a.op == "FB" and (a.stage, a.microbatch) == (a.b_stage, a.b_microbatch):
                        raise ScheduleError(f"{where}: a merged pair cannot hold the forward and the backward of "
                                            f"one chunk and microbatch")
                    for op, stage, mb in a.parts():
                        expected = next_mb.get((op, stage), 0)
                        if mb != expected:
                            raise ScheduleError(f"{where}: stage {stage} expects microbatch {expected} next "
                                                f"in {'forward' if op == 'F' else 'backward'}")
                        if op == "B" and next_mb.get(("F", stage), 0) <= mb:
                            raise ScheduleError(f"{where}: backward before forward")
                        next_mb[(op, stage)] = expected + 1
                pc[r] += 1
                progressed = True
        rounds += 1
        if not progressed:
            stuck = "; ".join(f"rank {r} at #{pc[r]} {lists[r][pc[r]]}" for r in range(len(lists))
                              if pc[r] < len(lists[r]))
            raise ScheduleError(f"deadlock: {stuck}")
    if sent:
        key = next(iter(sent))
        raise ScheduleError(f"message from rank {key[0]} to rank {key[1]} ({key[2]} of stage {key[3]}, "
                            f"microbatch {key[4]}) is never received")
    return rounds


@dataclass(frozen=True)
class Cell:
    """One compute action placed on a timeline (unit costs: forward 1, backward 2, merged ``FB`` 3; an FB
    cell also names its backward half)."""

    rank: int
    start: float
    end: float
    op: str
    stage: int
    microbatch: int
    b_stage: Optional[int] = None
    b_microbatch: Optional[int] = None


def timeline(lists: list[list[Action]], forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> tuple[list[Cell], float]:
    """Play the lists with unit compute costs and free communication; return (cells, bubble fraction).

    A receive waits until its message was sent; a send is ready when the compute before it ends.  Bubble
    fraction = idle rank-time / (ranks x makespan).  Raises `ScheduleError` on a deadlock (as `simulate`).
    """
    simulate(lists)
    clock = [0.0] * len(lists)
    pc = [0] * len(lists)
    ready: dict = {}
    cells: list[Cell] = []
    while any(pc[r] < len(lists[r]) for r in range(len(lists))):
        for r, actions in enumerate(lists):
            while pc[r] < len(actions):
                a = actions[pc[r]]
                if a.op.startswith("SEND"):
                    ready[_message(a, r)] = clock[r]
                elif a.op.startswith("RECV"):
                    key = _message(a, r)
                    if key not in ready:
                        break
                    clock[r] = max(clock[r], ready.pop(key))
                else:
                    cost = sum(forward_cost if op == "F" else backward_cost for op, _, _ in a.parts())
                    cells.append(Cell(r, clock[r], clock[r] + cost, a.op, a.stage, a.microbatch, a.b_stage,
                                      a.b_microbatch))
                    clock[r] += cost
                pc[r] += 1
    makespan = max(clock) if clock else 0.0
    busy = sum(c.end - c.start for c in cells)
    bubble = 1.0 - busy / (len(lists) * makespan) if makespan else 0.0
    return cells, bubble


def grid(lists: list[list[Action]], compute_only: bool = True) -> str:
    """Rank x time grid of the compute actions (``F3.0`` = forward of stage 3, microbatch 0), one row per rank.

    Columns are the rank's own order; a true timeline with bubbles comes from `timeline`.
    """
    rows = []
    for r, actions in enumerate(lists):
        cells = [str(a) for a in actions if not compute_only or a.op in COMPUTE]
        rows.append(f"rank {r:>2} | " + " ".join(f"{c:<{15 if '+' in c else 7}}" for c in cells))
    return "\n".join(rows)


def serialise(lists: list[list[Action]]) -> str:
    """Text form: one line per rank, actions separated by spaces (``rank 0: F0.0 SEND_F0.0->r1[32x2x32] ...``)."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, a)) for r, a in enumerate(lists))
