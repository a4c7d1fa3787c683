"""The run config's value checks that need no devices (the mesh and the rules are checked when the
mesh is built), one line each naming the key and a fix. The context-parallel cross-checks live here
once: `meshpar.parallel.context` calls the same functions at trace time."""

from __future__ import annotations

import dataclasses
import math

from meshpar.core.config.schema import (
    ATTENTION,
    CONTEXT_STRATEGIES,
    DATA_DTYPES,
    DATA_KINDS,
    DECODE_LOOPS,
    MOE_BALANCES,
    MOE_SCORES,
    ON_NAN,
    REMAT,
    SCHEDULES,
    SECOND_EXPERT_POLICIES,
    TOP_K,
    Config,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    top_k,
)
from meshpar.core.errors import ConfigError, suggest


def _axis_total(mesh: MeshConfig, axis: str) -> int:
    """A mesh axis's size as the config asks for it: mesh.<axis> (in a node) x mesh.dcn.<axis> (across)."""
    return getattr(mesh, axis) * int((mesh.dcn or {}).get(axis, 1))


def _check_moe(m: MoEConfig, model_name: str, mesh: MeshConfig) -> None:
    """MoE checks that need no devices; one line each, naming the key and a fix."""
    _choice("moe.routing", m.routing, TOP_K)
    k = top_k(m)
    if k < 1 or k > m.num_experts:
        what = f"moe.top_k={k}" if m.top_k is not None else f"moe.routing={m.routing}"
        raise ConfigError(
            f"{what} sends every token to {k} experts but moe.num_experts={m.num_experts}; use "
            f"1..{m.num_experts} experts per token, or more experts"
        )
    _choice("moe.score", m.score, MOE_SCORES)
    _choice("moe.balance", m.balance, MOE_BALANCES)
    if m.shared_experts < 0 or (m.expert_mlp is not None and m.expert_mlp < 1) or m.bias_rate <= 0:
        raise ConfigError(
            "config keys 'moe.shared_experts' must be >= 0, 'moe.expert_mlp' >= 1 or null, "
            f"'moe.bias_rate' > 0 (got {m.shared_experts}, {m.expert_mlp}, {m.bias_rate})"
        )
    if m.balance == "bias" and model_name == "moe" and _axis_total(mesh, "pipeline") > 1:
        raise ConfigError(
            "moe.balance=bias with mesh.pipeline > 1: the per-expert bias is state of the stacked "
            "layers, updated after each forward, which pipeline stages do not carry yet; use "
            "moe.balance=aux, or mesh.pipeline=1"
        )
    if m.group_size is not None and m.group_size < 1:
        raise ConfigError(
            f"config key 'moe.group_size' must be >= 1 or null (one sequence per group), got {m.group_size}"
        )
    if m.aux_loss_weight < 0 or m.z_loss_weight < 0:
        raise ConfigError("config keys 'moe.aux_loss_weight' and 'moe.z_loss_weight' must be >= 0")
    ep = _axis_total(mesh, "expert")
    if model_name == "moe" and ep > 1 and m.num_experts % ep:
        raise ConfigError(
            f"moe.num_experts={m.num_experts} is not divisible by the `expert` mesh axis "
            f"(mesh.expert={ep}); use a multiple of {ep} experts or resize mesh.expert"
        )


def check_length(t: int, cp: int, what: str = "batch.length") -> None:
    """Context parallelism's balanced order cuts each sequence into 2 x context chunks."""
    if t % (2 * cp):
        raise ConfigError(
            f"{what}={t} is not divisible by 2 x mesh.context = {2 * cp} (context parallelism cuts each "
            f"sequence into 2 x context chunks for a balanced causal load); use a multiple of {2 * cp}"
        )


