"""Today's MoE routing family (meshpar/nn/moe.py, models/moe.py): any top-k, softmax or sigmoid
scores, renormalised top-k (Mixtral, Qwen3-MoE), shared and fine-grained experts (DeepSeekMoE),
auxiliary-loss-free balancing by a per-expert selection bias (DeepSeek-V3); each style trained on
8 devices (expert parallelism, pipelines) equals one device after 3 steps (fp32, <= 1e-5).

Letters: G groups, S tokens per group, E experts, K experts per token, M model width.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.core.errors import ConfigError
from meshpar.nn import routing
from meshpar.train.data import MarkovLanguage
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, train_steps

route = jax.jit(routing.route, static_argnums=(1, 2), static_argnames=("score", "normalise"))


def _logits(seed=0, g=2, s=16, e=8):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(g, s, e)), jnp.float32)


def test_topk_gates_per_style():
    """Mixtral: softmax over the chosen K logits (= the K softmax probabilities renormalised);
    norm_topk off: the raw probabilities (Qwen2-MoE); sigmoid: the chosen sigmoids, renormalised
    (DeepSeek-V3); K = 3 picks 3 distinct best experts."""
    x = _logits()
    top_vals, top_idx = jax.lax.top_k(x, 3)
    r = route(x, 3, None, score="softmax", normalise=True)
    np.testing.assert_array_equal(r.index, top_idx)
    np.testing.assert_allclose(r.gates, jax.nn.softmax(top_vals, -1), rtol=1e-6)
    raw = route(x, 3, None, score="softmax", normalise=False)
    np.testing.assert_allclose(raw.gates, jnp.take_along_axis(jax.nn.softmax(x, -1), top_idx, -1), rtol=1e-6)
    sig = route(x, 2, None, score="sigmoid", normalise=True)
    chosen = jax.nn.sigmoid(top_vals[..., :2])
    np.testing.assert_allclose(sig.gates, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_bias_picks_experts_but_does_not_weigh_them():
    """A bias [E] changes which experts are chosen (scores + bias), never the gate of a chosen one."""
    x = _logits(1)
    bias = jnp.zeros(8).at[5].set(10.0)
    r = routing.route(x, 2, None, score="sigmoid", normalise=False, bias=bias)
    assert bool(jnp.all(r.index[..., 0] == 5))
    np.testing.assert_allclose(r.gates[..., 0], jax.nn.sigmoid(x[..., 5]), rtol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_balancing_evens_a_skewed_load(score):
    """Tokens prefer a few experts (router columns of growing scale, two sharing a direction): the
    max/min load is > 2; 200 bias updates (rate 0.01) bring it within 1.5, with no auxiliary loss."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 8)) / 8 * (1 + np.arange(8) / 2)
    w[:, :2] += 0.3 * rng.normal(size=(64, 1)) + 0.05
    logits = jnp.asarray(rng.normal(size=(4, 1024, 64)) @ w, jnp.float32)
    load = jax.jit(lambda b: routing.route(logits, 2, None, score=score, bias=b).load)
    before = load(jnp.zeros(8))
    step = jax.jit(lambda b: routing.updated_bias(b, load(b), 0.01))
    b = jnp.zeros(8)
    for _ in range(200):
        b = step(b)
    after = load(b)
    assert float(before.max() / before.min()) > 2.0
    assert float(after.max() / after.min()) <= 1.5, (before, after)


