"""Pipeline parallelism (meshpar/pipeline.py): every schedule computes the non-pipelined loss and
gradients, alone and with data x tensor axes; the HLO moves activations with collective-permute and
never gathers the layer stack; the tick tables have the papers' bubbles; 1F1B reruns no stage and
its memory does not grow with M; bad configs fail with one line naming the key.

Errors are norm-wise, ||a - b|| / ||b|| (see test_equivalence.py).
"""
import re

import jax
import numpy as np
import pytest

from meshpar import schedules
from meshpar.errors import ConfigError, ShardingError
from meshpar.inspect import collectives
from meshpar.step import Trainer
from tests.conftest import devices, make_cfg, rel

TINY = ["model.embed=32", "model.mlp=64", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
        "model.vocab=64", "batch.global_size=16", "batch.length=8"]




def pp_cfg(schedule, p, m, v=1, layers=4, mesh=None, *extra):
    return make_cfg(*TINY, f"model.layers={layers}", f"pipeline.schedule={schedule}", f"pipeline.microbatches={m}",
                    f"pipeline.virtual_stages={v}", *extra, mesh=mesh or {"pipeline": p})


_REF: dict = {}


def reference(layers: int):
    """Params, a batch, and the single-device (non-pipelined) loss and gradients for `layers`."""
    if layers not in _REF:
        cfg = make_cfg(*TINY, f"model.layers={layers}", "strategy=dp", mesh={})
        tr = Trainer(cfg, devices=devices(1))
        params = jax.device_get(tr.init()["params"])
        tokens = np.asarray(jax.random.randint(jax.random.key(7), tr.batch_shape, 0, 64))
        (loss, aux), grads = jax.jit(tr._grads)(params, tokens)
        _REF[layers] = (params, tokens, float(loss), jax.device_get(grads))
    return _REF[layers]


def pipelined(cfg, n):
    tr = Trainer(cfg, devices=devices(n))
    params, tokens, _, _ = reference(tr.spec.cfg.layers)
    params = jax.device_put(params, tr.param_shardings)
    tokens = jax.device_put(tokens, tr.batch_sharding)
    (loss, aux), grads = jax.jit(tr._grads)(params, tokens)
    return float(loss), aux, jax.device_get(grads)


def check_equal(cfg, n):
    _, _, loss0, grads0 = reference(cfg.model.layers)
    loss, aux, grads = pipelined(cfg, n)
    assert jax.tree.structure(grads) == jax.tree.structure(grads0)
    assert abs(loss - loss0) / loss0 <= 1e-5
    assert abs(float(aux["ce"]) - loss0) / loss0 <= 1e-5
    assert rel(grads, grads0) <= 1e-5


# (schedule, P, M, v, layers): every schedule, P in {2, 4}, M in {P, 2P, 4P}
ALONE = [(s, p, k * p, v, layers) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
         for p in (2, 4) for k in (1, 2, 4) for layers in [p * v if p * v > 2 else 4]]
FAST = {("gpipe", 2, 4), ("1f1b", 2, 2), ("1f1b", 4, 16), ("interleaved", 2, 8), ("interleaved", 4, 4)}


@pytest.mark.parametrize("schedule,p,m,v,layers", [
    pytest.param(*c, marks=() if c[:3] in FAST else pytest.mark.slow, id=f"{c[0]}-P{c[1]}-M{c[2]}") for c in ALONE])
def test_pipelined_loss_and_grads_equal_the_plain_model(schedule, p, m, v, layers):
    check_equal(pp_cfg(schedule, p, m, v, layers), p)


COMBINED_FAST = {("gpipe", 4), ("1f1b", 8), ("interleaved", 2)}


@pytest.mark.parametrize("schedule,m", [
    pytest.param(s, m, marks=() if (s, m) in COMBINED_FAST else pytest.mark.slow, id=f"{s}-M{m}")
    for s in ("gpipe", "1f1b", "interleaved") for m in (2, 4, 8)])
def test_pipeline_composes_with_data_and_tensor(schedule, m):
    """P = 2 stages x data 2 x tensor 2 under fsdp_tp (the default strategy)."""
    v = 2 if schedule == "interleaved" else 1
    check_equal(pp_cfg(schedule, 2, m, v, 4, {"pipeline": 2, "data": 2, "tensor": 2}), 8)


