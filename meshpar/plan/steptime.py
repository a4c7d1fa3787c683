"""The planner's step time: the collectives a candidate plan moves and the seconds of one step
(the letters and the memory side: `meshpar.plan.costmodel`).

Time per step (seconds).
* Compute: model FLOPs (PaLM appendix B, `meshpar.train.flops.flops_per_token`) x recomputation
  (full remat: one extra forward of the layers, x 4/3 of their FLOPs; save_dots: the attention
  score/PV matmuls again; GPipe and interleaved rerun each stage's forward in its backward, as
  GPipe's re-materialization (Huang et al. 2019), except a one-layer stage under full remat; 1F1B
  reruns nothing) per device, on the roofline of its GEMMs, plus the bytes every other kernel moves
  at memory bandwidth (`meshpar.plan.roofline`: its fit to the lent H100 and to Narayanan et al.
  2021's Table 1, `meshpar.plan.papers`).
* Collectives, alpha-beta (Hockney's model; NCCL's tuning model, src/graph/tuning.cc): a latency per
  collective and per hop (`Hardware.latency`) plus the bytes on ring formulas (Patarasuk & Yuan
  2009; NCCL's bus-bandwidth note) at `comm_efficiency` of the links: all-gather and
  reduce-scatter (n-1)/n x V / bw with n - 1 hops, all-reduce twice the bytes (a ring inside a
  node, across nodes NCCL's tree of 2 log2 hops), all-to-all (n-1)/n x V / bw, a permute V / bw
  and one hop; V is the whole tensor (what `meshpar inspect` reports), and each predicted op counts
  the separate collectives it stands for (a scan gathers, reduces, permutes once per layer, pass,
  microbatch or tick). An axis set that spans ICI and DCN runs hierarchically, as NCCL's rings do
  with a channel per NIC: (n_i - 1)/n_i V / bw_ici + (n_d - 1)/n_d (V / n_i) / bw_dcn.
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
* Context parallelism (meshpar.parallel.context, all-gather CP): per layer and forward pass an
  all-gather of K and V over `context`, 2 c b s k q / t_k bytes (whole tensor; each device receives
  (x-1)/x of it), gathered again in the backward, which reduce-scatters their gradients (as large);
  on the critical path. Weight gradients are all-reduced over `context` with the batch axes. Causal attention FLOPs
  are the same on every device (balanced order), so compute divides by N as before.
* Pipeline bubble (Narayanan et al. 2021, sec. 2.2): (p - 1) / (v M) of the compute time (GPipe and
  1F1B, whose ticks pair an F with a B, alike; interleaving divides it by v).
* Overlap: collectives over the batch axes (data, fsdp, expert-replicated gradient reductions, FSDP
  gathers, ZeRO's gather of updated weights) overlap with compute, as the H100 target's compiled
  schedule shows (`meshpar inspect --target h100`, 125m fsdp x 8: 3 of 4 all-gathers, every
  reduce-scatter and all-reduce with compute between start and done, the scanned layer's gather
  issued while the layer before computes); tensor-parallel collectives, MoE all-to-alls and pipeline
  transfers sit on the critical path. step = max(compute, overlapped) + exposed + bubble.
"""

from __future__ import annotations

import math
from functools import partial

from meshpar.core.errors import ShardingError
from meshpar.core.mesh import MESH_AXES
from meshpar.core.rules import BATCH_AXES, get_strategy
from meshpar.parallel.schedules import one_f_one_b_ticks
from meshpar.plan.costmodel import (
    Candidate,
    ModelFacts,
    Resolver,
    activation_bytes,
    local_batch,
    rows_factor,
    sharded_axes,
    split_factor,
    stage_recompute,
    state_bytes,
    workspace_parts,
)
from meshpar.plan.roofline import matmul_fit, vector_bytes


def _batch_axes(shape: dict) -> list:
    """Axes whose devices hold different tokens (weight gradients are summed over them): the batch
    axes and `context`."""
    return [a for a in (*BATCH_AXES, "context") if shape[a] > 1]


