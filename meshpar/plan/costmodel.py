"""The planner's cost model: bytes per device and seconds per step of one candidate plan.

Letters: N devices; mesh axes p (pipeline), d (data), f (fsdp), x (context), e (expert), t (tensor); B global batch
(sequences), T (= s) length (s / x tokens of a sequence per device), M_a gradient-accumulation microbatches, M
pipeline microbatches, v virtual stages; b = B / (d f e M_a M) sequences per device per microbatch; model sizes L
layers, h embed, a heads, k kv heads, q head_dim, F mlp, V vocab; Psi parameters. Bytes per parameter W, G, O
(weights, gradients, optimizer state); c bytes of the compute dtype.

Memory (per device, bytes).
* Model state, ZeRO (Rajbhandari et al. 2020, sec. 5, "Psi" accounting with W,G,O = 2,2,12:
  DP 16Psi, ZeRO-1 4Psi + 12Psi/N, ZeRO-2 2Psi + 14Psi/N, ZeRO-3 16Psi/N). Here every parameter is
  resolved with meshpar's own rules (`meshpar.core.rules.resolve`) for the candidate's mesh, so the
  shard factor of each tensor is the one the run will use: W x Psi_i / shards(params),
  G x Psi_i / shards(grads) (ZeRO-2: the optimizer layout), O x Psi_i / shards(optimizer).
  Defaults: what meshpar's precision policy stores (fp32 master weights 4, fp32 gradients 4,
  AdamW mu and nu 8).
* Activations after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", eq. 1-2: sbh(34 + 5as/h) bytes per layer, TP sbh(10 + 24/t + 5as/(ht)),
  TP+SP sbh(34 + 5as/h)/t, full recompute 2sbh), re-derived for meshpar's decoder (pre-norm RMSNorm,
  fused GQA QKV with RoPE, SwiGLU, no dropout) in elements per token of one layer:
      none:      4h (2 norm inputs + 2 norm outputs) + (2a + 2k) q (q, k after RoPE, v, attention
                 output) + 2 a s (softmax output and probabilities) + 4F (gate, up, silu, product)
      save_dots: h (layer input) + (a + 2k) q (QKV output) + 2h (wo, w_down outputs) + 2F (w_in output)
      full:      h (the layer input the scan keeps)
  A target's compile (XLA:GPU, libtpu) keeps more under `none`: the norms' inputs and outputs in
  fp32 beside their compute-dtype casts (4 h x 4 bytes + 2 h c), three [.., F] (3F: six before `swiglu`), and stored
  scores (`model.attention=xla`) once in fp32 and once cast (a s (4 + c) bytes); the H100
  compiles of 1b (1 and 8 devices, fsdp and tp_sp) and 8B (8, fsdp) came within 2% with them, 0.69-0.72
  without, and one H100 ran out of memory where the old count said 1b fits (bench/bench_device.py).
  Under TP the head and F terms are divided by t (TP without SP also keeps the row-parallel outputs,
  2h, before their all-reduce); under SP the h terms are divided too, and XLA:GPU's backward holds 6h
  whole (gathered column-parallel inputs, their cotangents, row-parallel outputs unscattered). Flash,
  cudnn (`auto` beyond 1k tokens) store no 2 a s term. Context parallelism divides the tokens per
  device by x; all_gather's gathered K and V (2 s k q per sequence) join the working set with their
  fp32 gradients (1b, context=32 x fsdp=2, H100: 2 x 512 MiB); the ring's two hops' K/V shards and
  one fp32 dK/dV, (2c + 4) 2 s k q / x. Unpipelined, each layer stores one microbatch's set.
  GPipe and interleaved rerun each stage in its backward: a stage stores a stage input [b, s, h] per
  tick (v M + P - 1) plus one microbatch's sets of its L/(P v) layers; a target's compile holds a
  second [ticks, b, s, h] buffer, the stash's cotangents (1b gpipe on 8 and 64 H100s: 2 x 5 x 160
  MiB; 2 x 4.75 GiB). 1F1B stores the sets of its
  L/P layers per slot (`stash_slots`; under `none` with the stage's weights in the compute dtype)
  and two [b, s, h] received per tick. On top: the working set of the layer being differentiated
  (its `none` set once), the logits in fp32 with their gradient (2 x 4 b s V / t) on XLA:CPU, one
  [b s, V / t] in the compute dtype on GPU and TPU targets (2.0 and 2.2 bytes per logit, measured
  on H100 and v5p compiles by varying V), or one token slice's of them under `train.loss_chunks`
  (1b fsdp on 8 H100s: 4.12 -> 3.63 GiB at 4 and 8 slices, the 500 MiB logits gone). MoE layers add
  their capacity buffers, [E,G,C,M|H]: b s k cf (2h + 3H_e/t) per MoE layer (no [G,S,E,C] masks).
* Gradients: the backward writes them at the parameters' layout (ZeRO-2: already scattered; ZeRO-1
  without accumulation: XLA reduce-scatters each layer's gradient inside the backward loop, so the
  stacked layers' are held scattered too); with accumulation an accumulator sits beside each
  microbatch's gradients (x 2).
* Workspace: weight-sized buffers of the compiled step, read off XLA's buffer assignment and live
  ranges (`--xla_dump_to`) of the configs in tests/plan/test_plan.py, each a rule of meshpar's step:
  the layer loops (forward, backward) each copy the stacked weights they read when the update
  writes those weights in place (every preset without a sharded optimizer state): 2 W_stacked; the
  layer being computed: one layer's weights (under FSDP gathered over the batch axes); ZeRO-1/2
  gather the updated weights after the backward, so that phase (grads + W; XLA:GPU: the stacked
  weights, capped by its scheduler's limit, `steptime.zero_update_gather`) counts where it exceeds
  the backward's peak.
  Not modelled: XLA's packing of all temporaries into one buffer (on CPU 15-25% over the largest
  live set). The loop copies are XLA:CPU's: the H100 and v5p compiles (`meshpar inspect --target`)
  hold none; for a compute dtype narrower than the weights they hold the stacked weights cast to it
  once (c x W_stacked, every preset without a sharded optimizer state; XLA:GPU only those it
  gathers, the others' casts fuse into their GEMMs: 8B dp x 8 holds none): the compiled temp grew
  with the local weights by 0.62-0.67 x their fp32 bytes (1b, fsdp=8 vs context=4 x fsdp=2). On one
  GPU the loss and the layers' backward use one slot in turn (`steptime.evaluate`).

Time per step and the collectives it moves: `meshpar.plan.steptime`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax

from meshpar.core.config import top_k
from meshpar.core.mesh import MESH_AXES
from meshpar.core.precision import get_policy
from meshpar.core.registry import default_model
from meshpar.core.rules import BATCH_AXES, get_strategy, parse_user_rules, resolve_kind, spec_axes
from meshpar.core.sharding import model_spec, path_name
from meshpar.nn.attention import AUTO_FLASH_FROM, cudnn_serves
from meshpar.nn.splash import LANE
from meshpar.plan.workload import Workload
from meshpar.train.data import packs_documents
from meshpar.train.flops import active_params, flops_per_token

REMATS = ("none", "save_dots", "full")


@dataclass(frozen=True)
class Leaf:
    """One parameter tensor: shape, logical names, whether it sits in the stacked (scanned) layers."""

    path: str
    shape: tuple
    names: tuple
    stacked: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelFacts:
    """What the cost model needs of a model: its parameter tensors and, for activations, its sizes;
    `run`: what it reads of the run (`Workload`)."""

    leaves: list
    params: int
    flops_per_token: float
    dims: dict  # layers, embed, heads, kv_heads, head_dim, mlp, vocab (None if unknown)
    run: Workload  # what the cost functions read of the run: batch, loss slices, attention, precision
    moe: dict = field(
        default_factory=dict
    )  # num_experts, every, top_k, capacity_factor (None: dropless), expert_mlp, shared_experts
    lookups: tuple = ()  # paths of tables read by a lookup only ([vocab, embed], embeddings not tied)

    @classmethod
    def from_config(cls, cfg) -> ModelFacts:
        """Shapes only (`nnx.eval_shape`): a 175B model costs no memory here."""

        spec = model_spec(default_model(cfg), get_policy(cfg.precision))
        names = jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple))
        leaves = [
            Leaf(path_name(p), tuple(s.shape), tuple(n), bool(n) and n[0] == "layers")
            for (p, s), n in zip(jax.tree_util.tree_leaves_with_path(spec.shapes), names)
        ]
        m = spec.model_config
        dims = {k: getattr(m, k, None) for k in ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")}
        moe = {}
        if any("expert" in lf.names for lf in leaves):
            moe = {
                "num_experts": cfg.moe.num_experts,
                "every": cfg.moe.every,
                "top_k": top_k(cfg.moe),
                "capacity_factor": cfg.moe.capacity_factor,
                "expert_mlp": cfg.moe.expert_mlp or dims["mlp"],
                "shared_experts": cfg.moe.shared_experts,
            }
        n = sum(lf.numel for lf in leaves)
        lookups = (
            ()
            if getattr(m, "tie_embeddings", False)
            else tuple(lf.path for lf in leaves if not lf.stacked and lf.names == ("vocab", "embed"))
        )
        per_token = flops_per_token(m, active_params(spec, top_k(cfg.moe)), cfg.batch.length)
        run = Workload(
            cfg.batch.global_size,
            cfg.batch.length,
            cfg.train.loss_chunks,
            cfg.model.attention,
            cfg.model.softcap,
            packs_documents(cfg.data),
            cfg.precision,
            cfg.model.context_strategy,
        )
        return cls(leaves, n, per_token, dims, run, moe, lookups)


@dataclass(frozen=True)
class Candidate:
    """One plan: full axis sizes (ICI x DCN), the part of each on DCN, strategy, remat, microbatches."""

    mesh: tuple  # sizes in MESH_AXES order
    dcn: tuple  # DCN part of each axis (1: all ICI)
    strategy: str
    remat: str
    microbatches: int = 1  # batch.microbatches (gradient accumulation)
    pp_microbatches: int = 1  # pipeline.microbatches
    schedule: str = "1f1b"
    virtual: int = 1

    @property
    def shape(self) -> dict:
        return dict(zip(MESH_AXES, self.mesh))

    @property
    def dcn_shape(self) -> dict:
        return dict(zip(MESH_AXES, self.dcn))


def split_factor(spec, shape: dict) -> int:
    return math.prod(shape[a] for a in spec_axes(spec))


def sharded_axes(spec) -> set:
    return set(spec_axes(spec))


def gathered_over(lf, axes) -> list:
    """The axes of `axes` FSDP gathers the weight `lf` over at use: all but an expert weight's own
    `expert` (each device runs its own experts), in `axes`' order."""
    return [a for a in axes if not (a == "expert" and "expert" in lf.names)]