@pytest.mark.slow
def test_pipeline_with_fsdp_and_gradient_accumulation():
    cfg = pp_cfg("1f1b", 2, 2, 1, 4, {"pipeline": 2, "fsdp": 2, "tensor": 2}, "strategy=fsdp_tp",
                 "batch.microbatches=2")
    tr = Trainer(cfg, devices=devices(8))
    params, tokens, loss0, grads0 = reference(4)
    state = tr.init()
    state = {**state, "params": jax.device_put(params, tr.param_shardings)}
    _, metrics = tr.step(state, jax.device_put(tokens, tr.batch_sharding))
    assert abs(float(metrics["loss"]) - loss0) / loss0 <= 1e-5
    gn0 = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads0))))
    assert abs(float(metrics["grad_norm"]) - gn0) / gn0 <= 1e-5


def test_pipelined_moe_with_expert_parallelism_equals_the_plain_moe():
    """MoE blocks return their weighted losses under aux "loss": 1F1B must feed those cotangents
    through its explicit per-stage vjp; per-layer metrics come back stacked [layers]."""
    mesh = {"pipeline": 2, "expert": 2, "tensor": 2}
    cfg = make_cfg(*TINY, "model.layers=4", "model.name=moe", "pipeline.schedule=1f1b", "pipeline.microbatches=4",
                   mesh=mesh)
    ref = make_cfg(*TINY, "model.layers=4", "model.name=moe", "strategy=dp", mesh={})
    tr0 = Trainer(ref, devices=devices(1))
    params = jax.device_get(tr0.init()["params"])
    tokens = np.asarray(jax.random.randint(jax.random.key(7), tr0.batch_shape, 0, 64))
    (loss0, aux0), grads0 = jax.jit(tr0._grads)(params, tokens)
    tr = Trainer(cfg, devices=devices(8))
    (loss, aux), grads = jax.jit(tr._grads)(jax.device_put(params, tr.param_shardings),
                                            jax.device_put(tokens, tr.batch_sharding))
    assert abs(float(loss) - float(loss0)) / float(loss0) <= 1e-5
    assert float(loss) > float(aux["ce"])          # the MoE losses are part of the loss
    assert rel(grads, jax.device_get(grads0)) <= 1e-5
    assert set(aux) == set(aux0)
    # metrics are averaged over microbatches, as gradient accumulation does: exact for the means
    # (the losses, drop fraction); per-microbatch maxima/minima of the expert load are not batch maxima
    for k in ("aux_loss", "z_loss", "drop_fraction"):
        np.testing.assert_allclose(np.asarray(aux[k]), np.asarray(aux0[k]), rtol=1e-5, atol=1e-6)


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


# -- HLO: collective-permute between stages, no gather of the layer stack ------------------------

@pytest.fixture(scope="module", params=["gpipe", "1f1b", "interleaved"])
def compiled_2x2x2(request):
    v = 2 if request.param == "interleaved" else 1
    cfg = pp_cfg(request.param, 2, 4, v, 4, {"pipeline": 2, "data": 2, "tensor": 2})
    tr = Trainer(cfg, devices=devices(8))
    return request.param, tr, tr.compile()


