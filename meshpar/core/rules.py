"""Logical axis rules: what a tensor dimension *means* -> which mesh axes split it.

Models name dimensions with the logical names of `LOGICAL_AXES`; a strategy is nothing but rule
tables mapping those names to ordered mesh-axis *candidates*. A candidate is one mesh axis or a
tuple of axes that split the dimension jointly (e.g. `batch` over `("data", "fsdp")`).

Resolution (t5x / Flax Linen semantics, owned here because Flax NNX resolves rules as a dict):
for each dimension, walk its candidates in order and take the first one that, after dropping mesh
axes of size 1 and axes already used by an earlier dimension of the same tensor, is non-empty.
A dimension that is not divisible by the product of the chosen axes is an error, never a silent
replication. Because an axis is used at most once per spec, no tensor can map two dimensions to
`expert` (the mistake that makes XLA all-gather expert weights instead of all-to-all).

Presets (rule tables), after Megatron-LM (Shoeybi et al. 2019), ZeRO (Rajbhandari et al. 2020):

| preset  | parameters                  | optimizer state        | gradients          | activations                  |
|---------|-----------------------------|------------------------|--------------------|------------------------------|
| dp      | replicated                  | replicated             | all-reduced        | batch over data/fsdp/expert  |
| zero1   | replicated                  | embed/mlp/vocab / N    | reduce-scattered   | as dp                        |
| zero2   | replicated                  | as zero1               | reduce-scattered   | as dp                        |
| fsdp    | embed over the batch axes   | as params (ZeRO-3)     | reduce-scattered   | as dp                        |
| hsdp    | embed over fsdp only        | as params              | RS in fsdp, AR data| as dp                        |
| tp      | heads/mlp/vocab over tensor | as params              | as params          | heads/mlp/vocab over tensor  |
| tp_sp   | as tp                       | as params              | as params          | tp + residual length/tensor  |
| fsdp_tp | fsdp + tp (2D)              | as params              | as params          | tp                           |
| fsdp_tp_sp | fsdp + tp (2D)           | as params              | as params          | tp + residual length/tensor  |

FSDP splits `embed` over the batch's axes, data x fsdp x expert: under expert parallelism the weights outside the
experts are split over `expert` too, their gradients reduce-scattered over it (as MaxText's); an expert weight's
`expert` dimension takes that axis first, and its `embed` splits over data x fsdp.

Every preset also splits `length` and `seq` over `context` (context parallelism, meshpar.parallel.context)
when mesh.context > 1; tp_sp and fsdp_tp_sp split the residual stream's length over context x tensor.

The train state at rest is split over `context` as over the data axes (`Strategy.rest`): each context device sees
other tokens of the same sequences, so gradients are summed over `context` as over `data`, and what ZeRO shards over
data it shards over data x fsdp x context too (Megatron-LM's distributed optimizer shards over its data x context
group). zero1/zero2 keep their fp32 master weights (meshpar's params) split over `context` and gather them at use;
fsdp/hsdp/fsdp_tp split the parameters over `context` with their FSDP axes and gather them per layer (fsdp_tp_sp as
fsdp_tp). dp, tp and tp_sp, which replicate the state over data, replicate it over `context`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshpar.core.errors import ShardingError, suggest
from meshpar.core.mesh import MESH_AXES

# The names meshpar's presets give rules for (the vocabulary is open: other names replicate unless a
# user rule maps them). Activations and parameters share names where they share meaning.
LOGICAL_AXES: dict[str, str] = {
    "batch": "sequences in a (micro)batch",
    "length": "sequence positions of the residual stream between blocks (Megatron-SP splits this)",
    "seq": "sequence positions inside attention / MLP (always whole under sequence parallelism)",
    "embed": "model width d_model",
    "heads": "attention query heads",
    "kv_heads": "attention key/value heads (grouped-query attention)",
    "kv": "per-head width d_head",
    "mlp": "feed-forward hidden width d_ff",
    "vocab": "vocabulary entries",
    "layers": "stacked decoder layers (scanned)",
    "norm": "scale vector of a normalisation layer",
    "stage": "pipeline stages",
    "expert": "mixture-of-experts experts (E)",
    "group": "MoE token groups (G)",
    "capacity": "MoE expert capacity (C)",
    "expert_mlp": "MoE expert hidden width (H)",
    "cache_batch": "KV-cache slots (requests decoded together, meshpar.serve.engine)",
    "cache_length": "positions held by a KV cache",
}

BATCH_AXES = ("data", "fsdp", "expert")

Candidate = str | tuple[str, ...]
RuleTable = tuple[tuple[str, tuple[Candidate, ...]], ...]


def spec_axes(spec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec (or a slice of one) names, in order: P('data', ('fsdp', 'tensor'))
    -> ('data', 'fsdp', 'tensor')."""
    return tuple(a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part))


