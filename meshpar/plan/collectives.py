"""The collectives a candidate plan moves in one step: kind, mesh axes, bytes, how many, and
whether (and in which pass) compute can hide them (their seconds: `meshpar.plan.steptime`).

* Bytes, read off the compiled steps of tests/plan/test_plan.py: data-parallel gradients and FSDP/ZeRO
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
"""

from __future__ import annotations

import math
from functools import partial

from meshpar.core.mesh import MESH_AXES
from meshpar.core.rules import BATCH_AXES, get_strategy
from meshpar.parallel.schedules import one_f_one_b_ticks
from meshpar.plan.costmodel import (
    Candidate,
    ModelFacts,
    Resolver,
    gathered_over,
    local_batch,
    rows_factor,
    sharded_axes,
    split_factor,
    stage_recompute,
)


def _batch_axes(shape: dict) -> list:
    """Axes whose devices hold different tokens (weight gradients are summed over them): the batch
    axes and `context`."""
    return [a for a in (*BATCH_AXES, "context") if shape[a] > 1]


def collectives(facts: ModelFacts, cand: Candidate, res: Resolver, c: int, g: int = 4, w: int = 4) -> list:
    """Predicted collectives of one step: [{kind, axes, bytes (whole tensor, per step), overlap, count}],
    bytes counted as `meshpar inspect` counts them: the weights' (gathers, gradient reductions) and
    the activations' (tensor, context, pipeline and expert parallelism). g, w: bytes of a gradient /
    weight element on the wire (`evaluate` passes bytes per parameter: meshpar reduces gradients and
    gathers weights in the parameter dtype, fp32); c: bytes of an activation element."""
    out: list = []
    _weight_collectives(out, facts, cand, res, c, g, w)
    if facts.dims.get("embed"):
        _activation_collectives(out, facts, cand, res, c, g, w)
    return out


def _add(out: list, kind: str, axes, nbytes: float, overlap: bool, count: float = 1.0, pass_: str = "backward") -> None:
    """One predicted collective (`count`: how many separate ones it stands for, each paying latency;
    `pass_`: the pass whose compute can hide it, when it overlaps)."""
    if nbytes > 0 and axes:
        out.append(
            {
                "kind": kind,
                "axes": sorted(axes, key=MESH_AXES.index),
                "bytes": float(nbytes),
                "overlap": overlap,
                "count": float(max(count, 1)),
                "pass": pass_,
            }
        )


def _gather_for_use(out: list, axes, nbytes: float, count: float, stacked: bool) -> None:
    """FSDP's gathers of weights for use: a scanned layer's in the forward and again in the
    backward's layer loop (half each), any other weight once in the forward (kept for the backward)."""
    if stacked:
        _add(out, "all-gather", axes, nbytes / 2, True, count / 2, "forward")
        _add(out, "all-gather", axes, nbytes / 2, True, count / 2, "backward")
    else:
        _add(out, "all-gather", axes, nbytes, True, count, "forward")


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
        on_batch = gathered_over(lf, [a for a in batch_axes if a in sharded])
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
                # the updated weights, gathered after the optimizer: no compute of the step is left to hide them
                add("all-gather", [a for a in rs if a not in on_batch], w * local, False, per)
                add(
                    "all-reduce",
                    [a for a in batch_axes if a not in rs],
                    g * full_over_batch * grad_times,
                    True,
                    per * grad_times,
                )
                _gather_for_use(  # master weights at rest over `context`, as FSDP
                    out, on_batch, at_use, per * (remat_ag if lf.stacked else 1) * mb, lf.stacked
                )
                continue
        if on_batch:  # FSDP: gather for use, reduce-scatter the grads
            _gather_for_use(out, on_batch, at_use, per * (remat_ag if lf.stacked else 1) * mb, lf.stacked)
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


def summarize(ops: list) -> dict:
    """kind -> bytes per step (as `meshpar.plan.inspect.summarize` reports them)."""
    out: dict = {}
    for op in ops:
        out[op["kind"]] = out.get(op["kind"], 0.0) + op["bytes"]
    return out
