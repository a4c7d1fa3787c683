"""Pipeline schedules as tick tables: which stage runs which microbatch when, the bubble, the stash.

Pure Python (no JAX): `meshpar inspect` prints these tables and `meshpar.pipeline` executes them.
Shapes: P stages, v virtual stages (chunks) per device, M microbatches. `F3` = forward of
microbatch 3, `B3` = its backward, `.` = idle (the bubble); interleaved ops carry their chunk, `F3.1`.

GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism"): all forwards, then all backwards, M + P - 1 ticks each way. The backward is JAX's
autodiff of the forward tick loop (ppermute transposes to the reverse ppermute); each stage is
rematerialised (`jax.checkpoint`), so a stage stashes one input [b, T, E] per tick, M in all.
P = 4, M = 4:

    stage 0 | F0 F1 F2 F3 .  .  .  |  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  |  .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 .  |  .  B3 B2 B1 B0 .  .
    stage 3 | .  .  .  F0 F1 F2 F3 |  B3 B2 B1 B0 .  .  .        bubble (P-1)/(M+P-1) = 3/7

1F1B, PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", §2.2; Narayanan et al. 2021 "Memory-Efficient Pipeline-Parallel DNN
Training"): stage s runs P - s - 1 warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards. Same bubble as GPipe, but a stage holds at most P - s
microbatches in flight (stashed inputs) instead of M. Here the backward is explicit: `jax.vjp` of the
stage recomputes it from the stashed input (the last stage folds its forward into its backward, and
stage 0 re-embeds instead of stashing). The schedule is a static table [ticks, P]; every tick
every device reads its own op with `lax.axis_index('pipeline')` and runs it in a `lax.switch` (a
real per-device conditional: each stage executes only its branch), while both ppermutes (activations
down, gradients up) run every tick *outside* the branches with masked payloads, so no stage ever
waits on a collective another stage skipped. P = 4, M = 4 (ticks of equal length):

    stage 0 | F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .
    stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .        bubble 2(P-1)/2(M+P-1) = 3/7

Interleaved / circular (Narayanan et al. 2021 §2.2.2, virtual pipeline stages; the circular
repeat of Praxis/MaxText): device s holds v non-adjacent chunks, chunk r*P + s for r < v, and
microbatches travel the ring v times. Microbatches enter in groups of P (so M % P == 0 when v > 1;
v = 1 is GPipe, any M): the output
of chunk r on the last device reaches device 0 exactly one tick before chunk r + 1 needs it, and no
buffer is needed. Forward ticks: v M + P - 1 of 1/v stage each, bubble (P-1)/(vM+P-1); backward by
autodiff as in GPipe. P = 2, v = 2, M = 2 (`Fm.r`: microbatch m, chunk r):

    stage 0 | F0.0 F1.0 F0.1 F1.1 .    | .    B1.1 B0.1 B1.0 B0.0
    stage 1 | .    F0.0 F1.0 F0.1 F1.1 | B1.1 B0.1 B1.0 B0.0 .         bubble 1/5
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Op:
    """One unit of work of one stage at one tick: forward or backward of microbatch `micro`
    through the device's chunk `chunk` (always 0 unless interleaved)."""
    kind: str          # "F" | "B"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list["Op | None"]]     # [tick][stage]


def _circular_forward(p: int, m: int, v: int) -> Table:
    """Forward ticks of GPipe (v = 1) and the circular schedule: device s at tick t runs item
    i = t - s; items go in groups of P microbatches x v chunks (i -> group g, chunk r, micro)."""
    ticks = v * m + p - 1
    table: Table = [[None] * p for _ in range(ticks)]
    for t in range(ticks):
        for s in range(p):
            i = t - s
            if 0 <= i < v * m:
                r, micro = _item(i, p, v)
                table[t][s] = Op("F", micro, r)
    return table


def _item(i: int, p: int, v: int) -> tuple[int, int]:
    """Item index -> (chunk r, microbatch): groups of P microbatches pass each chunk in turn."""
    if v == 1:
        return 0, i
    g, rem = divmod(i, p * v)
    return rem // p, g * p + rem % p


def _mirror(fwd: Table) -> Table:
    """Backward of an autodiff'd forward loop: the forward ticks in reverse, F -> B."""
    return [[None if op is None else Op("B", op.micro, op.chunk) for op in row] for row in reversed(fwd)]


def _one_f_one_b(p: int, m: int) -> Table:
    """PipeDream-Flush by simulation: per-stage op order (warm-up, 1F1B, cool-down), each op run at
    the first tick its input is ready (F(m) on s after F(m) on s-1; B(m) on s after B(m) on s+1)."""
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - warm, m)]
        orders.append(ops)
    done: dict[tuple[str, int, int], int] = {}
    pos, table, t = [0] * p, [], 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = [None] * p
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op = orders[s][pos[s]]
            dep = (("F", s - 1, op.micro) if s > 0 else None) if op.kind == "F" else \
                  (("B", s + 1, op.micro) if s < p - 1 else ("F", s, op.micro))
            if dep is None or done.get(dep, t) < t:
                row[s] = op
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, s, op.micro)] = t
                pos[s] += 1
        table.append(row)
        t += 1
    return table


