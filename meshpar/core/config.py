"""Run configuration: a typed schema, YAML files that compose, and dotted KEY=VALUE overrides.

    cfg = load_config("configs/tiny.yaml", ["steps=20", "mesh.tensor=2", "strategy=fsdp"])

Every key is a dataclass field below; an unknown key, a wrong type or an impossible value raises
`ConfigError` naming the dotted key and, for typos, the closest valid one. A YAML file may say
`base: other.yaml` (relative to itself) to start from another file.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshpar.core.errors import ConfigError, suggest

def _config_dir() -> Path:
    """`configs/` of a source checkout, else the copy installed as the package `meshpar.configs`."""
    src = Path(__file__).resolve().parents[2] / "configs"
    if (src / "tiny.yaml").exists():
        return src
    import importlib.resources
    return Path(str(importlib.resources.files("meshpar.configs")))


CONFIG_DIR = _config_dir()
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


@dataclass
class ModelConfig:
    """The model: a reference model of meshpar.models by size, or your own factory."""
    name: str = "decoder"             # decoder | moe (meshpar.models), or PKG.MODULE:FACTORY -> FACTORY(cfg, rngs)
    size: str = "tiny"                # tiny | 125m | 1b | 7b: dimensions below default from this
    layers: int | None = None         # transformer blocks (None: from model.size)
    embed: int | None = None          # model width d_model (None: from model.size)
    heads: int | None = None          # attention (query) heads (None: from model.size)
    kv_heads: int | None = None       # grouped-query attention; = heads for plain MHA
    head_dim: int | None = None       # features per head (None: embed / heads)
    mlp: int | None = None            # feed-forward hidden width (None: from model.size)
    vocab: int | None = None          # vocabulary size (None: from model.size)
    scan_layers: bool = True          # stack layers on a `layers` axis and lax.scan them
    remat: str = "full"               # none | full | save_dots | offload
    attention: str = "auto"           # xla | flash | cudnn | splash | auto: cudnn (GPU) / splash (TPU) where they can, else flash beyond 1k keys, else xla
    window: int | None = None         # sliding-window attention: a token sees the last `window` tokens (Mistral)
    softcap: float | None = None      # attention logit soft-cap c: scores c*tanh(s/c) (Gemma 2)
    context_strategy: str = "all_gather"   # mesh.context > 1: all_gather (K/V gathered, Llama 3) | ring (flash only)
    rope_theta: float = 10000.0       # RoPE base frequency
    norm_eps: float = 1e-6            # RMSNorm epsilon
    tie_embeddings: bool = False      # logits from the input embedding (no separate lm_head)
    rope_scaling: dict[str, Any] = field(default_factory=dict)   # {rope_type: llama3, factor, low_freq_factor, ...}
    init_from: str | None = None      # hf:DIR: dimensions from DIR/config.json, weights from its safetensors
    args: dict[str, Any] = field(default_factory=dict)   # free mapping for a user factory (model.args.width=64)


@dataclass
class MeshConfig:
    """Sizes of the named mesh axes (ICI, within a slice/node); one may be -1 (fill)."""
    data: int = 1                     # data parallelism: replicas of the weights, each with its own rows of the batch
    fsdp: int = 1                     # fully sharded data parallelism: weights split, gathered per layer (ZeRO-3)
    tensor: int = 1                   # tensor parallelism (Megatron): heads and MLP columns split inside a layer
    pipeline: int = 1                 # pipeline stages: the stacked layers cut into consecutive groups (pipeline.*)
    context: int = 1                  # context parallelism: each sequence split over devices (long sequences)
    expert: int = 1                   # expert parallelism: MoE experts split (model.name=moe, moe.*)
    dcn: dict[str, int] = field(default_factory=dict)   # multi-slice/multi-node sizes, e.g. {data: 2}


@dataclass
class BatchConfig:
    """The global batch of one optimizer step."""
    global_size: int = 16             # sequences per optimizer step, over all devices
    length: int = 64                  # tokens per sequence
    microbatches: int = 1             # gradient accumulation steps inside one optimizer step


@dataclass
class TrainConfig:
    """Optimizer (AdamW, warmup + cosine, clipping), loss, logging and numerics."""
    lr: float = 3e-3                  # peak learning rate (AdamW), reached after warmup_steps
    warmup_steps: int = 20            # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1         # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01        # AdamW decoupled weight decay (not on norms and vectors)
    b1: float = 0.9                   # AdamW first-moment decay
    b2: float = 0.95                  # AdamW second-moment decay
    clip_norm: float = 1.0            # gradients clipped to this global norm
    seed: int = 0                     # initialisation seed
    log_every: int = 10               # log (console, --metrics-out, TensorBoard) every N steps, the first and the last
    peak_tflops: float | None = None  # per device; None: from the device kind (on CPU: the host's matmul rate, measured once per machine)
    flops_per_example: float | None = None  # model FLOPs of one example, forward + backward (MFU of a loss other than lm); None: counted
    on_nan: str = "stop"              # non-finite loss/gradients: skip (drop the update) | stop (error naming the step)
    loss: str = "lm"                  # lm (next-token cross-entropy) | stages (the model's pre/layers/post/loss) | PKG.MODULE:FN, FN(model, batch) -> (loss, metrics)
    loss_chunks: int = 1              # lm loss: head + cross-entropy over this many strided token slices, recomputed in the backward (the [B, T, V] logits never whole; MaxText's num_vocab_tiling)
    require_annotations: bool = False  # a model variable without logical axis names is an error, not replicated


@dataclass
class DataConfig:
    """Where batches come from."""
    kind: str = "synthetic"           # synthetic | tokens | text | PKG.MODULE:FN (FN(cfg) -> your source)
    path: str | None = None           # token file (.bin, uint16/uint32) or text file/folder
    dtype: str = "uint16"             # token file dtype
    tokenizer: str | None = None      # text data and generate prompts: a tokenizer.json (or its folder); None: bytes
    documents: bool = True            # tokens/text: segment ids + per-document positions (no attention across documents)
    eos_id: int | None = None         # data.kind=tokens: the id that ends each document (None: one stream, no documents)
    branching: int = 4                # synthetic: successors per state of the Markov chain
    seed: int = 1234                  # batch s row r is a pure function of (seed, s, r): exact resume


@dataclass
class PipelineConfig:
    """Pipeline parallelism (read when mesh.pipeline > 1)."""
    schedule: str = "gpipe"           # gpipe | 1f1b | interleaved
    microbatches: int = 4             # microbatches per step flowing through the stages (bubble (P-1)/(M+P-1))
    virtual_stages: int = 1           # interleaved: layer chunks per device


TOP_K = {"top1": 1, "top2": 2}       # moe.routing -> experts per token (K): Switch, GShard


def top_k(moe) -> int:
    """Experts per token of a `cfg.moe`: moe.top_k, else what moe.routing names."""
    return moe.top_k if moe.top_k is not None else TOP_K[moe.routing]


@dataclass
class MoEConfig:
    """Mixture of experts (read by model.name=moe and user factories)."""
    routing: str = "top2"             # top1 | top2 (Switch, GShard): what top_k is when it is null
    top_k: int | None = None          # experts per token; null: from moe.routing
    score: str = "softmax"            # router scores: softmax (GShard, Mixtral) | sigmoid (DeepSeek-V3)
    norm_topk: bool | None = None     # renormalise the chosen k gates to sum to 1; null: when top_k > 1 (GShard)
    shared_experts: int = 0           # always-on experts added to the routed output (DeepSeekMoE), each expert_mlp wide
    expert_mlp: int | None = None     # hidden width of each expert (fine-grained experts); null: model.mlp
    balance: str = "aux"              # aux (load-balancing loss) | bias (DeepSeek-V3: a per-expert selection bias, no aux loss)
    bias_rate: float = 0.001          # moe.balance=bias: the bias moves by this per step, against the expert's load error
    capacity_factor: float | None = 1.25   # None: dropless
    num_experts: int = 4              # experts per MoE layer (divisible by mesh.expert)
    every: int = 2                    # MoE feed-forward in every k-th layer
    aux_loss_weight: float = 0.01     # load-balancing loss weight (GShard/Switch)
    z_loss_weight: float = 0.001      # router z-loss weight (ST-MoE)
    group_size: int | None = None     # tokens per routing group S; None: one sequence per group
    second_expert_policy: str = "all"  # all | random (GShard's random routing of the 2nd expert)


@dataclass
class ProfileConfig:
    """A `jax.profiler` trace of steps start_step .. start_step + steps - 1 (numbered as logged, from 1)."""
    dir: str | None = None            # None: no trace; else TensorBoard's --logdir (plugins/profile/...)
    start_step: int = 5               # first traced step: after compilation and warm-up
    steps: int = 3                    # steps traced


@dataclass
class MetricsConfig:
    """Metrics beyond the console and --metrics-out."""
    tensorboard: str | None = None    # write TensorBoard event files (scalars) here, beside the JSON Lines


@dataclass
class EvalConfig:
    """Loss on held-out data every `every` steps (0: never) over `batches` batches of batch.global_size."""
    every: int = 0                    # evaluate every N steps (0: never)
    batches: int = 4                  # held-out batches of batch.global_size per evaluation
    path: str | None = None           # tokens/text: a held-out file of data.kind; None: the holdout split
    holdout: float = 0.1              # tokens/text without eval.path: this last fraction is never trained on


@dataclass
class CheckpointConfig:
    """Asynchronous Orbax checkpoints; a run resumes from checkpoint.dir's newest usable one."""
    dir: str | None = None            # save here and resume from here (local path or gs://...); None: no checkpoints
    every: int = 0                    # 0: only at the end / on preemption
    keep: int = 3                     # newest checkpoints kept; older ones are deleted only after a newer one is complete