def collectives(facts: ModelFacts, cand: Candidate, res: Resolver, c: int, g: int = 4, w: int = 4) -> list:
    """Predicted collectives of one step: [{kind, axes, bytes (whole tensor, per step), overlap, count}],
    bytes counted as `meshpar inspect` counts them: the weights' (gathers, gradient reductions) and
    the activations' (tensor, context, pipeline and expert parallelism). g, w: bytes of a gradient /
    weight element on the wire (meshpar reduces gradients and gathers weights in the parameter
    dtype, fp32); c: bytes of an activation element."""
    out: list = []
    _weight_collectives(out, facts, cand, res, c, g, w)
    if facts.dims.get("embed"):
        _activation_collectives(out, facts, cand, res, c, g, w)
    return out


def _add(out: list, kind: str, axes, nbytes: float, overlap: bool, count: float = 1.0) -> None:
    """One predicted collective (`count`: how many separate ones it stands for, each paying latency)."""
    if nbytes > 0 and axes:
        out.append(
            {
                "kind": kind,
                "axes": sorted(axes, key=MESH_AXES.index),
                "bytes": float(nbytes),
                "overlap": overlap,
                "count": float(max(count, 1)),
            }
        )


def _weight_collectives(out: list, facts: ModelFacts, cand: Candidate, res: Resolver, c: int, g: int, w: int):
    """Per parameter: FSDP's gathers and reduce-scatters, ZeRO's, data parallelism's all-reduce, an
    embedding lookup's rows over the batch axes."""
    shape, st = cand.shape, get_strategy(cand.strategy)
    batch_axes, ma = _batch_axes(shape), cand.microbatches
    zero1 = st.opt_state is not None and not st.shard_grads
    add = partial(_add, out)
    remat_ag = 2  # the forward and the backward layer loop each gather (none is kept)
    grad_times = 1 if zero1 else ma
    tokens = (
        local_batch(facts.run, cand) * cand.pp_microbatches * facts.run.length / shape["context"]
    )  # per device, accumulation mb
    for lf in facts.leaves:
        ps = res.spec(lf, cand.strategy, shape, "rest")
        sharded = sharded_axes(ps)
        on_batch = [a for a in batch_axes if a in sharded and not (a == "expert" and "expert" in lf.names)]
        rest = [a for a in batch_axes if a not in sharded]  # partial sums to all-reduce
        local = lf.numel / split_factor(ps, shape)  # per-device elements at rest
        full_over_batch = local * math.prod(shape[a] for a in on_batch)
        rows = c * tokens * lf.shape[-1] if lf.path in facts.lookups else math.inf  # looked-up rows, per device
        if on_batch and sharded <= set(batch_axes) and rows < w * full_over_batch:
            add("all-to-all", on_batch, rows * ma, False, ma)  # lookup: rows move, not the table
            rows_all = rows * math.prod(shape[a] for a in batch_axes)  # every device's row gradients
            if not rest:  # row gradients back the same way
                add("all-to-all", on_batch, rows * ma, False, ma)
            elif rows_all < g * (full_over_batch + local):  # hsdp: gathered, scatter-added locally
                add("all-gather", batch_axes, rows_all * ma, True, ma)
                add("all-reduce", rest, g * local * ma, True, ma)
            else:
                add("reduce-scatter", on_batch, g * full_over_batch * ma, True, ma)
                add("all-reduce", rest, g * local * ma, True, ma)
            continue
        mb = ma * (cand.pp_microbatches if lf.stacked else 1)  # a stage gathers its layers per microbatch
        per = (facts.dims.get("layers") or 1) / shape["pipeline"] if lf.stacked else 1  # one collective per layer
        at_use = w * full_over_batch * (remat_ag if lf.stacked else 1) * mb  # weights gathered for use
        if st.opt_state is not None:  # ZeRO-1/2: RS into the sharded state, AG updated weights
            os_ = res.spec(lf, cand.strategy, shape, "opt_state")
            rs = [a for a in batch_axes if a in sharded_axes(os_)]
            if rs:
                rows_all = rows * math.prod(shape[a] for a in rs)  # every device's row gradients
                if (st.shard_grads or ma == 1) and rows_all < g * full_over_batch:
                    add("all-gather", rs, rows_all * ma, True, ma)  # scatter-added into the local shard
                else:
                    add("reduce-scatter", rs, g * full_over_batch * grad_times, True, per * grad_times)
                add("all-gather", [a for a in rs if a not in on_batch], w * local, True, per)
                add(
                    "all-reduce",
                    [a for a in batch_axes if a not in rs],
                    g * full_over_batch * grad_times,
                    True,
                    per * grad_times,
                )
                add(
                    "all-gather", on_batch, at_use, True, per * remat_ag * mb
                )  # master weights at rest over `context`, as FSDP
                continue
        if on_batch:  # FSDP: gather for use, reduce-scatter the grads
            add("all-gather", on_batch, at_use, True, per * (remat_ag if lf.stacked else 1) * mb)
            add("reduce-scatter", on_batch, g * full_over_batch * mb, True, per * mb)
            add("all-reduce", rest, g * local * mb, True, per * mb)
            continue
        if not lf.stacked and shape["pipeline"] > 1:  # outer params: one all-reduce over pipeline x rest
            add("all-reduce", rest + ["pipeline"], g * local * grad_times, False, grad_times)
        else:
            add("all-reduce", rest, g * local * grad_times, True, per * grad_times)