def test_hlo_permutes_activations_and_never_gathers_the_stack(compiled_2x2x2):
    schedule, tr, compiled = compiled_2x2x2
    shape = tr.describe()["mesh"]
    ops = collectives(compiled.as_text(), shape)
    act_bytes = (tr.cfg.batch.global_size // tr.cfg.pipeline.microbatches // 2) * tr.cfg.batch.length * 32 * 4
    permutes = [o for o in ops if o["kind"] == "collective-permute" and o["axes"] == ["pipeline"]]
    assert permutes, "no collective-permute over pipeline"
    # every stage-to-stage transfer carries one microbatch's activations (its data shard) or less
    assert all(o["bytes"] <= act_bytes for o in permutes)
    layers = jax.tree.leaves(tr.spec.shapes["layers"])
    smallest_stack = min(int(np.prod(a.shape)) * 4 for a in layers)
    for o in ops:
        if o["kind"] == "all-gather" and "pipeline" in o["axes"]:
            assert o["bytes"] < smallest_stack, f"all-gather of {o['bytes']} bytes over pipeline"
    # stacked layer params stay split over pipeline at rest
    for sh in jax.tree.leaves(tr.param_shardings["layers"]):
        assert sh.spec[0] == "pipeline"
    if schedule == "1f1b":   # a real per-device conditional (idle + F/B x first/middle/last), permutes outside it
        branches = set()
        for line in compiled.as_text().splitlines():
            found = re.search(r" conditional\(.*branch_computations=\{([^}]*)\}", line)
            if found:
                branches |= {c.strip().lstrip("%") for c in found.group(1).split(",")}
        assert len(branches) >= 7
        assert not any(o["computation"] in branches for o in permutes)
        ticks = schedules.one_f_one_b_program(2, 4)[0][0].shape[0]
        tensor = [o for o in ops if o["axes"] == ["tensor"] and o["bytes"] > 1024]
        assert tensor and all(o["times"] < ticks for o in tensor)   # counted by branch share, not every tick


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_gradients_are_reduced_over_data_once_per_step(schedule):
    """With weights replicated over `data` (tp), the pipeline is manual over `data` too and each
    replica keeps its gradients over the ticks: the all-reduces over `data` carry the parameters'
    gradients once per step, none inside the tick loop (before: a stage's whole gradient on every
    tick). FSDP-style presets shard weights over `data` and reduce-scatter per use, as FSDP does."""
    v = 2 if schedule == "interleaved" else 1
    cfg = pp_cfg(schedule, 2, 4, v, 4, {"pipeline": 2, "data": 2, "tensor": 2}, "strategy=tp")
    tr = Trainer(cfg, devices=devices(8))
    ops = collectives(tr.compile().as_text(), tr.describe()["mesh"])
    over_data = [o for o in ops if o["kind"] == "all-reduce" and "data" in o["axes"] and o["bytes"] > 1024]
    assert over_data and all(o.get("times", 1) == 1 for o in over_data), over_data   # (scalars aside)
    per_device = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(tr.spec.shapes)) / 2   # split over P or t
    assert sum(o["bytes"] for o in over_data) <= 1.05 * per_device


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
    pairs = f.size                                      # ticks x stages
    assert sum(shares) == pytest.approx(1)
    count = [round(x * pairs) for x in shares]
    stages = {0: 1, 1: p - 2, 2: 1}                     # stages per position
    for q in range(3):
        n_f, n_b, n_fb = count[1 + 3 * q: 4 + 3 * q]
        assert n_f + n_fb == m * stages[q] and n_b + n_fb == m * stages[q]
    assert count[7] == count[8] == 0                    # the last stage's F and B share one tick
    assert count[0] == pairs - sum(count[1:])           # idle


def test_one_f_one_b_holds_at_most_2_p_minus_s_minus_1_microbatches():
    """Lockstep 1F1B: stage s's output goes to the last stage and its cotangent comes back, 2(P-s)-1
    ticks, so stage s holds that many microbatches in flight (M when fewer), whatever M; GPipe M."""
    for p in (2, 3, 4, 8):               # any M, fewer microbatches than stages included
        for m in (1, 3, 5, 16):
            assert len(schedules.schedule_table("1f1b", p, m)) == 2 * (m + p - 1)
            (f, _), k_res = schedules.one_f_one_b_program(p, m)
            assert f.shape == (m + 2 * p - 2, p) and k_res == min(2 * p - 1, m)
    for p, m in ((2, 8), (4, 16)):
        assert schedules.in_flight(schedules.schedule_table("1f1b", p, m)) == [2 * (p - s) - 1 for s in range(p)]
        assert schedules.in_flight(schedules.schedule_table("gpipe", p, m)) == [m] * p


