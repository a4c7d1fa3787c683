"""Run output: a progress bar (rich) for people, JSON Lines for programs, TensorBoard scalars.

JSON Lines records (one object a line, `--metrics-out FILE`):
  {"event": "start", "mesh": {...}, "strategy": ..., "entropy_floor": ..., ...}
  {"event": "step", "step": n, "loss": ..., "step_time_s": ..., "tokens_per_s": ..., "examples_per_s": ...,
   "mfu": ..., ...}        (tokens_per_s is null for a loss other than the built-in LM loss)
  {"event": "eval", "step": n, "loss": ..., "perplexity": ..., "batches": k, "tokens": ...}   (eval.every)
  {"event": "end", "final_loss": ..., "gap_closed": ..., ...}
Fault tolerance adds: start `processes` and `scheduler` (under SLURM: job id, `restart_count` after a
requeue), and after a resume `resumed_from` / `resumed_path` /
`damaged_checkpoints`; step `skipped_steps` and `nonfinite` (and under fp16 `loss_scale`, the scale
the step used, and `overflows`); end `preempted` (signal name) / `stopped_at` / `checkpoint`.
A resumed run appends to the file: a new `start` record (with `resumed_from`) and the steps after
it, so one file holds the whole run (`meshpar plot` draws it as one). Only process 0 writes or prints.

Console: every logged step prints a line that stays (step, loss, lr, grad norm, throughput, MFU);
on a terminal a progress bar lives below them; in a pipe or a file there is no bar and no wrapping.

TensorBoard (`metrics.tensorboard=DIR`, tensorboardX event files): every number of a step record
is the scalar `train/<key>` (loss, lr, grad_norm, tokens_per_s, mfu, loss_scale, the MoE
drop_fraction / load_min / load_max / aux_loss ...), a per-layer list `train/<key>/<i>`; eval
records are `eval/loss` and `eval/perplexity`; all at the record's step, the same values as the JSON
Lines (stored as float32). View with `tensorboard --logdir DIR`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from meshpar.core.precision import get_policy
from meshpar.core.sharding import render_sharding_table
from meshpar.runtime.distributed import is_main, on_interrupt


def make_console(stderr: bool = False):
    """A rich Console: the terminal's width on a terminal; in a pipe or a log file, lines as long as
    they are (rich would wrap tables at 80 columns there: `PartitionSpe c`)."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=1000)


def _matmuls(facts: dict) -> str:
    """` (matmuls in float32)` when the run's matmuls are not in its policy's compute dtype (a model
    that sets its own dtypes: `meshpar.train.noops`), else nothing."""
    used = facts.get("matmul_dtypes") or []
    want = jnp.dtype(get_policy(facts["precision"]).compute_dtype).name if facts.get("precision") else None
    return f" (matmuls in {' / '.join(used)})" if used and want not in used else ""


def _devices(facts: dict) -> str:
    """`8 devices`, or `8 devices in 2 processes` (and the scheduler's job) when several take part."""
    n, procs = facts["devices"], facts.get("processes") or 1
    where = f"{n} devices" + (f" in {procs} processes" if procs > 1 else "")
    job = facts.get("scheduler") or {}
    if job.get("job_id"):
        where += f", {job['name']} job {job['job_id']}" + (
            f" restart {job['restart_count']}" if job.get("restart_count") else ""
        )
    return where