def table(**rules: Candidate | Sequence[Candidate] | None) -> RuleTable:
    """table(batch=[("data", "fsdp")], heads="tensor") -> normalised RuleTable."""
    out = []
    for name, cands in rules.items():
        if cands is None:
            cands = ()
        elif isinstance(cands, (str, tuple)):
            cands = (cands,)
        out.append((name, tuple(c if isinstance(c, str) else tuple(c) for c in cands)))
    return tuple(out)


@dataclass(frozen=True)
class Strategy:
    """A parallelism strategy = rule tables. `params` lays out activations and weights at their use;
    `rest` (ahead of `params`) the parameters at rest, and the gradients that take their layout."""

    name: str
    doc: str
    params: RuleTable
    opt_state: RuleTable | None = None  # ZeRO-1/2: optimizer state sharded although params are not
    shard_grads: bool = False  # ZeRO-2: gradients constrained to the opt_state layout (reduce-scatter)
    extra: RuleTable = field(default=())  # rules every strategy shares (stage, expert, groups)
    rest: RuleTable = field(default=())  # parameters at rest only: split over `context` (see the module docstring)

    def param_rules(self) -> RuleTable:
        return self.params + self.extra

    def rest_rules(self) -> RuleTable:
        return self.rest + self.params + self.extra

    def opt_rules(self) -> RuleTable:
        return (self.opt_state + self.params + self.extra) if self.opt_state is not None else self.rest_rules()

    def rules(self, kind: str) -> RuleTable:
        """The table for `kind`: "params" (activations, weights at use), "rest" (parameters at rest) or
        "opt_state"."""
        return {"params": self.param_rules, "rest": self.rest_rules, "opt_state": self.opt_rules}[kind]()


# the mesh axes whose devices hold different tokens of one batch: gradients are summed over them, and
# what a ZeRO stage shards over data it shards over all of them (Megatron's data x context group)
STATE_AXES = ("data", "fsdp", "context")


def narrowed(strategy: Strategy) -> Strategy:
    """`strategy` without its train state's split over `context`: the layout a tensor keeps when the
    data axes divide its dimension and data x context does not (the state as before context was added)."""

    def drop(rules: RuleTable) -> RuleTable:
        out = []
        for name, cands in rules:
            kept = [tuple(a for a in ((c,) if isinstance(c, str) else c) if a != "context") for c in cands]
            out.append((name, tuple(k[0] if len(k) == 1 else k for k in kept if k)))
        return tuple(out)

    return dataclasses.replace(
        strategy, rest=(), opt_state=None if strategy.opt_state is None else drop(strategy.opt_state)
    )


def resolve_kind(
    logical: Sequence[str | None],
    strategy: Strategy,
    user_rules: RuleTable,
    kind: str,
    mesh_shape: dict[str, int],
    shape: Sequence[int] | None = None,
    what: str = "tensor",
):
    """`resolve` of `logical` under the user's rules and `strategy`'s table for `kind`. A state tensor
    ("rest", "opt_state") whose dimension data x context does not divide takes the layout the data axes
    alone give it (`narrowed`); an error only where that fails too."""
    try:
        return resolve(logical, user_rules + strategy.rules(kind), mesh_shape, shape, what, strict=len(user_rules))
    except ShardingError:
        if kind == "params" or mesh_shape.get("context", 1) == 1:
            raise
        return resolve(
            logical, user_rules + narrowed(strategy).rules(kind), mesh_shape, shape, what, strict=len(user_rules)
        )


def over_context(rules: RuleTable) -> RuleTable:
    """`rules` with `context` joined to every candidate that splits over a data axis (data, fsdp)."""

    def widen(cand: Candidate) -> Candidate:
        axes = (cand,) if isinstance(cand, str) else cand
        return axes + ("context",) if {"data", "fsdp"} & set(axes) and "context" not in axes else cand

    return tuple((name, tuple(widen(c) for c in cands)) for name, cands in rules)


