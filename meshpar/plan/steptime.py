"""The planner's step time: the seconds of one step, from its compute, the collectives it moves
(`meshpar.plan.collectives`) and its bubble (the letters and the memory side: `meshpar.plan.costmodel`).

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
  with a channel per NIC: (n_i - 1)/n_i V / bw_ici + (n_d - 1)/n_d (V / n_i) / bw_dcn (or, with
  `Hardware.dcn_rings` "device", one flat ring at a device's NIC: (n - 1)/n V / bw_dcn).
* Pipeline bubble (Narayanan et al. 2021, sec. 2.2): (p - 1) / (v M) of the compute time (GPipe and
  1F1B, whose ticks pair an F with a B, alike; interleaving divides it by v).
* Overlap, per pass: collectives over the batch axes overlap with the compute of their own pass, as
  the H100 target's compiled schedule shows (`meshpar inspect --target h100`, 125m fsdp x 8: 3 of 4
  all-gathers, every reduce-scatter and all-reduce with compute between start and done, the scanned
  layer's gather issued while the layer before computes): FSDP's forward gathers behind the forward
  (a third of the model's matmuls, one pass over memory), its backward gathers and every gradient
  reduction behind the backward (the rest, recomputation included). ZeRO's gather of the updated
  weights runs after the update (125m zero1 on H100: at the end of the program, among the update's
  elementwise fusions), when no compute is left: exposed, as are tensor-parallel collectives, MoE
  all-to-alls and pipeline transfers. step = max(forward, its collectives) + max(backward, its
  collectives) + exposed + bubble.
"""

from __future__ import annotations

import math

from meshpar.core.errors import ShardingError
from meshpar.core.rules import BATCH_AXES, get_strategy
from meshpar.plan.collectives import collectives
from meshpar.plan.costmodel import (
    Candidate,
    ModelFacts,
    Resolver,
    activation_parts,
    local_batch,
    local_elements,
    split_factor,
    stage_recompute,
    state_bytes,
    tensor_splits,
    workspace_parts,
)
from meshpar.plan.roofline import matmul_fit, vector_bytes


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
    if n_d > 1 and hw.dcn_rings == "device":  # one flat ring through every device, a NIC its slowest link
        n = n_i * n_d
        ring = (n - 1) / n * v / hw.dcn_bw
        hops = (n - n_d) * hop_i + n_d * hop_d
    else:
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
    """compute_s (matmul_s + vector_s, `meshpar.plan.roofline`), comm_s (all collectives),
    exposed_comm_s (not overlapped), unhidden_s (overlapped, beyond their pass's compute), bubble_s,
    step_s, mfu."""
    n = math.prod(cand.mesh)
    model_flops = facts.flops_per_token * facts.run.global_size * facts.run.length
    flops = executed_flops(facts, cand)
    matmul = matmul_seconds(facts, cand, hw, c, flops)
    passes = 3 + (cand.remat != "none") + stage_recompute(facts, cand)
    vector = vector_bytes(facts, cand, res or Resolver(), bpp, c, passes, hw.kind) / hw.hbm_bw if hw.hbm_bw else 0.0
    compute = matmul + vector
    times = [collective_time(op, cand, hw) for op in ops]
    hidden = {"forward": 0.0, "backward": 0.0}  # collectives each pass's compute can hide
    for tm, op in zip(times, ops):
        if op["overlap"]:
            hidden[op["pass"]] += tm
    overlapped = sum(hidden.values())
    exposed = sum(tm for tm, op in zip(times, ops) if not op["overlap"])
    # the forward pass's share: a third of the model's matmuls (recomputation runs in the backward)
    # and one of the passes over memory
    forward = matmul * model_flops / (3 * n * flops) + vector / passes
    p = cand.shape["pipeline"]
    bubble = compute * (p - 1) / (cand.virtual * cand.pp_microbatches) if p > 1 else 0.0
    unhidden = max(hidden["forward"] - forward, 0.0) + max(hidden["backward"] - (compute - forward), 0.0)
    step = compute + unhidden + exposed + bubble
    return {
        "compute_s": compute,
        "matmul_s": matmul,
        "vector_s": vector,
        "comm_s": overlapped + exposed,
        "exposed_comm_s": exposed,
        "unhidden_s": unhidden,  # overlapping collectives longer than the pass that hides them
        "bubble_s": bubble,
        "step_s": step,
        "flops": flops,
        "mfu": model_flops / (step * n * hw.peak_flops),
    }