def _activation_collectives(out: list, facts: ModelFacts, cand: Candidate, res: Resolver, c: int, g: int, w: int):
    """Per layer pass: tensor parallelism's all-reduces (or SP's gathers and reduce-scatters), context
    parallelism's K/V gathers, the pipeline's permutes, expert parallelism's all-to-alls."""
    shape, st = cand.shape, get_strategy(cand.strategy)
    ma = cand.microbatches
    add = partial(_add, out)
    d = facts.dims
    b, s, h = local_batch(facts.run, cand), facts.run.length, d["embed"]
    n_mb = ma * cand.pp_microbatches
    layers = d["layers"] / shape["pipeline"]
    cp = shape["context"]
    act = c * b * s * h / cp  # one [b, s, h] activation per device
    t = shape["tensor"]
    p = shape["pipeline"]
    # layer passes per step: every stage computes on every tick of GPipe / interleaved (bubble ticks too)
    runs = ma * (cand.virtual * cand.pp_microbatches + p - 1) if p > 1 and cand.schedule != "1f1b" else n_mb
    if cp > 1:  # K and V gathered per layer, gradients scattered back
        t_k = t if any(n == "kv_heads" for n, _ in st.params) and d["kv_heads"] % t == 0 else 1
        kv = c * b * s * 2 * d["kv_heads"] * d["head_dim"] / t_k
        passes = 1 + (cand.remat == "full") + stage_recompute(facts, cand)
        add("all-gather", ["context"], kv * layers * (passes + 1) * runs, False, layers * (passes + 1) * runs)
        add("reduce-scatter", ["context"], kv * layers * runs, False, layers * runs)
    sp = any(n_ == "length" for n_, _ in st.params)  # SP: the residual is split over tensor
    if t > 1 and any(n == "heads" for n, _ in st.params):
        moe, kc = 0.0, 0.0  # share of MoE layers; their buffer [E,G,C,M] relative to [b, s, h]
        if facts.moe and any(n_ == "expert_mlp" for n_, _ in st.params):
            moe, kc = 1 / facts.moe["every"], facts.moe["top_k"] * rows_factor(facts.moe, shape)
        dense, full = 1 - moe, cand.remat == "full"
        one_f = p > 1 and cand.schedule == "1f1b"  # bytes averaged over its stages (per-device branches)
        lc = layers / cand.virtual  # layers a tick runs
        f = 1 + full + stage_recompute(facts, cand)  # forward passes: forward, layer and stage recompute
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
        # `StageModel.for_embed`) a lookup table split over tensor is gathered whole instead
        table_numel = sum(
            lf.numel
            for lf in facts.leaves
            if lf.path in facts.lookups
            and sp
            and p == 1
            and "tensor" in sharded_axes(res.spec(lf, cand.strategy, shape, "params"))
        )
        for kind, per_layer in (
            (("all-gather", ent_f + ex_b), ("reduce-scatter", ex_f + ent_b)) if sp else (("all-reduce", ex_f + ent_b),)
        ):
            lookup = (w if kind == "all-gather" else g) * table_numel if table_numel else act
            # 1F1B: the head on the last stage, the lookup on the first (its forward and backward ticks)
            edges = (act + 2 * lookup) / p if one_f else act + lookup
            add(kind, ["tensor"], runs * (act * lc * per_layer + edges), False, runs * (lc * per_layer + 2))
        if one_f and sp:  # 1F1B's embedding backward runs every tick on every stage (`meshpar.parallel.pipeline`),
            ticks = one_f_one_b_ticks(p, cand.pp_microbatches)  # on the gathered sequence-split cotangent
            add("all-gather", ["tensor"], act * ticks * ma, False, ticks * ma)
    if p > 1:
        permutes = (
            2 * one_f_one_b_ticks(p, cand.pp_microbatches)
            if cand.schedule == "1f1b"
            else 2 * (cand.virtual * cand.pp_microbatches + p - 1)
        )  # per tick: GPipe's and interleaved forward, mirrored
        add("collective-permute", ["pipeline"], act / (t if sp else 1) * permutes * ma, False, permutes * ma)
        if cand.schedule == "interleaved" and cand.virtual > 1:  # layers to chunk order and gradients back
            stacked = sum(
                lf.numel / split_factor(res.spec(lf, cand.strategy, shape, "rest"), shape)
                for lf in facts.leaves
                if lf.stacked
            )
            add("all-to-all", ["pipeline"], (w + g) * stacked * ma, False, 2 * ma)
    if facts.moe and shape["expert"] > 1:
        m = facts.moe
        per = 4 + (2 if cand.remat == "full" else 0)
        buf = c * b * s * m["top_k"] * rows_factor(m, shape) * h
        add("all-to-all", ["expert"], buf * per * n_mb * layers / m["every"], False, per * n_mb * layers / m["every"])


