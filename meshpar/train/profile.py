"""A profiler window over training steps: `profile.dir=D profile.start_step=S profile.steps=K`.

Steps S .. S+K-1 (numbered as the JSON Lines number them, from 1) run inside one `jax.profiler`
trace, each step wrapped in `jax.profiler.StepTraceAnnotation("train", step_num=n)` so the trace
viewers show step boundaries. Before step S the loop waits for the devices to finish the earlier
steps, and after step S+K-1 for that step to finish, so the trace holds the window's device work and
nothing else. Written by process 0 only (each process could trace its own devices; one trace is what
people open):

    D/plugins/profile/<timestamp>/<host>.xplane.pb        TensorBoard's profile plugin (tensorboard --logdir D)
    D/plugins/profile/<timestamp>/perfetto_trace.json.gz  https://ui.perfetto.dev -> Open trace file
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from meshpar.core.config import ProfileConfig
from meshpar.runtime.distributed import is_main


class ProfileWindow:
    def __init__(self, p: ProfileConfig, info=print):
        """`p`: the run's `cfg.profile` (dir, start_step, steps)."""
        self.dir = p.dir if (p.dir and is_main()) else None
        self.first, self.last = p.start_step, p.start_step + p.steps - 1
        self.info = info
        self.active = False
        self.done = False

    def note_start(self, first_step: int, last_step: int) -> None:
        """Say where the trace will go, or why there will be none (a resumed run past the window)."""
        if not self.dir:
            return
        if self.first < first_step or self.first > last_step:
            self.info(
                f"warning: profile.start_step={self.first} is outside the steps this run trains "
                f"({first_step}..{last_step}); no trace is written"
            )
            self.done = True
        else:
            self.info(f"profiling steps {self.first}..{min(self.last, last_step)} -> {Path(self.dir).absolute()}")

    def before(self, n: int, state) -> None:
        """Call before dispatching step n (1-based)."""
        if self.dir and not self.done and not self.active and n == self.first:
            jax.block_until_ready(state)  # earlier steps' device work stays out of the trace
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.active = True

    def annotate(self, n: int):
        return jax.profiler.StepTraceAnnotation("train", step_num=n) if self.active else contextlib.nullcontext()

    def after(self, n: int, outputs, last: bool = False) -> None:
        """Call after dispatching step n; stops the trace at the window's end (or the run's)."""
        if self.active and (n >= self.last or last):
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
            self.info(
                f"profile written to {Path(self.dir).absolute()} (tensorboard --logdir {self.dir}, "
                "or perfetto_trace.json.gz in https://ui.perfetto.dev)"
            )