@dataclass
class ServeConfig:
    """`meshpar generate` / `serve`: serving layout, decode batch, prefill batching, prefix cache, request queue."""
    strategy: str = "serve_tp"        # serve_tp, or any training preset (FSDP ones gather weights per token)
    slots: int = 8                    # requests decoded together (continuous batching)
    cache_length: int | None = None   # positions per slot (prompt + generated); None: the model's, capped by memory
    min_bucket: int = 16              # prompts are padded to powers of two >= this, up to cache_length
    max_new_tokens: int = 32          # default budget of new tokens per prompt (generate; serve without max_tokens)
    prefill_batch: int = 8            # waiting prompts prefilled together in one call (1: one at a time)
    prefill_chunk: int | None = None  # prompt tokens prefilled per tick at most; longer prompts in chunks between decode steps (None: whole)
    prefix_cache: int = 4             # prompts whose KV stays cached for reuse by a shared prefix (0: off)
    prefix_block: int = 16            # tokens per hashed block of the prefix cache (a prefix is reused in whole blocks)
    max_waiting: int = 256            # requests queued beyond the slots; more get HTTP 429 with Retry-After
    max_body_bytes: int = 4 * 2**20   # a request body larger gets HTTP 413, before it is read whole
    cors_origins: list[str] = field(default_factory=list)   # web origins allowed to call the API from a browser (CORS)
    openapi: bool = False             # serve the API's schema at /openapi.json
    allow_special_tokens_in_content: bool = False   # true: a special token's text in a chat message stays special
    drain_timeout_s: float | None = None   # SIGTERM: finish the requests in flight at most this long, then end the rest with 503 (None: however long)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    strategy: str = "fsdp_tp"         # dp | zero1 | zero2 | fsdp | hsdp | tp | tp_sp | fsdp_tp | fsdp_tp_sp (meshpar.core.rules.PRESETS)
    rules: list[list[Any]] = field(default_factory=list)  # user rules, [[logical, [mesh axes...]], ...], tried first
    precision: str = "bf16"           # bf16 | fp32 | fp16 (meshpar.core.precision.POLICIES; fp16 scales the loss)
    steps: int = 200                  # optimizer steps of the whole run (the cosine schedule ends here)
    devices: int = 8                  # devices to fake on a CPU-only host


