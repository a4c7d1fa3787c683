"""Mixed precision policies (Micikevicius et al. 2018): fp32 master weights and optimizer state,
low-precision compute, fp32 logits / softmax / loss.

A policy is a small frozen object and the one source of dtypes. meshpar makes the run's policy
active while it builds and traces a model (`use_policy`), so any model reads it the same way:
`param_dtype()` for new parameters (`meshpar.nn.layers.param` does), `compute_dtype()` for matmuls and
activations, and the built-in LM loss casts logits to `output_dtype` before its fp32 cross-entropy.
A model built from Flax layers can also take `dtype=` from `get_policy(cfg.precision)` in its factory.

`fp16` adds dynamic loss scaling (Micikevicius et al. 2018, sec. 3.2): float16 has 5 exponent bits,
so small gradients underflow to zero unless the loss (hence every backward activation) is multiplied
by a scale S before differentiation and the gradients divided by S after. The scale adapts:

    start S = 2^15
    gradients finite   -> apply the update; after 2000 finite steps in a row, S *= 2
    gradients inf/nan  -> skip the update (params and optimizer state unchanged), S *= 0.5 (>= 1)

The loss-scale state is part of the train state (`numerics`, replicated scalars), so it is
checkpointed and resumed with everything else. `numerics` exists under every policy (scale 1, never
changed, for bf16/fp32), which keeps the state's structure independent of the policy; its
`skipped_steps` also counts steps skipped by `train.on_nan=skip`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from meshpar.core import scopes
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.platform import platform


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: jnp.dtype  # at rest: parameters and optimizer state
    compute_dtype: jnp.dtype  # matmuls and activations
    output_dtype: jnp.dtype  # logits, softmax and loss
    loss_scaling: bool = False  # dynamic loss scaling (fp16): see `LossScale`


POLICIES: dict[str, Policy] = {
    "bf16": Policy("bf16", jnp.float32, jnp.bfloat16, jnp.float32),
    "fp32": Policy("fp32", jnp.float32, jnp.float32, jnp.float32),
    "fp16": Policy("fp16", jnp.float32, jnp.float16, jnp.float32, loss_scaling=True),
}


def get_policy(name: str) -> Policy:

    if name not in POLICIES:
        raise ConfigError(f"unknown precision policy '{name}'" + suggest(name, POLICIES))
    return POLICIES[name]


_ACTIVE = scopes.POLICY


@contextlib.contextmanager
def use_policy(policy: Policy) -> Iterator[Policy]:
    """Make `policy` the one `param_dtype()` / `compute_dtype()` answer (while building or tracing)."""
    token = _ACTIVE.set(policy)
    try:
        yield policy
    finally:
        _ACTIVE.reset(token)


def active_policy() -> Policy:
    """The policy in force (fp32 outside meshpar's init and step)."""
    return _ACTIVE.get() or POLICIES["fp32"]


def param_dtype() -> jnp.dtype:
    return (_ACTIVE.get() or POLICIES["fp32"]).param_dtype


def compute_dtype() -> jnp.dtype:
    return (_ACTIVE.get() or POLICIES["fp32"]).compute_dtype


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None, over: tuple[str, ...] = ()
) -> jax.Array:
    """Mean token cross-entropy (weighted by `weights` [batch, length] when given: sum(w nll) / sum(w)),
    computed in fp32 with a max-shifted log-softmax. `over`: manual mesh axes the tokens are split
    over (inside a shard_map), whose sums are added up first.

    logits [batch, length, vocab] (any float dtype), targets [batch, length] int -> scalar fp32.
    The target logit is picked with a one-hot contraction so a vocab-sharded `logits` needs only
    the small all-reduces of the max, the sum of exponentials and the picked logit. The gradient
    comes back in the logits' dtype from one elementwise pass (`_weighted_nll`'s own backward);
    `weights`, like `targets`, are data: no gradient flows to them (differentiate a loss of your own
    for learned token weights).
    """
    return _mean(*_nll_sums(logits, targets, weights), over)


