"""Pipeline schedules as tick tables: which stage runs which microbatch when, the bubble, the stash.

Pure Python (no JAX): `meshpar inspect` prints these tables and `meshpar.parallel.pipeline` executes them.
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

1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2; PipeDream-Flush, Narayanan et al. 2021 "Memory-Efficient Pipeline-Parallel DNN
Training"): after a warm-up, each stage alternates one forward and one backward, so a stage holds a
bounded number of microbatches in flight instead of M. Here it runs in lockstep ticks, as SPMD code
with a ppermute per tick must: at tick t stage s runs F(t - s) and then B(t - 2(P-1) + s). A tick
that pairs an F with a B costs tf + tb on every busy stage, so no stage waits for a neighbour's
longer op (PipeDream-Flush's one-op ticks would each last max(tf, tb): a backward, twice a
forward), the step takes (M + P - 1)(tf + tb) as in the paper, and stage s holds 2(P - s) - 1
microbatches (the round trip of its output to the last stage and back), at most 2P - 1. Forward
and backward are explicit: a forward keeps the stage's residuals (`jax.vjp`, what the model's remat
policy saves) in a slot and its backward applies them, so no stage is recomputed (the last stage
runs F(m) and B(m) in one tick, fused). Every device reads its ops with
`lax.axis_index('pipeline')` and runs them in a `lax.switch` (a real per-device conditional: each
stage executes only its branch), while both ppermutes (activations down, gradients up) run every
tick *outside* the branches with masked payloads, so no stage ever waits on a collective another
stage skipped. The table shows each tick as its forward phase, then its backward phase (phases in
which no stage works are left out). P = 4, M = 8 (bubble 2(P-1)/2(M+P-1) = 3/11, in flight 7 5 3 1):

    stage 0 | F0 F1 F2 F3 .  F4 .  F5 .  F6 B0 F7 B1 .  B2 .  B3 .  B4 B5 B6 B7
    stage 1 | .  F0 F1 F2 .  F3 .  F4 B0 F5 B1 F6 B2 F7 B3 .  B4 .  B5 B6 B7 .
    stage 2 | .  .  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 B7 .  .
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

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

from meshpar.core.config.schema import SCHEDULES as SCHEDULE_OPTIONS

SCHEDULES = SCHEDULE_OPTIONS  # pipeline.schedule's options, typed once in meshpar.core.config.schema


@dataclass(frozen=True)
class Op:
    """One unit of work of one stage at one tick: forward or backward of microbatch `micro`
    through the device's chunk `chunk` (always 0 unless interleaved)."""

    kind: str  # "F" | "B"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list["Op | None"]]  # [tick][stage]


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


def one_f_one_b_ticks(p: int, m: int) -> int:
    """Ticks of lockstep 1F1B: the last backward, B(M-1) on stage 0, runs at tick M - 1 + 2(P-1)."""
    return m + 2 * p - 2


def _lockstep(p: int, m: int):
    """Lockstep 1F1B as arrays [ticks, P]: at tick t stage s runs F(t - s), then B(t - 2(P-1) + s),
    each when it names a microbatch (-1: none)."""
    import numpy as np

    t, s = np.arange(one_f_one_b_ticks(p, m))[:, None], np.arange(p)[None, :]
    f, b = t - s, t - 2 * (p - 1) + s
    return (np.where((f >= 0) & (f < m), f, -1).astype(np.int32), np.where((b >= 0) & (b < m), b, -1).astype(np.int32))


def _one_f_one_b(p: int, m: int) -> Table:
    """Lockstep 1F1B as a table: each tick gives a forward row and a backward row, empty rows left out."""
    table: Table = []
    f, b = _lockstep(p, m)
    for f_row, b_row in zip(f, b):
        for kind, row in (("F", f_row), ("B", b_row)):
            if (row >= 0).any():
                table.append([Op(kind, int(i)) if i >= 0 else None for i in row])
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
    return [
        f"stage {s} | " + " ".join(_label(row[s], chunks).ljust(width) for row in table).rstrip()
        for s in range(len(table[0]))
    ]


def describe(pc, p: int) -> dict:
    """The `pipeline` section of `meshpar inspect` for `cfg.pipeline` on `p` stages: schedule table,
    bubble, stash per stage."""
    v = pc.virtual_stages if pc.schedule == "interleaved" else 1
    table = schedule_table(pc.schedule, p, pc.microbatches, v)
    return {
        "schedule": pc.schedule,
        "stages": p,
        "microbatches": pc.microbatches,
        "virtual_stages": v,
        "ticks": len(table),
        "table": [[str(op) if op else None for op in row] for row in table],  # [tick][stage]
        "lines": render_table(table),
        "bubble": bubble_fraction(table),
        "in_flight": in_flight(table),
    }


def one_f_one_b_program(p: int, m: int):
    """Lockstep 1F1B as arrays [ticks, P] for the executor (`meshpar.parallel.pipeline`): the microbatch each
    stage forwards (f) and backwards (b) at each of the M + 2P - 2 ticks (-1: none), and the residual
    slots a stage needs (microbatches forwarded and not yet backwarded, on the stages before the
    last: 2(P - s) - 1, so slot = micro % slots never collides). An activation (cotangent) arrives
    from stage s-1 (s+1) exactly at the tick that uses it, so neither needs a buffer."""
    k_res = max([1] + in_flight([row[:-1] for row in _one_f_one_b(p, m)]) if p > 1 else [1])
    return _lockstep(p, m), k_res


# A per-device branch (1F1B's switch) carries this named scope with the share of its loop's ticks it
# runs, averaged over the stages; `meshpar.plan.inspect` counts the collectives inside by it instead of
# counting every branch on every tick.
BRANCH_SHARE = "meshpar_branch_share="


POSITIONS = ("first", "middle", "last")
# the 1F1B executor's switch branches, numbered by this one table: (position, ops), ops "" = idle
ONE_F_ONE_B_BRANCHES = (("first", ""),) + tuple((q, ops) for q in POSITIONS for ops in ("F", "B", "FB"))


def one_f_one_b_branches(f, b):
    """[ticks, P] index into `ONE_F_ONE_B_BRANCHES` of the 1F1B executor's switch branch at each
    (tick, stage), from the program's f and b: idle, or F, B, F+B at the stage's position."""
    import numpy as np

    p = f.shape[1]
    pos = [POSITIONS[0 if s == 0 else 2 if s == p - 1 else 1] for s in range(p)]
    ops = np.array(["", "F", "B", "FB"])[(f >= 0).astype(int) + 2 * (b >= 0)]
    index = {key: i for i, key in enumerate(ONE_F_ONE_B_BRANCHES)}
    return np.array([[index[(pos[s], o) if o else ONE_F_ONE_B_BRANCHES[0]] for s, o in enumerate(row)] for row in ops])


def branch_shares(branches, n: int) -> list[float]:
    """Per branch 0..n-1: the share of (tick, stage) pairs that run it."""
    import numpy as np

    return [float(np.mean(branches == b)) for b in range(n)]
