"""The planner's cost model: bytes per device and seconds per step of one candidate plan.

Letters: N devices; mesh axes p (pipeline), d (data), f (fsdp), e (expert), t (tensor); B global
batch (sequences), T (= s) length, M_a gradient-accumulation microbatches, M pipeline microbatches,
v virtual stages; b = B / (d f e M_a M) sequences per device per microbatch; model sizes L layers,
h embed, a heads, k kv heads, q head_dim, F mlp, V vocab; Psi parameters. Bytes per parameter
W, G, O (weights, gradients, optimizer state); c bytes of the compute dtype.

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
  Under TP the head and F terms are divided by t (TP without SP also keeps the two row-parallel
  outputs, 2h, before their all-reduce); under SP (tp_sp) the h terms are divided too. Without
  pipelining every layer stores its set for one microbatch (accumulation runs them one by one).
  GPipe and interleaved rerun each stage in its backward: a stage stores a stage input [b, s, h] per
  tick (v M + P - 1) plus one microbatch's sets of its L/(P v) layers. 1F1B stores the sets of its
  L/P layers per slot (`stash_slots`; under `none` with the stage's weights in the compute dtype)
  and two [b, s, h] received per tick. On top: the working set of the layer being differentiated
  (its `none` set once), the logits in fp32 with their gradient (2 x 4 b s V / t). MoE layers add their
  capacity buffers, the expert input/output and hidden [E,G,C,M|H]: b s k cf (2h + 3H_e/t) per
  MoE layer (meshpar's default gather dispatch holds no [G,S,E,C] masks).
* Gradients: the backward writes them at the parameters' layout (ZeRO-2: already scattered; ZeRO-1
  without accumulation: XLA reduce-scatters each layer's gradient inside the backward loop, so the
  stacked layers' are held scattered too); with accumulation an accumulator sits beside each
  microbatch's gradients (x 2).
* Workspace: weight-sized buffers of the compiled step, read off XLA's buffer assignment and live
  ranges (`--xla_dump_to`) of the configs in tests/plan/test_plan.py, each a rule of meshpar's step:
  the layer loops (forward, backward) each copy the stacked weights they read when the update
  writes those weights in place (every preset without a sharded optimizer state): 2 W_stacked; the
  layer being computed: one layer's weights (under FSDP gathered over the batch axes); ZeRO-1/2
  gather the updated weights after the backward, so that phase (grads + W) counts only where it
  exceeds the backward's peak.
  Not modelled: XLA's packing of all temporaries into one buffer, which on CPU adds 15-25% over
  the largest live set.

Time per step (seconds).
* Compute: model FLOPs (PaLM appendix B, `meshpar.train.flops.flops_per_token`) x recomputation
  (full remat: one extra forward of the layers, x 4/3 of their FLOPs; save_dots: the attention
  score/PV matmuls again; GPipe and interleaved rerun each stage's forward in its backward, as
  GPipe's re-materialization (Huang et al. 2019), except a one-layer stage under full remat; 1F1B
  reruns nothing) / (N x peak x efficiency), the efficiency an assumption of the hardware preset
  (0.5: what tuned dense-LM runs report as MFU at scale).
* Collectives on ring formulas (Patarasuk & Yuan 2009; NCCL's bus-bandwidth note): all-gather and
  reduce-scatter (n-1)/n x V / bw, all-reduce twice that, all-to-all (n-1)/n x V / bw, a permute
  V / bw; V is the whole tensor (what `meshpar inspect` reports). An axis set that spans ICI and
  DCN runs hierarchically: (n_i - 1)/n_i V / bw_ici + (n_d - 1)/n_d (V / n_i) / bw_dcn.
  Bytes, read off the compiled steps of tests/plan/test_plan.py: data-parallel gradients and FSDP/ZeRO
  gathers per parameter; Megatron TP per layer and pass, in [b, s, h] units: column-parallel entries
  (SP: all-gather) in each forward pass (the forward, full remat's layer recompute, GPipe's stage
  recompute; SP under save_dots gathers the inputs again) and transposed in the backward,
  row-parallel exits likewise, the layer recompute's last exit dead code (it feeds nothing);
  1F1B's head and lookup run on one stage each (bytes averaged over the stages, as `inspect`);
  a MoE layer's expert collectives move its [E,G,C,M] buffer (k cf [b, s, h]), its gate and up
  projections transposed separately. A lookup table split over the batch axes moves looked-up rows
  (all-to-all of [b, s, h], and the row gradients back) when they are fewer bytes than the table;
  a replicated table's gradient under ZeRO (or an hsdp table's) is an all-gather of every
  device's row gradients when those are fewer bytes than the table's reduce-scatter. The
  interleaved schedule moves the stacked layers to chunk order and the gradients back (all-to-all).
* Pipeline bubble (Narayanan et al. 2021, sec. 2.2): (p - 1) / (v M) of the compute time (GPipe and
  1F1B, whose ticks pair an F with a B, alike; interleaving divides it by v).
* Overlap, assumed once: collectives over the batch axes (data, fsdp, expert-replicated gradient
  reductions, FSDP gathers, ZeRO's gather of updated weights) overlap with compute (XLA's async
  collectives and latency-hiding scheduler); tensor-parallel collectives, MoE all-to-alls and
  pipeline transfers sit on the critical path. step = max(compute, overlapped) + exposed + bubble.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax

from meshpar.core.errors import ShardingError
from meshpar.core.mesh import MESH_AXES
from meshpar.core.rules import BATCH_AXES, get_strategy, parse_user_rules, resolve, spec_axes
from meshpar.parallel.schedules import one_f_one_b_ticks, schedule_table

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
    """What the cost model needs of a model: its parameter tensors and, for activations, its sizes."""
    leaves: list
    params: int
    flops_per_token: float
    dims: dict                      # layers, embed, heads, kv_heads, head_dim, mlp, vocab (None if unknown)
    moe: dict = field(default_factory=dict)    # num_experts, every, top_k, capacity_factor, expert_mlp
    lookups: tuple = ()             # paths of tables read by a lookup only ([vocab, embed], embeddings not tied)

    @classmethod
    def from_config(cls, cfg) -> "ModelFacts":
        """Shapes only (`nnx.eval_shape`): a 175B model costs no memory here."""
        from meshpar.train.flops import active_params, flops_per_token
        from meshpar.core.precision import get_policy
        from meshpar.core.sharding import model_spec, path_name
        from meshpar.core.registry import default_model
        spec = model_spec(default_model(cfg), get_policy(cfg.precision))
        names = jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple))
        leaves = [Leaf(path_name(p), tuple(s.shape), tuple(n), bool(n) and n[0] == "layers")
                  for (p, s), n in zip(jax.tree_util.tree_leaves_with_path(spec.shapes), names)]
        m = spec.cfg
        dims = {k: getattr(m, k, None) for k in ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")}
        moe = {}
        if any("expert" in lf.names for lf in leaves):
            from meshpar.core.config import TOP_K
            moe = {"num_experts": cfg.moe.num_experts, "every": cfg.moe.every, "top_k": TOP_K[cfg.moe.routing],
                   "capacity_factor": cfg.moe.capacity_factor or 1.0, "expert_mlp": dims["mlp"]}
        n = sum(lf.numel for lf in leaves)
        lookups = () if getattr(m, "tie_embeddings", False) else tuple(
            lf.path for lf in leaves if not lf.stacked and lf.names == ("vocab", "embed"))
        return cls(leaves, n, flops_per_token(m, active_params(spec, cfg.moe.routing), cfg.batch.length), dims, moe, lookups)


@dataclass(frozen=True)
class Candidate:
    """One plan: full axis sizes (ICI x DCN), the part of each on DCN, strategy, remat, microbatches."""
    mesh: tuple                     # sizes in MESH_AXES order
    dcn: tuple                      # DCN part of each axis (1: all ICI)
    strategy: str
    remat: str
    microbatches: int = 1           # batch.microbatches (gradient accumulation)
    pp_microbatches: int = 1        # pipeline.microbatches
    schedule: str = "1f1b"
    virtual: int = 1

    @property
    def shape(self) -> dict:
        return dict(zip(MESH_AXES, self.mesh))

    @property
    def dcn_shape(self) -> dict:
        return dict(zip(MESH_AXES, self.dcn))


def _factor(spec, shape: dict) -> int:
    return math.prod(shape[a] for a in spec_axes(spec))


def _axes(spec) -> set:
    return set(spec_axes(spec))


class Resolver:
    """Each leaf's PartitionSpec under a strategy and mesh, by meshpar's resolver (cached)."""

    def __init__(self, cfg):
        self.user = parse_user_rules(cfg.rules)
        self.cache = {}

    def spec(self, leaf: Leaf, strategy: str, shape: dict, kind: str):
        key = (leaf.names, leaf.shape, strategy, tuple(shape.values()), kind)
        if key not in self.cache:
            s = get_strategy(strategy)
            rules = self.user + (s.opt_rules() if kind == "opt_state" else s.param_rules())
            self.cache[key] = resolve(leaf.names, rules, shape, leaf.shape, f"parameter '{leaf.path}'",
                                      strict=len(self.user))
        return self.cache[key]


def state_bytes(facts: ModelFacts, cand: Candidate, res: Resolver, bpp=(4, 4, 8)) -> dict:
    """Per-device params, grads, optimizer bytes (ZeRO accounting on meshpar's real layouts).
    Raises ShardingError when a tensor is not divisible by its mesh axes."""
    w, g, o = bpp
    shape = cand.shape
    zero2 = get_strategy(cand.strategy).shard_grads
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for lf in facts.leaves:
        ps = _factor(res.spec(lf, cand.strategy, shape, "params"), shape)
        os_ = _factor(res.spec(lf, cand.strategy, shape, "opt_state"), shape)
        out["params"] += w * lf.numel / ps
        out["grads"] += g * lf.numel / (os_ if zero2 else ps)
        out["optimizer"] += o * lf.numel / os_
    return out


def local_batch(cfg, cand: Candidate) -> float:
    """b: sequences per device per (accumulation x pipeline) microbatch."""
    s = cand.shape
    dp = s["data"] * s["fsdp"] * s["expert"]
    return cfg.batch.global_size / (dp * cand.microbatches * cand.pp_microbatches)


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


def _per_token(dims: dict, remat: str, t_heads: int, t_mlp: int, t_res: int, s: int) -> float:
    """Elements stored per token of one layer (see the module docstring)."""
    h, a, k, q, f = dims["embed"], dims["heads"], dims["kv_heads"], dims["head_dim"], dims["mlp"]
    if remat == "full" or remat == "offload":
        return h / t_res
    if remat == "save_dots":
        return 3 * h / t_res + (a + 2 * k) * q / t_heads + 2 * f / t_mlp
    partial = 2 * h if t_heads > 1 and t_res == 1 else 0      # TP without SP: the row-parallel outputs (wo, w_down)
    return 4 * h / t_res + partial + (2 * a + 2 * k) * q / t_heads + 2 * a * s / t_heads + 4 * f / t_mlp


def activation_parts(facts: ModelFacts, cand: Candidate, cfg, c: int) -> dict:
    """Per-device activation memory of one step (bytes) by term (see the module docstring)."""
    d, shape = facts.dims, cand.shape
    b, s = local_batch(cfg, cand), cfg.batch.length
    out = {"batch": 4 * b * cand.microbatches * cand.pp_microbatches * (s + 1)}   # int32 tokens [B, T+1] / dp
    if not all(d.get(k) for k in ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")):
        return out                                                      # a user model without sizes
    t = shape["tensor"]
    tp = get_strategy(cand.strategy).params
    t_heads = t if any(n == "heads" for n, _ in tp) and d["kv_heads"] % t == 0 else 1
    t_mlp = t if any(n == "mlp" for n, _ in tp) else 1
    t_res = t if any(n == "length" for n, _ in tp) else 1
    t_vocab = t if any(n == "vocab" for n, _ in tp) else 1
    layers = d["layers"] / shape["pipeline"]
    tokens = b * s
    per_layer = _per_token(d, cand.remat, t_heads, t_mlp, t_res, s)
    if shape["pipeline"] == 1:
        out["stored"] = c * layers * tokens * per_layer
    elif cand.schedule == "1f1b":   # residual slots (see stash_slots); the input and the gradient received
        out["stored"] = c * tokens * (stash_slots(cand) * layers * per_layer + 2 * d["embed"] / t_res)
    else:       # the stash of stage inputs, then one microbatch's residuals while its stage runs backward
        ticks = cand.virtual * cand.pp_microbatches + shape["pipeline"] - 1
        out["stored"] = c * tokens * (ticks * d["embed"] / t_res + layers / cand.virtual * per_layer)
    out["working"] = c * tokens * _per_token(d, "none", t_heads, t_mlp, t_res, s)
    out["logits"] = 2 * 4 * tokens * d["vocab"] / t_vocab
    if facts.moe:
        m = facts.moe
        moe_layers = layers / m["every"]
        buf = tokens * m["top_k"] * m["capacity_factor"] * (2 * d["embed"] + 3 * m["expert_mlp"] / t_mlp)
        held = moe_layers / cand.virtual if shape["pipeline"] > 1 else moe_layers   # one microbatch's
        out["moe"] = c * buf * ((held if cand.remat == "none" else 0) + 1)
    return out


def activation_bytes(facts: ModelFacts, cand: Candidate, cfg, c: int) -> float:
    return sum(activation_parts(facts, cand, cfg, c).values())


# -- collectives ---------------------------------------------------------------------------------

def _batch_axes(shape: dict) -> list:
    return [a for a in BATCH_AXES if shape[a] > 1]


def stage_recompute(facts: ModelFacts, cand: Candidate) -> float:
    """Forward passes of a stage its backward reruns: one for GPipe and interleaved (they keep stage
    inputs; a scan of two or more layers reruns whole), none for 1F1B (it keeps residuals) or for a
    one-layer tick under full remat (the rerun is dead: the stage holds the layer's only residual)."""
    if cand.shape["pipeline"] == 1 or cand.schedule == "1f1b":
        return 0.0
    per_tick = (facts.dims.get("layers") or 1) / cand.shape["pipeline"] / cand.virtual
    return 0.0 if cand.remat == "full" and per_tick <= 1 else 1.0


def collectives(facts: ModelFacts, cand: Candidate, cfg, res: Resolver, c: int, g: int = 4, w: int = 4) -> list:
    """Predicted collectives of one step: [{kind, axes, bytes (whole tensor, per step), overlap}],
    bytes counted as `meshpar inspect` counts them. g, w: bytes of a gradient / weight element on
    the wire (meshpar reduces gradients and gathers weights in the parameter dtype, fp32)."""
    shape, st = cand.shape, get_strategy(cand.strategy)
    batch_axes, ma = _batch_axes(shape), cand.microbatches
    zero1 = st.opt_state is not None and not st.shard_grads
    out = []

    def add(kind, axes, nbytes, overlap):
        if nbytes > 0 and axes:
            out.append({"kind": kind, "axes": sorted(axes, key=MESH_AXES.index), "bytes": float(nbytes),
                        "overlap": overlap})

    remat_ag = 2                    # the forward and the backward layer loop each gather (none is kept)
    grad_times = 1 if zero1 else ma
    tokens = local_batch(cfg, cand) * cand.pp_microbatches * cfg.batch.length   # per device, accumulation microbatch
    for lf in facts.leaves:
        ps = res.spec(lf, cand.strategy, shape, "params")
        sharded = _axes(ps)
        on_batch = [a for a in batch_axes if a in sharded and not (a == "expert" and "expert" in lf.names)]
        rest = [a for a in batch_axes if a not in sharded]          # partial sums to all-reduce
        local = lf.numel / _factor(ps, shape)          # per-device elements at rest
        full_over_batch = local * math.prod(shape[a] for a in on_batch)
        rows = c * tokens * lf.shape[-1] if lf.path in facts.lookups else math.inf   # looked-up rows, per device
        if on_batch and sharded <= set(batch_axes) and rows < w * full_over_batch:
            add("all-to-all", on_batch, rows * ma, False)              # lookup: rows move, not the table
            rows_all = rows * math.prod(shape[a] for a in batch_axes)  # every device's row gradients
            if not rest:                                                # row gradients back the same way
                add("all-to-all", on_batch, rows * ma, False)
            elif rows_all < g * (full_over_batch + local):              # hsdp: gathered, scatter-added locally
                add("all-gather", batch_axes, rows_all * ma, True)
                add("all-reduce", rest, g * local * ma, True)
            else:
                add("reduce-scatter", on_batch, g * full_over_batch * ma, True)
                add("all-reduce", rest, g * local * ma, True)
            continue
        if on_batch:                                   # FSDP: gather for use, reduce-scatter the grads
            mb = ma * (cand.pp_microbatches if lf.stacked else 1)   # a stage gathers its layers per microbatch
            add("all-gather", on_batch, w * full_over_batch * (remat_ag if lf.stacked else 1) * mb, True)
            add("reduce-scatter", on_batch, g * full_over_batch * mb, True)
            add("all-reduce", rest, g * local * mb, True)
            continue
        if st.opt_state is not None:                   # ZeRO-1/2: RS into the sharded state, AG updated weights
            os_ = res.spec(lf, cand.strategy, shape, "opt_state")
            rs = [a for a in batch_axes if a in _axes(os_)]
            if rs:
                rows_all = rows * math.prod(shape[a] for a in rs)      # every device's row gradients
                if (st.shard_grads or ma == 1) and rows_all < g * local:
                    add("all-gather", rs, rows_all * ma, True)         # scatter-added into the local shard
                else:
                    add("reduce-scatter", rs, g * local * grad_times, True)
                add("all-gather", rs, w * local, True)
                add("all-reduce", [a for a in batch_axes if a not in rs], g * local * grad_times, True)
                continue
        if not lf.stacked and shape["pipeline"] > 1:   # outer params: one all-reduce over pipeline x rest
            add("all-reduce", rest + ["pipeline"], g * local * grad_times, False)
        else:
            add("all-reduce", rest, g * local * grad_times, True)
    d = facts.dims
    if not d.get("embed"):
        return out
    b, s, h = local_batch(cfg, cand), cfg.batch.length, d["embed"]
    n_mb = ma * cand.pp_microbatches
    layers = d["layers"] / shape["pipeline"]
    act = c * b * s * h                                 # one [b, s, h] activation per device
    t = shape["tensor"]
    p = shape["pipeline"]
    sp = any(n_ == "length" for n_, _ in st.params)     # SP: the residual is split over tensor
    if t > 1 and any(n == "heads" for n, _ in st.params):
        # every stage computes on every tick of GPipe / interleaved (bubble ticks too)
        runs = ma * (cand.virtual * cand.pp_microbatches + p - 1) if p > 1 and cand.schedule != "1f1b" else n_mb
        moe, kc = 0.0, 0.0          # share of MoE layers; their buffer [E,G,C,M] relative to [b, s, h]
        if facts.moe and any(n_ == "expert_mlp" for n_, _ in st.params):
            moe, kc = 1 / facts.moe["every"], facts.moe["top_k"] * facts.moe["capacity_factor"]
        dense, full = 1 - moe, cand.remat == "full"
        one_f = p > 1 and cand.schedule == "1f1b"       # bytes averaged over its stages (per-device branches)
        lc = layers / cand.virtual                      # layers a tick runs
        f = 1 + full + stage_recompute(facts, cand)    # forward passes: forward, layer and stage recompute
        # The layer recompute's last row-parallel output (a dense layer's, the layer's own output) feeds
        # nothing: dead code. MoE models scan groups of layers that end in a MoE combine, not a collective.
        dead = dense * (full and not facts.moe)
        # per layer, in [b, s, h]: column-parallel entries / row-parallel exits, in forward passes (f)
        # and transposed in the backward (b); attention, dense MLP, MoE expert gate+up (2 entries) and
        # down; SP under save_dots/offload gathers each entry's input again for its weight gradient
        regather = 1 if sp and cand.remat in ("save_dots", "offload") else 0
        ent_f, ex_f = (f + regather) * (1 + dense + moe * kc), f * (1 + dense + moe * kc) - dead
        ent_b, ex_b = 1 + dense + 2 * moe * kc, 1 + dense + moe * kc
        # the head's input (and its gradient) and the lookup's output; under SP (no pipeline: see
        # `_Model.for_embed`) a lookup table split over tensor is gathered whole instead
        table_numel = sum(lf.numel for lf in facts.leaves if lf.path in facts.lookups and sp and p == 1
                          and "tensor" in _axes(res.spec(lf, cand.strategy, shape, "params")))
        for kind, per_layer in ((("all-gather", ent_f + ex_b), ("reduce-scatter", ex_f + ent_b)) if sp else
                                (("all-reduce", ex_f + ent_b),)):
            lookup = (w if kind == "all-gather" else g) * table_numel if table_numel else act
            # 1F1B: the head on the last stage, the lookup on the first (its forward and backward ticks)
            edges = (act + 2 * lookup) / p if one_f else act + lookup
            add(kind, ["tensor"], runs * (act * lc * per_layer + edges), False)
        if one_f and sp:        # 1F1B's embedding backward runs every tick on every stage (`meshpar.parallel.pipeline`),
            ticks = one_f_one_b_ticks(p, cand.pp_microbatches)    # on the gathered sequence-split cotangent
            add("all-gather", ["tensor"], act * ticks * ma, False)
    if p > 1:
        table = schedule_table(cand.schedule, p, cand.pp_microbatches, cand.virtual)
        permutes = 2 * one_f_one_b_ticks(p, cand.pp_microbatches) if cand.schedule == "1f1b" else len(table)  # per tick
        add("collective-permute", ["pipeline"], act / (t if sp else 1) * permutes * ma, False)
        if cand.schedule == "interleaved" and cand.virtual > 1:   # layers to chunk order and gradients back
            stacked = sum(lf.numel / _factor(res.spec(lf, cand.strategy, shape, "params"), shape)
                          for lf in facts.leaves if lf.stacked)
            add("all-to-all", ["pipeline"], (w + g) * stacked * ma, False)
    if facts.moe and shape["expert"] > 1:
        m = facts.moe
        per = 4 + (2 if cand.remat == "full" else 0)
        buf = c * b * s * m["top_k"] * m["capacity_factor"] * h
        add("all-to-all", ["expert"], buf * per * n_mb * layers / m["every"], False)
    return out


def collective_time(op: dict, cand: Candidate, hw) -> float:
    """Seconds of one predicted collective on its axes (ring; hierarchical across ICI and DCN)."""
    shape, dcn = cand.shape, cand.dcn_shape
    n_d = math.prod(dcn[a] for a in op["axes"])
    n_i = math.prod(shape[a] for a in op["axes"]) // n_d
    v = op["bytes"]
    if op["kind"] == "collective-permute":
        return v / (hw.dcn_bw if n_d > 1 else hw.ici_bw)
    ring = (n_i - 1) / n_i * v / hw.ici_bw + ((n_d - 1) / n_d * v / n_i / hw.dcn_bw if n_d > 1 else 0.0)
    return 2 * ring if op["kind"] == "all-reduce" else ring


def step_time(facts: ModelFacts, cand: Candidate, cfg, hw, ops: list) -> dict:
    """compute_s, comm_s (all collectives), exposed_s (not overlapped), bubble_s, step_s, mfu."""
    n = math.prod(cand.mesh)
    tokens = cfg.batch.global_size * cfg.batch.length
    model_flops = facts.flops_per_token * tokens
    d = facts.dims
    attn = 12.0 * d["layers"] * d["heads"] * d["head_dim"] * cfg.batch.length if d.get("heads") else 0.0
    layer_share = 1.0 - 6.0 * (d["vocab"] or 0) * (d["embed"] or 0) / max(facts.flops_per_token, 1.0)
    extra = {"none": 0.0, "full": layer_share / 3, "offload": attn / facts.flops_per_token / 3,
             "save_dots": attn / facts.flops_per_token / 3}[cand.remat]
    extra += stage_recompute(facts, cand) * layer_share / 3   # GPipe/interleaved rerun each stage in its backward
    compute = model_flops * (1 + extra) / (n * hw.peak_flops * hw.efficiency)
    times = [collective_time(op, cand, hw) for op in ops]
    overlapped = sum(tm for tm, op in zip(times, ops) if op["overlap"])
    exposed = sum(tm for tm, op in zip(times, ops) if not op["overlap"])
    p = cand.shape["pipeline"]
    bubble = compute * (p - 1) / (cand.virtual * cand.pp_microbatches) if p > 1 else 0.0
    step = max(compute, overlapped) + exposed + bubble
    return {"compute_s": compute, "comm_s": overlapped + exposed, "exposed_comm_s": exposed, "bubble_s": bubble,
            "step_s": step, "mfu": model_flops / (step * n * hw.peak_flops)}


def _local(lf: Leaf, cand: Candidate, res: Resolver) -> float:
    """Elements of `lf` one device holds at rest."""
    return lf.numel / _factor(res.spec(lf, cand.strategy, cand.shape, "params"), cand.shape)


def workspace_parts(facts: ModelFacts, cand: Candidate, res: Resolver, w: float = 4, c: int = 2) -> dict:
    """Weight-sized buffers the compiled step holds beside its state (bytes; see the module
    docstring), `w` bytes per weight element, `c` per compute-dtype element."""
    shape, st = cand.shape, get_strategy(cand.strategy)
    stacked = [lf for lf in facts.leaves if lf.stacked]
    w_stk = w * sum(_local(lf, cand, res) for lf in stacked)
    out = {"loop_copies": 2 * w_stk if st.opt_state is None else 0.0}
    layers = (facts.dims.get("layers") or 1) / shape["pipeline"]
    gathered = 0.0
    for lf in stacked:                              # FSDP: the layer being computed, gathered over the batch axes
        on_batch = _axes(res.spec(lf, cand.strategy, shape, "params")) & set(BATCH_AXES)
        gathered += _local(lf, cand, res) * math.prod(shape[a] for a in on_batch) / lf.shape[0] if on_batch else 0.0
    out["layer"] = w * gathered if gathered else w_stk / layers
    if shape["pipeline"] > 1 and cand.schedule == "1f1b" and cand.remat == "none":
        # 1F1B's stash under `none`: each slot keeps the stage's weights cast to the compute dtype
        out["stash_weights"] = stash_slots(cand) * c * sum(_local(lf, cand, res) for lf in stacked)
    return out


def evaluate(facts: ModelFacts, cand: Candidate, cfg, hw, res: Resolver, bpp, c: int) -> dict | None:
    """Memory, collectives and time of one candidate; None when a tensor does not divide its axes."""
    try:
        mem = state_bytes(facts, cand, res, bpp)
        ws = workspace_parts(facts, cand, res, bpp[0], c)
    except ShardingError:
        return None
    act = activation_bytes(facts, cand, cfg, c)
    grads = mem["grads"]
    st = get_strategy(cand.strategy)
    if cand.microbatches > 1:                       # the accumulator beside each microbatch's gradients
        mem["grads"] = 2 * grads
    elif st.opt_state is not None and not st.shard_grads:   # ZeRO-1: each layer's gradient is
        # reduce-scattered inside the backward loop (XLA), so the stacked layers' are held scattered
        mem["grads"] = grads = sum(bpp[1] * lf.numel / _factor(res.spec(
            lf, cand.strategy, cand.shape, "opt_state" if lf.stacked else "params"), cand.shape) for lf in facts.leaves)
    if st.opt_state is not None:                    # ZeRO: the gathered updated weights, after the backward
        ws["zero_gather"] = max(0.0, grads + mem["params"] - (mem["grads"] + act + sum(ws.values())))
    mem["activations"] = act
    mem["workspace"] = sum(ws.values())
    mem["total"] = sum(mem.values())
    ops = collectives(facts, cand, cfg, res, c)
    return {"memory": mem, "collectives": ops, "time": step_time(facts, cand, cfg, hw, ops),
            "fits": mem["total"] <= hw.memory_bytes}


def summarize(ops: list) -> dict:
    """kind -> bytes per step (as `meshpar.plan.inspect.summarize` reports them)."""
    out: dict = {}
    for op in ops:
        out[op["kind"]] = out.get(op["kind"], 0.0) + op["bytes"]
    return out

