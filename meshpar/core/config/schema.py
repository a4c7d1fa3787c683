"""The run config's schema: one dataclass per section, each field with its meaning in the comment
beside it (what `meshpar config` prints), and the option lists the fields take, typed here once for
the modules that implement them (`meshpar.nn.attention`, `meshpar.parallel.schedules`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# options a key takes; the module that implements each list imports it from here
REMAT = ("none", "full", "save_dots", "offload")  # model.remat (meshpar.nn.layers)
ATTENTION = ("auto", "xla", "flash", "cudnn", "splash")  # model.attention (meshpar.nn.attention)
DECODE_LOOPS = ("auto", "scan", "unrolled")  # serve.decode_loop (meshpar.nn.layers.decode_loop)
CONTEXT_STRATEGIES = ("all_gather", "ring")  # model.context_strategy (meshpar.parallel.context)
SCHEDULES = ("gpipe", "1f1b", "interleaved")  # pipeline.schedule (meshpar.parallel.schedules)
MOE_SCORES = ("softmax", "sigmoid")  # moe.score (meshpar.nn.routing)
MOE_BALANCES = ("aux", "bias")  # moe.balance
SECOND_EXPERT_POLICIES = ("all", "random")  # moe.second_expert_policy
DATA_KINDS = ("synthetic", "tokens", "text")  # data.kind, or PKG.MODULE:FN (meshpar.train.data)
DATA_DTYPES = ("uint16", "uint32")  # data.dtype
ON_NAN = ("skip", "stop")  # train.on_nan (meshpar.train.step)


@dataclass
class ModelConfig:
    """The model: a reference model of meshpar.models by size, or your own factory."""

    name: str = "decoder"  # decoder | moe (meshpar.models), or PKG.MODULE:FACTORY -> FACTORY(cfg, rngs)
    size: str = "tiny"  # tiny | 125m | 1b | 7b: dimensions below default from this
    layers: int | None = None  # transformer blocks (None: from model.size)
    embed: int | None = None  # model width d_model (None: from model.size)
    heads: int | None = None  # attention (query) heads (None: from model.size)
    kv_heads: int | None = None  # grouped-query attention; = heads for plain MHA
    head_dim: int | None = None  # features per head (None: embed / heads)
    mlp: int | None = None  # feed-forward hidden width (None: from model.size)
    vocab: int | None = None  # vocabulary size (None: from model.size)
    scan_layers: bool = True  # stack layers on a `layers` axis and lax.scan them
    remat: str = "full"  # none | full | save_dots | offload
    attention: str = "auto"  # xla | flash | cudnn | splash | auto: cudnn (GPU) / splash (TPU) where they can,
    # else flash beyond 1k keys, else xla
    window: int | None = None  # sliding-window attention: a token sees the last `window` tokens (Mistral)
    softcap: float | None = None  # attention logit soft-cap c: scores c*tanh(s/c) (Gemma 2)
    context_strategy: str = "all_gather"  # mesh.context > 1: all_gather (K/V gathered, Llama 3) | ring (flash only)
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = False  # logits from the input embedding (no separate lm_head)
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {rope_type: llama3, factor, low_freq_factor, ...}
    init_from: str | None = None  # hf:DIR: dimensions from DIR/config.json, weights from its safetensors
    args: dict[str, Any] = field(default_factory=dict)  # free mapping for a user factory (model.args.width=64)


@dataclass
class MeshConfig:
    """Sizes of the named mesh axes (ICI, within a slice/node); one may be -1 (fill)."""

    data: int = 1  # data parallelism: replicas of the weights, each with its own rows of the batch
    fsdp: int = 1  # fully sharded data parallelism: weights split, gathered per layer (ZeRO-3)
    tensor: int = 1  # tensor parallelism (Megatron): heads and MLP columns split inside a layer
    pipeline: int = 1  # pipeline stages: the stacked layers cut into consecutive groups (pipeline.*)
    context: int = 1  # context parallelism: each sequence split over devices (long sequences)
    expert: int = 1  # expert parallelism: MoE experts split (model.name=moe, moe.*)
    dcn: dict[str, int] = field(default_factory=dict)  # multi-slice/multi-node sizes, e.g. {data: 2}


@dataclass
class BatchConfig:
    """The global batch of one optimizer step."""

    global_size: int = 16  # sequences per optimizer step, over all devices
    length: int = 64  # tokens per sequence
    microbatches: int = 1  # gradient accumulation steps inside one optimizer step


@dataclass
class TrainConfig:
    """Optimizer (AdamW, warmup + cosine, clipping), loss, logging and numerics."""

    lr: float = 3e-3  # peak learning rate (AdamW), reached after warmup_steps
    warmup_steps: int = 20  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01  # AdamW decoupled weight decay (not on norms and vectors)
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.95  # AdamW second-moment decay
    clip_norm: float = 1.0  # gradients clipped to this global norm
    seed: int = 0  # initialisation seed
    log_every: int = 10  # log (console, --metrics-out, TensorBoard) every N steps, the first and the last
    peak_tflops: float | None = None  # per device; None: from the device kind (on CPU: the host's matmul rate,
    # measured once per machine)
    flops_per_example: float | None = None  # model FLOPs of one example, forward + backward (MFU of a loss
    # other than lm); None: counted
    on_nan: str = "stop"  # non-finite loss/gradients: skip (drop the update) | stop (error naming the step)
    max_consecutive_skips: int = 10  # on_nan=skip: this many skipped steps in a row stop the run (naming them)
    loss: str = "lm"  # lm (next-token cross-entropy) | stages (the model's pre/layers/post/loss) | PKG.MODULE:FN,
    # FN(model, batch) -> (loss, metrics)
    loss_chunks: int = 1  # lm loss: head + cross-entropy over this many strided token slices, recomputed in the
    # backward (the [B, T, V] logits never whole; MaxText's num_vocab_tiling)
    require_annotations: bool = False  # a model variable without logical axis names is an error, not replicated


@dataclass
class DataConfig:
    """Where batches come from."""

    kind: str = "synthetic"  # synthetic | tokens | text | PKG.MODULE:FN (FN(cfg) -> your source)
    path: str | None = None  # token file (.bin, uint16/uint32) or text file/folder
    dtype: str = "uint16"  # token file dtype
    tokenizer: str | None = None  # text data and generate prompts: a tokenizer.json (or its folder); None: bytes
    documents: bool = True  # tokens/text: segment ids + per-document positions (no attention across documents)
    eos_id: int | None = None  # data.kind=tokens: the id that ends each document (None: one stream, no documents)
    branching: int = 4  # synthetic: successors per state of the Markov chain
    seed: int = 1234  # batch s row r is a pure function of (seed, s, r): exact resume


@dataclass
class PipelineConfig:
    """Pipeline parallelism (read when mesh.pipeline > 1)."""

    schedule: str = "gpipe"  # gpipe | 1f1b | interleaved
    microbatches: int = 4  # microbatches per step flowing through the stages (bubble (P-1)/(M+P-1))
    virtual_stages: int = 1  # interleaved: layer chunks per device


TOP_K = {"top1": 1, "top2": 2}  # moe.routing -> experts per token (K): Switch, GShard


def top_k(moe) -> int:
    """Experts per token of a `cfg.moe`: moe.top_k, else what moe.routing names."""
    return moe.top_k if moe.top_k is not None else TOP_K[moe.routing]


@dataclass
class MoEConfig:
    """Mixture of experts (read by model.name=moe and user factories)."""

    routing: str = "top2"  # top1 | top2 (Switch, GShard): what top_k is when it is null
    top_k: int | None = None  # experts per token; null: from moe.routing
    score: str = "softmax"  # router scores: softmax (GShard, Mixtral) | sigmoid (DeepSeek-V3)
    norm_topk: bool | None = None  # renormalise the chosen k gates to sum to 1; null: when top_k > 1 (GShard)
    shared_experts: int = 0  # always-on experts added to the routed output (DeepSeekMoE), each expert_mlp wide
    expert_mlp: int | None = None  # hidden width of each expert (fine-grained experts); null: model.mlp
    balance: str = "aux"  # aux (load-balancing loss) | bias (DeepSeek-V3: a per-expert selection bias, no aux loss)
    bias_rate: float = 0.001  # moe.balance=bias: the bias moves by this per step, against the expert's load error
    capacity_factor: float | None = 1.25  # None: dropless
    num_experts: int = 4  # experts per MoE layer (divisible by mesh.expert)
    every: int = 2  # MoE feed-forward in every k-th layer
    aux_loss_weight: float = 0.01  # load-balancing loss weight (GShard/Switch)
    z_loss_weight: float = 0.001  # router z-loss weight (ST-MoE)
    group_size: int | None = None  # tokens per routing group S; None: one sequence per group
    second_expert_policy: str = "all"  # all | random (GShard's random routing of the 2nd expert)


@dataclass
class ProfileConfig:
    """A `jax.profiler` trace of steps start_step .. start_step + steps - 1 (numbered as logged, from 1)."""

    dir: str | None = None  # None: no trace; else TensorBoard's --logdir (plugins/profile/...)
    start_step: int = 5  # first traced step: after compilation and warm-up
    steps: int = 3  # steps traced


@dataclass
class MetricsConfig:
    """Metrics beyond the console and --metrics-out."""

    tensorboard: str | None = None  # write TensorBoard event files (scalars) here, beside the JSON Lines


@dataclass
class EvalConfig:
    """Loss on held-out data every `every` steps (0: never) over `batches` batches of batch.global_size."""

    every: int = 0  # evaluate every N steps (0: never)
    batches: int = 4  # held-out batches of batch.global_size per evaluation
    path: str | None = None  # tokens/text: a held-out file of data.kind; None: the holdout split
    holdout: float = 0.1  # tokens/text without eval.path: this last fraction is never trained on


@dataclass
class CheckpointConfig:
    """Asynchronous Orbax checkpoints; a run resumes from checkpoint.dir's newest usable one."""

    dir: str | None = None  # save here and resume from here (local path or gs://...); None: no checkpoints
    every: int = 0  # 0: only at the end / on preemption
    keep: int = 3  # newest checkpoints kept; older ones are deleted only after a newer one is complete


