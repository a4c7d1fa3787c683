"""The Hugging Face Llama family and its dense kin <-> the reference decoder (`meshpar.io.hf`).

Families (`FAMILIES`): one table of tensor names below, plus the few decoder options each adds:

    LlamaForCausalLM     the table as written
    MistralForCausalLM   + `sliding_window` (a token sees the last W positions) -> DecoderConfig.window
    Qwen2ForCausalLM     + q/k/v biases [N*D], [K*D], [K*D] -> layers.attn.bqkv [l, K, G+2, D] (qkv_bias)
    Qwen3ForCausalLM     + self_attn.q_norm / k_norm weights [D] -> layers.attn.q_norm / k_norm.scale
                           [l, D] (qk_norm: RMSNorm of each head before RoPE); explicit head_dim
    Gemma2ForCausalLM    + pre_feedforward_layernorm (-> ffn_norm), post_attention_layernorm and
                           post_feedforward_layernorm (-> post_attn_norm, post_ffn_norm), blocks stacked
                           in local/global pairs (layers.blocks.i [l] = HF layer 2l + i); (1 + w) norms,
                           GeGLU, query_pre_attn_scalar, both soft-caps, x sqrt(E) embeddings
    Gemma3ForCausalLM    Gemma 2's table plus Qwen3's q/k norms; `layer_types` in groups of p (p - 1
                           sliding, 1 full: layers.blocks.i [l] = HF layer p*l + i), the last L mod p
                           (sliding) layers unstacked (tail.blocks.i = HF layer p*(L // p) + i); RoPE
                           base and scaling per layer type (`rope_parameters`, or 4's `rope_theta`,
                           `rope_scaling`, `rope_local_base_freq`); text only (model_type gemma3_text)
    MixtralForCausalLM   attention as Mistral, Qwen3MoeForCausalLM as Qwen3; their experts and
                           routers: meshpar.models.hf_moe (model.name=moe)

config.json -> DecoderConfig: hidden_size E, num_hidden_layers L, num_attention_heads N,
num_key_value_heads K (default N), head_dim D (default E / N), intermediate_size F, vocab_size V,
rope theta and `linear`/`llama3` rope scaling (either transformers 5's `rope_parameters` or 4's
`rope_theta` + `rope_scaling`), rms_norm_eps, tie_word_embeddings. Refused in one line naming the
file and key: another architecture (Gemma3ForConditionalGeneration's vision tower too), a hidden_act
other than silu (GeGLU for Gemma), attention_bias/mlp_bias true, partial rotary embeddings, a rope
type other than default/linear/llama3, Qwen's `use_sliding_window` (windows on some layers only),
Gemma layer types that are not groups of sliding layers each closed by a full one, bidirectional
attention.

Tensors (HF `nn.Linear` weights are [out, in]; meshpar's are [in, out]; G = N / K):

    model.embed_tokens.weight [V, E]                  -> embedding [V, E]
    lm_head.weight [V, E] (absent when tied)          -> lm_head [E, V] (transposed)
    model.norm.weight [E]                             -> final_norm.scale [E]
    model.layers.l.input_layernorm.weight [E]         -> layers.attn_norm.scale [l, E]
    model.layers.l.post_attention_layernorm.weight    -> layers.ffn_norm.scale [l, E]
    model.layers.l.self_attn.q_proj.weight [N*D, E]   -> layers.attn.wqkv [l, E, k, j, D], j < G, head n = k*G + j
    model.layers.l.self_attn.k_proj.weight [K*D, E]   -> layers.attn.wqkv [l, E, k, G, D]
    model.layers.l.self_attn.v_proj.weight [K*D, E]   -> layers.attn.wqkv [l, E, k, G+1, D]
    model.layers.l.self_attn.o_proj.weight [E, N*D]   -> layers.attn.wo [l, N, D, E]
    model.layers.l.mlp.gate_proj.weight [F, E]        -> layers.ffn.w_in [l, E, 0, F]
    model.layers.l.mlp.up_proj.weight [F, E]          -> layers.ffn.w_in [l, E, 1, F]
    model.layers.l.mlp.down_proj.weight [E, F]        -> layers.ffn.w_down [l, F, E]

RoPE layout, stated rather than guessed: HF Llama checkpoints store q/k rows for the half-split
`rotate_half` form (feature i of a head pairs with feature i + D/2; the conversion from Meta's
interleaved pairs (2i, 2i+1) permuted the rows once, in `convert_llama_weights_to_hf.py`).
meshpar's `rope` is the same half-split form, so the row order within a head maps as the identity
(`ROPE_ROWS`); a checkpoint in Meta's interleaved layout would need the permutation
`interleaved_to_half` (`meshpar.models.hf_rope`, tested to differ) and is not what `hf:` reads.
"""

