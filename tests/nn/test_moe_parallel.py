"""Expert parallelism on 8 fake CPU devices: exactness against one device, the collectives XLA emits
(all-to-all over `expert` for dispatch and combine, never an all-gather of expert weights), training.

One single-device reference per routing (module-scoped), the same parameters and tokens everywhere.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.core.config import CONFIG_DIR, load_config
from meshpar.plan.inspect import collectives, split_computations
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel, tiered, usual_codegen

BASE = ["model.name=moe", "model.layers=4", "moe.every=2", "moe.num_experts=4"]  # two MoE layers
ROUTINGS = {
    "top2": ["moe.routing=top2"],
    "top1": ["moe.routing=top1"],
    "dropless": ["moe.capacity_factor=null"],
    "top2-random": ["moe.routing=top2", "moe.second_expert_policy=random"],
}  # GShard's random 2nd expert
MESHES = {
    "expert4-data2": ("dp", dict(expert=4, data=2)),
    "expert2-data2-tensor2": ("tp", dict(expert=2, data=2, tensor=2)),
    "expert2-data2-fsdp2": ("fsdp", dict(expert=2, data=2, fsdp=2)),
}
CASES = [(r, m) for r in ("top2", "top1", "dropless") for m in ("expert4-data2", "expert2-data2-tensor2")] + [
    ("top2-random", "expert2-data2-fsdp2")
]


def _grads(cfg, devs, params, tokens):
    """Loss, aux and gradients of one batch, and the compiled HLO (forward + backward)."""
    tr = Trainer(cfg, devices=devs)
    p = jax.device_put(params, tr.param_shardings)
    t = jax.device_put(tokens, tr.batch_sharding)
    compiled = jax.jit(tr._grads, in_shardings=(tr.param_shardings, tr.batch_sharding)).lower(p, t).compile()
    (loss, aux), grads = compiled(p, t)
    return jax.device_get((loss, aux, grads)), compiled.as_text(), tr.describe()["mesh"]


@pytest.fixture(scope="module")
def setup():
    devices(8)
    cfg = make_cfg(*BASE, mesh={})
    tr = Trainer(cfg, devices=jax.devices()[:1])
    params = jax.device_get(tr.init()["params"])
    tokens = np.asarray(jax.random.randint(jax.random.key(7), tr.batch_shape, 0, 128, jnp.int32))
    return params, tokens, {}


def _reference(setup, routing):
    params, tokens, refs = setup
    if routing not in refs:
        cfg = make_cfg(*BASE, *ROUTINGS[routing], "strategy=dp", mesh={})
        refs[routing] = _grads(cfg, jax.devices()[:1], params, tokens)[0]
    return refs[routing]


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize(
    "routing,mesh_name",
    tiered(CASES, {("top2", "expert4-data2"), ("dropless", "expert2-data2-tensor2")}, [f"{r}-{m}" for r, m in CASES]),
)
def test_expert_parallel_equals_single_device_and_uses_all_to_all(setup, routing, mesh_name):
    params, tokens, _ = setup
    strategy, mesh = MESHES[mesh_name]
    ref_loss, ref_aux, ref_grads = _reference(setup, routing)
    cfg = make_cfg(*BASE, *ROUTINGS[routing], f"strategy={strategy}", mesh=mesh)
    (loss, aux, grads), hlo, shape = _grads(cfg, jax.devices()[:8], params, tokens)

    # exactness (fp32): loss, every aux metric and the gradients, norm-wise
    assert rel(loss, ref_loss) <= 1e-5
    assert rel(grads, ref_grads) <= 1e-5
    expert_grads = [
        g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "'moe'" in str(path) and "w_" in str(path)
    ]
    assert expert_grads and np.linalg.norm(_flat(expert_grads)) > 0
    for k in ("aux_loss", "z_loss", "drop_fraction", "load_min", "load_max"):
        assert np.asarray(aux[k]).shape == (2,)
        np.testing.assert_allclose(aux[k], ref_aux[k], rtol=1e-5, atol=1e-7)
    if routing == "dropless":
        assert np.all(np.asarray(aux["drop_fraction"]) == 0)

    # collectives: dispatch and combine are all-to-alls over `expert`, forward and backward
    ops = collectives(hlo, shape)
    _, entry = split_computations(hlo)
    a2a = [o for o in ops if o["kind"] == "all-to-all" and o["computation"] != entry]  # inside the layers
    assert a2a and all(o["axes"] == ["expert"] for o in a2a), a2a
    lines = [ln for ln in hlo.splitlines() if " all-to-all(" in ln and "/while/" in ln]
    fwd = [ln for ln in lines if "transpose(" not in ln]
    bwd = [ln for ln in lines if "transpose(" in ln]
    assert len(fwd) >= 2 and len(bwd) >= 2, (len(fwd), len(bwd))
    gathers = [o for o in ops if o["kind"] == "all-gather"]
    if strategy == "fsdp":
        # ZeRO-3 gathers weights for compute, the dense ones over data x fsdp x expert (the batch axes);
        # inside the layers no expert weight is gathered: every gather is smaller than one layer's
        per_layer = min(
            x.nbytes // x.shape[0]
            for path, x in jax.tree_util.tree_leaves_with_path(params)
            if "'moe'" in str(path) and "w_" in str(path)
        )
        inside = [o for o in gathers if o["computation"] != entry]
        assert any("expert" in o["axes"] for o in inside), gathers
        assert all(o["bytes"] < per_layer for o in inside), (per_layer, gathers)
    else:
        assert sum(o["bytes"] * o["times"] for o in gathers) == 0, gathers


def test_the_packed_ragged_layout_equals_single_device(setup, monkeypatch):
    """GPU/TPU's dropless exchange (rows packed source after source, `ragged_all_to_all`'s offsets),
    run here over JAX's documented semantics (XLA:CPU has no ragged all-to-all): equal to one device."""
    from meshpar.nn import dropless

    monkeypatch.setattr(dropless, "EXCHANGE", "ragged")
    monkeypatch.setattr(dropless, "PACKED_WIRE", "padded")
    calls = []
    monkeypatch.setattr(
        dropless, "exchange", lambda *a, **k: calls.append(a[7]) or dropless.exchange_lib.exchange(*a, **k)
    )
    params, tokens, _ = setup
    ref_loss, _, ref_grads = _reference(setup, "dropless")
    cfg = make_cfg(*BASE, *ROUTINGS["dropless"], "strategy=dp", mesh=dict(expert=4, data=2))
    (loss, _, grads), hlo, _ = _grads(cfg, jax.devices()[:8], params, tokens)
    assert rel(loss, ref_loss) <= 1e-5 and rel(grads, ref_grads) <= 1e-5
    assert calls and set(calls) == {"padded"}  # the packed layout's exchanges (dispatch, return) ran


