"""Mixture-of-experts decoder LM: the dense decoder with an MoE feed-forward in every k-th layer.

    tokens [B, T] -> embed -> n = layers / k super-blocks, scanned over `layers`:
        super-block = (k - 1) dense blocks, then one block whose FFN is `MoEFFN`
    -> norm -> logits [B, T, V]

GShard (Lepikhin et al. 2020) puts an MoE layer in every other layer (k = 2); Switch (Fedus et al.
2021) likewise. Scanning super-blocks keeps one copy of the program whatever the depth, and every
scanned body returns the same aux dict (that of its MoE block), stacked [n] by the scan.
Routing, dispatch and combine live in `meshpar.nn.moe`; this file names logical axes only.

Decoding (`decode`, `cache_spec`: see `meshpar.models.decoder`) routes dropless whatever
`moe.capacity_factor` says: with capacity, whether a token is dropped depends on the other tokens
of its group, so a request's output would change with the batch it is served in.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.core.batch import Leaf
from meshpar.core.precision import compute_dtype
from meshpar.models.decoder import Decoder, DecoderConfig
from meshpar.models.layers import CACHE_AXES, MLP, Block, RMSNorm, in_order
from meshpar.nn import moe as moe_lib
from meshpar.nn import routing
from meshpar.nn.layers import param, scan_layers, stacked

_DECODING = contextvars.ContextVar("moe_decoding", default=False)  # set while tracing `MoEDecoder.decode`


class MoEFFN(nnx.Module):
    """Router [M, E], E SwiGLU experts (w_gate, w_up [E, M, H], w_down [E, H, M]; H = moe.expert_mlp,
    small for fine-grained experts), and `moe.shared_experts` always-on experts (DeepSeekMoE, Dai et
    al. 2024: one SwiGLU of width shared x H) added to the routed output. With `moe.balance=bias`
    the router's per-expert selection bias [E] is state (`routing.ExpertBias`).
    x [B, T, M] -> (y [B, T, M], aux); see `meshpar.nn.moe.moe_ffn`."""

    def __init__(self, cfg: DecoderConfig, moe: moe_lib.MoESettings, rngs: nnx.Rngs):
        m, h, e = cfg.embed, moe.expert_mlp or cfg.mlp, moe.num_experts
        self.router = param(rngs, (m, e), ("embed", None), 1.0 / math.sqrt(m))
        self.w_gate = param(rngs, (e, m, h), routing.W_IN, 1.0 / math.sqrt(m))
        self.w_up = param(rngs, (e, m, h), routing.W_IN, 1.0 / math.sqrt(m))
        self.w_down = param(rngs, (e, h, m), routing.W_OUT, 1.0 / math.sqrt(h * 2 * cfg.layers))
        self.shared = MLP(dataclasses.replace(cfg, mlp=moe.shared_experts * h), rngs) if moe.shared_experts else None
        self.expert_bias = routing.ExpertBias(jnp.zeros((e,), jnp.float32)) if moe.balance == "bias" else None
        self.moe = moe

    def __call__(self, x):
        settings = dataclasses.replace(self.moe, capacity_factor=None) if _DECODING.get() else self.moe
        bias = None if self.expert_bias is None else self.expert_bias[...]
        y, aux = moe_lib.moe_ffn(
            x, self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...], settings, bias
        )
        return (y if self.shared is None else y + self.shared(x)), aux


class SuperBlock(nnx.Module):
    """k consecutive layers: k - 1 dense blocks, then an MoE block. x [B, T, M] -> (x, aux of the MoE)."""

    cache_views = True  # its blocks decode through meshpar.nn.kvcache

    def __init__(self, cfg: DecoderConfig, moe: moe_lib.MoESettings, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, rngs) for _ in range(moe.every - 1)])
        self.moe = Block(cfg, rngs, ffn=MoEFFN(cfg, moe, rngs))

    def __call__(self, x, positions, cache=None, segment_ids=None):
        """-> (x, aux); with `cache` (a list: one {"k", "v"} per block, decoding) -> (x, aux, cache)."""
        return in_order([*self.dense, self.moe], x, positions, cache, segment_ids)


class MoEDecoder(Decoder):
    """`__call__(tokens) -> (logits [B, T, V], aux)`, aux values stacked [layers / k] (one per MoE layer)."""

    def __init__(self, cfg: DecoderConfig, moe: moe_lib.MoESettings, rngs: nnx.Rngs, seed: int = 0):
        from meshpar.core.errors import ConfigError

        if cfg.layers % moe.every:
            raise ConfigError(
                f"model.layers={cfg.layers} is not a multiple of moe.every={moe.every} "
                "(an MoE feed-forward every k-th layer); change one of them"
            )
        self.cfg = cfg
        self.moe_settings = moe
        self.seed = seed
        self.embedding = param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1.0)
        self.layers = stacked(lambda r: SuperBlock(cfg, moe, r), cfg.layers // moe.every, rngs)
        self.tail = None
        self.final_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs)
        self.lm_head = param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), 1.0 / math.sqrt(cfg.embed))

    def features(self, tokens, dtype=None, *, positions=None, segment_ids=None):
        """tokens [B, T] (positions, segment_ids [B, T]: as `Decoder`) -> (x [B, T, E] before `head`, aux)."""
        dtype = dtype or compute_dtype()  # the active precision policy's
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens, dtype)
        key = None
        if self.moe_settings.second_expert_policy == "random":
            # a fresh stream per batch; an integer hash of (token, row, position), so identical under every
            # sharding and in any order the rows are stored in (context parallelism's balanced order)
            b, t = tokens.shape
            where = jnp.arange(b, dtype=jnp.int32)[:, None] * t + jnp.broadcast_to(positions, tokens.shape)
            salt = jnp.sum(tokens.astype(jnp.int32) * (where.astype(jnp.int32) % 65521 + 1))
            key = jax.random.fold_in(jax.random.key(self.seed), salt)
        with moe_lib.routing_key(key):
            x, aux = scan_layers(
                self.layers, x, positions, self.cfg.remat, self.cfg.scan_layers, segment_ids=segment_ids
            )
        aux = dict(aux)
        load = aux.pop("expert_load", None)  # [L / k, E]: the bias moves after the forward
        if load is not None and not _DECODING.get():
            ffn = self.layers.moe.ffn
            ffn.expert_bias.set_value(routing.updated_bias(ffn.expert_bias[...], load, self.moe_settings.bias_rate))
        return x, aux

    def cache_spec(self, batch: int, length: int, dtype=None) -> list:
        """One {"k", "v"} [L / k, B, K, S, D] per position inside a super-block (k of them)."""
        c = self.cfg
        leaf = Leaf(
            (c.layers // self.moe_settings.every, batch, c.kv_heads, length, c.head_dim),
            dtype or compute_dtype(),
            CACHE_AXES,
        )
        return [{"k": leaf, "v": leaf} for _ in range(self.moe_settings.every)]

    # -- Hugging Face format (meshpar.io.hf): Mixtral and Qwen3-MoE (meshpar.models.hf_moe) ----------------
    def hf_tensors(self) -> dict:
        from meshpar.models.hf_moe import family_of, moe_tensors

        return moe_tensors(self.cfg, self.moe_settings, family_of(self.cfg, self.moe_settings))

    def hf_config(self) -> dict:
        from meshpar.models.hf_moe import moe_config

        return moe_config(self.cfg, self.moe_settings)

    def decode(self, tokens, positions, cache, dtype=None):
        """The decoder's `decode`, with the MoE layers routing dropless."""
        with self.decoding():
            return super().decode(tokens, positions, cache, dtype)

    @contextlib.contextmanager
    def decoding(self):
        """While inside, the MoE layers route dropless and the selection bias stays (decoding: also
        what a pipelined decode step wraps its stages in, `meshpar.parallel.pipeline_decode`)."""
        token = _DECODING.set(True)
        try:
            yield
        finally:
            _DECODING.reset(token)


def build(cfg, rngs: nnx.Rngs) -> MoEDecoder:
    """From a run config: `model.*` for the decoder, `moe.*` for the experts (which must agree with a
    Mixtral/Qwen3-MoE `model.init_from`'s config.json: `meshpar.models.hf_moe.check_settings`)."""
    if cfg.model.init_from:
        from meshpar.models.hf_moe import check_settings

        check_settings(cfg)
    return MoEDecoder(
        DecoderConfig.from_config(cfg.model), moe_lib.MoESettings.from_config(cfg.moe), rngs, seed=cfg.train.seed
    )