def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> Table:
    """The tick table [tick][stage] of a schedule (forward and backward)."""
    if schedule == "1f1b":
        return _one_f_one_b(p, m)
    fwd = _circular_forward(p, m, v if schedule == "interleaved" else 1)
    return fwd + _mirror(fwd)


def bubble_fraction(table: Table) -> float:
    """Idle (stage, tick) slots over all slots, every op counted as one tick."""
    slots = len(table) * len(table[0])
    return sum(op is None for row in table for op in row) / slots


def in_flight(table: Table) -> list[int]:
    """Per stage, the most microbatches whose forward ran and whose backward has not (the stash)."""
    p = len(table[0])
    out = []
    for s in range(p):
        live, peak = set(), 0
        for row in table:
            op = row[s]
            if op is not None:
                (live.add if op.kind == "F" else live.discard)((op.micro, op.chunk))
            peak = max(peak, len(live))
        out.append(peak)
    return out


def _label(op: Op | None, chunks: bool) -> str:
    return "." if op is None else f"{op.kind}{op.micro}.{op.chunk}" if chunks else f"{op.kind}{op.micro}"


def render_table(table: Table) -> list[str]:
    """One text line per stage: 'stage 0 | F0 F1 .  B0 ...' ('F3.1': chunk 1 when interleaved)."""
    chunks = any(op is not None and op.chunk for row in table for op in row)
    width = max(len(_label(op, chunks)) for row in table for op in row)
    return [f"stage {s} | " + " ".join(_label(row[s], chunks).ljust(width) for row in table).rstrip()
            for s in range(len(table[0]))]


def describe(cfg, p: int) -> dict:
    """The `pipeline` section of `meshpar inspect`: schedule table, bubble, stash per stage."""
    pc = cfg.pipeline
    v = pc.virtual_stages if pc.schedule == "interleaved" else 1
    table = schedule_table(pc.schedule, p, pc.microbatches, v)
    return {"schedule": pc.schedule, "stages": p, "microbatches": pc.microbatches, "virtual_stages": v,
            "ticks": len(table), "table": [[str(op) if op else None for op in row] for row in table],  # [tick][stage]
            "lines": render_table(table), "bubble": bubble_fraction(table), "in_flight": in_flight(table)}


def one_f_one_b_program(p: int, m: int):
    """The 1F1B table as arrays [ticks, P] for the executor (`meshpar.pipeline`): op kind (0 idle,
    1 F, 2 B), its microbatch, the microbatch whose activation arrives from stage s-1 (recv_f) and
    whose cotangent arrives from s+1 (recv_b) at each tick (-1: none); and the buffer slots those
    arrivals need (activations, cotangents)."""
    import numpy as np
    table = schedule_table("1f1b", p, m)
    n = len(table)
    kind = np.zeros((n, p), np.int32)         # 0 idle, 1 F, 2 B
    micro = np.zeros((n, p), np.int32)
    recv_f = np.full((n, p), -1, np.int32)    # microbatch whose activation arrives from s-1 this tick
    recv_b = np.full((n, p), -1, np.int32)    # microbatch whose cotangent arrives from s+1 this tick
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            kind[t, s], micro[t, s] = (1 if op.kind == "F" else 2), op.micro
            if t + 1 < n and op.kind == "F" and s + 1 < p:
                recv_f[t + 1, s + 1] = op.micro
            if t + 1 < n and op.kind == "B" and s > 0:
                recv_b[t + 1, s - 1] = op.micro
    return (kind, micro, recv_f, recv_b), (_slots(recv_f, kind, micro), _slots(recv_b, kind, micro))


# A per-device branch (1F1B's switch) carries this named scope with the share of its loop's ticks it
# runs, averaged over the stages; `meshpar.inspect` counts the collectives inside by it instead of
# counting every branch on every tick.
BRANCH_SHARE = "meshpar_branch_share="


def one_f_one_b_branches(kind):
    """[ticks, P] index of the 1F1B executor's switch branch at each (tick, stage): 0 idle,
    1 + position forward, 4 + position backward (position 0 first, 1 middle, 2 last stage)."""
    import numpy as np
    p = kind.shape[1]
    pos = np.array([0 if s == 0 else 2 if s == p - 1 else 1 for s in range(p)])
    return np.where(kind == 0, 0, np.where(kind == 1, 1 + pos, 4 + pos))


def branch_shares(branches, n: int) -> list[float]:
    """Per branch 0..n-1: the share of (tick, stage) pairs that run it."""
    import numpy as np
    return [float(np.mean(branches == b)) for b in range(n)]


def _slots(recv, kind, micro) -> int:
    """Buffer slots a stage needs: the most microbatches received and not yet backwarded (F) /
    consumed (B) at once. Slot = micro % slots never collides since microbatches flow in order."""
    n, p = recv.shape
    history = []
    for s in range(p):
        live = set()
        for t in range(n):
            if recv[t, s] >= 0:
                live.add(int(recv[t, s]))
            history.append(frozenset(live))
            if kind[t, s] == 2:
                live.discard(int(micro[t, s]))
    peak = max(1, max(map(len, history)))
    assert all(len({x % peak for x in live}) == len(live) for live in history)
    return peak
