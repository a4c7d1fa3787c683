"""Building blocks a model uses to meet meshpar: annotated parameters and stacked, scanned layers.

    w = param(rngs, (E, F), ("embed", "mlp"), std)       # an nnx.Param with logical axis names
    blocks = stacked(lambda r: Block(cfg, r), L, rngs)     # L copies on a leading `layers` axis
    x, aux = scan_layers(blocks, x, positions, remat)      # lax.scan over `layers`, with remat
    x, w = after(x, head[...])                             # the head's weight read after the stack
    logits = settled_cotangent(logits)                     # its gradient written in place (a TP head)
    gate, up = gated_inputs(x, w_in[...])                  # a GLU's two projections from one [E, 2, F]
    h = swiglu(gate, up)                                   # silu(gate) * up, its backward in one pass

Stacking puts the `layers` name in front of each parameter's logical axes, so the stack's layout
(at rest on its pipeline stage, say) survives into gradients and optimizer state. The pipeline
schedules (`meshpar.parallel.pipeline`) cut exactly such a stack into stages.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.core import scopes
from meshpar.core.config.schema import DECODE_LOOPS, REMAT
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.layout import active_layout, at_use, constrain
from meshpar.core.platform import platform
from meshpar.core.precision import param_dtype
from meshpar.core.sharding import logical_axes
from meshpar.nn import dropout, kvcache


def param(rngs: nnx.Rngs, shape, logical, std: float | None = None, init: str = "normal") -> nnx.Param:
    """A parameter with logical axis names (`logical_axes` metadata, resolved by meshpar), in the
    active precision policy's `param_dtype` (fp32 master weights under every preset policy).
    init: "normal" (truncated at 2 std), "ones" or "zeros"."""
    dtype = param_dtype()
    if init in ("ones", "zeros"):
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    else:
        value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, dtype)
    return nnx.Param(value, logical_axes=tuple(logical))


def stacked(make, n: int, rngs: nnx.Rngs):
    """n copies of the module `make(rngs)` stacked on a leading `layers` axis (nnx.vmap).

    `rngs` has a `params` stream and any other (`dropout`, ...); a stream the block keeps
    (nnx.Dropout's) becomes a stateless `meshpar.nn.dropout.LayerStream`, whose keys are derived from
    the step, the microbatch and the layer when `scan_layers` runs the stack."""
    keys = jax.random.split(rngs.params(), n)

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        spare = jax.random.fold_in(key, 1)
        return make(nnx.Rngs(spare, params=key, dropout=spare))

    mod = create(keys)
    dropout.detach(mod, type(mod).__name__)
    for _, var in nnx.iter_graph(mod):  # meshpar's names or Flax's (`out_sharding`) gain `layers`
        if isinstance(var, nnx.Variable):
            meta = var.get_metadata()
            for key in ("logical_axes", "out_sharding"):
                names = meta.get(key)
                if names is not None and len(names) < len(jnp.shape(var.get_value())):
                    var.set_metadata(key, ("layers",) + tuple(names))
    return mod


def vocab_parallel_head() -> bool:
    """Whether the active layout splits the logits [batch, seq, vocab] over `vocab` (a Megatron head,
    under tp, tp_sp, fsdp_tp...) outside a pipeline stage: there the head's backward is a vocab-parallel
    dot whose input gradient XLA reduce-scatters, and `after` and `settled_cotangent` order it."""
    layout = active_layout()
    if layout is None or scopes.manual_axes():
        return False
    spec = tuple(layout.spec(("batch", "seq", "vocab")))
    return len(spec) == 3 and spec[2] is not None


def head_backward_first() -> bool:
    """Whether `after`'s backward finishes the head's backward before the layers' (a barrier over the
    cotangents): under a vocab-parallel head (`vocab_parallel_head`), and for libtpu under a head whose
    weight [E, V] is gathered at its use (FSDP: split over a data axis, the whole vocabulary).
    There libtpu otherwise computed the head's weight gradient after the layers' backward, holding the
    logits' cotangent through it: Llama-2 7B at 4k tokens on 64 v5p chips, fsdp, 4.02 -> 3.72 GiB.
    XLA:GPU already orders FSDP's head first, and the barrier raised its peak (5.08 -> 5.78 GiB); with
    replicated weights libtpu's peak rose under DP (+0.49 GiB) and held under ZeRO-1 (bench/RESULTS.md)."""
    if vocab_parallel_head():
        return True
    layout = active_layout()
    if layout is None or scopes.manual_axes() or platform() != "tpu":
        return False
    return any(axes is not None for axes in layout.spec(("embed", "vocab")))