@dataclass
class ServeConfig:
    """`meshpar generate` / `serve`: serving layout, decode batch, prefill batching, prefix cache, request queue."""

    strategy: str = "serve_tp"  # serve_tp, or any training preset (FSDP ones gather weights per token)
    slots: int = 8  # requests decoded together (continuous batching)
    cache_length: int | None = None  # positions per slot (prompt + generated); None: the model's, capped by memory
    min_bucket: int = 16  # prompts are padded to powers of two >= this, up to cache_length
    max_new_tokens: int = 32  # default budget of new tokens per prompt (generate; serve without max_tokens)
    prefill_batch: int = 8  # waiting prompts prefilled together in one call (1: one at a time)
    prefill_chunk: int | None = None  # prompt tokens prefilled per tick at most; longer prompts in chunks
    # between decode steps (None: whole)
    prefix_cache: int = 4  # prompts whose KV stays cached for reuse by a shared prefix (0: off)
    prefix_block: int = 16  # tokens per hashed block of the prefix cache (a prefix is reused in whole blocks)
    max_waiting: int = 256  # requests queued beyond the slots; more get HTTP 429 with Retry-After
    max_body_bytes: int = 4 * 2**20  # a request body larger gets HTTP 413, before it is read whole
    cors_origins: list[str] = field(default_factory=list)  # web origins allowed to call the API from a browser (CORS)
    openapi: bool = False  # serve the API's schema at /openapi.json
    allow_special_tokens_in_content: bool = False  # true: a special token's text in a chat message stays special
    decode_loop: str = "auto"  # the layers in the decode step: scan | unrolled | auto (unrolled on a GPU,
    # where a scanned step copies every layer's weights out of the stack: meshpar.nn.layers.decode_loop)
    drain_timeout_s: float | None = None  # SIGTERM: finish the requests in flight at most this long, then end
    # the rest with 503 (None: however long)
    max_messages: int = 2048  # messages (and content parts) a chat request may hold, as OpenAI's limit; more: 400
    parse_workers: int = 1  # processes that read request bodies (JSON, chat template, tokenizer) beside the
    # server's, so no body stalls decoding (0: a thread of the server's own process)
    header_timeout_s: float = 10.0  # a connection's request headers must arrive within this (from its start or
    # its last answer); else it is closed (408 if it had begun)
    body_timeout_s: float = 60.0  # a request's body must arrive within this of its headers; else 408
    max_connections_per_client: int = 128  # open connections per client address; more are answered 429 (0: no bound)


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
    strategy: str = "fsdp_tp"  # dp | zero1 | zero2 | fsdp | hsdp | tp | tp_sp | fsdp_tp | fsdp_tp_sp
    # (meshpar.core.rules.PRESETS)
    rules: list[list[Any]] = field(default_factory=list)  # user rules, [[logical, [mesh axes...]], ...], tried first
    precision: str = "bf16"  # bf16 | fp32 | fp16 (meshpar.core.precision.POLICIES; fp16 scales the loss)
    steps: int = 200  # optimizer steps of the whole run (the cosine schedule ends here)
    devices: int = 8  # devices to fake on a CPU-only host