_COMMON = table(
    batch=[BATCH_AXES],
    group=[BATCH_AXES],
    expert="expert",
    stage="pipeline",
    layers="pipeline",  # stacked layers live at rest on their pipeline stage
    cache_batch=[BATCH_AXES],  # KV-cache slots, like a batch (serving)
    length="context",
    seq="context",
)  # context parallelism (meshpar.parallel.context)
_TP = table(heads="tensor", kv_heads="tensor", mlp="tensor", vocab="tensor", expert_mlp="tensor")
_ZERO_STATE = table(embed=[STATE_AXES], mlp=[STATE_AXES], vocab=[STATE_AXES], expert_mlp=[STATE_AXES])
# ZeRO-1/2's fp32 master weights (meshpar's params) at rest over `context`, gathered at use
_MASTER_OVER_CONTEXT = table(embed="context")
_FSDP = table(embed=[("data", "fsdp", "expert")], expert_mlp=[("data", "fsdp")])
_HSDP = table(embed="fsdp", expert_mlp="fsdp")

PRESETS: dict[str, Strategy] = {
    s.name: s
    for s in [
        Strategy("dp", "data parallel: params replicated, gradients all-reduced", table(), extra=_COMMON),
        Strategy(
            "zero1",
            "ZeRO-1: optimizer state sharded over data, params replicated over it",
            table(),
            opt_state=_ZERO_STATE,
            extra=_COMMON,
            rest=_MASTER_OVER_CONTEXT,
        ),
        Strategy(
            "zero2",
            "ZeRO-2: ZeRO-1 + gradients reduce-scattered",
            table(),
            opt_state=_ZERO_STATE,
            shard_grads=True,
            extra=_COMMON,
            rest=_MASTER_OVER_CONTEXT,
        ),
        Strategy(
            "fsdp",
            "ZeRO-3/FSDP: params, grads, optimizer state sharded over data x fsdp",
            _FSDP,
            extra=_COMMON,
            rest=over_context(_FSDP),
        ),
        Strategy(
            "hsdp",
            "hybrid sharded DP: FSDP inside `fsdp`, replicas over `data`",
            _HSDP,
            extra=_COMMON,
            rest=over_context(_HSDP),
        ),
        Strategy("tp", "Megatron 1D tensor parallel over `tensor`", _TP, extra=_COMMON),
        Strategy(
            "tp_sp",
            "Megatron TP + sequence parallel on the residual stream",
            _TP + table(length=[("context", "tensor")]),
            extra=_COMMON,
        ),
        Strategy(
            "fsdp_tp",
            "2D: FSDP over data x fsdp, Megatron TP over tensor",
            _TP + _FSDP[:1],
            extra=_COMMON,
            rest=over_context(_FSDP[:1]),
        ),
        Strategy(
            "fsdp_tp_sp",
            "2D: FSDP over data x fsdp, Megatron TP + sequence parallel over tensor",
            _TP + _FSDP[:1] + table(length=[("context", "tensor")]),
            extra=_COMMON,
            rest=over_context(_FSDP[:1]),
        ),
    ]
}


# Serving layouts (`meshpar.serve.engine`, `serve.strategy`): weights stay where they are for every decoded
# token, so per-token traffic is activations only. Any training preset may serve too; FSDP ones
# all-gather every weight per token (`meshpar.serve.engine` warns).
SERVING: dict[str, Strategy] = {
    s.name: s
    for s in [
        Strategy(
            "serve_tp",
            "serving: Megatron TP over `tensor` (heads, kv heads, mlp, vocab; embed never split), "
            "requests and KV-cache slots over data/fsdp/expert, the cache's kv heads over `tensor`",
            _TP,
            extra=_COMMON,
        ),
    ]
}


def get_strategy(name: str) -> Strategy:
    if name in SERVING:
        return SERVING[name]
    if name not in PRESETS:
        raise ShardingError(f"unknown strategy '{name}'" + suggest(name, {**PRESETS, **SERVING}))
    return PRESETS[name]


def parse_user_rules(rules: Sequence) -> RuleTable:
    """YAML `rules: [[heads, [tensor]], [batch, [[data, fsdp]]], [vocab, null]]` -> RuleTable.

    A user rule goes before the preset's, so it wins; `null` / `[]` forces replication. The logical
    vocabulary is open: a user model may name `patch` or `channels` and map them here; only the
    mesh axes are checked.
    """
    out = []
    for i, item in enumerate(rules):
        name, cands = item
        if cands is None:
            cands = []
        if isinstance(cands, str):
            cands = [cands]
        norm = []
        for c in cands:
            axes = (c,) if isinstance(c, str) else tuple(c)
            for a in axes:
                if a not in MESH_AXES:
                    raise ShardingError(f"rules[{i}] ({name}): unknown mesh axis '{a}'" + suggest(a, MESH_AXES))
            norm.append(axes[0] if len(axes) == 1 else axes)
        out.append((name, tuple(norm)))
    return tuple(out)