@jax.custom_vjp
def after(x, *weights):
    """(x, *weights), unchanged, with each weight readable only once x exists
    (`lax.optimization_barrier`), in the forward pass. For a weight used after the layer stack (an
    LM head, a tied embedding as the head): its compute-dtype copy and FSDP all-gather then happen
    after the stack, where it is used. Without it libtpu started Llama-2's head gather, bf16 [E, V] =
    250 MB per device, before the first layer and held it across all of them (issue 43).

    The backward, where `head_backward_first` (a vocab-parallel head; an FSDP head on TPU), returns the
    cotangents of x and the weights together (a barrier): the head's weight gradient is finished
    before the layers' backward starts, so the logits' gradient [B, T, V / tensor] is not held across
    that backward.
    With `settled_cotangent` this took Llama-3 8B on 64 v5p chips, fsdp_tp_sp, from 9.20 to 8.08 GiB
    at 8k tokens and from 6.35 to 5.16 GiB on 64 H100s at 4k. Elsewhere it passes them straight through:
    the barrier raised fsdp's peak on H100 (5.08 -> 5.78 GiB) and a 1F1B pipeline's (+0.24 GiB);
    bench/RESULTS.md."""
    return jax.lax.optimization_barrier((x, *weights))


def _after_fwd(x, *weights):
    return jax.lax.optimization_barrier((x, *weights)), None


def _after_bwd(_, cotangents):
    if head_backward_first():
        return tuple(jax.lax.optimization_barrier(tuple(cotangents)))
    return tuple(cotangents)


after.defvjp(_after_fwd, _after_bwd)


@jax.custom_vjp
def settled_cotangent(logits):
    """`logits` [B, T, V], unchanged; under a vocab-parallel head (`vocab_parallel_head`) its cotangent
    is written whole, in the logits' own shape, before the head's backward reads it (a barrier). XLA
    then writes that gradient over the logits, in place. Without it libtpu fused the softmax's
    gradient into the operand of the head's windowed (collective-matmul) backward, [B, 1, T, V /
    tensor], which cannot share the logits' buffer: two such buffers live at once, 2.1 GB each for
    Llama-3 8B at 8k tokens on v5p with tensor=4. Under fsdp (whole vocabulary) the barrier raised
    libtpu's peak (5.11 -> 5.61 GiB at 4k), so there it is not set."""
    return logits


def _settled_bwd(_, g):
    return (jax.lax.optimization_barrier(g) if vocab_parallel_head() else g,)


settled_cotangent.defvjp(lambda logits: (logits, None), _settled_bwd)


