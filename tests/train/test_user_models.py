"""Users' own Flax NNX models through meshpar's public API (examples/gpt2.py, examples/vision.py).

Properties: every preset's first steps equal the single-device run, with dropout on (its masks do
not depend on the mesh); Flax's own annotations and meshpar's helper give the same shardings;
non-Param state (dropout RNG streams) survives a checkpoint and a restore onto another mesh. (How
they install: tests/test_install.py; the contracts users' code meets: tests/test_user_contract.py.)
"""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import meshpar
from tests.conftest import devices, make_cfg, tiered, train_steps

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from examples import gpt2 as gpt2_example  # noqa: E402
from examples import vision as vision_example  # noqa: E402

MESHES = {
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "zero2": {"data": 8},
    "fsdp": {"fsdp": 8},
    "hsdp": {"data": 2, "fsdp": 4},
    "tp": {"data": 2, "tensor": 4},
    "tp_sp": {"data": 2, "tensor": 4},
    "fsdp_tp": {"data": 2, "fsdp": 2, "tensor": 2},
}
STEPS = 2


def _cfg(example: str, strategy: str, mesh: dict, *extra):
    return meshpar.load_config(
        REPO / "examples" / f"{example}.yaml",
        [
            f"strategy={strategy}",
            "precision=fp32",
            "train.warmup_steps=1",
            *[f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")],
            *extra,
        ],
    )


def _trainer(example: str, cfg, n: int):
    if example == "gpt2":
        return meshpar.Trainer(cfg, devices=devices(n), model=lambda rngs: gpt2_example.gpt2(cfg, rngs)), None
    src = vision_example.source(cfg)
    tr = meshpar.Trainer(
        cfg,
        devices=devices(n),
        model=lambda rngs: vision_example.mixer(cfg, rngs),
        loss=vision_example.classification_loss,
        batch_spec=src.batch_spec(cfg.batch.global_size, cfg.batch.length),
    )
    return tr, src


def _losses(example: str, strategy: str, mesh: dict, n: int, *extra):
    from meshpar.train.loop import make_data_source

    cfg = _cfg(example, strategy, mesh, *extra)
    tr, src = _trainer(example, cfg, n)
    src = src or make_data_source(cfg, tr)
    state, out = train_steps(tr, src, cfg, STEPS)
    return out, tr, state


_REF: dict = {}


def _reference(example: str):
    if example not in _REF:
        _REF[example] = _losses(example, "dp", {}, 1)[0]
    return _REF[example]


@pytest.mark.parametrize(
    "strategy,example",
    tiered(
        [(s, e) for e in ("gpt2", "vision") for s in MESHES],
        {("dp", "gpt2"), ("fsdp_tp", "gpt2"), ("tp_sp", "vision"), ("hsdp", "vision")},
        [f"{s}-{e}" for e in ("gpt2", "vision") for s in MESHES],
    ),
)
def test_examples_equal_the_single_device_run_under_every_preset(strategy, example):
    """gpt2 trains with dropout 0.1: equal losses on 1 and 8 devices mean equal dropout masks."""
    want = _reference(example)
    got, tr, _ = _losses(example, strategy, MESHES[strategy], 8)
    if example == "gpt2":
        assert jax.tree.leaves(tr.spec.var_shapes), "gpt2's dropout RNG state should be carried"
    for g, w in zip(got, want):
        assert abs(g - w) / abs(w) <= 1e-5, (strategy, got, want)
    assert got[1] != got[0]


def test_fp16_loss_scaling_works_for_a_user_loss():
    """The vision example's own loss under fp16 (dynamic loss scaling, 2 accumulation steps): the
    scale is applied and removed, and the loss follows fp32's."""
    fp16, tr, state = _losses("vision", "fsdp_tp", MESHES["fsdp_tp"], 8, "precision=fp16")
    assert float(state["numerics"]["loss_scale"]) == 2.0**15 and int(state["numerics"]["skipped_steps"]) == 0
    for a, b in zip(fp16, _reference("vision")):
        assert abs(a - b) / b <= 2e-2


def test_dropout_is_on_and_changes_the_loss():
    on = _reference("gpt2")
    off = _losses("gpt2", "dp", {}, 1, "model.args.dropout=0.0")[0]
    assert abs(on[0] - off[0]) > 1e-4


# -- annotations: Flax's API and meshpar's helper are the same thing ---------------------------


class FlaxAnnotated(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.normal(0.02)
        self.up = nnx.Linear(
            32,
            64,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
            rngs=rngs,
        )
        self.emb = nnx.Embed(128, 32, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)
        self.norm = nnx.LayerNorm(
            32, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), use_bias=False, rngs=rngs
        )
        self.raw = nnx.Param(jax.numpy.zeros((64, 32)), out_sharding=("mlp", "embed"))


class HelperAnnotated(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Module()
        self.up.kernel = meshpar.param(rngs, (32, 64), ("embed", "mlp"), 0.02)
        self.up.bias = meshpar.param(rngs, (64,), ("mlp",), init="zeros")
        self.emb = nnx.Module()
        self.emb.embedding = meshpar.param(rngs, (128, 32), ("vocab", "embed"), 0.02)
        self.norm = nnx.Module()
        self.norm.scale = meshpar.param(rngs, (32,), ("norm",), init="ones")
        self.raw = meshpar.param(rngs, (64, 32), ("mlp", "embed"), 0.02)


@pytest.mark.parametrize(
    "strategy,mesh", [("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}), ("tp", {"tensor": 8}), ("fsdp", {"fsdp": 8})]
)
def test_flax_annotations_and_meshpar_helper_give_identical_shardings(strategy, mesh):
    from meshpar.core.mesh import make_mesh

    cfg = make_cfg(f"strategy={strategy}", mesh=mesh)
    layout = meshpar.Layout(make_mesh(cfg.mesh, devices(8)), meshpar.get_strategy(strategy))
    a = meshpar.param_shardings(meshpar.model_spec(FlaxAnnotated), layout)
    b = meshpar.param_shardings(meshpar.model_spec(HelperAnnotated), layout)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.leaves(a) == jax.tree.leaves(b)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(a))


def test_unannotated_parameters_are_replicated_and_listed_or_refused():
    class Partly(nnx.Module):
        def __init__(self, rngs):
            self.named = meshpar.param(rngs, (32, 64), ("embed", "mlp"), 0.02)
            self.bare = nnx.Param(jax.numpy.zeros((64, 8)))
            self.custom = nnx.Param(jax.numpy.zeros((64, 8)), out_sharding=("mlp", "patch"))

    from meshpar.core.mesh import make_mesh

    spec = meshpar.model_spec(Partly)
    assert spec.unannotated == ["bare"]
    layout = meshpar.Layout(make_mesh(make_cfg(mesh={"tensor": 8}).mesh, devices(8)), meshpar.get_strategy("tp"))
    rows = {r["name"]: r for r in meshpar.sharding_table(spec, layout)}
    assert rows["bare"]["spec"] == "replicated" and rows["bare"]["note"] == "no annotation: replicated"
    assert rows["custom"]["note"] == "no rule for 'patch'"
    with pytest.raises(meshpar.ShardingError, match=r"have no logical axis names: bare; annotate them"):
        meshpar.model_spec(Partly, require_annotations=True)


# -- non-Param state through a checkpoint --------------------------------------------------------


def test_non_param_state_survives_checkpoint_and_cross_mesh_restore(tmp_path):
    """gpt2's dropout RNG streams (key and counter) are saved on fsdp x 8 and restored onto tp x 4:
    the same values, and the next step (its dropout masks included) gives the same loss."""
    from meshpar.io.checkpoint import Checkpointer
    from meshpar.train.loop import make_data_source

    extra = [f"checkpoint.dir={tmp_path / 'ck'}"]
    cfg = _cfg("gpt2", "fsdp", {"fsdp": 8}, *extra)
    tr, _ = _trainer("gpt2", cfg, 8)
    data = meshpar.Batches(
        make_data_source(cfg, tr), tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed
    )
    state = tr.init()
    for _ in range(2):
        state, _ = tr.step(state, next(data))
    saved_vars = jax.tree.map(np.asarray, jax.device_get(state["vars"]))
    assert saved_vars and any(np.asarray(v).any() for v in jax.tree.leaves(saved_vars))
    ck = Checkpointer(cfg.checkpoint, tr, info=lambda m: None)
    ck.save(2, state, data.state(), wait=True)
    ck.close()
    _, m3 = tr.step(state, next(data))

    cfg2 = _cfg("gpt2", "tp", {"tensor": 4}, *extra)
    tr2, _ = _trainer("gpt2", cfg2, 4)
    found = Checkpointer(cfg2.checkpoint, tr2, info=lambda m: None).restore_latest()
    assert found.step == 2
    for got, want in zip(jax.tree.leaves(jax.device_get(found.state["vars"])), jax.tree.leaves(saved_vars)):
        assert np.array_equal(np.asarray(got), want)
    data2 = meshpar.Batches(
        make_data_source(cfg2, tr2), tr2.batch_sharding, cfg2.batch.global_size, cfg2.batch.length, cfg2.data.seed
    )
    data2.restore(found.data)
    _, m3b = tr2.step(found.state, next(data2))
    assert abs(float(m3b["loss"]) - float(m3["loss"])) / float(m3["loss"]) <= 1e-5
