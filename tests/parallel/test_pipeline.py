"""Pipeline parallelism (meshpar/parallel/pipeline.py): every schedule computes the non-pipelined loss and
gradients, alone and with data x tensor (x fsdp, with accumulation) axes, loss scaling included; the
tick tables have the papers' bubbles; bad configs fail with one line naming the key. (What the
compiled program holds: test_pipeline_program.py; MoE: test_pipeline_moe.py; every model x
schedule trains: test_pipeline_combinations.py; users' models: test_stages.py.)

Errors are norm-wise, ||a - b|| / ||b|| (see test_equivalence.py).
"""

import jax
import numpy as np
import pytest

from meshpar.core.errors import ConfigError, ShardingError
from meshpar.parallel import schedules
from meshpar.train.step import Trainer
from tests.conftest import devices, rel
from tests.parallel.pipelines import check_equal, pp_cfg, reference

ALONE = [
    (s, p, k * p, v, layers)
    for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
    for p in (2, 4)
    for k in (1, 2, 4)
    for layers in [p * v if p * v > 2 else 4]
]
FAST = {("gpipe", 2, 4), ("1f1b", 2, 2), ("1f1b", 4, 16), ("interleaved", 2, 8), ("interleaved", 4, 4)}


@pytest.mark.parametrize(
    "schedule,p,m,v,layers",
    [pytest.param(*c, marks=() if c[:3] in FAST else pytest.mark.slow, id=f"{c[0]}-P{c[1]}-M{c[2]}") for c in ALONE],
)
def test_pipelined_loss_and_grads_equal_the_plain_model(schedule, p, m, v, layers):
    check_equal(pp_cfg(schedule, p, m, v, layers), p)


COMBINED_FAST = {("gpipe", 4), ("1f1b", 8), ("interleaved", 2)}


@pytest.mark.parametrize(
    "schedule,m",
    [
        pytest.param(s, m, marks=() if (s, m) in COMBINED_FAST else pytest.mark.slow, id=f"{s}-M{m}")
        for s in ("gpipe", "1f1b", "interleaved")
        for m in (2, 4, 8)
    ],
)
def test_pipeline_composes_with_data_and_tensor(schedule, m):
    """P = 2 stages x data 2 x tensor 2 under fsdp_tp (the default strategy)."""
    v = 2 if schedule == "interleaved" else 1
    check_equal(pp_cfg(schedule, 2, m, v, 4, {"pipeline": 2, "data": 2, "tensor": 2}), 8)


def test_the_first_stage_reading_the_table_whole_over_tensor_equals_the_plain_model(monkeypatch):
    """Under jaxlib >= 0.11 the first stage reads the outer parameters whole over `tensor` too (its
    SPMD partitioner aborts on the embedding gather from a table split over `tensor` beside an
    automatic `data`: `meshpar.parallel.pipeline._GATHER_OVER_TENSOR_ABORTS`). That path, forced here
    under any jax, computes the same loss and gradients."""
    from meshpar.parallel import pipeline

    monkeypatch.setattr(pipeline, "_GATHER_OVER_TENSOR_ABORTS", True)
    read = []
    embed_specs = pipeline._embed_specs
    monkeypatch.setattr(pipeline, "_embed_specs", lambda *a: read.append(embed_specs(*a)) or read[-1])
    check_equal(pp_cfg("gpipe", 2, 2, 1, 4, {"pipeline": 2, "data": 2, "tensor": 2}), 8)
    specs = jax.tree.leaves(read, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert specs and all(s == jax.sharding.PartitionSpec(*[None] * len(s)) for s in specs), specs


@pytest.mark.slow
def test_pipeline_with_fsdp_and_gradient_accumulation():
    cfg = pp_cfg(
        "1f1b", 2, 2, 1, 4, {"pipeline": 2, "fsdp": 2, "tensor": 2}, "strategy=fsdp_tp", "batch.microbatches=2"
    )
    tr = Trainer(cfg, devices=devices(8))
    params, tokens, loss0, grads0 = reference(4)
    state = tr.init()
    state = {**state, "params": jax.device_put(params, tr.param_shardings)}
    _, metrics = tr.step(state, jax.device_put(tokens, tr.batch_sharding))
    assert abs(float(metrics["loss"]) - loss0) / loss0 <= 1e-5
    gn0 = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads0))))
    assert abs(float(metrics["grad_norm"]) - gn0) / gn0 <= 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_loss_scale_scales_the_gradients_not_the_loss(schedule):
    """fp16 loss scaling: Trainer._grads(..., loss_scale=S) returns the grads of S * loss."""
    tr = Trainer(pp_cfg(schedule, 2, 2), devices=devices(2))
    params, tokens, loss0, grads0 = reference(4)
    params = jax.device_put(params, tr.param_shardings)
    tokens = jax.device_put(tokens, tr.batch_sharding)
    (loss, _), grads = jax.jit(tr._grads)(params, tokens, np.float32(1024.0))
    assert abs(float(loss) - loss0) / loss0 <= 1e-5
    assert rel(jax.tree.map(lambda g: np.asarray(g) / 1024.0, jax.device_get(grads)), grads0) <= 1e-5