class Resolver:
    """Each leaf's PartitionSpec under a strategy and mesh, by meshpar's resolver (cached)."""

    def __init__(self, rules=()):
        """`rules`: the run's `cfg.rules` (the user's, tried first)."""
        self.user = parse_user_rules(rules)
        self.cache = {}

    def spec(self, leaf: Leaf, strategy: str, shape: dict, kind: str):
        key = (leaf.names, leaf.shape, strategy, tuple(shape.values()), kind)
        if key not in self.cache:
            self.cache[key] = resolve_kind(
                leaf.names, get_strategy(strategy), self.user, kind, shape, leaf.shape, f"parameter '{leaf.path}'"
            )
        return self.cache[key]


def state_bytes(facts: ModelFacts, cand: Candidate, res: Resolver, bpp=(4, 4, 8)) -> dict:
    """Per-device params, grads, optimizer bytes (ZeRO accounting on meshpar's real layouts).
    Raises ShardingError when a tensor is not divisible by its mesh axes."""
    w, g, o = bpp
    shape = cand.shape
    zero2 = get_strategy(cand.strategy).shard_grads
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for lf in facts.leaves:
        ps = split_factor(res.spec(lf, cand.strategy, shape, "rest"), shape)
        os_ = split_factor(res.spec(lf, cand.strategy, shape, "opt_state"), shape)
        out["params"] += w * lf.numel / ps
        out["grads"] += g * lf.numel / (os_ if zero2 else ps)
        out["optimizer"] += o * lf.numel / os_
    return out


