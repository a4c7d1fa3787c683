"""Llama-style decoder-only language model in Flax NNX (RMSNorm, RoPE, SwiGLU, grouped KV heads).

tokens [B, T] -> embed [B, T, E] -> stacked blocks (scanned over `layers`) -> norm -> logits [B, T, V].
Parameters and activations carry logical axis names only; meshpar's rules decide the layout.

Serving (`meshpar.serve.engine`) needs two more methods, the protocol any user model can implement too:
`cache_spec(B, S)` declares the KV cache (a tree of `meshpar.Leaf`, K and V [L, B, K, S, D]),
and `decode(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)` runs the blocks
on new tokens at their positions, reading and writing the cache (prefill: T = the prompt bucket;
generate: T = 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from meshpar.core.batch import Leaf
from meshpar.core.layout import constrain
from meshpar.core.precision import compute_dtype
from meshpar.models.layers import CACHE_AXES, RESIDUAL, Block, Pattern, RMSNorm
from meshpar.nn.layers import after, param, scan_layers, stacked

# name: (layers, embed, heads, kv_heads, head_dim, mlp, vocab)
SIZES = {
    "tiny": (2, 64, 8, 4, 8, 256, 128),
    "125m": (12, 768, 12, 12, 64, 3072, 32000),
    "1b": (16, 2048, 32, 8, 64, 8192, 32000),
    "7b": (32, 4096, 32, 32, 128, 11008, 32000),
}


@dataclass(frozen=True)
class DecoderConfig:
    layers: int
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    remat: str = "full"
    scan_layers: bool = True
    attention: str = "auto"
    window: int | None = None  # sliding-window attention (keys a token sees), None: all before it
    softcap: float | None = None  # attention scores c*tanh(s/c) (Gemma 2)
    context_strategy: str = "all_gather"  # sequences split over `context`: all_gather | ring
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # logits = x @ embedding.T (no separate lm_head)
    rope_scaling: tuple | None = None  # ("linear", factor) | ("llama3", factor, low, high, original_max_positions)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
    family: str = "llama"  # the Hugging Face family export writes (meshpar.models.hf_llama.FAMILIES)
    # Gemma 2/3: RMSNorm x (1 + w), norms after attention and MLP too, GeGLU, scores / sqrt(query_scale),
    # embeddings x sqrt(E), logits soft-capped, local (window) and global layers in groups of p
    norm_offset: float = 0.0
    post_norms: bool = False
    mlp_act: str = "silu"  # silu | gelu_tanh
    query_scale: float | None = None
    embed_scale: bool = False
    final_softcap: float | None = None
    local_global: int | None = None  # p: groups of p layers, p - 1 with the window, then one without
    local_rope: tuple | None = None  # (theta, scaling) of the windowed layers of a group, when not the global
    # layers' rope_theta/rope_scaling (Gemma 3)

    @classmethod
    def from_config(cls, m) -> DecoderConfig:
        """From a `meshpar.core.config.ModelConfig`: size preset, then explicit fields; with
        `model.init_from=hf:DIR`, the dimensions of DIR/config.json (see `meshpar.models.hf_llama`)."""
        from meshpar.core.errors import ConfigError, suggest

        if getattr(m, "init_from", None):
            from meshpar.models.hf_llama import decoder_config

            return decoder_config(m)
        if m.size not in SIZES:
            raise ConfigError(f"unknown model size '{m.size}'" + suggest(m.size, SIZES))
        base = dict(zip(("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab"), SIZES[m.size]))
        for k in base:
            v = getattr(m, k)
            if v is not None:
                base[k] = v
        if base["heads"] % base["kv_heads"]:
            raise ConfigError(f"model.heads={base['heads']} must be a multiple of model.kv_heads={base['kv_heads']}")
        if m.head_dim is None and (m.embed is not None or m.heads is not None):  # "None: embed / heads"
            if base["embed"] % base["heads"]:
                raise ConfigError(
                    f"model.embed={base['embed']} is not a multiple of model.heads={base['heads']}: "
                    f"set model.head_dim explicitly"
                )
            base["head_dim"] = base["embed"] // base["heads"]
        if base["head_dim"] % 2:
            implied = " (model.embed / model.heads)" if m.head_dim is None else ""
            raise ConfigError(f"model.head_dim={base['head_dim']}{implied} must be even (rotary embedding)")
        scaling = getattr(m, "rope_scaling", None) or None
        if scaling:
            from meshpar.models.hf_rope import rope_scaling

            scaling = rope_scaling(scaling, "model.rope_scaling")
        return cls(
            **base,
            remat=m.remat,
            scan_layers=m.scan_layers,
            attention=m.attention,
            window=getattr(m, "window", None),
            softcap=getattr(m, "softcap", None),
            context_strategy=getattr(m, "context_strategy", "all_gather"),
            rope_theta=m.rope_theta,
            norm_eps=m.norm_eps,
            tie_embeddings=getattr(m, "tie_embeddings", False),
            rope_scaling=scaling,
        )

    def replace(self, **kw) -> DecoderConfig:
        return dataclasses.replace(self, **kw)


class Decoder(nnx.Module):
    """The dense reference LM. `__call__(tokens) -> (logits [B, T, V], aux)`.

    Layers: one stack scanned over `layers` (blocks, or with `local_global` = p groups of p blocks,
    `Pattern`); when p does not divide the layers, the last L mod p (local) blocks are an unscanned
    `tail` after the stack (Gemma 3 1B: 4 groups of 6, then 2), which a pipeline cannot cut."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, block=None):
        self.cfg = cfg
        # tied, the table is the LM head too: at the head's scale 1/sqrt(E) (std 1.0 gave logits of std
        # sqrt(E) and a first loss of ~10 ln V), as tied families start (GPT-2's 0.02, Gemma's table
        # times sqrt(E) at the input, model.embed_scale)
        std = 1.0 / math.sqrt(cfg.embed) if cfg.tie_embeddings else 1.0
        self.embedding = param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), std)
        p = cfg.local_global or 1
        groups, rest = divmod(cfg.layers, p)
        if groups == 0:
            from meshpar.core.errors import ConfigError

            raise ConfigError(f"model.layers={cfg.layers} is fewer than the local/global pattern's {p} layers")
        default = (lambda r: Pattern(cfg, r)) if p > 1 else (lambda r: Block(cfg, r))
        self.layers = stacked(block or default, groups, rngs)
        self.tail = Pattern(cfg, rngs, count=rest) if rest else None
        self.final_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs, cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), 1.0 / math.sqrt(cfg.embed))

    def embed(self, tokens, dtype):
        """tokens [B, T] int -> [B, T, E] (row gather of a vocab-parallel table)."""
        x = jnp.take(self.embedding[...].astype(dtype), tokens, axis=0)
        if self.cfg.embed_scale:  # Gemma: x sqrt(E), the factor rounded to the compute dtype
            x = x * jnp.asarray(math.sqrt(self.cfg.embed), dtype)
        return constrain(x, RESIDUAL)

    def head(self, x, dtype):
        """[B, T, E] -> logits [B, T, V] (vocab-parallel LM head under TP)."""
        table = self.embedding if self.cfg.tie_embeddings else self.lm_head
        x, w = after(x, table[...])  # its gather here, not before the layers
        x = self.final_norm(x)
        logits = jnp.einsum("bte,ve->btv" if self.cfg.tie_embeddings else "bte,ev->btv", x, w.astype(dtype))
        if self.cfg.final_softcap:  # Gemma 2: c tanh(logits / c)
            c = self.cfg.final_softcap
            logits = (c * jnp.tanh(logits.astype(jnp.float32) / c)).astype(logits.dtype)
        return constrain(logits, ("batch", "seq", "vocab"))

    def pipeline_refusal(self) -> str | None:
        """Why a pipeline cannot cut this model into embed | layers | head (`meshpar.nn.stages`), or None."""
        if self.tail is None:
            return None
        p = self.cfg.local_global
        return (
            f"its {self.cfg.layers} layers are {self.cfg.layers // p} scanned groups of {p} plus a tail of "
            f"{len(self.tail.blocks)} local layers after them, which no stage holds"
        )

    def __call__(self, tokens, dtype=None, *, positions=None, segment_ids=None):
        """tokens [B, T] -> (logits [B, T, V], aux). Packed documents: positions [B, T] (RoPE restarts
        at each document; default 0..T-1) and segment_ids [B, T] (a token sees its own document only)."""
        dtype = dtype or compute_dtype()  # the active precision policy's
        x, aux = self.features(tokens, dtype, positions=positions, segment_ids=segment_ids)
        return self.head(x, dtype), aux

    def features(self, tokens, dtype=None, *, positions=None, segment_ids=None):
        """tokens [B, T] -> (x [B, T, E] before `head`, aux): what the loss reads when it runs the head
        itself (`train.loss_chunks`)."""
        dtype = dtype or compute_dtype()
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens, dtype)
        x, aux = scan_layers(self.layers, x, positions, self.cfg.remat, self.cfg.scan_layers, segment_ids=segment_ids)
        if self.tail is not None:
            x, _ = self.tail(x, positions, segment_ids=segment_ids)
        return x, aux

    # -- serving (meshpar.serve.engine) ---------------------------------------------------------------------
    def cache_spec(self, batch: int, length: int, dtype=None) -> dict:
        """The KV cache of `batch` sequences of up to `length` positions: {"k", "v"} [L, B, K, S, D]
        (a local/global pattern: one such pair per block of a group; with a tail, {"layers": those,
        "tail": one pair [B, K, S, D] per tail block})."""
        c = self.cfg
        p = c.local_global or 1
        dtype = dtype or compute_dtype()
        leaf = Leaf((c.layers // p, batch, c.kv_heads, length, c.head_dim), dtype, CACHE_AXES)
        stack = {"k": leaf, "v": leaf} if p == 1 else [{"k": leaf, "v": leaf} for _ in range(p)]
        if self.tail is None:
            return stack
        one = Leaf(leaf.shape[1:], dtype, CACHE_AXES[1:])
        return {"layers": stack, "tail": [{"k": one, "v": one} for _ in self.tail.blocks]}

    def decode(self, tokens, positions, cache, dtype=None):
        """tokens, positions [B, T] -> (logits [B, T, V], cache with these tokens' keys/values)."""
        dtype = dtype or compute_dtype()
        x = self.embed(tokens, dtype)
        stack = cache if self.tail is None else cache["layers"]
        x, _, stack = scan_layers(self.layers, x, positions, "none", self.cfg.scan_layers, cache=stack)
        if self.tail is None:
            return self.head(x, dtype), stack
        x, _, tail = self.tail(x, positions, cache["tail"])
        return self.head(x, dtype), {"layers": stack, "tail": tail}

    # -- Hugging Face format (meshpar.io.hf) --------------------------------------------------------------
    def hf_tensors(self) -> dict:
        """{parameter path: meshpar.io.hf.Source}: how each parameter reads from / writes to the HF
        tensors of its family (meshpar.models.hf_llama)."""
        from meshpar.models.hf_tensors import tensors

        return tensors(self.cfg)

    def hf_config(self) -> dict:
        """The `config.json` of this model in its family's format (`meshpar.models.hf_llama.FAMILIES`)."""
        from meshpar.models.hf_llama import hf_config

        return hf_config(self.cfg)

    def hf_ignorable(self, name: str) -> bool:
        from meshpar.models.hf_llama import ignorable

        return ignorable(name)