def test_random_routing_under_context_parallelism_equals_single_device(setup):
    """GShard's random 2nd expert with sequences split over `context` (rows stored in the balanced
    order): each token draws what it draws on one device (the key hashes tokens with their sequence
    positions, the draws are made in sequence order), so loss, aux metrics and gradients match."""
    params, tokens, _ = setup
    ref_loss, ref_aux, ref_grads = _reference(setup, "top2-random")
    cfg = make_cfg(*BASE, *ROUTINGS["top2-random"], "strategy=dp", mesh=dict(context=2, expert=2, data=2))
    loss, aux, grads = _grads(cfg, jax.devices()[:8], params, tokens)[0]
    assert rel(loss, ref_loss) <= 1e-5 and rel(grads, ref_grads) <= 1e-5
    for k in ("drop_fraction", "load_min", "load_max"):
        np.testing.assert_allclose(aux[k], ref_aux[k], rtol=1e-5, atol=1e-7)


def test_moe_tiny_train_step_hlo():
    """The shipped config's compiled train step (bf16, dp preset, expert=4 x data=2)."""
    devices(8)
    cfg = load_config(CONFIG_DIR / "moe-tiny.yaml", ["steps=2"])
    tr = Trainer(cfg, devices=jax.devices()[:8])
    hlo = tr.compile().as_text()
    ops = collectives(hlo, tr.describe()["mesh"])
    a2a = [o for o in ops if o["kind"] == "all-to-all"]
    n_moe = cfg.model.layers // cfg.moe.every
    assert sum(o["times"] for o in a2a) >= 4 * n_moe  # dispatch + combine, forward + backward
    assert all(o["axes"] == ["expert"] for o in a2a)
    assert sum(o["bytes"] for o in ops if o["kind"] == "all-gather") == 0
    # expert weights stay split over `expert`: each device holds E / 4 experts
    rows = {
        ".".join(map(str, p)): s
        for p, s in jax.tree_util.tree_leaves_with_path(jax.tree.map(lambda s: s.spec, tr.param_shardings))
    }
    w = [s for name, s in rows.items() if "moe" in name and "w_gate" in name]
    assert w and all(s[1] == "expert" for s in w)


