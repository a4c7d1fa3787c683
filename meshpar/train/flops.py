"""Model FLOPs for MFU: what one token (or example) costs, and what a device can do.

MFU = model FLOPs per step / (step time x devices x peak), after PaLM (Chowdhery et al. 2022)
appendix B. Works for any model: the attention term needs `layers`, `heads` and `head_dim` on the
model's `cfg` (the reference decoders have them); without them it is 6N per token.
"""

from __future__ import annotations

import math

import jax

from meshpar.core.batch import is_leaf
from meshpar.core.layout import use_layout
from meshpar.core.precision import use_policy
from meshpar.core.sharding import ModelSpec
from meshpar.nn import dropout
from meshpar.train.hostpeak import host_flops


def active_params(spec: ModelSpec, top_k: int = 2) -> float:
    """Parameters one token's forward pass multiplies with: all but the input embedding table (a
    gather, not a matmul), and of each expert weight (logical axis `expert`, size E) only the
    top_k / E share its token is routed to (`meshpar.core.config.top_k(cfg.moe)`); shared experts
    are dense weights, counted whole."""
    total = 0.0
    for shape, names in zip(
        jax.tree.leaves(spec.shapes), jax.tree.leaves(spec.logical, is_leaf=lambda x: isinstance(x, tuple))
    ):
        if names == ("vocab", "embed"):
            continue
        n = float(math.prod(shape.shape))
        if "expert" in names:
            n *= top_k / shape.shape[names.index("expert")]
        total += n
    return total


def flops_per_token(model_cfg, n_active: float, length: int) -> float:
    """PaLM (Chowdhery et al. 2022) appendix B: 6N + 12*L*H*Q*T per token, N the parameters a token
    passes through (`active_params`). Convention: the attention term counts the full T x T score
    matrix (no causal halving), as PaLM does; it is left out for a model whose `cfg` does not say
    `layers`, `heads` and `head_dim`."""
    attn = [getattr(model_cfg, k, None) for k in ("layers", "heads", "head_dim")]
    return 6.0 * n_active + (12.0 * math.prod(attn) * length if all(attn) else 0.0)


_PEAK_BF16 = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
    ("L4", 121e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 197e12),
    ("TPU v4", 275e12),
]


def peak_flops_per_device(peak_tflops: float | None = None) -> tuple[float, str]:
    """Dense bf16 peak per device and where it came from: `train.peak_tflops`, then a table of device
    kinds, else the host's matmul rate (`meshpar.train.hostpeak`: measured once per machine) shared
    by the fake devices."""
    if peak_tflops:
        return peak_tflops * 1e12, "train.peak_tflops"
    dev = jax.local_devices()[0]  # this process's own (jax.devices()[0] may be another process's)
    for key, peak in _PEAK_BF16:
        if key in dev.device_kind:
            return peak, f"{dev.device_kind} datasheet"

    host, where = host_flops()
    n = jax.local_device_count()
    return host / n, f"host matmul {host / 1e12:.3g} TFLOP/s / {n} fake devices, {where}"


def matmul_flops(jaxpr) -> float:
    """FLOPs of the matrix products in a (closed) jaxpr: 2 per multiply-add of every dot_general and
    convolution, sub-jaxprs included (a scan's body times its length; a cond's costliest branch; a
    while loop's body once, its trip count being unknown)."""
    import numpy as np

    total = 0.0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        prim = eqn.primitive.name
        if prim == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            total += 2.0 * np.prod(lhs) * np.prod([d for i, d in enumerate(rhs) if i not in (*rc, *rb)])
        elif prim == "conv_general_dilated":
            rhs, out = eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
            features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * np.prod(out) * np.prod(rhs) / features
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")]
        subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v if hasattr(b, "jaxpr")]
        if prim == "cond":
            total += max(matmul_flops(b) for b in eqn.params["branches"])
        elif subs:
            total += (eqn.params.get("length", 1) if prim == "scan" else 1) * sum(matmul_flops(j) for j in subs)
    return total


def loss_forward(trainer, seed: int = 0, layout=None):
    """The jaxpr of `trainer.loss` on the whole global batch, forward only (traced, not compiled),
    under `layout` (default: the trainer's), the dropout of stacked layers drawn from `seed` as the
    step draws it."""

    spec = trainer.spec
    batch = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype), trainer.batch_spec, is_leaf=is_leaf
    )

    def forward(params, vars, b):  # traced as the train step traces it (its layout, dropout of stacked layers drawn)
        with use_layout(layout or trainer.layout), use_policy(trainer.policy), dropout.training(seed, 0):
            return trainer.loss(spec.merge(params, vars), b)[0]

    return jax.make_jaxpr(forward)(spec.shapes, spec.var_shapes or {}, batch)


def loss_forward_flops(trainer, seed: int = 0) -> float:
    """Matmul FLOPs of `trainer.loss` on the whole global batch, forward only (`loss_forward`)."""
    return matmul_flops(loss_forward(trainer, seed))


def model_flops_per_step(trainer, batch, train, experts_per_token: int) -> tuple[float, str]:
    """Model FLOPs of one optimizer step, what MFU divides, and how they were counted: the built-in
    LM loss by PaLM's per-token formula; another loss by `train.flops_per_example` if set, else as 3 x
    the matmul FLOPs of its forward over the global batch (forward + backward, the 6N = 3 x 2N of
    Kaplan et al. 2020: the same count for any model, tokens or not). `batch`, `train`: the run's
    `cfg.batch` and `cfg.train`; `experts_per_token`: its MoE top-K (`TrainSetup.model_flops`)."""
    b, t = batch, train
    if trainer.is_lm:
        per_token = flops_per_token(trainer.spec.model_config, active_params(trainer.spec, experts_per_token), b.length)
        return per_token * b.global_size * b.length, "6N + 12LHQT per token (PaLM)"
    if t.flops_per_example:
        return t.flops_per_example * b.global_size, "train.flops_per_example"
    return 3.0 * loss_forward_flops(trainer, t.seed), "3 x the loss's forward matmuls"
