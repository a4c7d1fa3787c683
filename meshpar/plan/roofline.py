"""The device's own work in one step: matmuls on the roofline, every other kernel at memory bandwidth.

    compute_s = matmul FLOPs / (peak x efficiency x fit) + vector bytes / hbm_bw

Letters as in `meshpar.plan.costmodel`: b sequences per microbatch and device, s tokens, h embed,
a heads, k kv heads, q head_dim, F mlp, V vocab, t the tensor axis (t_heads, t_mlp, t_res, t_vocab:
what each dimension is split by), c bytes per compute-dtype element.

* Matmul FLOPs: the model's (PaLM appendix B: 6 x parameters per token plus attention's 12 L h s,
  unmasked) times recomputation (`meshpar.plan.steptime`), per device. `efficiency` is the fraction
  of peak a large matmul reaches on the device (`meshpar.plan.hardware`); `fit` is what the step's
  own GEMMs lose on the roofline (Williams et al. 2009, "Roofline"): an [m, K] x [K, n] GEMM moves
  c (mK + Kn + mn) bytes for 2 m n K FLOPs, so it runs at min(1, intensity / ridge) of the compute
  roof (ridge = peak x efficiency / hbm_bw FLOPs per byte), times its tile quantization, m n over
  the 128 x 128 output tiles that cover it (the small-matrix penalty). `fit` is the FLOP-weighted
  harmonic mean over one layer's GEMMs (q/k/v, the output projection, the MLP's in and out, the
  head), with m the tokens a device computes at once (b s / context). Attention (flash, cuDNN,
  splash) is counted unmasked at the same rate: on the lent H100 the step's attention kernels took
  46 ms where 12 L h s FLOPs per token at the matmuls' 767 TFLOP/s predict 45.8.
* Vector bytes: every other kernel (norms, activations, rotary, residual adds, casts, the loss, the
  optimizer update) is bound by memory bandwidth. Per token, layer and pass over the layers
  (forward 1, each recomputed forward 1, backward 2), 16 h / t_res + 4 F / t_mlp elements of the
  compute dtype, plus 6 a s / t_heads where attention stores its [s, s] scores (fp32 scores written
  and read, the bf16 probabilities written and read), plus the residuals the remat policy keeps
  (`costmodel.per_token_elements`) written once and read once; per token the loss's 6 V / t_vocab; per
  parameter element the update (AdamW reads the weight, gradient and two moments and writes three:
  7 w bytes per optimizer-state element) and 2 g + w + c bytes per weight element the device
  computes with (the gradient written and read, the weight read and cast; a weight FSDP gathers is
  whole at use, and cast again where the backward gathers it again). The token terms are fitted on the lent
  H100's profile of a Llama-3 8B-shaped step (bench/RESULTS.md: the non-matmul kernels took 86 ms of
  494.5), and predict the 1b step within 1% (543 ms against 541).
"""

from __future__ import annotations

import math

from meshpar.core.rules import BATCH_AXES
from meshpar.plan.costmodel import (
    efficient_attention,
    local_batch,
    per_token_elements,
    rows_factor,
    sharded_axes,
    split_factor,
    tensor_splits,
)

TILE = 128
TOKEN_H, TOKEN_F, TOKEN_SCORES, TOKEN_V = 16, 4, 6, 6  # compute-dtype elements, see above


def gemm_fit(m: float, k: float, n: float, hw, c: int = 2) -> float:
    """Fraction of the matmul roof one [m, k] x [k, n] GEMM reaches: the roofline, times the tile
    quantization of its m x n output."""
    if min(m, k, n) < 1:
        return 1.0
    if hw.hbm_bw:
        intensity = 2 * m * n * k / (c * (m * k + k * n + m * n))
        roof = min(1.0, intensity / (hw.peak_flops * hw.efficiency / hw.hbm_bw))
    else:
        roof = 1.0
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE) * TILE * TILE
    return roof * m * n / tiles


def matmul_fit(facts, cand, hw, c: int = 2) -> float:
    """FLOP-weighted fit of one layer's GEMMs and the head (1.0 for a model without sizes)."""
    d = facts.dims
    if not all(d.get(x) for x in ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")):
        return 1.0
    sp = tensor_splits(facts, cand)
    m = local_batch(facts.run, cand) * facts.run.length / cand.shape["context"]
    h, q, f = d["embed"], d["head_dim"], (facts.moe.get("expert_mlp") or d["mlp"])
    gemms = [
        (m, h, (d["heads"] + 2 * d["kv_heads"]) * q / sp["heads"]),
        (m, d["heads"] * q / sp["heads"], h),
        (m, h, 2 * f / sp["mlp"]),
        (m, f / sp["mlp"], h),
        (m, h, d["vocab"] / sp["vocab"]),
    ]
    flops = [mm * kk * nn for mm, kk, nn in gemms]
    seconds = [fl / gemm_fit(*g, hw, c) for fl, g in zip(flops, gemms)]
    return sum(flops) / sum(seconds)


def vector_bytes(facts, cand, res, bpp, c: int = 2, passes: float = 4.0, compiler: str = "gpu") -> float:
    """Bytes one device moves per step through kernels that are not matmuls (see the module docstring);
    `passes`: passes over the layers (forward, recomputed forwards, backward as 2)."""
    shape = cand.shape
    w, g = bpp[0], bpp[1]
    opt, used = 0.0, 0.0  # optimizer-state elements; weight elements computed with, x gathers
    for lf in facts.leaves:
        opt += lf.numel / split_factor(res.spec(lf, cand.strategy, shape, "opt_state"), shape)
        spec = res.spec(lf, cand.strategy, shape, "rest")
        gathered = math.prod(shape[a] for a in sharded_axes(spec) & {*BATCH_AXES, "context"})  # FSDP: whole at use
        used += lf.numel / split_factor(spec, shape) * gathered * (2 if gathered > 1 and lf.stacked else 1)
    out = 7 * w * opt + (2 * g + w + c) * used
    d = facts.dims
    if not all(d.get(x) for x in ("layers", "embed", "heads", "mlp", "vocab")):
        return out
    sp = tensor_splits(facts, cand)
    dp = shape["data"] * shape["fsdp"] * shape["expert"]
    tokens = facts.run.global_size * facts.run.length / (dp * shape["context"])  # per device per step
    f = d["mlp"]
    if facts.moe:  # MoE layers run top_k x capacity rows through experts of expert_mlp
        share = 1 / facts.moe["every"]
        f = (1 - share) * f + share * facts.moe["top_k"] * rows_factor(facts.moe, shape) * facts.moe["expert_mlp"]
    per = TOKEN_H * d["embed"] / sp["res"] + TOKEN_F * f / sp["mlp"]
    scores = (
        0
        if efficient_attention(facts.run, compiler, shape["pipeline"] > 1, d.get("head_dim") or 0)
        else facts.run.length
    )
    per += TOKEN_SCORES * d["heads"] * scores / sp["heads"]
    stored = 2 * per_token_elements(
        d, cand.remat, sp["heads"], sp["mlp"], sp["res"], scores, c, compiler
    )  # written, read
    layers = d["layers"] / shape["pipeline"]
    return out + c * tokens * (layers * (passes * per + stored) + TOKEN_V * d["vocab"] / sp["vocab"])