class MetricsLogger:
    """Console, JSON Lines (`path`) and TensorBoard output of one run (process 0 only).

    A run that resumes from a checkpoint appends to `path` (its `start` record says `resumed_from`),
    so the file holds the whole run; a fresh run starts the file anew."""

    def __init__(self, path: str | None, total_steps: int, console=None, tensorboard: str | None = None):
        self.console = console or make_console()
        self.main = is_main()
        self.path = Path(path) if (path and self.main) else None
        self.file = None
        self.tb = None
        if tensorboard and self.main:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(logdir=str(tensorboard), flush_secs=30)
        self.total = total_steps
        self.progress = None
        self.task = None

    def _write(self, rec: dict) -> None:
        if self.file:
            self.file.write(json.dumps(rec, default=_default) + "\n")
            self.file.flush()

    def info(self, msg: str) -> None:
        if self.main:
            self.console.print(msg)

    def start(self, facts: dict, trainer=None) -> None:
        cfg = facts.pop("config", None)
        if self.path is not None:
            self.file = open(self.path, "a" if facts.get("resumed_from") is not None else "w")  # noqa: SIM115
        on_interrupt.append(self.close)
        self._write({"event": "start", **facts, **({"config": dataclasses.asdict(cfg)} if cfg else {})})
        if not self.main:
            return
        floor = facts.get("entropy_floor")
        self.console.print(
            f"[bold]meshpar[/] {facts['strategy']} on {facts['mesh_str']} ({_devices(facts)}), "
            f"{facts['params'] / 1e6:.2f}M params, precision {facts['precision']}{_matmuls(facts)}"
            + (f", entropy floor {floor:.4f} nats/token" if floor is not None else "")
        )
        if trainer is not None:
            self.console.print(render_sharding_table(trainer.sharding_table()))
        if self.console.is_terminal:  # the bar stays below the step lines (which stay on screen)
            self.progress, self.task = _progress_bar(self.console, self.total, facts.get("resumed_from") or 0)

    def _print(self, msg: str) -> None:
        """A line that stays, printed above the progress bar when there is one."""
        (self.progress.console.print if self.progress is not None else self.console.print)(msg)

    def _scalars(self, prefix: str, rec: dict, skip=("step",)) -> None:
        if self.tb is None:
            return
        for k, v in rec.items():
            if k in skip or v is None or isinstance(v, (bool, str)):
                continue
            if isinstance(v, list):
                for i, x in enumerate(v):
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        self.tb.add_scalar(f"{prefix}/{k}/{i}", x, rec["step"])
            elif isinstance(v, (int, float)):
                self.tb.add_scalar(f"{prefix}/{k}", v, rec["step"])

    def eval(self, rec: dict) -> None:
        """An evaluation record: {"step", "loss", "perplexity", ...}."""
        self._write({"event": "eval", **rec})
        self._scalars("eval", rec, skip=("step", "batches", "tokens", "eval_s"))
        if self.main:
            self._print(f"eval step {rec['step']}: loss {rec['loss']:.4f}, perplexity {rec['perplexity']:.3f}")

    def step(self, rec: dict) -> None:
        self._write({"event": "step", **rec})
        self._scalars("train", rec)
        if not self.main:
            return
        self._print(_step_line(rec, self.total))
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"])

    def end(self, rec: dict) -> None:
        self._write({"event": "end", **rec})
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.main and rec.get("final_loss") is None:  # e.g. resumed at the last step: nothing to train
            self.console.print(f"done: no steps left to train ({rec.get('steps')} steps)")
        elif self.main:  # losses of the whole run, resumes included
            what = f"stopped after step {rec['stopped_at']}" if rec.get("preempted") else "done"
            msg = f"{what}: loss {rec['initial_loss']:.4f} -> {rec['final_loss']:.4f}"
            if rec.get("entropy_floor") is not None:
                msg += f" (floor {rec['entropy_floor']:.4f}, {100 * rec['gap_closed']:.1f}% of the gap closed)"
            self.console.print(msg + f" in {rec['wall_s']:.1f}s")
        self.close()

    def close(self) -> None:
        """Stop the bar (the terminal gets its cursor back) and close the files; safe to call twice."""
        if self.close in on_interrupt:
            on_interrupt.remove(self.close)
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.file and not self.file.closed:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


_SHOWN_ELSEWHERE = {
    "step",
    "loss",
    "total_loss",
    "ce",
    "grad_norm",
    "lr",
    "nonfinite",
    "skipped_steps",
    "overflows",
    "step_time_s",
    "examples_per_s",
    "tokens_per_s",
    "mfu",
}


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(f"{x:.3g}" for x in v) + "]"
    return f"{v:.3g}"


def _default(o):
    try:
        return float(o)
    except Exception:  # noqa: BLE001
        return str(o)


def _progress_bar(console, total: int, done: int):
    """A started rich progress bar of `total` steps, `done` of them already -> (bar, its task)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console)
    task = bar.add_task("train", total=total, completed=done)
    bar.start()
    return bar, task


def _step_line(rec: dict, total: int) -> str:
    """A step record as its console line: step, loss, lr, grad norm, rate, MFU, then the loss
    function's own metrics (MoE: aux_loss, load_... per layer; a classifier: accuracy)."""
    extra = "".join(f" {k} {_fmt(v)}" for k, v in rec.items() if k not in _SHOWN_ELSEWHERE and v is not None)
    rate = (
        f"{rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("tokens_per_s") is not None
        else f"{rec['examples_per_s']:,.1f} examples/s"
    )
    parts = [
        f"step {rec['step']:>5}/{total}",
        f"loss {rec['loss']:.4f}",
        *(f"{name} {rec[k]:.3g}" for k, name in (("lr", "lr"), ("grad_norm", "grad norm")) if k in rec),
        rate,
        f"MFU {100 * rec['mfu']:.2f}%",
    ]
    return " | ".join(parts) + extra