def local_batch(run: Workload, cand: Candidate) -> float:
    """b: sequences per device per (accumulation x pipeline) microbatch."""
    s = cand.shape
    dp = s["data"] * s["fsdp"] * s["expert"]
    return run.global_size / (dp * cand.microbatches * cand.pp_microbatches)


def in_flight(cand: Candidate) -> int:
    """Microbatches whose activations a stage holds at once (GPipe M, lockstep 1F1B <= 2P - 1,
    interleaved v M; `meshpar.parallel.schedules`)."""
    p = cand.shape["pipeline"]
    if p == 1:
        return 1
    if cand.schedule == "1f1b":
        return min(2 * p - 1, cand.pp_microbatches)
    return cand.pp_microbatches * (cand.virtual if cand.schedule == "interleaved" else 1)


def stash_slots(cand: Candidate) -> int:
    """1F1B's residual sets alive on a stage: one per microbatch in flight, the spare slot, the set a
    tick writes and the one it reads (`meshpar.parallel.pipeline`: its branches see one slot, never the stash)."""
    return in_flight(cand) + 3


def efficient_attention(run: Workload, compiler: str = "cpu", pipelined: bool = False, head_dim: int = 0) -> bool:
    """Whether attention stores no [s, s] scores: flash, cudnn or splash; `auto` beyond AUTO_FLASH_FROM
    keys, and on a target wherever `meshpar.nn.attention.choose` picks cuDNN (GPU: `cudnn_serves`) or
    splash (TPU: lengths a multiple of its lane), never inside a pipeline stage."""

    a = run.attention
    if a in ("flash", "cudnn", "splash") or (a == "auto" and run.length > AUTO_FLASH_FROM):
        return True
    if a != "auto" or compiler == "cpu" or pipelined:
        return False
    if compiler == "tpu":
        return run.length % LANE == 0
    return cudnn_serves(get_policy(run.precision).compute_dtype, head_dim, run.documents, run.softcap)