def check_context_attention(strategy: str, attention: str) -> None:
    """What attention can run across `context` shards: the ring merges partial results by their
    log-sum-exp (flash; auto becomes flash), and the cuDNN and splash kernels see only their own shard."""
    if strategy == "ring" and attention not in ("flash", "auto"):
        raise ConfigError(
            f"model.context_strategy=ring needs model.attention=flash (got {attention}): the ring merges "
            "partial results by their log-sum-exp; use flash, or context_strategy=all_gather"
        )
    if attention in ("cudnn", "splash"):
        raise ConfigError(
            f"model.attention={attention} cannot attend across mesh.context shards; use model.attention=flash"
        )


def _check_attention(m: ModelConfig, mesh: MeshConfig, length: int, devices: int) -> None:
    """Attention and context-parallel checks that need no devices; one line each (m, mesh: the run's
    `cfg.model` and `cfg.mesh`)."""
    _choice("model.attention", m.attention, ATTENTION)
    _choice("model.context_strategy", m.context_strategy, CONTEXT_STRATEGIES)
    if m.window is not None and m.window < 1:
        raise ConfigError(
            f"config key 'model.window' must be a positive number of tokens (a token sees the last "
            f"`window` tokens) or null, got {m.window}"
        )
    if m.softcap is not None and m.softcap <= 0:
        raise ConfigError(
            f"config key 'model.softcap' must be > 0 (scores become c*tanh(s/c)) or null, got {m.softcap}"
        )
    cp = _axis_total(mesh, "context")
    sizes = [_axis_total(mesh, f.name) for f in dataclasses.fields(MeshConfig) if f.name != "dcn"]
    # a mesh that cannot be the devices' (mesh.context=3 on 8) is the fault to name first: the mesh says so when built
    if cp > 1 and (-1 in sizes or math.prod(sizes) == devices):
        check_length(length, cp)
    pp = _axis_total(mesh, "pipeline")
    if cp > 1 and pp > 1 and m.name == "moe":
        raise ConfigError(
            f"mesh.context={cp} with mesh.pipeline={pp} and model.name=moe: a pipeline stage routes only "
            "its own share of each sequence, which changes capacity and load balancing; drop one of "
            "context, pipeline or the MoE layers"
        )
    if cp > 1:
        check_context_attention(m.context_strategy, m.attention)


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"config key '{key}' has unknown value '{value}'" + suggest(value, choices))