def zero_update_gather(facts: ModelFacts, cand: Candidate, res: Resolver, hw, state: float, w: float) -> float:
    """XLA:GPU's ZeRO-1/2 update phase (bytes beside the state): the updated stacked weights gathered
    (W bytes each, in a layout the output is transposed from), all live at once, unless that passes
    its scheduler's memory limit for temporaries, 0.95 (0.8 HBM - state) (XLA's
    GetSchedulerMemoryLimit), where its rematerialization gathers them fewer at a time, never fewer
    than the largest. From the H100 compiles' buffer assignments: 7b at data=64 held all four
    (24.1 GiB), 8B at data=8 (limit 21.1 GiB) the largest and less beside it (18.0 GiB temp)."""
    sizes = _stacked_bytes(facts, cand, res, w)
    limit = 0.95 * (0.8 * hw.memory_bytes - state)
    return min(sum(sizes), max(max(sizes, default=0.0), limit))


def tpu_zero_update(facts: ModelFacts, cand: Candidate, res: Resolver, w: float) -> float:
    """libtpu's ZeRO-1/2 update phase (bytes beside the state, with the sharded gradients): the largest
    stacked weight gathered whole after its update, twice (W bytes each: gathered, and copied into the
    parameters' layout). From libtpu 0.0.42.1's v5p dumps: 7b at data=64 held w_in [32, 4096, 2, 11008]
    fp32 (10.75 GiB) gathered and copied; 1b at data=8 held w_in's copy (2 GiB) and w_down's, old and
    new (1 + 1 GiB), in a heap of 10.12 GiB. The whole gathered model (the rule before) was 1.18x
    7b's compiled peak on 64 chips."""
    return 2 * max(_stacked_bytes(facts, cand, res, w), default=0.0)


def _stacked_bytes(facts: ModelFacts, cand: Candidate, res: Resolver, w: float) -> list[float]:
    """Each stacked weight's bytes on a device in its at-rest layout (ZeRO's: whole), W bytes an element."""
    return [w * local_elements(lf, cand, res) for lf in facts.leaves if lf.stacked]


def _head_leaves(facts: ModelFacts) -> list:
    """The LM head's weight [E, V] (or the tied embedding): the unstacked leaves naming embed and vocab."""
    return [lf for lf in facts.leaves if not lf.stacked and {"embed", "vocab"} <= set(lf.names)]


def whole_vocab_head(facts: ModelFacts, cand: Candidate) -> bool:
    """Whether the LM head's weight [E, V] (or the tied embedding) is whole over the vocabulary at its
    use and the optimizer state is not ZeRO's: FSDP's head, gathered over the batch axes before its
    GEMM, or DP's, replicated."""
    if tensor_splits(facts, cand)["vocab"] > 1 or get_strategy(cand.strategy).opt_state is not None:
        return False
    return bool(_head_leaves(facts))


def _head_split(facts: ModelFacts, cand: Candidate, res: Resolver) -> int:
    """Devices the LM head's weight is split over at rest (1: replicated, or no head)."""
    return max(
        (split_factor(res.spec(lf, cand.strategy, cand.shape, "rest"), cand.shape) for lf in _head_leaves(facts)),
        default=1,
    )


def fsdp_head(facts: ModelFacts, cand: Candidate, res: Resolver) -> bool:
    """Whether the LM head's weight is whole over the vocabulary (`whole_vocab_head`) and split at rest
    (over the batch axes: FSDP's, gathered before its GEMM), not replicated (DP's)."""
    return whole_vocab_head(facts, cand) and _head_split(facts, cand, res) > 1


