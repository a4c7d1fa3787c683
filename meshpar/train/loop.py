"""The training loop: data, steps, metrics, checkpoints (read top to bottom in one sitting).

    end = run(cfg)                                    # the model / loss / data named by cfg
    end = run(cfg, trainer=Trainer(cfg, model=..., loss=...), source=my_source)   # your own

The step itself (grads, microbatches, the optimizer update) is `meshpar.train.step`; this module feeds it
batches, logs what it returns and saves what it produces.

The host never waits for the devices except where it must: batches are built `PREFETCH` steps
ahead on a background thread (`meshpar.train.batches.Prefetch`), and the loop reads device values (`_read`,
the one place it does) only at logging steps (`train.log_every`, the first and the last step), at
evaluations, before a checkpoint is written and at the end. In between, steps are dispatched back
to back. The non-finite flag of every step is kept on the device until then and checked in order,
so `train.on_nan=stop` still names the first bad step and no checkpoint is ever written after it, and
`train.on_nan=skip` stops, naming them, once `train.max_consecutive_skips` steps in a row were skipped.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from meshpar.core import precision as precision_lib
from meshpar.core.errors import ConfigError, MeshparError
from meshpar.runtime.distributed import Preempted, PreemptionGuard, scheduler_job
from meshpar.runtime.peers import await_peer_verdict, progress
from meshpar.train.batches import Batches, Prefetch
from meshpar.train.data import floor_gap_closed, make_eval_source, make_source
from meshpar.train.evaluate import Evaluator
from meshpar.train.flops import peak_flops_per_device
from meshpar.train.metrics import MetricsLogger
from meshpar.train.profile import ProfileWindow
from meshpar.train.step import Trainer, trainer_for, user_source

PREFETCH = 2  # batches built ahead of the step that consumes them (0: build in the loop)
DATA_KEYS = ("data.seed", "batch.global_size", "batch.length", "data.kind", "data.path")
SCHEDULE_KEYS = ("steps", "train.lr", "train.warmup_steps", "train.min_lr_ratio")  # the lr schedule's shape


def data_changes(saved_config: dict, cfg, keys=DATA_KEYS) -> list[str]:
    """`key=new (checkpoint: old)` for every dotted key of `keys` (default: the data stream's) whose
    value differs from the saved run's config."""
    out = []
    for key in keys:
        *section, name = key.split(".")
        saved = saved_config.get(section[0]) if section else saved_config
        new = getattr(getattr(cfg, section[0]) if section else cfg, name, None)
        if isinstance(saved, dict) and saved.get(name) != new:
            out.append(f"{key}={new} (checkpoint: {saved.get(name)})")
    return out


def make_data_source(cfg, trainer: Trainer):
    """`data.kind` -> a source: built-in token sources (vocabulary from the model or `model.vocab`)
    or `PKG.MODULE:FN` called as `FN(cfg)`."""

    if ":" in cfg.data.kind:
        return user_source(cfg)
    vocab = _vocab(cfg.model, trainer)
    if vocab is None:
        raise ConfigError(f"data.kind={cfg.data.kind} needs the vocabulary size: set model.vocab (or model.args.vocab)")
    return make_source(cfg.data, cfg.batch, cfg.eval, vocab)


def make_evaluator(data, batch, evaluation, model, trainer: Trainer, source):
    """The held-out evaluation of a run training on `source` (`meshpar.train.evaluate`); `data`,
    `batch`, `evaluation`, `model`: the run's `cfg.data`, `cfg.batch`, `cfg.eval`, `cfg.model`."""
    held_out = make_eval_source(data, batch, evaluation, _vocab(model, trainer), source)
    return Evaluator(trainer, held_out, evaluation, batch, data.seed)


def _vocab(model, trainer: Trainer) -> int | None:
    """The vocabulary size: the model's own config, else `model.vocab` / `model.args.vocab` (`model`:
    the run's `cfg.model`)."""
    return getattr(trainer.spec.model_config, "vocab", None) or model.vocab or model.args.get("vocab")


def run(cfg, metrics_out: str | None = None, console=None, trainer: Trainer | None = None, source=None) -> dict:
    """Train to `cfg.steps` steps; returns the end record. The loop a newcomer reads in one sitting.

    With `checkpoint.dir`: resume from its newest usable checkpoint (saved on any mesh/strategy),
    save every `checkpoint.every` steps (asynchronously) and at the end; SIGTERM/SIGINT save at the
    step reached and raise `Preempted`. A non-finite step never reaches the state (the compiled step
    skips it); with `train.on_nan=stop` the loop raises naming the step before any later save.
    """
    from meshpar.io.checkpoint import Checkpointer  # local: Orbax loads only for a run with checkpoint.dir

    source = source if source is not None else user_source(cfg)
    trainer = trainer or trainer_for(cfg, source=source)
    source = source or make_data_source(cfg, trainer)
    facts = {**trainer.describe(), "matmul_dtypes": trainer.notices.matmul_dtypes()}  # the dtypes really used
    log = MetricsLogger(metrics_out, cfg.steps, console=console, tensorboard=cfg.metrics.tensorboard)
    floor = getattr(source, "entropy_rate", None)
    ckpt = data = profiler = None
    closed = []

    def close_all():
        """Once: stop the profiler and the prefetch thread, finish the checkpoint writes in flight."""
        if not closed:
            closed.append(_close(profiler, data, ckpt))

    try:
        ckpt = Checkpointer(cfg.checkpoint, trainer, info=log.info) if cfg.checkpoint.dir else None
        found = ckpt.restore_latest() if ckpt else None
        resumed = _resumed(found)
        peak, peak_src = _log_start(log, cfg, trainer, {**facts, "entropy_floor": floor, **resumed}, found)

        data = _batches(source, trainer, cfg.batch, cfg.data.seed, found)
        t0 = time.perf_counter()
        compiled = trainer.compile()
        compile_s = time.perf_counter() - t0
        state = _first_state(trainer, found, cfg.precision)
        if PREFETCH:
            data = Prefetch(data, PREFETCH)
        evaluate = make_evaluator(cfg.data, cfg.batch, cfg.eval, cfg.model, trainer, source) if cfg.eval.every else None
        profiler = ProfileWindow(cfg.profile, info=log.info)
        step_flops, _ = trainer.model_flops()  # model FLOPs of one step (meshpar.train.flops)
        log.info(f"compiled train step in {compile_s:.1f}s; MFU against {peak / 1e12:.3g} TFLOP/s/device ({peak_src})")

        start = int(_read(state["step"]))
        profiler.note_start(start + 1, cfg.steps)
        # the whole run's first logged loss: kept in every checkpoint, so a resumed run reports its gap too
        first_loss = found.meta.get("initial_loss") if found else None
        stop, metrics = None, None
        unchecked = []  # (step, nonfinite, loss) on the device, not yet read
        skipped = []  # the steps skipped in a row so far (train.on_nan=skip)
        window_start, window_steps = time.perf_counter(), 0

        def check_finite(values=None):
            """Read (unless given) and check the flags of the steps not yet checked, oldest first."""
            nonlocal unchecked
            if unchecked:
                values = _read([u[1:] for u in unchecked]) if values is None else values
                for (n, _, _), (bad, loss) in zip(unchecked, values):
                    _check_finite(cfg.train, n, bad, loss, skipped)
            unchecked = []

        # Ctrl-C from here on (second one: at once) saves at the step reached and stops, and one that
        # lands while the cleanup finishes the checkpoint writes waits for them
        with PreemptionGuard() as guard:
            try:
                for step in range(start, cfg.steps):
                    n = step + 1  # steps are numbered from 1 in logs, checkpoints, profiles
                    batch = next(data)
                    profiler.before(n, state)
                    with profiler.annotate(n):
                        state, metrics = compiled(state, batch)
                    profiler.after(n, metrics, last=n == cfg.steps)
                    window_steps += 1
                    unchecked.append((n, metrics["nonfinite"], metrics["loss"]))
                    progress["step"] = n
                    if n % cfg.train.log_every == 0 or n == cfg.steps or step == start:
                        metrics, flags = _read((metrics, [u[1:] for u in unchecked]))  # waits for step n
                        dt = (time.perf_counter() - window_start) / window_steps
                        rec = _record(n, metrics, dt, facts, step_flops / (peak * facts["devices"]))
                        first_loss = rec["loss"] if first_loss is None else first_loss
                        log.step(rec)
                        check_finite(flags)
                        window_start, window_steps = time.perf_counter(), 0
                    if evaluate is not None and n % cfg.eval.every == 0:
                        check_finite()
                        log.eval({"step": n, **evaluate(state)})
                        window_start, window_steps = time.perf_counter(), 0
                    stop = guard.reached(n)
                    if ckpt and (ckpt.due(n) or stop or n == cfg.steps):
                        check_finite()  # never save past a step that must stop the run
                        path = ckpt.save(n, state, data.state(), wait=bool(stop), run={"initial_loss": first_loss})
                        log.info(f"checkpoint step {n} -> {path}" + (" (written)" if stop else " (writing)"))
                    if stop:
                        break
                check_finite()
            except Exception as e:
                if jax.process_count() > 1:  # a collective failed: if a peer died, exit naming it
                    await_peer_verdict(e)
                raise
            finally:
                close_all()
    except BaseException:
        log.close()  # the bar stopped, the JSON Lines and TensorBoard files hold every step logged
        raise
    finally:  # also on an error before the loop
        close_all()
    # the loss at the step reached (after an interrupt that may be past the last logged step)
    final = None if metrics is None else float(_read(metrics["loss"]))
    end = dict(steps=cfg.steps, initial_loss=first_loss, final_loss=final, entropy_floor=floor, compile_s=compile_s)
    return _finish(log, {**end, "wall_s": time.perf_counter() - t0, **resumed}, stop, ckpt)


def _resumed(found) -> dict:
    """What the start and end records say of a resume (nothing for a fresh run)."""
    if found is None:
        return {}
    return {"resumed_from": found.step, "resumed_path": found.path, "damaged_checkpoints": found.damaged}


def _batches(source, trainer: Trainer, batch, seed: int, found):
    """The run's batches from `source` (`batch`: its `cfg.batch`), at the checkpoint's position on a
    resume, the source checked against the batch spec before anything compiles."""

    data = Batches(source, trainer.batch_sharding, batch.global_size, batch.length, seed, batch_spec=trainer.batch_spec)
    if found:
        data.restore(found.data)
    data.probe()
    return data


def _close(profiler, data, ckpt) -> bool:
    """Stop the profiler and the prefetch thread, finish the checkpoint writes in flight (they hold
    good states)."""

    if profiler is not None:
        profiler.stop()
    if isinstance(data, Prefetch):
        data.close()
    if ckpt:
        ckpt.close()
    return True


def _log_start(log, cfg, trainer: Trainer, facts: dict, found) -> tuple[float, str]:
    """The start record (the run's facts, the peak MFU divides by, measured before compiling), the
    trainer's warnings and what a resume restored -> (peak FLOP/s per device, where it came from)."""

    peak, peak_src = peak_flops_per_device(cfg.train.peak_tflops)
    log.start(
        {
            **facts,
            "processes": jax.process_count(),
            "scheduler": scheduler_job(),
            "peak_flops_per_device": peak,
            "peak_source": peak_src,
            "config": cfg,
        },
        trainer,
    )
    for line in trainer.warnings():
        log.info(line)
    if found:
        _report_resume(found, cfg, log.info)
    return peak, peak_src


def _first_state(trainer: Trainer, found, precision: str):
    """The state the loop starts from: the checkpoint's (with a fresh loss scale if it was saved under
    another precision policy), else a sharded init."""
    state = found.state if found else trainer.init()
    if found and found.meta.get("precision") != precision:  # the loss scale belongs to the old policy
        state["numerics"] = jax.device_put(
            precision_lib.LOSS_SCALE.init(trainer.policy), trainer.state_shardings["numerics"]
        )
    return state


def _record(n: int, metrics: dict, dt: float, facts: dict, mfu_per_s: float) -> dict:
    """The logged record of step n: its metrics, the mean step time `dt` since the last record, the
    rates, and MFU (`mfu_per_s`: the step's model FLOPs over the devices' peak, per second of step)."""
    return {
        "step": n,
        **{k: _jsonable(v) for k, v in metrics.items()},
        "step_time_s": dt,
        "examples_per_s": facts["examples_per_step"] / dt,
        "tokens_per_s": facts["tokens_per_step"] / dt if facts["tokens_per_step"] else None,
        "mfu": mfu_per_s / dt,
    }


def _finish(log, end: dict, stop, ckpt) -> dict:
    """Log the end record and return it (with the share of the gap to the entropy floor the run
    closed); after SIGTERM/SIGINT (`stop`: the signal) raise `Preempted` naming the step reached and
    the checkpoint that holds it."""
    if None not in (end["entropy_floor"], end["initial_loss"], end["final_loss"]):
        end["gap_closed"] = floor_gap_closed(end["initial_loss"], end["final_loss"], end["entropy_floor"])
    if not stop:
        log.end(end)
        return end
    import signal as signal_lib

    name = signal_lib.Signals(stop).name
    end.update(preempted=name, stopped_at=progress["step"], checkpoint=ckpt.path(progress["step"]) if ckpt else None)
    log.end(end)
    where = (
        f"saved checkpoint {ckpt.path(progress['step'])}; rerun the same command to resume"
        if ckpt
        else "no checkpoint.dir, nothing saved"
    )
    raise Preempted(stop, f"stopped by {name} after step {progress['step']}; {where}")


def _report_resume(found, cfg, info) -> None:
    """One line on where the run resumed from, and a warning for each way its data stream or its
    learning-rate schedule now differs from the saved run's."""
    saved_mesh = " ".join(f"{a}={n}" for a, n in (found.meta.get("mesh") or {}).items() if n > 1) or "1 device"
    info(
        f"resumed from step {found.step} ({found.path}; saved with {found.meta.get('strategy')} on "
        f"{saved_mesh}, {found.meta.get('processes')} process(es), precision {found.meta.get('precision')})"
    )
    saved = found.meta.get("config") or {}
    changes = data_changes(saved, cfg) + _holdout_change(saved, cfg.data, cfg.eval)
    if changes:
        info(
            f"warning: resuming with a different data stream: {', '.join(changes)}; batches from step "
            f"{found.step + 1} on are not the ones the saved run would have seen"
        )
    changes = data_changes(saved, cfg, SCHEDULE_KEYS)
    if changes:
        info(
            f"warning: resuming with a different learning-rate schedule: {', '.join(changes)}; warmup and "
            f"cosine decay from step {found.step + 1} on follow the new values, not the saved run's"
        )


def _holdout_change(saved: dict | None, data, evaluation) -> list[str]:
    """Token/text data trains on the first 1 - eval.holdout of data.path when evaluation is on without
    eval.path (meshpar.train.data.make_source): a resume that turns that split on, off or resizes it reads
    other windows. `data`, `evaluation`: the run's `cfg.data` and `cfg.eval`."""

    def split(ev):
        return ev.get("holdout", 0.1) if ev.get("every") and not ev.get("path") else None

    if data.kind not in ("tokens", "text") or not saved or "eval" not in saved:
        return []
    old = split(saved["eval"])
    new = split({"every": evaluation.every, "path": evaluation.path, "holdout": evaluation.holdout})
    return (
        [] if old == new else [f"training part of data.path: eval.holdout={new} (checkpoint: {old}; None: whole file)"]
    )


def _read(tree):
    """The loop's only device -> host read (waits for the values): one call per logging step,
    evaluation, checkpoint and end."""
    return jax.device_get(tree)


def _check_finite(train, step: int, nonfinite, loss, skipped: list) -> None:
    """Whether `step` had a non-finite loss or gradients (its update was skipped), by `train.on_nan`
    (`train`: the run's `cfg.train`): `stop` raises naming it; `skip` counts it in `skipped`, the steps
    skipped in a row, and raises once they reach `train.max_consecutive_skips` (a state that makes
    every batch non-finite never trains again: its updates are all dropped)."""
    if not int(nonfinite):
        skipped.clear()
        return
    if train.on_nan == "stop":
        raise MeshparError(
            f"non-finite loss or gradients at step {step} (loss {float(loss)}); its update was "
            "not applied and no checkpoint was written after it (train.on_nan=stop). Lower "
            "train.lr, check the data, or set train.on_nan=skip to skip such steps"
        )
    skipped.append(step)
    if len(skipped) >= train.max_consecutive_skips:
        raise MeshparError(
            f"steps {skipped[0]}..{step}: {len(skipped)} steps in a row had a non-finite loss or gradients "
            f"(the last loss {float(loss):.4g}) and were skipped (train.on_nan=skip, train.max_consecutive_skips="
            f"{train.max_consecutive_skips}); the run stops, as it no longer trains. Lower train.lr or check the data"
        )


def _jsonable(v):
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else a.tolist()
