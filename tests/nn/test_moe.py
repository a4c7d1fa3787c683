"""MoE routing semantics on hand-built logits (GShard Alg. 1, Switch), the layer, rules and errors.

Letters: G groups, S tokens per group, E experts, C capacity, M model width, H expert hidden width.
Everything here runs eagerly on one device in a few seconds; the parallel runs are in test_moe_parallel.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.core.errors import ConfigError, ShardingError
from meshpar.core.rules import PRESETS, resolve
from meshpar.nn import moe, routing
from tests.conftest import make_cfg

LN = math.log
# jitted once per shape: eager mode would compile every small op of the router separately
route = jax.jit(routing.route, static_argnums=(1, 2, 3))
moe_ffn = jax.jit(moe.moe_ffn, static_argnums=(5,))


def _logits(rows):
    """[[logit per expert] per token] -> [1, S, E] fp32 (one group)."""
    return jnp.asarray(rows, jnp.float32)[None]


# ------------------------------------------------------------------------------------------------
# capacity and dropping


def test_capacity_formula():
    assert routing.capacity(8, 4, 2, 1.0) == 4  # ceil(2 * 8 * 1.0 / 4)
    assert routing.capacity(8, 4, 2, 1.25) == 5  # ceil(5.0)
    assert routing.capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
    with pytest.raises(ConfigError, match="capacity_factor"):
        routing.capacity(8, 4, 1, 0.0)


def test_top1_capacity_drops_later_tokens_in_order():
    # five tokens want expert 0, one wants expert 1; C = ceil(1 * 6 * 1.0 / 2) = 3
    rows = [[2.0, 0.0]] * 5 + [[0.0, 1.0]]
    r = route(_logits(rows), top_k=1, capacity_factor=1.0)
    assert r.combine.shape == (1, 6, 2, 3)
    np.testing.assert_array_equal(r.kept[0, :, 0], [True, True, True, False, False, True])
    np.testing.assert_array_equal(r.position[0, [0, 1, 2, 5], 0], [0, 1, 2, 0])
    # every kept token occupies exactly one (expert, slot); no slot holds two tokens
    d = np.asarray(r.dispatch[0])
    np.testing.assert_array_equal(d.sum(axis=(1, 2)), [1, 1, 1, 0, 0, 1])
    assert d.sum(axis=0).max() == 1
    # Switch: the combine weight is the softmax probability of the chosen expert (not renormalised)
    p0 = math.exp(2.0) / (math.exp(2.0) + 1.0)
    np.testing.assert_allclose(
        np.asarray(r.combine[0]).sum(axis=(1, 2)), [p0] * 3 + [0, 0] + [1 / (1 + math.exp(-1))], rtol=1e-6
    )
    assert float(r.drop_fraction) == pytest.approx(2 / 6)
    np.testing.assert_allclose(r.load, [5 / 6, 1 / 6], rtol=1e-6)


def test_top2_renormalised_gates_and_second_choices_queue_after_first():
    # probabilities (0.5, 0.3, 0.2): g1 = 0.5 / 0.8, g2 = 0.3 / 0.8
    r = route(_logits([[LN(0.5), LN(0.3), LN(0.2)]]), top_k=2, capacity_factor=2.0)
    np.testing.assert_array_equal(r.index[0, 0], [0, 1])
    np.testing.assert_allclose(r.gates[0, 0], [0.625, 0.375], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.combine[0, 0]).sum(-1), [0.625, 0.375, 0.0], rtol=1e-6)

    # GShard: a group's first choices take the slots before any second choice.
    # tokens' (1st, 2nd) experts: t0 (0, 1), t1 (1, 0), t2 (0, 1), t3 (0, 1)
    a, b = 1.0, 0.0
    rows = [[a, b], [b, a], [a, b], [a, b]]
    r = route(_logits(rows), top_k=2, capacity_factor=1.0)  # C = ceil(2 * 4 / 2) = 4: nothing drops
    assert bool(r.kept.all()) and float(r.drop_fraction) == 0.0
    np.testing.assert_array_equal(r.position[0, :, 0], [0, 0, 1, 2])  # first choices: ranks within each expert
    np.testing.assert_array_equal(r.position[0, :, 1], [1, 3, 2, 3])  # second choices: after all first choices
    r = route(_logits(rows), top_k=2, capacity_factor=0.75)  # C = 3: slot 3 is dropped
    np.testing.assert_array_equal(r.kept[0], [[True, True], [True, False], [True, True], [True, False]])
    assert float(r.drop_fraction) == pytest.approx(2 / 8)
    # a kept token's combine weights are its renormalised gates; a dropped 2nd choice loses its share
    c = np.asarray(r.combine[0]).sum(axis=(1, 2))
    g = np.asarray(r.gates[0])
    np.testing.assert_allclose(c, [1.0, g[1, 0], 1.0, g[3, 0]], rtol=1e-6)


def test_random_routing_keeps_second_expert_with_probability_2g2():
    s = 4000
    # g2 = 0.5 after renormalisation: 2 * g2 = 1 > U(0, 1) always
    r = route(_logits([[0.0, 0.0, -30.0]] * s), 2, None, "random", jax.random.key(0))
    assert bool(r.routed.all())
    # g2 = 0.25: kept with probability 0.5
    r = route(_logits([[LN(3.0), 0.0, -30.0]] * s), 2, None, "random", jax.random.key(1))
    frac = float(r.routed[..., 1].mean())
    assert abs(frac - 0.5) < 0.05
    assert bool(r.routed[..., 0].all())
    np.testing.assert_allclose(np.asarray(r.gates[..., 1])[~np.asarray(r.routed[..., 1])], 0.0)
    # load counts routed assignments only: expert 0 gets all first choices
    assert float(r.load[0]) == pytest.approx(1 / (1 + frac), rel=1e-5)


# ------------------------------------------------------------------------------------------------
# auxiliary losses


@pytest.mark.parametrize("e,k", [(2, 1), (4, 2), (8, 1)])
def test_aux_loss_is_the_weight_under_uniform_routing(e, k):
    logits = jnp.zeros((3, 16, e))  # uniform gates; argmax ties all pick expert 0
    r = route(logits, k, 1.0)
    assert float(r.aux_loss) == pytest.approx(1.0, rel=1e-6)
    settings = moe.MoESettings(e, k, 1.0, aux_loss_weight=0.01, z_loss_weight=0.0)
    assert settings.aux_loss_weight * float(r.aux_loss) == pytest.approx(0.01, rel=1e-6)
    # a collapsed router (everything to expert 0, gate ~1) costs E times as much
    collapsed = jnp.zeros((3, 16, e)).at[..., 0].set(30.0)
    assert float(route(collapsed, k, 1.0).aux_loss) == pytest.approx(e, rel=1e-4)


def test_z_loss_value():
    # logsumexp([0, ln 3]) = ln 4; logsumexp([1, 1]) = 1 + ln 2
    r = route(_logits([[0.0, LN(3.0)], [1.0, 1.0]]), 1, 1.0)
    assert float(r.z_loss) == pytest.approx((LN(4) ** 2 + (1 + LN(2)) ** 2) / 2, rel=1e-6)


# ------------------------------------------------------------------------------------------------
# the layer


def _experts(e, m, h, key):
    k1, k2, k3 = jax.random.split(key, 3)
    return (
        jax.random.normal(k1, (e, m, h)) / m**0.5,
        jax.random.normal(k2, (e, m, h)) / m**0.5,
        jax.random.normal(k3, (e, h, m)) / h**0.5,
    )


def test_dropped_tokens_return_their_input_unchanged():
    e, m, h, s = 2, 4, 8, 6
    router = jnp.zeros((m, e)).at[0, 0].set(5.0).at[1, 1].set(5.0)  # logits = 5 * x[:, :2]
    noise = jax.random.normal(jax.random.key(0), (1, s, m)).at[..., :2].set(0.0)
    want = jnp.array([0, 0, 0, 0, 0, 1])
    x = noise + 0.9 * jax.nn.one_hot(want, m)[None]  # five tokens want expert 0
    wg, wu, wd = _experts(e, m, h, jax.random.key(1))
    settings = moe.MoESettings(e, 1, 1.0, group_size=s)  # C = 3
    y, aux = moe_ffn(x, router, wg, wu, wd, settings)
    out = x + y  # the block's residual connection
    dropped = np.array([False, False, False, True, True, False])
    np.testing.assert_array_equal(np.asarray(out[0, dropped]), np.asarray(x[0, dropped]))
    assert float(aux["drop_fraction"]) == pytest.approx(2 / 6)
    # kept tokens: gate * SwiGLU expert of their expert
    r = route(jnp.einsum("gsm,me->gse", x, router), 1, 1.0)
    for t in np.flatnonzero(~dropped):
        ex = int(want[t])
        ref = (jax.nn.silu(x[0, t] @ wg[ex]) * (x[0, t] @ wu[ex])) @ wd[ex]
        np.testing.assert_allclose(y[0, t], r.gates[0, t, 0] * ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,policy", [(1, "all"), (2, "all"), (2, "random")])
def test_dropless_equals_capacity_mode_when_nothing_drops(k, policy):
    e, m, h, b, t = 4, 8, 16, 3, 10
    x = jax.random.normal(jax.random.key(2), (b, t, m))
    router = jax.random.normal(jax.random.key(3), (m, e))
    w = _experts(e, m, h, jax.random.key(4))
    full = moe.MoESettings(e, k, e / k, second_expert_policy=policy)  # C = S: no expert can overflow
    y_cap, aux_cap = moe_ffn(x, router, *w, full)
    y_dl, aux_dl = moe_ffn(x, router, *w, moe.MoESettings(e, k, None, second_expert_policy=policy))
    assert float(aux_cap["drop_fraction"]) == 0.0 and float(aux_dl["drop_fraction"]) == 0.0
    np.testing.assert_allclose(y_dl, y_cap, rtol=1e-5, atol=1e-6)
    # and some tokens do drop at a tight capacity, changing the output
    y_tight, aux_tight = moe_ffn(x, router, *w, moe.MoESettings(e, k, 0.5))
    assert float(aux_tight["drop_fraction"]) > 0.0
    assert not np.allclose(y_tight, y_cap)


def test_model_reports_aux_per_moe_layer():
    from flax import nnx

    from meshpar import models

    cfg = make_cfg("model.name=moe", "model.layers=4", "moe.every=2", "batch.length=8")

    @jax.jit
    def run(tokens):
        return models.build(cfg, nnx.Rngs(params=jax.random.key(0)))(tokens)

    logits, aux = run(jnp.zeros((2, 8), jnp.int32))
    assert logits.shape == (2, 8, 128)
    assert set(aux) == {"loss", "aux_loss", "z_loss", "drop_fraction", "load_min", "load_max"}
    for v in aux.values():
        assert v.shape == (2,)  # 4 layers, MoE every 2nd: two MoE layers
    np.testing.assert_allclose(aux["loss"], 0.01 * aux["aux_loss"] + 0.001 * aux["z_loss"], rtol=1e-6)
    assert bool(jnp.all(aux["load_min"] <= 0.25)) and bool(jnp.all(aux["load_max"] >= 0.25))


# ------------------------------------------------------------------------------------------------
# rules: the `expert` mesh axis can only ever split E (no all-gather fallback)

MESHES = [dict(expert=4, data=2), dict(expert=2, data=2, tensor=2), dict(expert=2, data=2, fsdp=2), dict(expert=8)]


def _axes(part):
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_shipped_rules_put_expert_axis_on_E_only_and_reshard_G_to_E_by_expert_alone(preset):
    strategy = PRESETS[preset]
    for mesh in MESHES:
        shape = {a: mesh.get(a, 1) for a in ("pipeline", "data", "fsdp", "expert", "tensor")}

        def parts(logical, rules=None, shape=shape):
            rules = strategy.param_rules() if rules is None else rules
            return [_axes(p) for p in list(resolve(logical, rules, shape)) + [None] * len(logical)]

        for rules in (strategy.param_rules(), strategy.opt_rules()):  # parameters and optimizer state
            for logical in (("layers",) + routing.W_IN, ("layers",) + routing.W_OUT):
                assert [i for i, p in enumerate(parts(logical, rules)) if "expert" in p] == [1], (preset, mesh)
        for logical in (routing.EXPERT_IN, routing.EXPERT_HIDDEN):
            assert [i for i, p in enumerate(parts(logical)) if "expert" in p] == [0], (preset, mesh)
        # tokens [E, G, C, M] split on G (data.., expert) -> on E (expert) and G (data..): only `expert` moves
        g_tokens, g_experts = set(parts(routing.GROUPED)[1]), set(parts(routing.EXPERT_IN)[1])
        assert g_tokens - g_experts == {"expert"} and g_experts <= g_tokens, (preset, mesh)


# ------------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_key_and_a_fix():
    with pytest.raises(ConfigError, match=r"moe.num_experts=6 .*mesh.expert=4"):
        make_cfg("model.name=moe", "moe.num_experts=6", mesh=dict(expert=4, data=2))
    with pytest.raises(ConfigError, match="moe.capacity_factor"):
        make_cfg("model.name=moe", "moe.capacity_factor=0")
    with pytest.raises(ConfigError, match="moe.capacity_factor"):
        make_cfg("model.name=moe", "moe.capacity_factor=-1.5")
    with pytest.raises(ConfigError, match=r"top2.*moe.num_experts=1"):
        make_cfg("model.name=moe", "moe.routing=top2", "moe.num_experts=1")
    with pytest.raises(ConfigError, match="second_expert_policy"):
        make_cfg("model.name=moe", "moe.second_expert_policy=sometimes")
    make_cfg("model.name=moe", "moe.routing=top1", "moe.num_experts=1")  # fine


def test_errors_found_when_building():
    from meshpar.train.step import Trainer

    # the `expert` axis filled from the devices: the resolver names the parameter, the axis and the fix
    cfg = make_cfg("model.name=moe", "moe.num_experts=6", mesh=dict(expert=-1, data=2))
    with pytest.raises(ShardingError, match=r"'expert', size 6.*expert=4"):
        Trainer(cfg)
    cfg = make_cfg("model.name=moe", "model.layers=3", "moe.every=2", mesh={})
    with pytest.raises(ConfigError, match=r"model.layers=3 .*moe.every=2"):
        Trainer(cfg, devices=jax.devices()[:1])


def test_inspect_reads_replica_groups_on_a_permuted_device_list():
    """XLA prints the dispatch all-to-all of the tp mesh as mesh[...], device_ids=([..]T(..)) {axis}."""
    from meshpar.core.hlo import device_groups
    from meshpar.plan.inspect import _axes_of_groups

    line = (
        "%all-to-all.42 = (f32[1,2]) all-to-all(%a, %b), channel_id=4, replica_groups=mesh['axis_0'=2,"
        "'axis_1'=2,'axis_2'=1,'axis_3'=1,'axis_4'=1,'axis_5'=2], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}"
    )
    groups = device_groups(line)
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _axes_of_groups(groups, {"pipeline": 1, "data": 2, "fsdp": 1, "expert": 2, "tensor": 2}) == ["expert"]