# the largest group libtpu 0.0.42.1 windows an FSDP einsum over (v5p: on 8, 16 and 32 chips; not on 64)
TPU_WINDOWED_GROUP = 32


def tpu_windowed_head(facts: ModelFacts, cand: Candidate, res: Resolver) -> bool:
    """Whether libtpu computes the FSDP head's weight gradient dW = h^T dlogits [E, V] as a windowed
    einsum (XLA SPMD's `windowed_dot_general_body_rs` loop: a shard of dW a step, passed round the
    group by collective-permute) rather than one matmul and a reduce-scatter: an FSDP head
    (`fsdp_head`) split over at most TPU_WINDOWED_GROUP devices. The loop takes the logits' cotangent
    as an operand, so libtpu writes it to its own slot beside the logits. Its v5p dumps: 125m, 1b and
    8b fsdp on 8 chips, 125m and 1b on 16 and 32, and fsdp=32 x tensor=2 on 64 hold the loops; a
    group of 64 (fsdp=64, data=2 x fsdp=32) holds none, and dW there fuses the cotangent in."""
    return fsdp_head(facts, cand, res) and _head_split(facts, cand, res) <= TPU_WINDOWED_GROUP


def loss_phase(
    facts: ModelFacts,
    cand: Candidate,
    res: Resolver,
    bpp,
    c: int,
    parts: dict,
    compiler: str = "gpu",
    domain: int | None = None,
) -> float | None:
    """Bytes the compiler (XLA:GPU; libtpu, below) holds beside the state and the stored residuals
    while it computes the loss and the head's backward, where that phase ends before the layers'
    backward begins (the larger phase then counts); None where the logits' cotangent stays live
    through the layers' backward (the sum counts).
    - One device: the logits, their cotangent and the unstacked weights' gradients.
    - ZeRO-1/2 (replicated weights, gradients reduce-scattered to the optimizer's layout): XLA
      computes the head's weight gradient straight after the loss; the phase holds the logits (their
      cotangent in their slot), the head's weight in the compute dtype, the stacked gradients as held
      and a layer's input and output.
    - A head split over the vocabulary (TP, TP+SP, FSDP x TP): meshpar finishes the head's backward
      before the layers' (`meshpar.nn.layers.after`), so the phase is the same as ZeRO's.
    - An FSDP head (whole over the vocabulary, its weight split over the batch axes) whose batch axes
      span more than one node (`domain` devices): XLA:GPU's scheduler computes the head's weight
      gradient before the layers' backward (its compiled order on 64 H100s at 125m, 1b and 7b, and
      1b's MoE rows; on 8 after), so the phase is the same as ZeRO's.
    - Otherwise (DP's replicated head, an FSDP head inside one node) XLA:GPU computes the head's weight
      gradient after the layers' backward, holding the cotangent through it: the sum counts.
    `compiler` "tpu": the phase ends before the layers' backward for a head whole over the vocabulary
    (`whole_vocab_head`: FSDP's, whose backward meshpar finishes first there,
    `meshpar.nn.layers.head_backward_first`, and DP's, which libtpu itself differentiates first) and
    for a vocab-parallel head; ZeRO's order varies with size and chip count: the sum counts. libtpu
    writes the logits' cotangent to its own slot, the phase holding two [b, s, V / t] buffers, where
    it has two consumers it is not fused into: a vocab-parallel head's dh and dW GEMMs, or an FSDP
    head's windowed dW loop (`tpu_windowed_head`). From the v5p dumps: 125m and 1b fsdp_tp and 1b
    tp_sp on 8 chips hold logits and cotangent (2 x 500 MiB) at the loss and neither in the layers'
    backward; 125m fsdp on 8 peaks there, at 1.46 GiB."""
    if cand.microbatches > 1 or cand.shape["pipeline"] > 1 or "logits" not in parts:
        return None
    sp = tensor_splits(facts, cand)
    if compiler == "tpu" and not (whole_vocab_head(facts, cand) or sp["vocab"] > 1):
        return None
    if math.prod(cand.shape.values()) == 1:
        return 2 * parts["logits"] + sum(bpp[1] * lf.numel for lf in facts.leaves if not lf.stacked)
    shape, st, d = cand.shape, get_strategy(cand.strategy), facts.dims
    # the head's backward ends before the layers': ZeRO's, a vocab-parallel head's, on TPU a whole one's,
    # on GPU an FSDP one's across nodes (above)
    phased = (
        compiler == "tpu"
        or st.opt_state is not None
        or sp["vocab"] > 1
        or (domain is not None and math.prod(shape[a] for a in BATCH_AXES) > domain and fsdp_head(facts, cand, res))
    )
    if not phased or not any(shape[a] > 1 for a in BATCH_AXES):
        return None
    stacked = sum(
        bpp[1] * lf.numel / split_factor(res.spec(lf, cand.strategy, shape, "opt_state"), shape)
        for lf in facts.leaves
        if lf.stacked
    )
    tokens = local_batch(facts.run, cand) * facts.run.length / shape["context"]
    head = c * d["vocab"] * d["embed"] / sp["vocab"]
    two = compiler == "tpu" and (sp["vocab"] > 1 or tpu_windowed_head(facts, cand, res))
    logits = 2 * parts["logits"] if two else parts["logits"]
    return logits + head + stacked + 2 * c * tokens * d["embed"] / sp["res"]


