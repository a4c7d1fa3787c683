"""What a trace runs under: the context variables meshpar's modules set around a call and read while
tracing it, declared here once, and the one probe of the enclosing `shard_map`'s manual axes.

Each variable is set with a `with` block by the module named first and read by the ones after it:

    LAYOUT    the active `Layout` (mesh + rules)   set: core.layout.use_layout (Trainer, Engine, pipeline);
              read: core.layout (constrain, at_use), nn layers through them
    POLICY    the precision `Policy`                set: core.precision.use_policy; read: core.precision
              (param_dtype, compute_dtype), nn layers
    BALANCED  sequences stored in the balanced      set: core.sequence.balanced (train.loss, pipeline);
              (zig-zag) order over `context`        read: core.sequence, parallel.context, nn.moe
    BRANCHES  MoE layers run inside per-device      set: nn.dropless.in_device_branches (1F1B);
              branches (route replicated)           read: nn.dropless
    ROUTING_KEY  random routing's key of the step   set: nn.moe.routing_key (Trainer); read: nn.moe
    DRAWS     dropout's (seed, step, microbatch,    set: nn.dropout (Trainer, pipeline ticks);
              layer) key parts                      read: nn.dropout
    PLATFORM  the platform a program is built for   set: core.platform.target (deviceless compiles);
              (a target, not the host's)            read: core.platform
    DECODE_LOOP  how decoding runs the stacked      set: nn.layers.decode_loop (Engine's generate);
              layers: "scan", "unrolled", "auto"    read: nn.layers.scan_layers
"""

from __future__ import annotations

import contextvars
from typing import Any

LAYOUT: contextvars.ContextVar[Any] = contextvars.ContextVar("meshpar_layout", default=None)
POLICY: contextvars.ContextVar[Any] = contextvars.ContextVar("meshpar_policy", default=None)  # None: fp32
BALANCED: contextvars.ContextVar[bool] = contextvars.ContextVar("meshpar_context_balanced", default=False)
BRANCHES: contextvars.ContextVar[bool] = contextvars.ContextVar("meshpar_moe_branches", default=False)
ROUTING_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar("meshpar_moe_key", default=None)
DRAWS: contextvars.ContextVar[Any] = contextvars.ContextVar("meshpar_dropout_draws", default=None)
PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshpar_platform", default=None)
DECODE_LOOP: contextvars.ContextVar[str] = contextvars.ContextVar("meshpar_decode_loop", default="scan")


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the enclosing `shard_map` is manual over (a pipeline stage's `pipeline`, maybe
    `data` and `context`); () outside one."""
    import jax  # local: core.platform reads this module before anything may import jax

    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)
