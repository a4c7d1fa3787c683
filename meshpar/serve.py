"""Sharded inference: prefill, insert and generate over a KV cache, with continuous batching.

    engine = Engine(cfg)                                   # mesh, serving layout, weights
    done = engine.run([Request([5, 6, 7], max_new_tokens=8, sampling=Sampling(temperature=0.7))])

The engine's three calls (the prefill/insert/generate split of JetStream and MaxText's engine):

    prefill(tokens, true length, sampling)  -> (entry: a cache of P positions + the request, first token)
    insert(entry, state, slot)              -> state with the request in `slot`
    generate(state)                         -> (state, next token per slot [B], logits [B, V])

(each takes `params=` to serve other weights than the engine's own).

A prompt of n tokens is padded to the bucket P = the smallest power of two >= max(n, min_bucket),
capped at the cache length S: one compilation per bucket; causal attention makes the padding
invisible to the n real positions. `generate` compiles once and donates the decode state (updated
in place). Sampling settings are per-slot traced arrays (`meshpar.sampling`): changing them never
recompiles. `run` is continuous batching: a request enters a free slot as soon as one frees (end
of sequence, its token budget, or a full cache), while the other slots keep decoding.

Layout (`serve.strategy`, default `serve_tp` in `meshpar.rules.SERVING`): weights are placed once,
at load, in the serving layout: Megatron TP over `tensor`, nothing over data/fsdp, so a decoded
token moves activations only (an FSDP layout would all-gather every weight per token; the engine
warns). The KV cache [L, B, K, S, D] is an array with logical axes (`cache_batch`, `cache_length`,
`kv_heads`), placed by the same rule tables: K over `tensor`, slots B over data. When K is not a
multiple of the tensor size the cache's heads cannot be split: K is replicated (cache and QKV
weights) and the slots are split over data x tensor instead (Pope et al. 2022 make the same
trade for multi-query attention), or replicated over `tensor` if the slots do not divide.

Per decode step every weight byte and every cache byte is read once, so decode is bound by memory
bandwidth: bytes/s per device = (weight bytes + cache bytes per device) / step time.

The model protocol (any nnx.Module can implement it; see `meshpar.models.decoder`):
    model.cache_spec(B, S) -> tree of meshpar.data.Leaf, each with a `cache_batch` and a `cache_length` axis
    model.decode(tokens [B, T], positions [B, T], cache) -> (logits [B, T, V], cache)
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar import precision as precision_lib
from meshpar.data import is_leaf
from meshpar.errors import ConfigError
from meshpar.mesh import make_mesh
from meshpar.rules import BATCH_AXES, Layout, get_strategy, parse_user_rules, spec_axes, table, use_layout
from meshpar.sampling import Sampling, position_key, sample
from meshpar.sharding import building, model_spec, param_shardings, path_name, var_shardings


@dataclass
class Request:
    """A prompt (token ids), its budget of new tokens, its sampling settings and end token."""
    tokens: list
    max_new_tokens: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    eos: int | None = None


@dataclass
class Completion:
    prompt: list
    tokens: list = field(default_factory=list)
    finish: str = ""          # eos | max_tokens | cache_full
    ttft_s: float = 0.0       # from `run` start to this request's first token (queueing included)


def buckets(cache_length: int, min_bucket: int) -> list[int]:
    """Prompt lengths compiled for: powers of two from min_bucket, capped at (and ending with) S."""
    out, p = [], 1 << max(0, math.ceil(math.log2(max(1, min_bucket))))
    while p < cache_length:
        out.append(p)
        p *= 2
    return out + [cache_length]


def serving_layout(mesh, strategy: str, user_rules, cache_spec, slots: int) -> tuple[Layout, list[str]]:
    """The layout a model is served in, and notes (one line each) on what it had to give up."""
    layout = Layout(mesh, get_strategy(strategy), parse_user_rules(user_rules))
    shape, notes = layout.shape, []
    t = shape.get("tensor", 1)
    kv = {leaf.shape[leaf.axes.index("kv_heads")] for leaf in jax.tree.leaves(cache_spec, is_leaf=is_leaf)
          if "kv_heads" in leaf.axes}
    if t > 1 and any(k % t for k in kv):
        k = min(kv)
        data = math.prod(shape.get(a, 1) for a in BATCH_AXES)
        over = (*BATCH_AXES, "tensor") if slots % (data * t) == 0 else BATCH_AXES
        extra = table(kv_heads=None, cache_batch=[over])
        layout = dataclasses.replace(layout, strategy=dataclasses.replace(
            layout.strategy, params=extra + layout.strategy.params))
        where = "slots over data x tensor" if "tensor" in over else "replicated over tensor (serve.slots not divisible)"
        notes.append(f"note: kv_heads={k} cannot split over tensor={t}: K/V heads replicated, KV cache {where}")
    return layout, notes


def _zeros(spec):
    """A tree of `Leaf` -> zero arrays of those shapes and dtypes (an empty cache)."""
    return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), spec, is_leaf=is_leaf)


def _check_length(request: Request, length: int) -> None:
    n = len(request.tokens)
    if n == 0:
        raise ConfigError("empty prompt: give at least one token")
    if n > length:
        raise ConfigError(f"prompt of {n} tokens is longer than the KV cache (serve.cache_length={length}); "
                          "raise serve.cache_length or shorten the prompt")


def _single(layout: Layout) -> Layout:
    """One request (batch 1, prefill): its batch, cache-slot and group dimensions are not split."""
    return dataclasses.replace(layout, user_rules=table(batch=None, cache_batch=None, group=None) + layout.user_rules)


class Engine:
    """Serve a model on a mesh: load weights into the serving layout, then prefill/insert/generate.

    `model`: factory rngs -> nnx.Module implementing the protocol above (default: `cfg.model.name`).
    `weights`: {"params", "vars"} pure dicts to serve (default: `cfg.checkpoint.dir`'s newest
    checkpoint (a folder that is missing or empty is an error), else `model.init_from`, else a fresh
    init from train.seed)."""

    def __init__(self, cfg, *, model: Callable | None = None, devices=None, weights=None,
                 info: Callable[[str], None] = print):
        from flax import nnx
        from meshpar.step import default_model
        self.cfg, self.info = cfg, info
        self.mesh = make_mesh(cfg.mesh, devices)
        if dict(zip(self.mesh.axis_names, self.mesh.devices.shape)).get("pipeline", 1) > 1:
            raise ConfigError("serving does not pipeline: set mesh.pipeline=1 (use mesh.tensor / mesh.data for the devices)")
        self.policy = precision_lib.get_policy(cfg.precision)
        self.dtype = self.policy.compute_dtype
        self.factory = model or default_model(cfg)
        self.spec = model_spec(self.factory, self.policy)
        with building(self.policy):
            self.abstract = abstract = nnx.eval_shape(lambda: self.factory(nnx.Rngs(0)))
        name = type(abstract).__name__
        if not (callable(getattr(abstract, "decode", None)) and callable(getattr(abstract, "cache_spec", None))):
            raise ConfigError(f"model {name} cannot be served: it needs decode(tokens, positions, cache) and "
                              "cache_spec(batch, length) (see meshpar.serve)")
        self.slots = cfg.serve.slots
        self.length = cfg.serve.cache_length or cfg.batch.length
        self.buckets = buckets(self.length, cfg.serve.min_bucket)
        with precision_lib.use_policy(self.policy):
            self.cache_spec = abstract.cache_spec(self.slots, self.length)
            self._entry_specs = {p: abstract.cache_spec(1, p) for p in self.buckets}
        for path, leaf in jax.tree_util.tree_leaves_with_path(self.cache_spec, is_leaf=is_leaf):
            if not is_leaf(leaf) or "cache_batch" not in leaf.axes or "cache_length" not in leaf.axes:
                raise ConfigError(f"{name}.cache_spec: leaf {path_name(path) or 'cache'} must be a meshpar.data.Leaf "
                                  "with a 'cache_batch' and a 'cache_length' axis")
        self.vocab = self._vocab(abstract)
        self.layout, self.notes = serving_layout(self.mesh, cfg.serve.strategy, cfg.rules, self.cache_spec, self.slots)
        rep = NamedSharding(self.mesh, P())
        params = jax.tree.map(lambda s: s.update(dtype=self._serve_dtype(s.dtype)), self.spec.shapes)
        self.weight_shardings = {"params": param_shardings(self.spec, self.layout),
                                 "vars": var_shardings(self.spec, self.layout)}
        self.notes += self._gather_warning()
        self.weight_shapes = {"params": params, "vars": self.spec.var_shapes}
        cache_sh = jax.tree.map(lambda leaf: self.layout.sharding(leaf.axes, leaf.shape, "KV cache"),
                                self.cache_spec, is_leaf=is_leaf)
        self.state_shardings = {"cache": cache_sh, **{k: rep for k in ("pos", "token", "temp", "top_k", "top_p", "key")}}
        self.traces = collections.Counter()      # compilations: one trace per compiled shape
        self._empty = None
        self._prefill = jax.jit(self._prefill_fn, out_shardings=(None, rep, rep))
        self._insert = jax.jit(self._insert_fn, out_shardings=self.state_shardings, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_fn, in_shardings=(self.weight_shardings, self.state_shardings),
                                 out_shardings=(self.state_shardings, rep, rep), donate_argnums=(1,))
        self.weights, self.source = self._load(weights)

    # -- set-up ----------------------------------------------------------------------------------
    def _vocab(self, abstract) -> int:
        """The logits' last dimension, from an abstract decode of one token (no memory, no compile)."""
        from flax import nnx

        def one(t):
            with building(self.policy):
                m = self.factory(nnx.Rngs(0))
            with precision_lib.use_policy(self.policy):
                return m.decode(t, t, _zeros(m.cache_spec(1, 1)))[0]
        return int(jax.eval_shape(one, jax.ShapeDtypeStruct((1, 1), jnp.int32)).shape[-1])

    def _serve_dtype(self, dtype):
        """Floating weights are served in the compute dtype (bf16 halves the bytes every step reads)."""
        return self.dtype if jnp.issubdtype(dtype, jnp.floating) else dtype

    def _gather_warning(self) -> list[str]:
        split = {a for s in jax.tree.leaves(self.weight_shardings["params"]) for a in spec_axes(s.spec)} & set(BATCH_AXES)
        if not split:
            return []
        return [f"warning: serve.strategy={self.cfg.serve.strategy} splits weights over {', '.join(sorted(split))}: "
                "every decoded token all-gathers them; serve.strategy=serve_tp keeps them in place"]

    def _load(self, weights):
        """-> (weights in the serving layout and dtype, where they came from)."""
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              {"params": self.spec.shapes, "vars": self.spec.var_shapes}, self.weight_shardings)
        source = "given"
        if weights is None and self.cfg.checkpoint.dir:
            from meshpar.checkpoint import restore_weights
            found = restore_weights(self.cfg.checkpoint.dir, target, self.info)
            if found is not None:
                tree, step, _ = found
                weights, source = {"params": tree["params"], "vars": tree.get("vars", {})}, f"checkpoint step {step}"
            elif not self.cfg.model.init_from:
                raise ConfigError(f"checkpoint.dir '{self.cfg.checkpoint.dir}' holds no checkpoint to serve; train "
                                  "into it first, or leave checkpoint.dir unset to serve a fresh random init")
        if weights is None and self.cfg.model.init_from:   # a Hugging Face model, read into the serving layout
            from meshpar import hf
            params = hf.load(self.cfg.model.init_from, self.abstract, self.weight_shardings["params"],
                             self.weight_shapes["params"])
            vars = jax.jit(lambda key: self._init_fn(key)["vars"], out_shardings=self.weight_shardings["vars"])(
                jax.random.key(self.cfg.train.seed))
            return {"params": params, "vars": vars}, self.cfg.model.init_from
        if weights is None:                 # born in place, in the serving dtype: one compiled call
            source = f"fresh init (train.seed={self.cfg.train.seed})"
            init = jax.jit(lambda key: self._cast(self._init_fn(key)), out_shardings=self.weight_shardings)
            return init(jax.random.key(self.cfg.train.seed)), source
        if all(jnp.dtype(x.dtype) == jnp.dtype(self._serve_dtype(x.dtype)) for x in jax.tree.leaves(weights)):
            return jax.device_put(weights, self.weight_shardings), source
        return jax.jit(self._cast, out_shardings=self.weight_shardings)(weights), source

    def _cast(self, weights):
        return jax.tree.map(lambda x: x.astype(self._serve_dtype(x.dtype)), weights)

    def _init_fn(self, key):
        from flax import nnx
        with building(self.policy):
            model = self.factory(nnx.Rngs(key))
        return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "vars": self.spec.vars_of(model)}

    def _model(self, weights):
        model = self.spec.merge(weights["params"], weights["vars"])
        if hasattr(model, "eval"):
            model.eval()                      # dropout off, running statistics used
        return model

    def state_shapes(self) -> dict:
        """The decode state: the cache [.., B, S, ..] and per slot its position (where its last token
        goes), last token and sampling settings."""
        b, key = self.slots, jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        sds = jax.ShapeDtypeStruct
        shapes = {"cache": jax.tree.map(lambda leaf: sds(leaf.shape, leaf.dtype), self.cache_spec, is_leaf=is_leaf),
                  "pos": sds((b,), jnp.int32), "token": sds((b,), jnp.int32), "temp": sds((b,), jnp.float32),
                  "top_k": sds((b,), jnp.int32), "top_p": sds((b,), jnp.float32), "key": sds((b, *key.shape), key.dtype)}
        return jax.tree.map(lambda a, sh: sds(a.shape, a.dtype, sharding=sh), shapes, self.state_shardings)

    def new_state(self) -> dict:
        """An empty decode state, born in its shardings (all slots free)."""
        if self._empty is None:
            fill = {"top_k": self.vocab, "top_p": 1}
            self._empty = jax.jit(lambda: {k: jax.tree.map(lambda a: jnp.full(a.shape, fill.get(k, 0), a.dtype), v)
                                           for k, v in self.state_shapes().items()},
                                  out_shardings=self.state_shardings)
        return self._empty()

    # -- the three compiled calls ------------------------------------------------------------------
    def _prefill_fn(self, weights, tokens, length, samp):
        """tokens [1, P], length = true prompt length -> (entry cache, first token, its logits [V])."""
        self.traces["prefill"] += 1
        p = tokens.shape[1]
        layout = _single(self.layout)
        with use_layout(layout), precision_lib.use_policy(self.policy):
            logits, cache = self._model(weights).decode(tokens, jnp.arange(p, dtype=jnp.int32)[None],
                                                        _zeros(self._entry_specs[p]))
        last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, keepdims=False).astype(jnp.float32)
        key = position_key(samp["key"], length - 1)
        tok = sample(last[None], samp["temp"][None], samp["top_k"][None], samp["top_p"][None], key[None])[0]
        return {"cache": cache, "length": length, "token": tok, **samp}, tok, last

    def _insert_fn(self, entry, state, slot):
        """Write a prefilled request into `slot`: its cache rows (padded to S), position, token, sampling."""
        self.traces["insert"] += 1
        onehot = jnp.arange(self.slots) == slot                                         # [B]
        length, token = entry["length"], entry["token"]

        def put(leaf, e, c):
            bd, ld = leaf.axes.index("cache_batch"), leaf.axes.index("cache_length")
            pad = [(0, 0)] * e.ndim
            pad[ld] = (0, c.shape[ld] - e.shape[ld])
            mask = onehot.reshape([-1 if d == bd else 1 for d in range(c.ndim)])
            return jnp.where(mask, jnp.pad(e, pad).astype(c.dtype), c)

        cache = jax.tree.map(put, self.cache_spec, entry["cache"], state["cache"], is_leaf=is_leaf)
        new = {"cache": cache, "pos": jnp.where(onehot, length, state["pos"]),
               "token": jnp.where(onehot, token, state["token"])}
        for k in ("temp", "top_k", "top_p"):
            new[k] = jnp.where(onehot, entry[k], state[k])
        new["key"] = jnp.where(onehot[:, None], entry["key"][None], state["key"])
        return new

    def _generate_fn(self, weights, state):
        """One token for every slot: each slot's last token at its position -> the next one."""
        self.traces["generate"] += 1
        pos = jnp.minimum(state["pos"], self.length - 1)     # a full slot is never read back (run frees it)
        with use_layout(self.layout), precision_lib.use_policy(self.policy):
            logits, cache = self._model(weights).decode(state["token"][:, None], pos[:, None], state["cache"])
        logits = logits[:, 0].astype(jnp.float32)                                       # [B, V]
        keys = jax.vmap(position_key)(state["key"], pos)
        nxt = sample(logits, state["temp"], state["top_k"], state["top_p"], keys)
        return {**state, "cache": cache, "token": nxt, "pos": state["pos"] + 1}, nxt, logits

    # -- public calls ----------------------------------------------------------------------------
    @staticmethod
    def precheck(cfg, requests) -> None:
        """The checks that need no model (run before loading one): prompt lengths and sampling ranges."""
        length = cfg.serve.cache_length or cfg.batch.length
        for r in requests:
            _check_length(r, length)
            r.sampling.check(vocab=None)

    def check(self, request: Request) -> None:
        """One line naming what is wrong with a request."""
        _check_length(request, self.length)
        bad = [t for t in request.tokens if not 0 <= int(t) < self.vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary 0..{self.vocab - 1}")
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        request.sampling.check(self.vocab)

    def bucket(self, n: int) -> int:
        return next(p for p in self.buckets if p >= n)

    def prefill(self, tokens, true_length: int | None = None, sampling: Sampling | None = None, params=None):
        """One prompt -> (entry, its first token (a device scalar), the logits that chose it [V]).

        `tokens`: the prompt's ids (padded here to its bucket), or ids already padded to a bucket with
        `true_length` the real count. The entry holds the prompt's cache [.., 1, P, ..], its length,
        first token and sampling settings, for `insert`. `params`: weights (default: the engine's)."""
        tokens = list(np.asarray(tokens).reshape(-1))
        n = len(tokens) if true_length is None else int(true_length)
        request = Request(tokens[:n], 1, sampling or Sampling())
        self.check(request)
        padded = np.zeros((1, self.bucket(max(n, len(tokens)))), np.int32)
        padded[0, :n] = tokens[:n]
        return self._prefill(self.weights if params is None else params, jnp.asarray(padded), jnp.int32(n),
                             request.sampling.arrays(self.vocab))

    def insert(self, entry, state, slot: int):
        """-> `state` with the prefilled request in `slot` (donated: updated in place)."""
        return self._insert(entry, state, jnp.int32(slot))

    def generate(self, state, params=None):
        """-> (state, next token per slot [B], logits [B, V]); `state` is donated."""
        return self._generate(self.weights if params is None else params, state)

    def warmup(self, requests=()) -> None:
        """Compile prefill/insert for the buckets of `requests` and generate, outside any timing."""
        state = self.new_state()
        for p in sorted({self.bucket(len(r.tokens)) for r in requests if r.tokens}):
            entry, _, _ = self.prefill([0] * p)
            state = self.insert(entry, state, 0)
        jax.block_until_ready(self.generate(state))

    def run(self, requests: list[Request], on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Continuous batching: every request decoded to its end; `on_token(request index, token)` streams."""
        for r in requests:
            self.check(r)
        t0 = time.perf_counter()
        out = [Completion(list(r.tokens)) for r in requests]
        queue = collections.deque(range(len(requests)))
        free, active = list(range(self.slots)), {}
        state = self.new_state()
        self.decode_steps, self.decode_s = 0, 0.0

        def emit(i, tok) -> bool:
            """Record a token; True when request i is finished."""
            r, c = requests[i], out[i]
            c.tokens.append(tok)
            if on_token:
                on_token(i, tok)
            if r.eos is not None and tok == r.eos:
                c.finish = "eos"
            elif len(c.tokens) >= r.max_new_tokens:
                c.finish = "max_tokens"
            elif len(r.tokens) + len(c.tokens) > self.length:       # no room to write the last token
                c.finish = "cache_full"
            return bool(c.finish)

        while queue or active:
            while queue and free:
                i, slot = queue.popleft(), free.pop(0)
                r = requests[i]
                entry, tok, _ = self.prefill(r.tokens, sampling=r.sampling)
                state = self.insert(entry, state, slot)
                tok = int(tok)
                out[i].ttft_s = time.perf_counter() - t0
                if emit(i, tok):
                    free.append(slot)
                else:
                    active[slot] = i
            if not active:
                continue
            t = time.perf_counter()
            state, toks, _ = self.generate(state)
            toks = np.asarray(toks)
            self.decode_s += time.perf_counter() - t
            self.decode_steps += 1
            for slot, i in list(active.items()):
                if emit(i, int(toks[slot])):
                    del active[slot]
                    free.append(slot)
        return out

    # -- facts -----------------------------------------------------------------------------------
    def compiled_generate(self):
        """The compiled decode step (HLO text, memory_analysis) without running it."""
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.weights)
        return self._generate.lower(shapes, self.state_shapes()).compile()

    def bytes_per_device(self) -> dict:
        """Weight and KV-cache bytes one device holds (what a decode step reads)."""
        from meshpar.sharding import bytes_per_device
        w = sum(bytes_per_device(a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(self.weights))
        c = sum(bytes_per_device(leaf.shape, leaf.dtype, sh) for leaf, sh in zip(
            jax.tree.leaves(self.cache_spec, is_leaf=is_leaf), jax.tree.leaves(self.state_shardings["cache"])))
        return {"weights": int(w), "cache": int(c)}