def chunked_cross_entropy(
    head,
    x: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    chunks: int = 1,
    over: tuple[str, ...] = (),
) -> jax.Array:
    """`cross_entropy(head(x), targets, weights, over)` with the logits never whole (vocabulary
    tiling, as MaxText's `num_vocab_tiling`): the tokens are cut into n = `chunks` strided slices
    (slice j holds positions j, j + n, ...), and a scan computes each slice's logits and loss sums
    under `jax.checkpoint`, so the backward recomputes a slice's logits instead of storing them.
    Strided, so a slice keeps each device's share of a sequence split over devices.

    head: [batch, length / n, embed] -> [batch, length / n, vocab]; x [batch, length, embed];
    targets, weights [batch, length] (length a multiple of n) -> scalar fp32. Memory: the
    [batch, length, vocab] logits and their gradient shrink n-fold; compute: the head's forward
    runs once more in the backward."""
    if chunks <= 1:
        return cross_entropy(head(x), targets, weights, over)
    b, t = targets.shape
    if t % chunks:
        raise ValueError(
            f"chunked_cross_entropy: {chunks} slices do not divide the {t} tokens of a row; pick a divisor"
        )

    def slices(a):  # [B, T, ...] -> [n, B, T / n, ...], slice j = positions j::n
        return jnp.moveaxis(a.reshape(b, t // chunks, chunks, *a.shape[2:]), 2, 0)

    @jax.checkpoint
    def one(_, xs):  # no carry: each slice's sums come out stacked (inside a shard_map they vary)
        xc, tc, wc = xs
        return None, _nll_sums(head(xc), tc, wc)

    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    _, (num, den) = jax.lax.scan(one, None, (slices(x), slices(targets), slices(w)))
    return _mean(jnp.sum(num), jnp.sum(den), over)


def check_loss_chunks(chunks: int, length: int, context: int = 1, other_loss: str | bool | None = None) -> None:
    """One line when `train.loss_chunks` cannot slice the run's loss: a loss other than the built-in
    `lm` (`other_loss` says which, "train.loss is 'stages'"), or slices that do not divide the tokens
    a device holds of a sequence."""

    if chunks > 1 and other_loss:
        raise ConfigError(
            f"train.loss_chunks={chunks} slices the built-in lm loss, and {other_loss}; set "
            "train.loss_chunks=1 (a loss of your own can call meshpar.chunked_cross_entropy itself)"
        )
    if (length // context) % chunks:
        where = (
            f"the {length // context} tokens a device holds of a sequence (mesh.context={context})"
            if context > 1
            else f"batch.length={length}"
        )
        raise ConfigError(f"train.loss_chunks={chunks} does not divide {where}; pick a divisor")


def _nll_lse(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(nll, log-sum-exp), each [batch, length] fp32: log sum_v exp(z_v) - z_target, max-shifted."""
    z = logits.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(z - top), axis=-1)) + top[..., 0]
    picked = jnp.sum(z * jax.nn.one_hot(targets, z.shape[-1], dtype=jnp.float32), axis=-1)
    return lse - picked, lse


@jax.custom_vjp
def _weighted_nll(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """sum(w nll) (scalar fp32) of logits [batch, length, vocab] in any float dtype, with its own
    backward: d logits = g w (softmax(z) - onehot(target)), computed in fp32 from the logits and the
    saved log-sum-exp and written in the logits' dtype in one elementwise pass (as MaxText's
    `cross_entropy_with_logits`). Autodiff of the fp32 upcast kept fp32 [b s, V / t] buffers where
    XLA did not fuse it: four in libtpu's GPipe loss tick, two in XLA:GPU's (bench/RESULTS.md)."""
    return _weighted_nll_fwd(logits, targets, weights)[0]


def _weighted_nll_fwd(logits, targets, weights):
    nll, lse = _nll_lse(logits, targets)
    return jnp.sum(weights * nll), (logits, targets, weights, lse)


def _weighted_nll_bwd(res, g):
    logits, targets, weights, lse = res
    z = logits.astype(jnp.float32)
    onehot = jax.nn.one_hot(targets, z.shape[-1], dtype=jnp.float32)
    d = (g * weights)[..., None] * (jnp.exp(z - lse[..., None]) - onehot)
    return d.astype(logits.dtype), None, None  # targets and weights are data: no gradient


_weighted_nll.defvjp(_weighted_nll_fwd, _weighted_nll_bwd)


def _nll_sums(logits, targets, weights) -> tuple[jax.Array, jax.Array]:
    """(sum of w nll, sum of w): w = 1 per token without weights."""
    if weights is None:
        ones = jnp.ones(targets.shape, jnp.float32)
        return _weighted_nll(logits, targets, ones), jnp.asarray(targets.size, jnp.float32)
    return _weighted_nll(logits, targets, weights.astype(jnp.float32)), jnp.sum(weights).astype(jnp.float32)


def _mean(num, den, over: tuple[str, ...]) -> jax.Array:
    if over:
        num, den = jax.lax.psum((num, den), over)
    return num / jnp.maximum(den, 1.0)


# ----------------------------------------------------------------------------------------------
# Dynamic loss scaling and non-finite steps.


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling: the constants, and pure functions of the `numerics` state (a dict of
    replicated scalars: loss_scale f32, good_steps / skipped_steps / overflows int32)."""

    initial: float = 2.0**15
    period: int = 2000  # finite steps in a row before the scale doubles
    factor: float = 2.0
    minimum: float = 1.0  # halving stops here: a persistent overflow at S = 1 is a real one

    def init(self, policy: Policy) -> dict:
        return {
            "loss_scale": jnp.asarray(self.initial if policy.loss_scaling else 1.0, jnp.float32),
            "good_steps": jnp.zeros((), jnp.int32),
            "skipped_steps": jnp.zeros((), jnp.int32),
            "overflows": jnp.zeros((), jnp.int32),
        }

    @staticmethod
    def scale(loss: jax.Array, scale: jax.Array | None) -> jax.Array:
        """The value to differentiate: loss * S (or the loss itself without loss scaling)."""
        return loss if scale is None else loss * scale.astype(loss.dtype)

    @staticmethod
    def unscale(grads, scale: jax.Array | None):
        """Gradients of loss * S -> gradients of the loss (division in the gradients' own dtype)."""
        if scale is None:
            return grads
        return jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)

    def update(self, policy: Policy, numerics: dict, loss: jax.Array, grads) -> tuple[jax.Array, jax.Array, dict]:
        """Decide one step: returns (apply, nonfinite_loss, new numerics).

        * finite loss and gradients: apply; count towards the next doubling (fp16 only);
        * fp16, finite loss, non-finite gradients: an overflow of the scaled backward pass:
          skip, halve the scale, count an overflow;
        * non-finite loss (any policy), or non-finite gradients without loss scaling: skip, and
          report `nonfinite_loss` so the loop can apply `train.on_nan` (skip or stop).
        The skip is done by the caller with `select(apply, new, old)`, so a skipped step leaves
        params and optimizer state bitwise unchanged.
        """
        loss_ok = jnp.isfinite(loss)
        grads_ok = all_finite(grads)
        apply = loss_ok & grads_ok
        overflow = (loss_ok & ~grads_ok) if policy.loss_scaling else jnp.zeros((), bool)
        s = numerics["loss_scale"]
        good = jnp.where(apply, numerics["good_steps"] + 1, 0)
        if policy.loss_scaling:
            grow = good >= self.period
            s = jnp.where(grow, s * self.factor, s)
            good = jnp.where(grow, 0, good)
            s = jnp.where(overflow, jnp.maximum(s / self.factor, self.minimum), s)
        new = {
            "loss_scale": s,
            "good_steps": good.astype(jnp.int32),
            "skipped_steps": numerics["skipped_steps"] + (~apply).astype(jnp.int32),
            "overflows": numerics["overflows"] + overflow.astype(jnp.int32),
        }
        return apply, ~apply & ~overflow, new


LOSS_SCALE = LossScale()


def all_finite(tree) -> jax.Array:
    """True iff every element of every floating leaf is finite (one fused reduction per leaf)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.ones((), bool)


def select(pred: jax.Array, new, old):
    """`new` where `pred` else `old`, leaf by leaf (a skipped step keeps `old` bit for bit)."""
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def gather_dtype(dtype) -> jnp.dtype:
    """Dtype to all-gather a 16-bit float in by hand (`lax.all_gather`): float32 on CPU, where the
    transpose (a bf16 reduce-scatter whose reducer ends in a copy) aborts XLA:CPU's all-reduce
    promotion pass (JAX 0.10); `dtype` elsewhere."""
    if jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and platform() == "cpu":
        return jnp.float32
    return dtype


def attention_dtype(dtype) -> jnp.dtype:
    """Input dtype for `jax.nn.dot_product_attention`: `dtype`, except float16 on CPU, which runs in
    float32 there (JAX's XLA attention asks for an F16 x F16 -> F32 dot that XLA:CPU does not have)."""
    if jnp.dtype(dtype) == jnp.float16 and platform() == "cpu":
        return jnp.float32
    return dtype