@pytest.mark.slow
def test_moe_tiny_learns_and_logs_moe_metrics(tmp_path):
    devices(8)
    from meshpar.cli import main

    out = tmp_path / "metrics.jsonl"
    with usual_codegen():  # 40 steps: XLA:CPU's usual code runs them faster than the suite's
        code = main(
            [
                "train",
                "--config",
                str(CONFIG_DIR / "moe-tiny.yaml"),
                "--metrics-out",
                str(out),
                "steps=40",
                "train.log_every=10",
            ]
        )
    assert code == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    end = recs[-1]
    assert end["event"] == "end" and end["gap_closed"] > 0.9, end  # towards the entropy floor
    for r in steps:
        for k in ("aux_loss", "z_loss", "drop_fraction", "load_min", "load_max"):
            assert len(r[k]) == 2  # one value per MoE layer
        assert all(0 <= d < 0.5 for d in r["drop_fraction"])
        assert all(lo <= 0.25 <= hi for lo, hi in zip(r["load_min"], r["load_max"]))
        assert r["total_loss"] > r["loss"]  # aux + z losses are added


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
def test_dropless_buffers_hold_the_worst_case_every_token_to_one_shard(exchange, monkeypatch):
    """The receive buffer is sized for the worst case a router can make, ep sources x n tokens x
    min(K, E_l) rows (a token's K experts are distinct): every token of every shard routed to experts
    0 and 1, whose shard (E_l = 1 of 4 experts here, K = 2) then receives ep x n rows, a full buffer.
    The step equals one device's, on the dense exchange and on the packed ragged one."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshpar.core.config import MeshConfig
    from meshpar.core.layout import Layout, use_layout
    from meshpar.core.mesh import make_mesh
    from meshpar.core.rules import PRESETS
    from meshpar.nn import moe
    from meshpar.nn.routing import Routing

    if exchange == "ragged":
        from meshpar.nn import dropless

        monkeypatch.setattr(dropless, "EXCHANGE", "ragged")
        monkeypatch.setattr(dropless, "PACKED_WIRE", "padded")
    g, s, m, h, e, k = 8, 4, 8, 16, 4, 2
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (g, s, m))
    w_gate, w_up = (jax.random.normal(kk, (e, m, h)) / 3 for kk in keys[1:3])
    w_down = jax.random.normal(keys[3], (e, h, m)) / 4
    index = jnp.broadcast_to(jnp.array([1, 0], jnp.int32), (g, s, k))  # experts 1 and 0, for every token
    gates = jnp.broadcast_to(jnp.array([0.6, 0.4]), (g, s, k))
    ones = jnp.ones((g, s, k), bool)
    zero = jnp.zeros(())
    r = Routing(index, gates, ones, ones, jnp.zeros((g, s, k), jnp.int32), None, None, zero, zero, zero, zero)
    want = moe.dropless(x, r, w_gate, w_up, w_down)  # one device
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=1, expert=4), jax.devices()[:8])
    layout = Layout(mesh, PRESETS["dp"])

    @jax.jit
    def sharded(x, r, w_gate, w_up, w_down):
        with use_layout(layout):
            return moe.dropless(x, r, w_gate, w_up, w_down)

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh:
        got = sharded(
            put(x, P(("data", "expert"))), r, put(w_gate, P("expert")), put(w_up, P("expert")), put(w_down, P("expert"))
        )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