# ----------------------------------------------------------------------------------------------
# Building a dataclass tree from plain dicts, with typed errors.

def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert `value` to type `tp`; `key` is the dotted name for errors."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {k: _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):   # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    types_ = _field_types(cls)
    for k in data:
        if k not in types_:
            raise ConfigError(f"unknown config key '{prefix}{k}'" + suggest(k, types_, prefix))
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "dcn":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        if not base_path.exists() and (CONFIG_DIR / base).exists():
            base_path = CONFIG_DIR / base
        data = _merge(_read_yaml(base_path), data)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """'mesh.tensor=2' -> (['mesh', 'tensor'], 2); values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like KEY=VALUE (e.g. mesh.tensor=2)")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _merge({}, data)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{k}' is not a section")
        node[keys[-1]] = value
    return data


def from_dict(data: dict, given: list[str] | None = None) -> Config:
    """Build, complete from `model.init_from` (`meshpar.core.pretrained`) and validate; `given`: the
    dotted keys the user set (default: those of `data` that differ from the defaults,
    `meshpar.core.notices`); `cfg.ignored` lists those the run will not read."""
    from meshpar.core.notices import given_keys, ignored_keys
    from meshpar.core.pretrained import resolve
    cfg = _build(Config, data)
    given = given_keys(data, [], Config()) if given is None else given
    resolve(cfg, given, top_k)          # what a Mixtral / Qwen3-MoE model.init_from implies (model.name, moe.*)
    validate(cfg)
    cfg.ignored = ignored_keys(given, cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, under: dict | None = None) -> Config:
    """The YAML file (default: the embedded configs/tiny.yaml) + KEY=VALUE overrides, validated.
    `under`: settings laid under them (a checkpoint's saved model settings, for `generate`): a given
    file and the overrides win over them, and they win over the embedded default."""
    from meshpar.core.notices import given_keys
    data = _read_yaml(Path(path) if path else DEFAULT_CONFIG)
    if under:
        data = _merge(under, data) if path else _merge(data, under)
    overrides = overrides or []
    given = given_keys(data, [parse_override(o) for o in overrides], Config())
    return from_dict(apply_overrides(data, overrides), given)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _axis_total(cfg: Config, axis: str) -> int:
    """A mesh axis's size as the config asks for it: mesh.<axis> (in a node) x mesh.dcn.<axis> (across)."""
    return getattr(cfg.mesh, axis) * int((cfg.mesh.dcn or {}).get(axis, 1))


def _check_moe(cfg: Config) -> None:
    """MoE checks that need no devices; one line each, naming the key and a fix."""
    m = cfg.moe
    _choice("moe.routing", m.routing, TOP_K)
    k = top_k(m)
    if k < 1 or k > m.num_experts:
        what = f"moe.top_k={k}" if m.top_k is not None else f"moe.routing={m.routing}"
        raise ConfigError(f"{what} sends every token to {k} experts but moe.num_experts={m.num_experts}; use "
                          f"1..{m.num_experts} experts per token, or more experts")
    _choice("moe.score", m.score, ("softmax", "sigmoid"))
    _choice("moe.balance", m.balance, ("aux", "bias"))
    if m.shared_experts < 0 or (m.expert_mlp is not None and m.expert_mlp < 1) or m.bias_rate <= 0:
        raise ConfigError("config keys 'moe.shared_experts' must be >= 0, 'moe.expert_mlp' >= 1 or null, "
                          f"'moe.bias_rate' > 0 (got {m.shared_experts}, {m.expert_mlp}, {m.bias_rate})")
    if m.balance == "bias" and cfg.model.name == "moe" and _axis_total(cfg, "pipeline") > 1:
        raise ConfigError("moe.balance=bias with mesh.pipeline > 1: the per-expert bias is state of the stacked "
                          "layers, updated after each forward, which pipeline stages do not carry yet; use "
                          "moe.balance=aux, or mesh.pipeline=1")
    if m.group_size is not None and m.group_size < 1:
        raise ConfigError(f"config key 'moe.group_size' must be >= 1 or null (one sequence per group), "
                          f"got {m.group_size}")
    if m.aux_loss_weight < 0 or m.z_loss_weight < 0:
        raise ConfigError("config keys 'moe.aux_loss_weight' and 'moe.z_loss_weight' must be >= 0")
    ep = _axis_total(cfg, "expert")
    if cfg.model.name == "moe" and ep > 1 and m.num_experts % ep:
        raise ConfigError(f"moe.num_experts={m.num_experts} is not divisible by the `expert` mesh axis "
                          f"(mesh.expert={ep}); use a multiple of {ep} experts or resize mesh.expert")


def _check_attention(cfg: Config) -> None:
    """Attention and context-parallel checks that need no devices; one line each."""
    m = cfg.model
    _choice("model.attention", m.attention, ("xla", "flash", "cudnn", "splash", "auto"))
    _choice("model.context_strategy", m.context_strategy, ("all_gather", "ring"))
    if m.window is not None and m.window < 1:
        raise ConfigError(f"config key 'model.window' must be a positive number of tokens (a token sees the last "
                          f"`window` tokens) or null, got {m.window}")
    if m.softcap is not None and m.softcap <= 0:
        raise ConfigError(f"config key 'model.softcap' must be > 0 (scores become c*tanh(s/c)) or null, got {m.softcap}")
    cp = _axis_total(cfg, "context")
    sizes = [_axis_total(cfg, f.name) for f in dataclasses.fields(MeshConfig) if f.name != "dcn"]
    # a mesh that cannot be the devices' (mesh.context=3 on 8) is the fault to name first: the mesh says so when built
    if cp > 1 and cfg.batch.length % (2 * cp) and (-1 in sizes or math.prod(sizes) == cfg.devices):
        raise ConfigError(f"batch.length={cfg.batch.length} is not divisible by 2 x mesh.context = {2 * cp} (context "
                          f"parallelism cuts each sequence into 2 x context chunks for a balanced causal load); use "
                          f"a multiple of {2 * cp}")
    pp = _axis_total(cfg, "pipeline")
    if cp > 1 and pp > 1 and m.name == "moe":
        raise ConfigError(f"mesh.context={cp} with mesh.pipeline={pp} and model.name=moe: a pipeline stage routes only "
                          "its own share of each sequence, which changes capacity and load balancing; drop one of "
                          "context, pipeline or the MoE layers")
    if cp > 1 and m.context_strategy == "ring" and m.attention not in ("flash", "auto"):
        raise ConfigError(f"model.context_strategy=ring needs model.attention=flash (got {m.attention}): the ring merges "
                          "partial results by their log-sum-exp; use flash, or context_strategy=all_gather")
    if cp > 1 and m.attention in ("cudnn", "splash"):
        raise ConfigError(f"model.attention={m.attention} cannot attend across mesh.context shards; use "
                          "model.attention=flash")


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"config key '{key}' has unknown value '{value}'" + suggest(value, choices))