def per_token_elements(
    dims: dict, remat: str, t_heads: int, t_mlp: int, t_res: int, s: int, c: int = 2, compiler: str = "cpu"
) -> float:
    """Elements (of `c` bytes) stored per token of one layer (see the module docstring)."""
    h, a, k, q, f = dims["embed"], dims["heads"], dims["kv_heads"], dims["head_dim"], dims["mlp"]
    if remat == "full" or remat == "offload":
        return h / t_res
    if remat == "save_dots":
        return 3 * h / t_res + (a + 2 * k) * q / t_heads + 2 * f / t_mlp
    partial = 2 * h if t_heads > 1 and t_res == 1 else 0  # TP without SP: the row-parallel outputs (wo, w_down)
    if compiler != "cpu":  # the targets' own residuals: the norms' inputs and outputs in fp32 beside their
        # compute-dtype casts, three [.., F] (w_in's two halves, `swiglu`'s product; its backward keeps
        # no silu or sigmoid), and stored scores once in fp32 and once cast
        norms, mlp, scores = 2 * h + 4 * h * 4 / c, 3 * f, (1 + 4 / c) * a * s
    else:
        norms, mlp, scores = 4 * h, 4 * f, 2 * a * s
    return norms / t_res + partial + (2 * a + 2 * k) * q / t_heads + scores / t_heads + mlp / t_mlp