# -- schedules: tick tables and bubbles ----------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_fractions_match_the_papers(p, k):
    m = k * p
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        table = schedules.schedule_table(schedule, p, m, v)
        want = (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)
        assert schedules.bubble_fraction(table) == pytest.approx(want, abs=1e-12)
        # every stage does each (microbatch, chunk) forward once and backward once, F before B
        for s in range(p):
            ops = [row[s] for row in table if row[s] is not None]
            n_chunks = v if schedule == "interleaved" else 1
            assert len(ops) == 2 * m * n_chunks
            for op in ops:
                if op.kind == "B":
                    assert ops.index(schedules.Op("F", op.micro, op.chunk)) < ops.index(op)


def test_one_f_one_b_branches_carry_their_share_of_the_ticks():
    """`meshpar inspect` counts a collective inside 1F1B's per-device switch by the share of
    (tick, stage) pairs that run its branch, not on every tick: each stage runs each microbatch's F
    and B once, in the branches of its position (first, middle, last: F, B or both in one tick)."""
    p, m = 4, 8
    (f, b), _ = schedules.one_f_one_b_program(p, m)
    shares = schedules.branch_shares(schedules.one_f_one_b_branches(f, b), 10)
    pairs = f.size  # ticks x stages
    assert sum(shares) == pytest.approx(1)
    count = [round(x * pairs) for x in shares]
    stages = {0: 1, 1: p - 2, 2: 1}  # stages per position
    for q in range(3):
        n_f, n_b, n_fb = count[1 + 3 * q : 4 + 3 * q]
        assert n_f + n_fb == m * stages[q] and n_b + n_fb == m * stages[q]
    assert count[7] == count[8] == 0  # the last stage's F and B share one tick
    assert count[0] == pairs - sum(count[1:])  # idle


def test_one_f_one_b_holds_at_most_2_p_minus_s_minus_1_microbatches():
    """Lockstep 1F1B: stage s's output goes to the last stage and its cotangent comes back, 2(P-s)-1
    ticks, so stage s holds that many microbatches in flight (M when fewer), whatever M; GPipe M."""
    for p in (2, 3, 4, 8):  # any M, fewer microbatches than stages included
        for m in (1, 3, 5, 16):
            assert len(schedules.schedule_table("1f1b", p, m)) == 2 * (m + p - 1)
            (f, _), k_res = schedules.one_f_one_b_program(p, m)
            assert f.shape == (m + 2 * p - 2, p) and k_res == min(2 * p - 1, m)
    for p, m in ((2, 8), (4, 16)):
        assert schedules.in_flight(schedules.schedule_table("1f1b", p, m)) == [2 * (p - s) - 1 for s in range(p)]
        assert schedules.in_flight(schedules.schedule_table("gpipe", p, m)) == [m] * p


# -- errors: one line naming the key and a fix ---------------------------------------------------


def test_layers_not_divisible_by_stages_times_virtual():
    with pytest.raises(
        ConfigError,
        match=r"model.layers=4 is not divisible by mesh.pipeline=2 x "
        r"pipeline.virtual_stages=4 \(= 8 chunks\); "
        r"use a multiple of 8 stacked layers",
    ):
        Trainer(pp_cfg("interleaved", 2, 4, 4, 4), devices=devices(2))


def test_microbatches_not_a_multiple_of_stages_for_interleaved():
    with pytest.raises(ConfigError, match=r"pipeline.microbatches=3 is not a multiple of mesh.pipeline=2"):
        Trainer(pp_cfg("interleaved", 2, 3, 2, 4, None, "batch.global_size=12"), devices=devices(2))


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(
        ConfigError,
        match=r"batch.global_size=16 does not split into pipeline.microbatches=3 "
        r"microbatches; use a multiple of 3 for batch.global_size",
    ):
        Trainer(pp_cfg("gpipe", 2, 3), devices=devices(2))
    with pytest.raises(ShardingError, match=r"pipeline microbatch of 2 sequences .* data-parallel size 4"):
        Trainer(pp_cfg("1f1b", 2, 8, 1, 4, {"pipeline": 2, "data": 4}), devices=devices(8))


def test_errors_are_one_line():
    for cfg in (pp_cfg("interleaved", 2, 4, 4, 4), pp_cfg("gpipe", 2, 3), pp_cfg("gpipe", 2, 2, 2)):
        with pytest.raises(ConfigError) as e:
            Trainer(cfg, devices=devices(2))
        assert "\n" not in str(e.value)