def validate(cfg: Config) -> None:
    """Value checks that need no devices (mesh/rule checks happen when the mesh is built)."""
    from meshpar.core import precision, rules  # local: avoid import cycles

    _choice("strategy", cfg.strategy, rules.PRESETS)
    _choice("precision", cfg.precision, precision.POLICIES)
    _choice("model.remat", cfg.model.remat, ("none", "full", "save_dots", "offload"))
    _check_attention(cfg)
    if ":" not in cfg.data.kind:
        _choice("data.kind", cfg.data.kind, ("synthetic", "tokens", "text"))
    _choice("data.dtype", cfg.data.dtype, ("uint16", "uint32"))
    _choice("pipeline.schedule", cfg.pipeline.schedule, ("gpipe", "1f1b", "interleaved"))
    _choice("moe.second_expert_policy", cfg.moe.second_expert_policy, ("all", "random"))
    _choice("train.on_nan", cfg.train.on_nan, ("skip", "stop"))
    _choice("serve.strategy", cfg.serve.strategy, {**rules.SERVING, **rules.PRESETS})
    for key, v, zero in [("checkpoint.every", cfg.checkpoint.every, "only at the end"),
                         ("eval.every", cfg.eval.every, "no evaluation"), ("serve.prefix_cache", cfg.serve.prefix_cache, "off")]:
        if v < 0:
            raise ConfigError(f"config key '{key}' must be >= 0 (0: {zero}), got {v}")
    for key, v in [("checkpoint.keep", cfg.checkpoint.keep), ("steps", cfg.steps), ("devices", cfg.devices), ("batch.global_size", cfg.batch.global_size),
                   ("batch.length", cfg.batch.length), ("batch.microbatches", cfg.batch.microbatches),
                   ("train.log_every", cfg.train.log_every), ("train.loss_chunks", cfg.train.loss_chunks), ("pipeline.microbatches", cfg.pipeline.microbatches),
                   ("pipeline.virtual_stages", cfg.pipeline.virtual_stages), ("moe.num_experts", cfg.moe.num_experts),
                   ("moe.every", cfg.moe.every), ("data.branching", cfg.data.branching),
                   ("serve.slots", cfg.serve.slots), ("serve.min_bucket", cfg.serve.min_bucket),
                   ("serve.max_new_tokens", cfg.serve.max_new_tokens), ("serve.cache_length", cfg.serve.cache_length or 1),
                   ("serve.prefill_batch", cfg.serve.prefill_batch), ("serve.prefix_block", cfg.serve.prefix_block),
                   ("serve.max_waiting", cfg.serve.max_waiting), ("serve.max_body_bytes", cfg.serve.max_body_bytes),
                   ("profile.start_step", cfg.profile.start_step), ("profile.steps", cfg.profile.steps), ("eval.batches", cfg.eval.batches)]:
        if v < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {v}")
    precision.check_loss_chunks(cfg.train.loss_chunks, cfg.batch.length, max(_axis_total(cfg, "context"), 1), cfg.train.loss != "lm" and f"train.loss is '{cfg.train.loss}'")
    if cfg.train.lr <= 0:
        raise ConfigError(f"config key 'train.lr' must be > 0, got {cfg.train.lr}")
    for key, v, least, null in (("serve.prefill_chunk", cfg.serve.prefill_chunk, 1, "prefill whole"),
                                ("serve.drain_timeout_s", cfg.serve.drain_timeout_s, 0, "drain however long")):
        if v is not None and v < least:
            raise ConfigError(f"config key '{key}' must be >= {least} or null ({null}), got {v}")
    if cfg.moe.capacity_factor is not None and cfg.moe.capacity_factor <= 0:
        raise ConfigError(f"config key 'moe.capacity_factor' must be > 0 or null (dropless), got {cfg.moe.capacity_factor}")
    _check_moe(cfg)
    if cfg.model.init_from is not None and not cfg.model.init_from.startswith("hf:"):
        raise ConfigError(f"config key 'model.init_from' must look like hf:DIR (a Hugging Face model directory), "
                          f"got {cfg.model.init_from!r}")
    if cfg.data.kind in ("tokens", "text") and not cfg.data.path:
        raise ConfigError(f"config key 'data.path' is required when data.kind={cfg.data.kind}")
    for i, rule in enumerate(cfg.rules):
        if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(f"config key 'rules[{i}]' must be [logical_name, [mesh_axis, ...]], got {rule!r}")
    if not 0.0 < cfg.eval.holdout < 1.0:
        raise ConfigError(f"config key 'eval.holdout' must be between 0 and 1 (a fraction of data.path), "
                          f"got {cfg.eval.holdout}")
    if cfg.eval.path and cfg.data.kind not in ("tokens", "text"):
        raise ConfigError(f"config key 'eval.path' is read for data.kind=tokens or text (data.kind={cfg.data.kind}: "
                          "the evaluation stream is the source's own held-out steps)")