COMMON = ["batch.length=32", "batch.global_size=8", "model.layers=2", "model.name=moe", "moe.every=1"]
STYLES = {
    "deepseek": [
        "moe.num_experts=8",
        "moe.top_k=2",
        "moe.shared_experts=1",
        "moe.expert_mlp=64",
        "moe.score=sigmoid",
        "moe.balance=bias",
        "moe.capacity_factor=null",
    ],
    "mixtral": ["moe.num_experts=8", "moe.top_k=2", "moe.norm_topk=true"],
    "qwen3": ["moe.num_experts=8", "moe.top_k=4", "moe.norm_topk=true", "moe.expert_mlp=32"],
}
PIPE = ["pipeline.microbatches=2"]
CASES = {  # name: (style, mesh, extra config)
    "deepseek: expert=4 x data=2": ("deepseek", {"expert": 4, "data": 2}, []),
    "mixtral: expert=4 x data=2": ("mixtral", {"expert": 4, "data": 2}, []),
    "qwen3: expert=2 x data=2 x tensor=2": ("qwen3", {"expert": 2, "data": 2, "tensor": 2}, []),
    "mixtral, gpipe: pipeline=2 x expert=2 x data=2": ("mixtral", {"pipeline": 2, "expert": 2, "data": 2}, PIPE),
    "qwen3, 1f1b: pipeline=2 x expert=2 x data=2": (
        "qwen3",
        {"pipeline": 2, "expert": 2, "data": 2},
        [*PIPE, "pipeline.schedule=1f1b"],
    ),
    "mixtral, interleaved: pipeline=2 x expert=2 x data=2": (
        "mixtral",
        {"pipeline": 2, "expert": 2, "data": 2},
        [*PIPE, "pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "model.layers=4"],
    ),
}
_REF: dict = {}


def _train(extra, mesh, n):
    cfg = make_cfg(*COMMON, *extra, mesh=mesh)
    tr = Trainer(cfg, devices=devices(n))
    state, losses = train_steps(tr, MarkovLanguage(tr.spec.model_config.vocab, 4, 1), cfg, 3)
    return losses, jax.device_get(state["vars"])


@pytest.mark.parametrize("name", list(CASES))
def test_moe_styles_train_on_8_devices_as_on_one(name):
    style, mesh, extra = CASES[name]
    ref_extra = (*STYLES[style], *[e for e in extra if e.startswith("model.")])
    if ref_extra not in _REF:
        _REF[ref_extra] = _train(ref_extra, {}, 1)
    (want, want_vars), (got, got_vars) = _REF[ref_extra], _train([*STYLES[style], *extra], mesh, 8)
    assert max(abs(a - b) / abs(a) for a, b in zip(want, got)) <= 1e-5, (want, got)
    for a, b in zip(jax.tree.leaves(want_vars), jax.tree.leaves(got_vars)):  # the bias moved alike
        np.testing.assert_allclose(a, b, atol=1e-7)
    if style == "deepseek":  # one bias per MoE layer, moved by +-rate each step: 3 steps -> |b| <= 0.003
        bias = np.asarray(jax.tree.leaves(got_vars)[0])
        assert bias.shape == (2, 8) and 0 < np.abs(bias).max() <= 0.003 + 1e-7


def test_shared_and_fine_grained_experts_have_their_shapes():
    """moe.expert_mlp sets each expert's width; moe.shared_experts=2 adds one always-on SwiGLU of
    width 2 x expert_mlp, counted whole by the FLOPs' active parameters."""
    from meshpar.core.config import top_k
    from meshpar.train.flops import active_params

    cfg = make_cfg(*COMMON, *STYLES["deepseek"], "moe.shared_experts=2", mesh={})
    tr = Trainer(cfg, devices=devices(1))
    ffn = tr.spec.shapes["layers"]["moe"]["ffn"]
    assert ffn["w_gate"].shape[1:] == (8, 64, 64) and ffn["shared"]["w_in"].shape[1:] == (64, 2, 128)
    experts = sum(int(np.prod(ffn[k].shape)) for k in ("w_gate", "w_up", "w_down"))
    emb = tr.spec.shapes["embedding"].shape
    assert active_params(tr.spec, top_k(cfg.moe)) == pytest.approx(
        tr.spec.num_params - emb[0] * emb[1] - experts * (1 - 2 / 8)
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["moe.top_k=9"], "moe.top_k=9 sends every token to 9 experts but moe.num_experts=8"),
        (["moe.score=relu"], "config key 'moe.score' has unknown value 'relu'"),
        (["moe.balance=bias", "mesh.pipeline=2"], "moe.balance=bias with mesh.pipeline > 1"),
    ],
)
def test_bad_moe_keys_are_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(*COMMON, "moe.num_experts=8", *args)


def test_dropless_expert_parallelism_says_its_exchange_is_padded():
    tr = Trainer(make_cfg(*COMMON, *STYLES["deepseek"], mesh={"expert": 4, "data": 2}), devices=devices(8))
    assert any("padded all-to-all" in w and "4 x its routed rows" in w for w in tr.warnings())
    assert not any(
        "padded" in w
        for w in Trainer(
            make_cfg(*COMMON, *STYLES["mixtral"], mesh={"expert": 4, "data": 2}), devices=devices(8)
        ).warnings()
    )