def resolve(
    logical: Sequence[str | None],
    rules: RuleTable,
    mesh_shape: dict[str, int],
    shape: Sequence[int] | None = None,
    what: str = "tensor",
    strict: int = 0,
):
    """Logical axes of one tensor -> `PartitionSpec` (first match, skip size-1 and used axes).

    `what` names the tensor in errors ("parameter 'layers.attn.wq'"). With `shape`, every sharded
    dimension is checked for divisibility by the product of its mesh axes. A name no rule covers is
    replicated (`uncovered` lists such names). The first `strict` entries of `rules` are the user's:
    one whose mesh axes an earlier dimension already took is an error, never a silent replication.
    """
    from jax.sharding import PartitionSpec

    if shape is not None and len(shape) != len(logical):
        raise ShardingError(
            f"{what}: {len(logical)} logical axes {tuple(logical)} for a rank-{len(shape)} "
            f"array of shape {tuple(shape)}"
        )
    lookup: dict[str, list[tuple[int, tuple[Candidate, ...]]]] = {}
    for i, (rule_name, cands) in enumerate(rules):
        lookup.setdefault(rule_name, []).append((i, cands))
    used: dict[str, int] = {}  # mesh axis -> the dimension that took it
    parts: list = []
    for dim, name in enumerate(logical):
        if name is None:
            parts.append(None)
            continue
        chosen: tuple[str, ...] = ()
        for i, cands in lookup.get(name, []):  # user rules first, then the preset's
            taken = None
            for cand in cands:
                axes = (cand,) if isinstance(cand, str) else cand
                live = tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
                axes = tuple(a for a in live if a not in used)
                if axes:
                    chosen = axes
                    break
                taken = taken or next((a for a in live if a in used), None)
            if i < strict and not chosen and taken:
                other = used[taken]
                raise ShardingError(
                    f"{what}: rule rules[{i}] [{name}, {list(cands)}] wants mesh axis '{taken}' for dimension "
                    f"{dim} ('{name}'), but dimension {other} ('{logical[other]}') already uses it; give one of "
                    f"them another axis, or write [{name}, null] to replicate it"
                )
            if chosen or not cands:  # an explicit empty rule means "replicate"
                break
        if chosen and shape is not None:
            n = math.prod(mesh_shape[a] for a in chosen)
            if shape[dim] % n:
                sizes = " x ".join(f"{a}={mesh_shape[a]}" for a in chosen)
                raise ShardingError(
                    f"{what}: dimension {dim} ('{name}', size {shape[dim]}) is not divisible by mesh axes "
                    f"{sizes} (= {n}); change the size to a multiple of {n}, resize those mesh axes, or add "
                    f"a rule [{name}, null] to replicate it"
                )
        used.update({a: dim for a in chosen})
        parts.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def uncovered(logical: Sequence[str | None], rules: RuleTable) -> list[str]:
    """The names of `logical` outside meshpar's vocabulary that no rule mentions (replicated: listed
    in the sharding table). Vocabulary names without a rule (`norm`, say) replicate by design."""
    known = {name for name, _ in rules} | set(LOGICAL_AXES)
    return [n for n in logical if n is not None and n not in known]


def check_rule_names(user_rules: RuleTable, used: set[str]) -> list[str]:
    """User rules whose logical name is neither in `used` (the names a model's parameters, variables
    and batch leaves carry) nor in meshpar's vocabulary. Such a rule is a typo when a used name is
    close to it (error, with the suggestion); otherwise it may name activations only (returned, for
    one warning line)."""
    known = set(used) | set(LOGICAL_AXES)
    idle = []
    for i, (name, _) in enumerate(user_rules):
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)  # embd, not patch~batch
        if close:
            raise ShardingError(
                f"rules[{i}]: unknown logical axis '{name}' (did you mean '{close[0]}'?): "
                f"no parameter, variable or batch leaf of this model names it"
            )
        idle.append(f"rules[{i}] ({name})")
    return idle