def test_one_f_one_b_backward_applies_the_stashed_residuals():
    """1F1B keeps each forward's residuals for its backward and never reruns a stage: under remat
    `none`, a middle stage's forward branch holds the layer's 6 forward matmuls, its backward branch
    only the 12 transposed ones (dx and dW of each), the branch running both 6 + 12. A backward that
    reran the stage would hold the forward matmuls again."""
    p, m = 4, 8
    tr = Trainer(pp_cfg("1f1b", p, m, 1, 4, None, "model.remat=none"), devices=devices(p))
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          tr.spec.shapes, tr.param_shardings)
    tokens = jax.ShapeDtypeStruct(tr.batch_shape, np.int32, sharding=tr.batch_sharding)
    hlo = jax.jit(tr._grads).lower(params, tokens).compile().as_text()
    found = {}
    for ops in ("F", "B", "FB"):
        dots = [ln for ln in hlo.splitlines() if " dot(" in ln and f"/middle_{ops}/" in ln]
        forward = sum("transpose(" not in ln for ln in dots)
        found[ops] = (forward, len(dots) - forward)
    assert found == {"F": (6, 0), "B": (0, 12), "FB": (6, 12)}      # q|k|v, scores, PV, wo, w_gate|up, w_down


def test_inspect_reports_the_pipeline():
    """`meshpar inspect` JSON carries the tick table, its bubble and peak temporary memory."""
    from meshpar.inspect import report
    cfg = pp_cfg("interleaved", 2, 4, 2, 4, {"pipeline": 2, "data": 2, "tensor": 2})
    rep = report(cfg)["pipeline"]
    assert rep["bubble"] == pytest.approx((2 - 1) / (2 * 4 + 2 - 1))
    assert rep["ticks"] == 2 * (2 * 4 + 2 - 1) and len(rep["lines"]) == 2
    assert rep["lines"][0].startswith("stage 0 | F0.0 F1.0 F0.1 F1.1 F2.0 ")
    assert rep["peak_temp_bytes"] > 0


# -- memory: 1F1B stashes at most 2P - 1 microbatches, GPipe M -------------------------------------

def test_one_f_one_b_memory_does_not_grow_with_microbatches():
    """Pipelined loss+grads of a fixed microbatch (b=4, T=64, E=64, full remat), M = 4P = 8 and 16:
    GPipe stashes a stage input per microbatch, 1F1B the residuals (here the layer inputs) of at most
    2P - 1 microbatches whatever M, so from M = 8P it holds less."""
    def temp(schedule, m):
        cfg = make_cfg("model.embed=64", "model.mlp=128", "model.heads=4", "model.kv_heads=4", "model.head_dim=16",
                       "model.vocab=64", "model.layers=4", "batch.length=64", f"batch.global_size={4 * m}",
                       f"pipeline.schedule={schedule}", f"pipeline.microbatches={m}", mesh={"pipeline": 2})
        tr = Trainer(cfg, devices=devices(2))
        params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              tr.spec.shapes, tr.param_shardings)
        tokens = jax.ShapeDtypeStruct(tr.batch_shape, np.int32, sharding=tr.batch_sharding)
        return jax.jit(tr._grads).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    g8, g16, f8, f16 = temp("gpipe", 8), temp("gpipe", 16), temp("1f1b", 8), temp("1f1b", 16)
    stage_input = 4 * 64 * 64 * 4                       # one [b, T, E] fp32 activation
    assert g16 - g8 >= 8 * stage_input                  # GPipe stashes every extra microbatch
    assert f16 - f8 < 0.1 * (g16 - g8)                  # 1F1B at most 2P - 1, whatever M
    assert f16 < g16


# -- errors: one line naming the key and a fix ---------------------------------------------------

def test_layers_not_divisible_by_stages_times_virtual():
    with pytest.raises(ConfigError, match=r"model.layers=4 is not divisible by mesh.pipeline=2 x "
                                          r"pipeline.virtual_stages=4 \(= 8 chunks\); "
                                          r"use a multiple of 8 stacked layers"):
        Trainer(pp_cfg("interleaved", 2, 4, 4, 4), devices=devices(2))