from __future__ import annotations

from meshpar.core.errors import ConfigError
from meshpar.io.hf import hf_path, read_config
from meshpar.models.hf_rope import rope_of, rope_parameters

# architecture -> family (its config.json's model_type)
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
MOE = ("mixtral", "qwen3_moe")  # their experts: meshpar.models.hf_moe
GEMMA = ("gemma2", "gemma3_text")
WINDOWED = ("mistral", "mixtral", *GEMMA)  # families whose config.json's sliding_window is read
ARCHITECTURES = tuple(FAMILIES)
ROPE_ROWS = "identity"  # HF rotate_half rows == meshpar rope rows (see the module docstring)


def decoder_config(m):
    """`model.init_from=hf:DIR` (a `meshpar.core.config.ModelConfig`) -> DecoderConfig from DIR/config.json."""
    from meshpar.models.decoder import DecoderConfig

    hf = read_config(m.init_from)
    where = str(hf_path(m.init_from) / "config.json")

    def need(key, default=None):
        v = default if hf.get(key) is None else hf[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{where}: key '{key}' must be a positive integer, got {v!r}")
        return v

    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        vlm = next((a for a in archs if a.endswith("ForConditionalGeneration")), None)
        raise ConfigError(
            f"{where}: key 'architectures' is {archs}; meshpar implements {', '.join(ARCHITECTURES)}"
            + (f" ({vlm} has a vision tower: read its text model's ...ForCausalLM checkpoint)" if vlm else "")
        )
    gemma = family in GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(hf.get(act_key) or "silu")
    if act is None or gemma != (act == "gelu_tanh"):
        raise ConfigError(
            f"{where}: key '{act_key}' is {hf.get(act_key)!r}; the decoder's MLP is SwiGLU (silu), "
            "or GeGLU (gelu_pytorch_tanh) for Gemma"
        )
    for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise ConfigError(
                f"{where}: key '{key}' is true; "
                + (
                    "the decoder is causal"
                    if key == "use_bidirectional_attention"
                    else "the decoder has no biases" + (" but Qwen2's q/k/v biases" if family == "qwen2" else "")
                )
            )
    if family in MOE and getattr(m, "name", "moe") != "moe":
        raise ConfigError(
            f"{where}: key 'architectures' is {archs}, a mixture of experts: model.name=moe reads it "
            "(leave model.name unset: load_config sets it and the moe.* keys from config.json)"
        )
    if family in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise ConfigError(
            f"{where}: key 'use_sliding_window' is true; a window on some layers only (Qwen's "
            "max_window_layers) is not implemented: set it false to read the model without windows"
        )
    window = hf.get("sliding_window") if family in WINDOWED else None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: key 'sliding_window' must be a positive integer or null, got {window!r}")
    glob, loc = rope_of(hf, where, family)
    extra = (
        gemma_options(hf, where, family, window, glob, loc)
        if gemma
        else {"window": window, "rope_theta": glob[0], "rope_scaling": glob[1]}
    )
    heads = need("num_attention_heads")
    dims = {
        "layers": need("num_hidden_layers"),
        "embed": need("hidden_size"),
        "heads": heads,
        "kv_heads": need("num_key_value_heads", heads),
        "mlp": need("intermediate_size"),
        "vocab": need("vocab_size"),
    }
    dims["head_dim"] = need("head_dim", hf.get("head_dim") or dims["embed"] // heads)
    if heads % dims["kv_heads"]:
        raise ConfigError(
            f"{where}: key 'num_key_value_heads'={dims['kv_heads']} does not divide num_attention_heads={heads}"
        )
    for k, v in dims.items():
        mine = getattr(m, k, None)
        if mine is not None and mine != v:
            raise ConfigError(
                f"model.{k}={mine} disagrees with {where} ({v}); drop it: model.init_from sets the dimensions"
            )
    return DecoderConfig(
        **dims,
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention=m.attention,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        family=family,
        **extra,
    )


def gemma_options(hf: dict, where: str, family: str, window, glob: tuple, loc: tuple) -> dict:
    """Gemma 2/3's decoder options from their config.json: (1 + w) norms, post-norms, GeGLU,
    query_pre_attn_scalar, soft-caps, x sqrt(E) embeddings, and the layer pattern (`layer_types`, or
    4's `sliding_window_pattern`) with the RoPE (theta, scaling) of its global and local layers."""
    layers = hf.get("num_hidden_layers") or 0
    every = hf.get("sliding_window_pattern") or (2 if family == "gemma2" else 6)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
    ]
    p = types.index("full_attention") + 1 if "full_attention" in types else None
    if types != layer_types(p, layers):
        raise ConfigError(
            f"{where}: key 'layer_types' must repeat (sliding_attention x p-1, full_attention), the "
            "last group maybe cut short (Gemma 2: p = 2; Gemma 3: 6); other patterns are not implemented"
        )
    if p is None:  # every layer sliding: one kind of layer, the local one
        glob = loc
    elif p == 1:  # every layer full: no window anywhere
        p, window = None, None
    return {
        "norm_offset": 1.0,
        "post_norms": True,
        "mlp_act": "gelu_tanh",
        "embed_scale": True,
        "query_scale": hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256,
        "softcap": hf.get("attn_logit_softcapping"),
        "final_softcap": hf.get("final_logit_softcapping"),
        "local_global": p,
        "window": window,
        "rope_theta": glob[0],
        "rope_scaling": glob[1],
        "local_rope": loc if p and loc != glob else None,
    }


def layer_types(p: int | None, layers: int) -> list[str]:
    """Gemma's `layer_types` of groups of p (p - 1 sliding, then full; the last group maybe cut
    short); p None: every layer sliding."""
    return ["full_attention" if p and (i + 1) % p == 0 else "sliding_attention" for i in range(layers)]


def gemma_config(c, family: str) -> dict:
    """The Gemma-only keys of config.json (`gemma_options` read back)."""
    p = c.local_global
    kinds = layer_types(p, c.layers) if c.window is not None else ["full_attention"] * c.layers
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": c.query_scale or c.head_dim,
        "attn_logit_softcapping": c.softcap,
        "final_logit_softcapping": c.final_softcap,
        "sliding_window": c.window,
        "layer_types": kinds,
    }
    if family == "gemma3_text":
        loc = c.local_rope or (c.rope_theta, c.rope_scaling)
        out.update(
            use_bidirectional_attention=False,
            rope_local_base_freq=loc[0],
            rope_parameters={
                "full_attention": rope_parameters(c.rope_theta, c.rope_scaling),
                "sliding_attention": rope_parameters(*loc),
            },
            **({"sliding_window_pattern": p} if p else {}),
        )
    return out


