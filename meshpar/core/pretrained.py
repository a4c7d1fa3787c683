"""What a Hugging Face directory (`model.init_from=hf:DIR`) says about the run config before any
model exists.

Its `config.json` is read here (one line naming the file when it cannot be). For a mixture of
experts (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`) the config is completed when it is loaded:
`model.name=moe` and the `moe.*` keys the checkpoint implies, so the planner, FLOP counts and checks
see the experts it has (the dense dimensions are the model's to read: `meshpar.models.hf_llama`). A
key the user gave must agree with config.json: one line naming the key and both values.

    config.json (Mixtral)       moe.*              config.json (Qwen3-MoE)
    num_local_experts           num_experts        num_experts (transformers 5: num_local_experts)
    num_experts_per_tok         top_k              num_experts_per_tok
    intermediate_size           expert_mlp         moe_intermediate_size
    (every layer: 1)            every              decoder_sparse_step
    (always: true)              norm_topk          norm_topk_prob
    softmax, dropless (capacity_factor null), no shared experts: both
"""

from __future__ import annotations

import json
from pathlib import Path

from meshpar.core.errors import ConfigError

MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}


def hf_path(spec: str) -> Path:
    """`hf:DIR` (the `model.init_from` form) or DIR -> Path."""
    return Path(spec[3:] if spec.startswith("hf:") else spec).expanduser()


def read_json(path: Path, what: str = "") -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file{what}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return data


def read_config(spec: str) -> dict:
    """DIR/config.json of an `hf:DIR` checkpoint."""
    return read_json(hf_path(spec) / "config.json", " (model.init_from needs a Hugging Face model directory)")


def moe_settings(init_from: str) -> dict | None:
    """{moe key: (value, what in config.json says it)} of a Mixtral / Qwen3-MoE checkpoint; None for
    any other architecture."""
    hf = read_config(init_from)
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in MOE_ARCHITECTURES), None)
    if arch is None:
        return None
    where = hf_path(init_from) / "config.json"

    def need(key, default=None):  # a positive integer of config.json, with its key
        v = hf.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{where}: key '{key}' must be a positive integer, got {v!r}")
        return v, key

    fixed = lambda v: (v, arch)  # noqa: E731 - what the family always does
    common = {"score": fixed("softmax"), "capacity_factor": fixed(None), "shared_experts": fixed(0)}
    if MOE_ARCHITECTURES[arch] == "mixtral":
        return {
            "num_experts": need("num_local_experts", 8),
            "top_k": need("num_experts_per_tok", 2),
            "expert_mlp": need("intermediate_size"),
            "every": fixed(1),
            "norm_topk": fixed(True),
            **common,
        }
    if hf.get("mlp_only_layers"):
        raise ConfigError(
            f"{where}: key 'mlp_only_layers' is {hf['mlp_only_layers']}; dense layers at chosen depths "
            "are not implemented (decoder_sparse_step is: an MoE layer every k-th)"
        )
    experts = (
        "num_experts" if "num_experts" in hf else "num_local_experts"
    )  # the hub's key; transformers 5 writes the other
    return {
        "num_experts": need(experts),
        "top_k": need("num_experts_per_tok", 8),
        "expert_mlp": need("moe_intermediate_size"),
        "every": need("decoder_sparse_step", 1),
        "norm_topk": (bool(hf.get("norm_topk_prob", False)), "norm_topk_prob"),
        **common,
    }


def _text(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _given(moe, init_from: str, key: str, given: list[str], want: dict, top_k):
    """(the key the user gave for moe.`key`, its value, what the run makes of it), or None if none was
    given: null norm_topk is top_k > 1, null expert_mlp is model.mlp (config.json's intermediate_size);
    moe.routing, when moe.top_k is not given, says top_k (`moe`, `init_from`: the run's `cfg.moe` and
    `model.init_from`)."""
    if key == "top_k" and "moe.top_k" not in given and "moe.routing" in given:
        try:
            return "moe.routing", moe.routing, top_k(moe)
        except KeyError:  # an unknown moe.routing: validate names it
            return None
    if f"moe.{key}" not in given:
        return None
    v = getattr(moe, key)
    if v is None and key == "norm_topk":
        return f"moe.{key}", v, want["top_k"][0] > 1
    if v is None and key == "expert_mlp":
        return f"moe.{key}", v, read_config(init_from).get("intermediate_size")
    return f"moe.{key}", v, v


def resolve(cfg, given: list[str], top_k) -> None:
    """Complete `cfg` from a Mixtral / Qwen3-MoE `model.init_from` (see the module docstring); a
    given key that disagrees with config.json: one line naming it and both values. `top_k`:
    `meshpar.core.config.top_k` (experts per token of a `cfg.moe`)."""
    m = cfg.model
    if not (m.init_from or "").startswith("hf:") or ":" in m.name:  # a user factory reads what it likes
        return
    want = moe_settings(m.init_from)
    if want is None:
        return
    where = hf_path(m.init_from) / "config.json"
    if "model.name" in given and m.name != "moe":
        raise ConfigError(
            f"model.name={m.name} disagrees with {where} (a mixture of experts: moe); drop it: model.init_from sets it"
        )
    for key, (value, source) in want.items():
        found = _given(cfg.moe, cfg.model.init_from, key, given, want, top_k)
        if found is not None and found[2] != value:
            raise ConfigError(
                f"{found[0]}={_text(found[1])} disagrees with {where} ({source}: {_text(value)}); "
                "drop it: model.init_from sets it"
            )
    if cfg.moe.balance != "aux":
        raise ConfigError(
            f"moe.balance={cfg.moe.balance} with {where} (a Mixtral/Qwen3-MoE checkpoint): its router "
            "has no selection bias to read or write; use moe.balance=aux"
        )
    m.name = "moe"
    for key, (value, _) in want.items():
        setattr(cfg.moe, key, value)