def test_microbatches_not_a_multiple_of_stages_for_interleaved():
    with pytest.raises(ConfigError, match=r"pipeline.microbatches=3 is not a multiple of mesh.pipeline=2"):
        Trainer(pp_cfg("interleaved", 2, 3, 2, 4, None, "batch.global_size=12"), devices=devices(2))


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(ConfigError, match=r"batch.global_size=16 does not split into pipeline.microbatches=3 "
                                          r"microbatches; use a multiple of 3 for batch.global_size"):
        Trainer(pp_cfg("gpipe", 2, 3), devices=devices(2))
    with pytest.raises(ShardingError, match=r"pipeline microbatch of 2 sequences .* data-parallel size 4"):
        Trainer(pp_cfg("1f1b", 2, 8, 1, 4, {"pipeline": 2, "data": 4}), devices=devices(8))


def test_errors_are_one_line():
    for cfg in (pp_cfg("interleaved", 2, 4, 4, 4), pp_cfg("gpipe", 2, 3), pp_cfg("gpipe", 2, 2, 2)):
        with pytest.raises(ConfigError) as e:
            Trainer(cfg, devices=devices(2))
        assert "\n" not in str(e.value)


# -- end to end ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_pp_tiny_learns_like_the_default(tmp_path):
    from meshpar.config import CONFIG_DIR, load_config
    from meshpar.loop import run
    """configs/pp-tiny.yaml (1F1B over 2 stages x data 2 x tensor 2) against the non-pipelined
    default, 30 steps each on the same synthetic data: the loss falls as far."""
    pp = run(load_config(CONFIG_DIR / "pp-tiny.yaml", ["steps=30", "train.log_every=30"]))
    base = run(load_config(None, ["steps=30", "train.log_every=30"]))
    assert pp["final_loss"] < 0.3 * pp["initial_loss"]
    assert abs(pp["final_loss"] - base["final_loss"]) < 0.1 * (base["initial_loss"] - base["final_loss"])


# -- pipeline x MoE: every combination trains or stops with one line ---------------------------

MOE_TINY = [*TINY, "batch.global_size=8", "steps=1", "pipeline.microbatches=2"]
MODELS = {"decoder": ["model.name=decoder", "model.layers=4"],
          "moe-top1": ["model.name=moe", "model.layers=8", "moe.routing=top1"],
          "moe-top2": ["model.name=moe", "model.layers=8", "moe.routing=top2"],
          "moe-dropless": ["model.name=moe", "model.layers=8", "moe.capacity_factor=null"]}
SWEEP = [("decoder", "1f1b"), ("moe-top1", "interleaved"), ("moe-top2", "1f1b"),
         ("moe-dropless", "gpipe"), ("moe-dropless", "1f1b"), ("moe-dropless", "interleaved")]