def family_of(c) -> str:
    """The family export writes: the one read, or for a decoder made here the one that has its options."""
    if c.family != "llama":
        return c.family
    if c.post_norms:
        return "gemma3_text" if c.qk_norm else "gemma2"
    return "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else "mistral" if c.window else "llama"


def hf_config(c) -> dict:
    """DecoderConfig -> the config.json of its family (transformers 5's `rope_parameters`, plus 4's
    `rope_theta`/`rope_scaling` keys so either version reads the same RoPE)."""
    rope = rope_parameters(c.rope_theta, c.rope_scaling)
    family = family_of(c)
    if c.softcap is not None and family not in GEMMA:
        raise ConfigError(
            "model.softcap: attention soft-capping has no place in the Llama, Mistral or Qwen formats; "
            "export a model without it"
        )
    if c.window is not None and family not in ("mistral", *GEMMA):
        raise ConfigError(
            f"model.window: the {family} format has no window for every layer; a windowed decoder "
            "exports as Mistral (a model read from Mistral does)"
        )
    arch = next(a for a, f in FAMILIES.items() if f == family)
    no_window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.layers}
    extra = (
        gemma_config(c, family)
        if family in GEMMA
        else {"mistral": {"sliding_window": c.window}, "qwen2": no_window, "qwen3": no_window}.get(family, {})
    )
    act = "gelu_pytorch_tanh" if c.mlp_act == "gelu_tanh" else "silu"
    return {
        "architectures": [arch],
        "model_type": family,
        "hidden_act": act,
        "hidden_size": c.embed,
        "intermediate_size": c.mlp,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": rope,
        "rope_theta": c.rope_theta,
        **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if c.rope_scaling else {}),
        **extra,
    }


def ignorable(name: str) -> bool:
    """Tensors a Llama checkpoint may hold that carry nothing the decoder needs: RoPE buffers, and a
    copy of the embedding saved as lm_head by some tied checkpoints (the embedding is read)."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"
