"""The Hugging Face mixture-of-experts families (Mixtral, Qwen3-MoE) <-> `meshpar.models.moe`.

Attention, norms and embeddings are the Llama table (`meshpar.models.hf_llama.block_tensors`; Mixtral
as Mistral, Qwen3-MoE as Qwen3 with q/k norms). Per MoE layer l (letters: E experts, M embed, H
expert width):

    Mixtral      block_sparse_moe.gate.weight [E, M]              -> layers.moe.ffn.router [l, M, E]
                 block_sparse_moe.experts.e.w1 / w3.weight [H, M] -> layers.moe.ffn.w_gate / w_up [l, e, M, H]
                 block_sparse_moe.experts.e.w2.weight [M, H]      -> layers.moe.ffn.w_down [l, e, H, M]
    Qwen3-MoE    mlp.gate.weight, mlp.experts.e.gate_proj / up_proj / down_proj.weight (the same shapes)

Routing: softmax over the E router logits, top k, and (Mixtral always, Qwen3-MoE by
`norm_topk_prob`) the k weights renormalised: meshpar's `moe.score=softmax` and `moe.norm_topk`.
Both route every token (no capacity): `moe.capacity_factor=null`. Qwen3-MoE's `decoder_sparse_step`
k (an MoE feed-forward in every k-th layer, the others dense of `intermediate_size`) is `moe.every`;
meshpar stacks k - 1 dense blocks then an MoE block, which are HF layers j*k .. j*k + k - 1.

The run's `moe.*` keys are config.json's: `load_config` sets them (`meshpar.core.pretrained`), so the
planner, FLOP counts and checks read them before any model exists; a key the user gives must agree.
"""

from __future__ import annotations

import numpy as np

from meshpar.core.errors import ConfigError
from meshpar.core.pretrained import MOE_ARCHITECTURES, hf_path, moe_settings, read_config
from meshpar.models.hf_llama import hf_config as dense_config
from meshpar.models.hf_tensors import grouped, layered, span, tensors

MOE_FAMILIES = MOE_ARCHITECTURES
# family -> (router tensor, expert prefix, (gate, up, down) names)
NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
}


def moe_keys(init_from: str) -> dict:
    """The `moe.*` settings config.json implies, {key: value} (`meshpar.core.pretrained.moe_settings`)."""
    return {k: v for k, (v, _) in (moe_settings(init_from) or {}).items()}


def check_settings(cfg) -> None:
    """One line if the run's moe.* disagree with config.json's, listing every key to set. A config
    loaded by `load_config` already has them (`meshpar.core.pretrained.resolve`); this catches one
    changed in Python afterwards."""
    from meshpar.core.config import top_k

    want = moe_keys(cfg.model.init_from)
    if not want:
        raise ConfigError(
            f"{hf_path(cfg.model.init_from) / 'config.json'}: not a Mixtral or Qwen3-MoE checkpoint; "
            "model.name=moe reads those"
        )
    got = {k: getattr(cfg.moe, k) for k in want}
    got["top_k"] = top_k(cfg.moe)
    got["norm_topk"] = got["top_k"] > 1 if cfg.moe.norm_topk is None else cfg.moe.norm_topk
    got["expert_mlp"] = cfg.moe.expert_mlp or read_config(cfg.model.init_from)["intermediate_size"]
    if got != want:
        fix = " ".join(
            f"moe.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in want.items()
        )
        wrong = ", ".join(f"moe.{k}={got[k]}" for k in want if got[k] != want[k])
        raise ConfigError(f"{cfg.model.init_from}: config.json's experts disagree with {wrong}; set {fix}")
    if cfg.moe.balance != "aux":
        raise ConfigError(
            "moe.balance=bias with a Mixtral/Qwen3-MoE checkpoint: its router has no selection "
            "bias to read or write; use moe.balance=aux"
        )


def blocks(every: int, moe_layers: int) -> dict:
    """{path prefix: (HF layer indices, with dense MLP)} of a MoEDecoder with `moe_layers` super-blocks."""
    *dense, moe = grouped(every, moe_layers)
    return {
        **{("layers", "dense", str(d)): (ids, True) for d, ids in enumerate(dense)},
        ("layers", "moe"): (moe, False),
    }


def moe_tensors(c, settings, family: str) -> dict:
    """{parameter path: Source} of a `MoEDecoder` (config `c`, `MoESettings`) read as `family`."""
    k, n = settings.every, c.layers // settings.every
    e, m, h = settings.num_experts, c.embed, settings.expert_mlp or c.mlp
    router, prefix, (gate, up, down) = NAMES[family]
    ids = blocks(k, n)[("layers", "moe")][0]
    name = lambda i, w: f"{prefix.format(i)}{w}.weight"  # noqa: E731

    def experts(w, shape):  # HF [out, in] per expert -> [E_s, in_s, out_s]
        def read(get_l, box):
            es, (a, b) = box[0], box[1:]
            return np.stack([get_l(name(i, w), b, a).T for i in span(*es)], 0)

        return layered(
            ids, {name(i, w): shape for i in range(e)}, read, lambda a: {name(i, w): a[i].T for i in range(e)}
        )

    out = tensors(c, blocks(k, n))
    out.update(
        {
            ("layers", "moe", "ffn", "router"): layered(
                ids, {router: (e, m)}, lambda g, b: g(router, b[1], b[0]).T, lambda a: {router: a.T}
            ),
            ("layers", "moe", "ffn", "w_gate"): experts(gate, (h, m)),
            ("layers", "moe", "ffn", "w_up"): experts(up, (h, m)),
            ("layers", "moe", "ffn", "w_down"): experts(down, (m, h)),
        }
    )
    return out


def family_of(c, settings) -> str:
    """The family an MoE decoder exports as: the one read, else Mixtral when it can say the model."""
    if c.family in NAMES:
        return c.family
    return "mixtral" if settings.every == 1 and settings.normalise and not c.qk_norm else "qwen3_moe"


def moe_config(c, settings) -> dict:
    """The config.json of an MoE decoder in its family's keys."""
    if settings.score != "softmax" or settings.shared_experts or settings.balance != "aux":
        raise ConfigError(
            "moe.score=sigmoid, moe.shared_experts and moe.balance=bias have no place in the Mixtral "
            "or Qwen3-MoE formats; export a softmax-routed model without shared experts"
        )
    family = family_of(c, settings)
    arch = next(a for a, f in MOE_FAMILIES.items() if f == family)
    h = settings.expert_mlp or c.mlp
    base = dense_config(c.replace(family="mistral" if family == "mixtral" else "qwen3", qk_norm=family == "qwen3_moe"))
    base.update(
        architectures=[arch],
        model_type=family,
        num_experts_per_tok=settings.top_k,
        router_aux_loss_coef=settings.aux_loss_weight,
        output_router_logits=False,
    )
    if family == "mixtral":
        return {**base, "num_local_experts": settings.num_experts, "intermediate_size": h}
    return {
        **base,
        "num_experts": settings.num_experts,
        "moe_intermediate_size": h,
        "intermediate_size": c.mlp,
        "decoder_sparse_step": settings.every,
        "mlp_only_layers": [],
        "norm_topk_prob": settings.normalise,
    }