def validate(cfg: Config) -> None:
    """Value checks that need no devices (mesh/rule checks happen when the mesh is built)."""
    from meshpar.core import precision, rules  # local: they import jax, which loading a config does not

    _choice("strategy", cfg.strategy, rules.PRESETS)
    _choice("precision", cfg.precision, precision.POLICIES)
    _choice("model.remat", cfg.model.remat, REMAT)
    _check_attention(cfg.model, cfg.mesh, cfg.batch.length, cfg.devices)
    if ":" not in cfg.data.kind:
        _choice("data.kind", cfg.data.kind, DATA_KINDS)
    _choice("data.dtype", cfg.data.dtype, DATA_DTYPES)
    _choice("pipeline.schedule", cfg.pipeline.schedule, SCHEDULES)
    _choice("moe.second_expert_policy", cfg.moe.second_expert_policy, SECOND_EXPERT_POLICIES)
    _choice("train.on_nan", cfg.train.on_nan, ON_NAN)
    _choice("serve.strategy", cfg.serve.strategy, {**rules.SERVING, **rules.PRESETS})
    _choice("serve.decode_loop", cfg.serve.decode_loop, DECODE_LOOPS)
    for key, v, zero in [
        ("checkpoint.every", cfg.checkpoint.every, "only at the end"),
        ("eval.every", cfg.eval.every, "no evaluation"),
        ("serve.prefix_cache", cfg.serve.prefix_cache, "off"),
        ("serve.parse_workers", cfg.serve.parse_workers, "bodies read on a thread of the server's process"),
        ("serve.max_connections_per_client", cfg.serve.max_connections_per_client, "no bound"),
    ]:
        if v < 0:
            raise ConfigError(f"config key '{key}' must be >= 0 (0: {zero}), got {v}")
    for key, v in [
        ("checkpoint.keep", cfg.checkpoint.keep),
        ("steps", cfg.steps),
        ("devices", cfg.devices),
        ("batch.global_size", cfg.batch.global_size),
        ("batch.length", cfg.batch.length),
        ("batch.microbatches", cfg.batch.microbatches),
        ("train.log_every", cfg.train.log_every),
        ("train.loss_chunks", cfg.train.loss_chunks),
        ("train.max_consecutive_skips", cfg.train.max_consecutive_skips),
        ("pipeline.microbatches", cfg.pipeline.microbatches),
        ("pipeline.virtual_stages", cfg.pipeline.virtual_stages),
        ("moe.num_experts", cfg.moe.num_experts),
        ("moe.every", cfg.moe.every),
        ("data.branching", cfg.data.branching),
        ("serve.slots", cfg.serve.slots),
        ("serve.min_bucket", cfg.serve.min_bucket),
        ("serve.max_new_tokens", cfg.serve.max_new_tokens),
        ("serve.cache_length", cfg.serve.cache_length or 1),
        ("serve.prefill_batch", cfg.serve.prefill_batch),
        ("serve.prefix_block", cfg.serve.prefix_block),
        ("serve.max_waiting", cfg.serve.max_waiting),
        ("serve.max_body_bytes", cfg.serve.max_body_bytes),
        ("serve.max_messages", cfg.serve.max_messages),
        ("profile.start_step", cfg.profile.start_step),
        ("profile.steps", cfg.profile.steps),
        ("eval.batches", cfg.eval.batches),
    ]:
        if v < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {v}")
    precision.check_loss_chunks(
        cfg.train.loss_chunks,
        cfg.batch.length,
        max(_axis_total(cfg.mesh, "context"), 1),
        cfg.train.loss != "lm" and f"train.loss is '{cfg.train.loss}'",
    )
    if cfg.train.lr <= 0:
        raise ConfigError(f"config key 'train.lr' must be > 0, got {cfg.train.lr}")
    for key, seconds in (
        ("serve.header_timeout_s", cfg.serve.header_timeout_s),
        ("serve.body_timeout_s", cfg.serve.body_timeout_s),
    ):
        if not seconds > 0:
            raise ConfigError(f"config key '{key}' must be > 0 seconds, got {seconds}")
    for key, bound, least, null in (
        ("serve.prefill_chunk", cfg.serve.prefill_chunk, 1, "prefill whole"),
        ("serve.drain_timeout_s", cfg.serve.drain_timeout_s, 0, "drain however long"),
    ):
        if bound is not None and bound < least:
            raise ConfigError(f"config key '{key}' must be >= {least} or null ({null}), got {bound}")
    if cfg.moe.capacity_factor is not None and cfg.moe.capacity_factor <= 0:
        raise ConfigError(
            f"config key 'moe.capacity_factor' must be > 0 or null (dropless), got {cfg.moe.capacity_factor}"
        )
    _check_moe(cfg.moe, cfg.model.name, cfg.mesh)
    if cfg.model.init_from is not None and not cfg.model.init_from.startswith("hf:"):
        raise ConfigError(
            f"config key 'model.init_from' must look like hf:DIR (a Hugging Face model directory), "
            f"got {cfg.model.init_from!r}"
        )
    if cfg.data.kind in ("tokens", "text") and not cfg.data.path:
        raise ConfigError(f"config key 'data.path' is required when data.kind={cfg.data.kind}")
    for i, rule in enumerate(cfg.rules):
        if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(f"config key 'rules[{i}]' must be [logical_name, [mesh_axis, ...]], got {rule!r}")
    if not 0.0 < cfg.eval.holdout < 1.0:
        raise ConfigError(
            f"config key 'eval.holdout' must be between 0 and 1 (a fraction of data.path), got {cfg.eval.holdout}"
        )
    if cfg.eval.path and cfg.data.kind not in ("tokens", "text"):
        raise ConfigError(
            f"config key 'eval.path' is read for data.kind=tokens or text (data.kind={cfg.data.kind}: "
            "the evaluation stream is the source's own held-out steps)"
        )