def tensor_splits(facts: ModelFacts, cand: Candidate) -> dict:
    """What the tensor axis splits under the candidate's preset: heads (t_heads; when the KV heads
    divide), mlp (t_mlp), the residual (t_res: sequence parallelism), vocab (t_vocab)."""
    t = cand.shape["tensor"]
    names = {n for n, _ in get_strategy(cand.strategy).params}
    return {
        "heads": t if "heads" in names and facts.dims["kv_heads"] % t == 0 else 1,
        "mlp": t if "mlp" in names else 1,
        "res": t if "length" in names else 1,
        "vocab": t if "vocab" in names else 1,
    }


def activation_parts(facts: ModelFacts, cand: Candidate, c: int, compiler: str = "cpu") -> dict:
    """Per-device activation memory of one step (bytes) by term (see the module docstring)."""
    d, shape = facts.dims, cand.shape
    run = facts.run
    b, s = local_batch(run, cand), run.length
    leaves = 3 if run.documents else 1  # tokens (+ segment ids, positions)
    out = {"batch": 4 * leaves * b * cand.microbatches * cand.pp_microbatches * (s + 1)}  # int32 [B, T+1] / dp
    if not all(d.get(k) for k in ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")):
        return out  # a user model without sizes
    sp = tensor_splits(facts, cand)
    t_heads, t_mlp, t_res, t_vocab = sp["heads"], sp["mlp"], sp["res"], sp["vocab"]
    layers = d["layers"] / shape["pipeline"]
    cp = shape["context"]
    tokens = b * s / cp
    scores = (
        0 if efficient_attention(run, compiler, shape["pipeline"] > 1, d["head_dim"]) else s
    )  # keys whose scores a token stores
    per_layer = per_token_elements(d, cand.remat, t_heads, t_mlp, t_res, scores, c, compiler)
    if shape["pipeline"] == 1:
        out["stored"] = c * layers * tokens * per_layer
    elif cand.schedule == "1f1b":  # residual slots (see stash_slots); the input and the gradient received
        out["stored"] = c * tokens * (stash_slots(cand) * layers * per_layer + 2 * d["embed"] / t_res)
    else:  # the stash of stage inputs, then one microbatch's residuals while its stage runs backward
        ticks = cand.virtual * cand.pp_microbatches + shape["pipeline"] - 1
        stashes = 1 if compiler == "cpu" else 2  # a target's compile holds the stash's cotangents beside it
        out["stored"] = c * tokens * (stashes * ticks * d["embed"] / t_res + layers / cand.virtual * per_layer)
    out["working"] = c * tokens * per_token_elements(d, "none", t_heads, t_mlp, t_res, scores)
    if cp > 1:  # all_gather's gathered K/V and fp32 dK/dV; the ring's two hops' K/V and one fp32 dK/dV
        kv = b * 2 * s * d["kv_heads"] * d["head_dim"] / t_heads
        out["working"] += (2 * c + 4) * kv / cp if run.context_strategy == "ring" else (c + 4) * kv
    if compiler == "gpu" and t_res > 1:  # SP: 6 whole [b, s, h] (1b tp_sp, 64 H100s: 6 x 128 MiB)
        out["working"] += c * tokens * 6 * d["embed"]
    # fp32 logits and their gradient; a target: one buffer in the compute dtype (GPipe's loss tick too,
    # since `cross_entropy` writes its own backward: it held two fp32 [b s, V / t] on H100, four on v5p)
    logit_bytes = 2 * 4 if compiler == "cpu" else c
    out["logits"] = logit_bytes * tokens * d["vocab"] / t_vocab / run.loss_chunks  # one slice's (train.loss_chunks)
    if facts.moe:
        m = facts.moe
        moe_layers = layers / m["every"]
        buf = tokens * m["top_k"] * rows_factor(m, shape) * (2 * d["embed"] + 3 * m["expert_mlp"] / t_mlp)
        held = moe_layers / cand.virtual if shape["pipeline"] > 1 else moe_layers  # one microbatch's
        out["moe"] = c * buf * ((held if cand.remat == "none" else 0) + 1)
    return out


def rows_factor(moe: dict, shape: dict) -> float:
    """Expert-buffer rows per routed (token, expert) pair: the capacity factor, or, dropless, the
    worst case `meshpar.nn.moe.dropless` pads each shard's receive buffer to: ep sources of n tokens
    each sending it at most min(K, E_l) rows, over the n K it routes."""
    if moe["capacity_factor"] is not None:
        return moe["capacity_factor"]
    ep, k = shape["expert"], moe["top_k"]
    return ep * min(k, max(moe["num_experts"] // ep, 1)) / k


def stage_recompute(facts: ModelFacts, cand: Candidate) -> float:
    """Forward passes of a stage its backward reruns: one for GPipe and interleaved (they keep stage
    inputs; a scan of two or more layers reruns whole), none for 1F1B (it keeps residuals) or for a
    one-layer tick under full remat (the rerun is dead: the stage holds the layer's only residual)."""
    if cand.shape["pipeline"] == 1 or cand.schedule == "1f1b":
        return 0.0
    per_tick = (facts.dims.get("layers") or 1) / cand.shape["pipeline"] / cand.virtual
    return 0.0 if cand.remat == "full" and per_tick <= 1 else 1.0


def local_elements(lf: Leaf, cand: Candidate, res: Resolver) -> float:
    """Elements of `lf` one device holds at rest."""
    return lf.numel / split_factor(res.spec(lf, cand.strategy, cand.shape, "rest"), cand.shape)


def workspace_parts(
    facts: ModelFacts, cand: Candidate, res: Resolver, w: float = 4, c: int = 2, compiler: str = "cpu"
) -> dict:
    """Weight-sized buffers the compiled step holds beside its state (bytes; see the module
    docstring), `w` bytes per weight element, `c` per compute-dtype element; the layer loops' weight
    copies are XLA:CPU's (`compiler` "cpu"), the compute-dtype copy libtpu's and, of the stacked
    weights it gathers, XLA:GPU's."""
    shape, st = cand.shape, get_strategy(cand.strategy)
    stacked = [(lf, local_elements(lf, cand, res)) for lf in facts.leaves if lf.stacked]
    n_stk = sum(n for _, n in stacked)  # stacked weight elements one device holds
    out = {"loop_copies": 2 * w * n_stk if st.opt_state is None and compiler == "cpu" else 0.0}
    layers = (facts.dims.get("layers") or 1) / shape["pipeline"]
    gathered, n_gathered = 0.0, 0.0
    for lf, n in stacked:  # FSDP: the layer being computed, gathered over the batch axes and context
        sharded = sharded_axes(res.spec(lf, cand.strategy, shape, "rest"))
        on_batch = gathered_over(lf, [a for a in (*BATCH_AXES, "context") if a in sharded])
        gathered += n * math.prod(shape[a] for a in on_batch) / lf.shape[0] if on_batch else 0.0
        n_gathered += n if on_batch else 0.0
    if compiler != "cpu" and c < w and st.opt_state is None:  # XLA:GPU: what it gathers; libtpu: all
        out["compute_copy"] = c * (n_gathered if compiler == "gpu" else n_stk)
    out["layer"] = w * gathered if gathered else w * n_stk / layers
    if shape["pipeline"] > 1 and cand.schedule == "1f1b" and cand.remat == "none":
        # 1F1B's stash under `none`: each slot keeps the stage's weights cast to the compute dtype
        out["stash_weights"] = stash_slots(cand) * c * n_stk
    return out