def collective_time(op: dict, cand: Candidate, hw) -> float:
    """Seconds of one predicted collective on its axes: alpha-beta (latency per collective and hop,
    then bytes at `comm_efficiency` of the links), ring, hierarchical across ICI and DCN."""
    shape, dcn = cand.shape, cand.dcn_shape
    n_d = math.prod(dcn[a] for a in op["axes"])
    n_i = math.prod(shape[a] for a in op["axes"]) // n_d
    v, bw = op["bytes"], hw.comm_efficiency
    base, hop_i, hop_d = hw.latency
    if op["kind"] == "collective-permute":
        return op.get("count", 1) * (base + (hop_d if n_d > 1 else hop_i)) + v / (
            (hw.dcn_bw if n_d > 1 else hw.ici_bw) * bw
        )
    ring = (n_i - 1) / n_i * v / hw.ici_bw + ((n_d - 1) / n_d * v / n_i / hw.dcn_bw if n_d > 1 else 0.0)
    hops = (n_i - 1) * hop_i + (n_d - 1) * hop_d
    if op["kind"] == "all-reduce":  # a ring inside the node; across nodes NCCL's tree, 2 log2 hops
        hops = 2 * ((n_i - 1) * hop_i + math.ceil(math.log2(n_d)) * hop_d) if n_d > 1 else 2 * hops
        ring *= 2
    return op.get("count", 1) * (base + hops) + ring / bw


def executed_flops(facts: ModelFacts, cand: Candidate) -> float:
    """Matmul FLOPs one device executes per step: the model's, with recomputation."""
    n = math.prod(cand.mesh)
    model_flops = facts.flops_per_token * facts.run.global_size * facts.run.length
    d = facts.dims
    attn = 12.0 * d["layers"] * d["heads"] * d["head_dim"] * facts.run.length if d.get("heads") else 0.0
    layer_share = 1.0 - 6.0 * (d["vocab"] or 0) * (d["embed"] or 0) / max(facts.flops_per_token, 1.0)
    extra = {
        "none": 0.0,
        "full": layer_share / 3,
        "offload": attn / facts.flops_per_token / 3,
        "save_dots": attn / facts.flops_per_token / 3,
    }[cand.remat]
    extra += stage_recompute(facts, cand) * layer_share / 3  # GPipe/interleaved rerun each stage in its backward
    if facts.run.loss_chunks > 1:  # the head's forward again, slice by slice, in its backward
        extra += 2.0 * (d["vocab"] or 0) * (d["embed"] or 0) / max(facts.flops_per_token, 1.0)
    return model_flops * (1 + extra) / n


def matmul_seconds(facts: ModelFacts, cand: Candidate, hw, c: int = 2, flops: float | None = None) -> float:
    """The step's matmuls on one device (`flops`: `executed_flops`, when already counted), on the
    roofline of their shapes (`meshpar.plan.roofline`)."""
    flops = executed_flops(facts, cand) if flops is None else flops
    return flops / (hw.peak_flops * hw.efficiency * matmul_fit(facts, cand, hw, c))