@pytest.mark.parametrize("model,schedule", SWEEP, ids=[f"{m}-{s}" for m, s in SWEEP])
def test_pipeline_with_moe_trains_or_stops_with_one_line(capsys, model, schedule):
    from meshpar.cli import main
    v = 2 if schedule == "interleaved" else 1
    code = main(["train", *MOE_TINY, *MODELS[model], f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}",
                 "mesh.pipeline=2", "mesh.expert=2", "mesh.tensor=2", "mesh.data=1", "mesh.fsdp=1"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    if code:
        assert code == 2 and out.err.startswith("meshpar: error: ") and out.err.count("\n") == 1, out.err
    assert (model, schedule) != ("moe-dropless", "1f1b") or "cannot run dropless MoE" in out.err
    assert code == 0 or (model, schedule) == ("moe-dropless", "1f1b"), out.err[-2000:]


def test_pipelined_dropless_moe_equals_the_plain_model():
    """GPipe over 2 stages with dropless experts split over `expert` inside each stage: loss and
    gradients equal the unpipelined model on one device (fp32)."""
    extra = [*TINY, "model.name=moe", "model.layers=4", "moe.capacity_factor=null", "pipeline.microbatches=2"]
    tr0 = Trainer(make_cfg(*extra, "strategy=dp", mesh={}), devices=devices(1))
    params = jax.device_get(tr0.init()["params"])
    tokens = np.asarray(jax.random.randint(jax.random.key(7), tr0.batch_shape, 0, 64))
    (loss0, _), grads0 = jax.jit(tr0._grads)(params, tokens)
    tr = Trainer(make_cfg(*extra, mesh={"pipeline": 2, "expert": 2, "tensor": 2}), devices=devices(8))
    (loss, _), grads = jax.jit(tr._grads)(jax.device_put(params, tr.param_shardings),
                                          jax.device_put(tokens, tr.batch_sharding))
    assert abs(float(loss) - float(loss0)) / float(loss0) <= 1e-5
    assert rel(jax.device_get(grads), jax.device_get(grads0)) <= 1e-5


# -- a user's model with its own loss: the stage protocol (meshpar.stages) ----------------------

def _vit(mesh: dict, n: int, *extra, steps: int = 3):
    """examples/vit.py (BatchNorm stem and dropout in `pre`, its own loss) for `steps` steps ->
    (losses, params, non-Param state)."""
    import sys
    from pathlib import Path

    import meshpar
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from examples import vision, vit
    cfg = meshpar.load_config(repo / "examples" / "vit.yaml", [
        "precision=fp32", "train.warmup_steps=1", "batch.global_size=16",
        *[f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")], *extra])
    src = vision.source(cfg)
    tr = Trainer(cfg, devices=devices(n), model=lambda rngs: vit.vit(cfg, rngs), loss=meshpar.stage_loss,
                 batch_spec=src.batch_spec(cfg.batch.global_size, cfg.batch.length))
    data = meshpar.Batches(src, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed,
                           batch_spec=tr.batch_spec)
    state, losses = tr.init(), []
    for _ in range(steps):
        state, m = tr.step(state, next(data))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state["params"]), jax.device_get(state["vars"])


_VIT: dict = {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_user_model_with_its_own_loss_and_a_batchnorm_stem_pipelines_like_one_device(schedule):
    """pipeline=2 x data=2 x tensor=2, 4 microbatches == 1 device accumulating the same 4 microbatches
    (BatchNorm normalises each microbatch either way), after 3 steps: losses, parameters and the
    BatchNorm running statistics (relative <= 1e-5), the dropout RNG stream exactly."""
    if "ref" not in _VIT:
        _VIT["ref"] = _vit({}, 1, "batch.microbatches=4")
    want_l, want_p, want_v = _VIT["ref"]
    got_l, got_p, got_v = _vit({"pipeline": 2, "data": 2, "tensor": 2}, 8, f"pipeline.schedule={schedule}",
                               "pipeline.microbatches=4")
    assert rel(got_l, want_l) <= 1e-5 and rel(got_p, want_p) <= 1e-5, (got_l, want_l)
    stats = lambda v: {k: v["stem"][k] for k in ("mean", "var")}
    assert rel(stats(got_v), stats(want_v)) <= 1e-5
    assert not np.allclose(want_v["stem"]["mean"], 0.0)                          # the statistics trained
    assert jax.tree.all(jax.tree.map(np.array_equal, got_v["drop"], want_v["drop"]))   # the RNG stream


def test_pipelining_refuses_what_the_stage_protocol_cannot_express_in_one_line():
    """A loss that is neither lm nor stages; a model without post; state inside the stacked layers."""
    cfg = make_cfg(*TINY, "model.layers=2", mesh={"pipeline": 2})
    with pytest.raises(ConfigError, match=r"cuts the loss into stages: train.loss=lm .* or train.loss=stages"):
        Trainer(cfg, devices=devices(2), loss=lambda model, tokens: (0.0, {}))
    from meshpar.stages import stage_loss
    with pytest.raises(ConfigError, match=r"model Decoder cannot be pipelined: train.loss=stages needs .* it lacks "
                                          r"\.pre, \.post, \.loss"):
        Trainer(cfg, devices=devices(2), loss=stage_loss)

    import meshpar
    from flax import nnx

    class Counting(nnx.Module):                  # BatchNorm inside the repeated layers: state that would travel
        def __init__(self, rngs):
            self.layers = meshpar.stacked(lambda r: nnx.BatchNorm(4, rngs=r), 2, rngs)

        def pre(self, batch):
            return batch

        def post(self, x):
            return x

        def loss(self, outputs, batch):
            return outputs.mean(), {}
    with pytest.raises(ConfigError, match=r"the stacked layers hold non-Param state \(layers\.(mean|var)"):
        Trainer(cfg, devices=devices(2), model=lambda rngs: Counting(rngs), loss=stage_loss)