REMAT_POLICIES = {
    "none": None,
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_dots": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
assert tuple(REMAT_POLICIES) == REMAT, "one policy per option of model.remat"


def gated_inputs(x, w, names=("batch", "seq", "mlp")):
    """A gated linear unit's two input projections from one fused weight: x [B, T, E], w [E, 2, F]
    -> (gate, up), each [B, T, F] pinned to `names` (Shazeer 2020's GLU: act(x Wg) * x Wu).

    One GEMM into [B, T, 2, F] on GPU and CPU; two GEMMs on TPU, the same FLOPs in buffers half as
    large: libtpu packed the fused output's backward buffers worse (Llama 3 8B on 64 v5p chips, 8k
    tokens, fsdp_tp_sp: the same live peak as MaxText's separate projections, 0.4 GiB more allocated),
    where on H100 the split added 0.1-0.3 GiB (bench/RESULTS.md)."""
    if platform() == "tpu":
        return tuple(constrain(jnp.einsum("bte,ef->btf", x, w[:, i]), names) for i in (0, 1))
    h = constrain(jnp.einsum("bte,ecf->btcf", x, w), (*names[:-1], None, names[-1]))
    return h[:, :, 0], h[:, :, 1]


@jax.custom_vjp
def swiglu(gate, up):
    """SwiGLU's product silu(gate) * up (Shazeer 2020), any matching shapes, in their dtype, with its
    backward in one elementwise pass: dgate = d up s (1 + gate (1 - s)), dup = d gate s, s =
    sigmoid(gate), in fp32. Autodiff of silu sums two cotangent terms for `gate` in a pass of their
    own; under remat libtpu held three [rows, F] buffers of them beside the recomputed gate, up and
    the incoming cotangent (Mixtral on 128 v5p chips: 11.83 -> 11.54 GiB peak; dense Llama rows and
    XLA:GPU's programs unchanged, bench/RESULTS.md)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, d):
    gate, up = res
    g, u, d32 = (t.astype(jnp.float32) for t in (gate, up, d))
    s = jax.nn.sigmoid(g)
    return (d32 * u * s * (1 + g * (1 - s))).astype(gate.dtype), (d32 * g * s).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def decode_loop_for(loop: str, platform_name: str) -> str:
    """`serve.decode_loop` on a platform -> "scan" or "unrolled". "auto": unrolled on a GPU, where XLA
    copies each scanned layer's weights out of the stacked arrays on every call (the matmuls' Triton
    kernels take no dynamic slice: 6.8 ms of copies per decode step for Llama-3 8B on an H200), scanned
    elsewhere (libtpu prefetches the slice)."""
    if loop not in DECODE_LOOPS:
        raise ConfigError(f"decode loop '{loop}': one of {', '.join(DECODE_LOOPS)}" + suggest(loop, DECODE_LOOPS))
    return ("unrolled" if platform_name == "gpu" else "scan") if loop == "auto" else loop


@contextlib.contextmanager
def decode_loop(loop: str) -> Iterator[None]:
    """Within: how `scan_layers` runs the stack when decoding (called with `cache`). "scan": as
    training does; "unrolled": one program copy per layer, each reading its weights from the stack in
    place; "auto": as `decode_loop_for` decides for the platform being compiled for."""
    token = scopes.DECODE_LOOP.set(decode_loop_for(loop, platform()))
    try:
        yield
    finally:
        scopes.DECODE_LOOP.reset(token)


def scan_layers(layers_mod, x, positions, remat: str = "full", scan: bool = True, cache=None, segment_ids=None):
    """Apply a stacked module [layers, ...] to x [B, T, E] (or any pytree of arrays: an encoder-decoder's
    {"y": [B, T, E], "enc": [B, S, E]}, say) layer by layer.

    `lax.scan` keeps one copy of the layer program (compile time independent of depth); the remat
    policy decides what the backward pass recomputes. Each layer is called `layer(x, positions)`, or
    `layer(x)` when `positions` is None (`layer(x, positions, segment_ids=...)` for packed documents,
    segment_ids [B, T]), and returns x (its structure, shapes and dtypes) or (x, aux). Returns (x, aux) with aux
    stacked [layers] ({} when the layers return none).
    With `cache` (a KV cache stacked [layers, ...], decoding) each layer is called as
    `layer(x, positions, cache=its slice) -> (x, aux, new slice)` and (x, aux, cache) is returned; a
    layer class with `cache_views = True` gets `meshpar.nn.kvcache.View`s instead, and its writes
    through `kvcache.write` update the stack in place. Under `decode_loop("unrolled")` (or "auto" on a
    GPU) the decoding layers run unrolled even where `scan` is true.
    """
    graphdef, state = nnx.split(layers_mod)

    def pin(v):
        """One layer's weight slice, pinned to its at-rest layout (its logical axes minus `layers`).
        Under FSDP the weight stays sharded until use (an all-gather per layer; explicit where the
        layout says so, `meshpar.core.layout.at_use`) and, by transposition, its gradient is
        reduce-scattered per layer inside the backward loop instead of all-reduced whole and sliced
        after the loop."""
        names = logical_axes(v)
        return v.replace(at_use(v.get_value(), names[1:])) if names else v

    def body(carry, xs):
        layer_state, i = xs if draws else (xs, 0)
        layer_state = jax.tree.map(pin, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        layer = nnx.merge(graphdef, layer_state)
        with dropout.layer(i):  # the layer's dropout keys (meshpar.nn.dropout)
            if segment_ids is not None:
                out = layer(carry, positions, segment_ids=segment_ids)
            else:
                out = layer(carry) if positions is None else layer(carry, positions)
        return out if isinstance(out, tuple) else (out, {})

    def decode_body(carry, xs):
        """The stacked cache rides in the carry (a scan's xs -> ys would copy the whole cache every
        step). A layer with `cache_views` gets a `kvcache.View` per leaf and writes its new entries
        into the stack in place; any other gets its slice, which is written back whole."""
        x, cache = carry
        layer_state, i = xs
        layer_state = jax.tree.map(pin, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if views:
            mine = jax.tree.map(lambda c: kvcache.View(c, i), cache)
        else:
            mine = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False), cache)
        y, aux, mine = nnx.merge(graphdef, layer_state)(x, positions, cache=mine)
        cache = jax.tree.map(lambda c, m: kvcache.restack(c, m, i), cache, mine, is_leaf=kvcache.is_view)
        return (y, cache), aux

    n = jax.tree.leaves(state)[0].shape[0]
    views = getattr(layers_mod, "cache_views", False)
    draws = dropout.draws(graphdef)  # its blocks draw dropout keys: the scan passes the layer index
    unrolled = not scan or (cache is not None and scopes.DECODE_LOOP.get() == "unrolled")
    loop = functools.partial(_unrolled, n=n) if unrolled else jax.lax.scan
    if cache is not None:  # decoding: no backward pass, so no remat
        (x, cache), aux = loop(decode_body, (x, cache), (state, jnp.arange(n)))
        return x, aux, cache
    body = _activation_and_aux(body, type(layers_mod).__name__, scan)
    if REMAT_POLICIES[remat] is not None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat](), prevent_cse=not scan)
    return loop(body, x, (state, jnp.arange(n)) if draws else state)


def _activation_and_aux(body, name: str, scan: bool):
    """`body` (which hands a layer's tuple on as it is, anything else as (it, {})) -> (x, aux): the
    layer returned its activation (the carry's pytree structure: an array, a dict, a tuple, ...) or
    (activation, aux). One line naming the layer when it returns another structure, or, under
    `lax.scan` (which carries x from layer to layer), other shapes or dtypes."""

    def run(carry, xs):
        out = body(carry, xs)
        if jax.tree.structure(out) == jax.tree.structure(carry):  # a tuple activation, no aux
            out = (out, {})
        elif jax.tree.structure(out[0]) != jax.tree.structure(carry):
            got = out[0] if isinstance(out[1], dict) and not out[1] else out
            raise ConfigError(
                f"meshpar.stacked layer {name} returned {describe(got)} for the activation "
                f"{describe(carry)}; a stacked layer returns its input's structure, or (it, aux dict)"
            )
        if scan:
            check_keeps(carry, out[0], f"meshpar.stacked layer {name}")
        return out

    return run


def check_keeps(x, y, what: str) -> None:
    """One line unless the activation y (any pytree) has x's shapes and dtypes: `what` maps x to y."""
    same = jax.tree.map(lambda a, b: jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b), x, y)
    if not all(jax.tree.leaves(same)):
        raise ConfigError(
            f"{what} maps the activation {describe(x)} to {describe(y)}; the stacked layers must keep "
            "their input's shapes and dtypes (change widths in pre or post, or out of the stack)"
        )


def describe(tree) -> str:
    """An activation pytree in one line: 'float32[2,8,16]', or "{['enc']: float32[2,6,16], ['y']: ...}"."""

    def one(a):
        if not hasattr(a, "dtype"):
            return type(a).__name__
        return f"{jnp.dtype(a.dtype).name}[{','.join(map(str, jnp.shape(a)))}]"

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if len(leaves) == 1 and not leaves[0][0]:
        return one(leaves[0][1])
    return "{" + ", ".join(f"{jax.tree_util.keystr(k)}: {one(a)}" for k, a in leaves) + "}"


def _unrolled(f, carry, xs, n: int):
    """`lax.scan(f, carry, xs)` as a Python loop over the n layers (one program copy per layer)."""
    ys = []
    for i in range(n):
        carry, y = f(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return carry, _stack(ys)


def _stack(auxes: list):
    """Per-layer aux dicts -> one dict stacked [layers] ({} when the layers report nothing)."""
    return jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes and jax.tree.leaves(auxes[0]) else {}
