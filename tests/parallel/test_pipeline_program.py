"""What a pipelined step compiles to: activations move between stages by collective-permute and the
layer stack is never gathered; gradients are reduced over `data` once per step; 1F1B applies the
stashed residuals and reruns no stage, and its memory does not grow with M; `meshpar inspect`
reports the pipeline; configs/pp-tiny.yaml learns like the default.
"""

import re

import jax
import numpy as np
import pytest

from meshpar.parallel import pipeline, schedules
from meshpar.plan.inspect import collectives
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, tiered, usual_codegen
from tests.parallel.pipelines import pp_cfg

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
    # the stacked matrices (jax 0.11's XLA gathers the interleaved chunks' [L, E] norm-scale gradients
    # whole to reorder them into the at-rest layout, "involuntary full rematerialization": 512 bytes here)
    layers = [a for a in jax.tree.leaves(tr.spec.shapes["layers"]) if len(a.shape) >= 3]
    smallest_stack = min(int(np.prod(a.shape)) * 4 for a in layers)
    for o in ops:
        if o["kind"] == "all-gather" and "pipeline" in o["axes"]:
            assert o["bytes"] < smallest_stack, f"all-gather of {o['bytes']} bytes over pipeline"
    # stacked layer params stay split over pipeline at rest
    for sh in jax.tree.leaves(tr.param_shardings["layers"]):
        assert sh.spec[0] == "pipeline"
    if schedule == "1f1b":  # a real per-device conditional, permutes outside it
        branches = set()
        for line in compiled.as_text().splitlines():
            found = re.search(r" conditional\(.*branch_computations=\{([^}]*)\}", line)
            if found:
                branches |= {c.strip().lstrip("%") for c in found.group(1).split(",")}
        # only the branches two stages run: idle, the first stage's F, B and F+B, the last's fused F+B
        # (not the middle stage's, nor the last's F or B alone: 5 of the 10, the program 2.3x smaller)
        assert len(branches) == 5
        assert not any(o["computation"] in branches for o in permutes)
        ticks = schedules.one_f_one_b_program(2, 4)[0][0].shape[0]
        # (where the first stage reads the outer parameters whole over `tensor`, jaxlib >= 0.11, XLA
        # gathers them in the tick loop, beside the embedding's backward: `pipeline._GATHER_OVER_TENSOR_ABORTS`)
        whole = pipeline._GATHER_OVER_TENSOR_ABORTS
        tensor = [
            o
            for o in ops
            if o["axes"] == ["tensor"] and o["bytes"] > 1024 and not (whole and o["kind"] == "all-gather")
        ]
        assert tensor and all(o["times"] < ticks for o in tensor)  # counted by branch share, not every tick


@pytest.mark.parametrize("schedule", tiered(["gpipe", "1f1b", "interleaved"], {"1f1b"}))
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
    assert over_data and all(o.get("times", 1) == 1 for o in over_data), over_data  # (scalars aside)
    per_device = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(tr.spec.shapes)) / 2  # split over P or t
    assert sum(o["bytes"] for o in over_data) <= 1.05 * per_device


def test_one_f_one_b_backward_applies_the_stashed_residuals():
    """1F1B keeps each forward's residuals for its backward and never reruns a stage: under remat
    `none`, a middle stage's forward branch holds the layer's 6 forward matmuls, its backward branch
    only the 12 transposed ones (dx and dW of each), the branch running both 6 + 12. A backward that
    reran the stage would hold the forward matmuls again."""
    p, m = 4, 8
    tr = Trainer(pp_cfg("1f1b", p, m, 1, 4, None, "model.remat=none"), devices=devices(p))
    params = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tr.spec.shapes, tr.param_shardings
    )
    tokens = jax.ShapeDtypeStruct(tr.batch_shape, np.int32, sharding=tr.batch_sharding)
    hlo = jax.jit(tr._grads).lower(params, tokens).compile().as_text()
    found = {}
    for ops in ("F", "B", "FB"):
        dots = [ln for ln in hlo.splitlines() if " dot(" in ln and f"/middle_{ops}/" in ln]
        forward = sum("transpose(" not in ln for ln in dots)
        found[ops] = (forward, len(dots) - forward)
    assert found == {"F": (6, 0), "B": (0, 12), "FB": (6, 12)}  # q|k|v, scores, PV, wo, w_gate|up, w_down


def test_inspect_reports_the_pipeline():
    """`meshpar inspect` JSON carries the tick table, its bubble and peak temporary memory."""
    from meshpar.plan.inspect import report

    cfg = pp_cfg("interleaved", 2, 4, 2, 4, {"pipeline": 2, "data": 2, "tensor": 2})
    rep = report(cfg)["pipeline"]
    assert rep["bubble"] == pytest.approx((2 - 1) / (2 * 4 + 2 - 1))
    assert rep["ticks"] == 2 * (2 * 4 + 2 - 1) and len(rep["lines"]) == 2
    assert rep["lines"][0].startswith("stage 0 | F0.0 F1.0 F0.1 F1.1 F2.0 ")
    assert rep["peak_temp_bytes"] > 0


# -- memory: 1F1B stashes at most 2P - 1 microbatches, GPipe M -------------------------------------


@pytest.mark.slow
def test_one_f_one_b_memory_does_not_grow_with_microbatches():
    """Pipelined loss+grads of a fixed microbatch (b=4, T=64, E=64, full remat), M = 4P = 8 and 16:
    GPipe stashes a stage input per microbatch, 1F1B the residuals (here the layer inputs) of at most
    2P - 1 microbatches whatever M, so from M = 8P it holds less."""

    def temp(schedule, m):
        cfg = make_cfg(
            "model.embed=64",
            "model.mlp=128",
            "model.heads=4",
            "model.kv_heads=4",
            "model.head_dim=16",
            "model.vocab=64",
            "model.layers=4",
            "batch.length=64",
            f"batch.global_size={4 * m}",
            f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={m}",
            mesh={"pipeline": 2},
        )
        tr = Trainer(cfg, devices=devices(2))
        params = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tr.spec.shapes, tr.param_shardings
        )
        tokens = jax.ShapeDtypeStruct(tr.batch_shape, np.int32, sharding=tr.batch_sharding)
        return jax.jit(tr._grads).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    g8, g16, f8, f16 = temp("gpipe", 8), temp("gpipe", 16), temp("1f1b", 8), temp("1f1b", 16)
    stage_input = 4 * 64 * 64 * 4  # one [b, T, E] fp32 activation
    assert g16 - g8 >= 8 * stage_input  # GPipe stashes every extra microbatch
    assert f16 - f8 < 0.1 * (g16 - g8)  # 1F1B at most 2P - 1, whatever M
    assert f16 < g16


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_pp_tiny_learns_like_the_default(tmp_path):
    from meshpar.core.config import CONFIG_DIR, load_config
    from meshpar.train.loop import run

    """configs/pp-tiny.yaml (1F1B over 2 stages x data 2 x tensor 2) against the non-pipelined
    default, 30 steps each on the same synthetic data: the loss falls as far."""
    with usual_codegen():  # 2 x 30 steps: XLA:CPU's usual code runs them faster than the suite's
        pp = run(load_config(CONFIG_DIR / "pp-tiny.yaml", ["steps=30", "train.log_every=30"]))
        base = run(load_config(None, ["steps=30", "train.log_every=30"]))
    assert pp["final_loss"] < 0.3 * pp["initial_loss"]
    assert abs(pp["final_loss"] - base["final_loss"]) < 0.1 * (base["initial_loss"] - base["final_loss"])