def evaluate(
    facts: ModelFacts,
    cand: Candidate,
    hw,
    res: Resolver,
    bpp,
    c: int,
    compiler: str | None = None,
    waits_for: tuple = (),
) -> dict | None:
    """Memory, collectives and time of one candidate; None when a tensor does not divide its axes.
    `compiler`: whose buffers to count, "cpu" (fake devices) or the hardware's kind (default);
    `waits_for`: collective kinds on the critical path even where meshpar's program hides them (a
    model of another framework's run: `meshpar.plan.papers`)."""
    compiler = compiler or hw.kind
    try:
        mem = state_bytes(facts, cand, res, bpp)
        ws = workspace_parts(facts, cand, res, bpp[0], c, compiler)
    except ShardingError:
        return None
    parts = activation_parts(facts, cand, c, compiler)
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
    loss = (
        loss_phase(facts, cand, res, bpp, c, parts, compiler, hw.domain if compiler == "gpu" else None)
        if compiler in ("gpu", "tpu")
        else None
    )
    if one_f and compiler == "tpu" and "logits" in parts:  # libtpu's 1F1B last stage: the loss and the
        # head's backward end before the stage's layers' backward (the logits' slot is free at the peak)
        loss = mem["grads"] + sum(ws.values()) + parts["logits"]
    if loss is not None:  # the loss ends before the layers' backward: the larger phase counts
        backward = mem["grads"] + parts["working"] + sum(ws.values())
        parts["logits"] = max(loss, backward) - backward
    act = sum(parts.values())
    if st.opt_state is not None:  # ZeRO: the gathered updated weights, after the backward
        if compiler == "gpu":
            update = zero_update_gather(facts, cand, res, hw, mem["params"] + mem["optimizer"], bpp[0])
        else:  # libtpu: the largest stack; XLA:CPU: all of them
            update = grads + (tpu_zero_update(facts, cand, res, bpp[0]) if compiler == "tpu" else mem["params"])
        ws["zero_gather"] = max(0.0, update - (mem["grads"] + act + sum(ws.values())))
    mem["activations"] = act
    mem["workspace"] = sum(ws.values())
    mem["total"] = sum(mem.values())
    ops = [
        {**op, "overlap": op["overlap"] and op["kind"] not in waits_for}
        for op in collectives(facts, cand, res, c, g=bpp[1], w=bpp[0])
    ]
    return {
        "memory": mem,
        "collectives": ops,
        "time": step_time(facts, cand, hw, ops, res, bpp, c),
        "fits": mem["total"] <= hw.memory_bytes,
    }