def lower_bound(facts: ModelFacts, cand: Candidate, hw, c: int = 2) -> float:
    """Seconds no cheaper than the candidate's step: its matmuls and their bubble (what the search
    sorts by, to cost the promising candidates first and stop when none left can rank)."""
    p = cand.shape["pipeline"]
    return matmul_seconds(facts, cand, hw, c) * (1 + ((p - 1) / (cand.virtual * cand.pp_microbatches) if p > 1 else 0))


def step_time(
    facts: ModelFacts, cand: Candidate, hw, ops: list, res: Resolver | None = None, bpp=(4, 4, 8), c: int = 2
) -> dict:
    """compute_s (matmul_s + vector_s, `meshpar.plan.roofline`), comm_s (all collectives), exposed_s
    (not overlapped), bubble_s, step_s, mfu."""
    n = math.prod(cand.mesh)
    model_flops = facts.flops_per_token * facts.run.global_size * facts.run.length
    flops = executed_flops(facts, cand)
    matmul = matmul_seconds(facts, cand, hw, c, flops)
    passes = 3 + (cand.remat != "none") + stage_recompute(facts, cand)
    vector = vector_bytes(facts, cand, res or Resolver(), bpp, c, passes, hw.kind) / hw.hbm_bw if hw.hbm_bw else 0.0
    compute = matmul + vector
    times = [collective_time(op, cand, hw) for op in ops]
    overlapped = sum(tm for tm, op in zip(times, ops) if op["overlap"])
    exposed = sum(tm for tm, op in zip(times, ops) if not op["overlap"])
    p = cand.shape["pipeline"]
    bubble = compute * (p - 1) / (cand.virtual * cand.pp_microbatches) if p > 1 else 0.0
    step = max(compute, overlapped) + exposed + bubble
    return {
        "compute_s": compute,
        "matmul_s": matmul,
        "vector_s": vector,
        "comm_s": overlapped + exposed,
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "step_s": step,
        "flops": flops,
        "mfu": model_flops / (step * n * hw.peak_flops),
    }


def evaluate(
    facts: ModelFacts, cand: Candidate, hw, res: Resolver, bpp, c: int, compiler: str | None = None
) -> dict | None:
    """Memory, collectives and time of one candidate; None when a tensor does not divide its axes.
    `compiler`: whose buffers to count, "cpu" (fake devices) or the hardware's kind (default)."""
    compiler = compiler or hw.kind
    try:
        mem = state_bytes(facts, cand, res, bpp)
        ws = workspace_parts(facts, cand, res, bpp[0], c, compiler)
    except ShardingError:
        return None
    act = activation_bytes(facts, cand, c, compiler)
    grads = mem["grads"]
    st = get_strategy(cand.strategy)
    one_f = cand.shape["pipeline"] > 1 and cand.schedule == "1f1b"
    if cand.microbatches > 1 or one_f:  # the accumulator beside each microbatch's gradients
        mem["grads"] = 2 * grads  # (1F1B sums its microbatches' in the schedule's carry)
    elif st.opt_state is not None and not st.shard_grads:  # ZeRO-1: each layer's gradient is
        # reduce-scattered inside the backward loop (XLA), so the stacked layers' are held scattered
        mem["grads"] = grads = sum(
            bpp[1]
            * lf.numel
            / split_factor(res.spec(lf, cand.strategy, cand.shape, "opt_state" if lf.stacked else "rest"), cand.shape)
            for lf in facts.leaves
        )
    if st.opt_state is not None:  # ZeRO: the gathered updated weights, after the backward
        ws["zero_gather"] = max(0.0, grads + mem["params"] - (mem["grads"] + act + sum(ws.values())))
    mem["activations"] = act
    mem["workspace"] = sum(ws.values())
    mem["total"] = sum(mem.values())
    ops = collectives(facts, cand, res, c)
    return {
        "memory": mem,
        "collectives": ops,
        "time": step_time(facts, cand, hw, ops, res, bpp, c),
        "fits": mem["total"] <= hw.memory_bytes,
    }


def summarize(ops: list) -> dict:
    """kind -> bytes per step (as `meshpar.plan.inspect.summarize` reports them)."""
    out: dict = {}
    for op in ops:
        out[op["kind"]] = out.get(op["kind"], 0.0) + op["bytes"]
    return out
