"""Checkpoints: Orbax `CheckpointManager`, asynchronous, atomic, restorable onto any mesh.

    ckpt = Checkpointer(cfg.checkpoint, trainer)
    found = ckpt.restore_latest()           # None, or Restored(step, state, data, meta, path)
    ckpt.save(step, state, data.state())     # returns once arrays are on the host; writes go on in the background
    ckpt.close()                             # waits for the last write

One checkpoint is the folder `checkpoint.dir/<step>/` with three items:

    state/   the whole train state (params, optimizer state, step, loss-scale numerics), each
             process writing only the shards it holds (OCDBT + Zarr, via TensorStore)
    data/    JSON: the data iterator's position (`Batches.state()`)
    meta/    JSON: the resolved config, the RNG seeds, the saving mesh / strategy / process count,
             and a fingerprint of every state leaf

What it guarantees:

* Atomic: Orbax writes `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only after every
  item of every process is written, so a crash mid-save leaves no folder that looks complete (on
  GCS, where renames are slow, a commit file written last plays that role).
* The last good checkpoint survives a new one: steps beyond `checkpoint.keep` are deleted by the
  manager's finalisation of the *newer* save, which runs only after that save committed.
* Asynchronous: `save` blocks only for the device -> host copy; the writes overlap the next steps.
  The train step donates its input state, which is safe because the copy is already done.
* Exact resume: the state, the data position and the config are everything a step depends on. The
  RNG state is the seeds: batch s is built from (data.seed, s, row), the init from train.seed, and
  the step draws no random numbers (a layer that needs some should fold the step counter into a
  key from train.seed, which keeps it so). Any key array added to the train state is saved with it.
* Restore onto any mesh: the target is `Trainer.abstract_state()`, `ShapeDtypeStruct`s carrying the
  *new* shardings; each process reads only the slices its devices hold and nothing is gathered on
  one device (ZeRO-style sharded states, Rajbhandari et al. 2020, stay sharded end to end).
* Damage is detected, not trusted: besides Orbax/TensorStore read errors, every leaf's fingerprint
  (a position-weighted hash of its bits, summed mod 2^32, so it does not depend on the sharding)
  is recomputed after the restore and compared.
* Fallback order: newest to oldest. A damaged checkpoint is reported by step, path and reason; once
  an older one restores cleanly the damaged folders are renamed `<step>.damaged-<time>` (kept for
  inspection, never deleted) so the run can write that step again; if one cannot be moved, the
  next save of that step replaces it. If none is usable the run stops with `CheckpointError` and
  touches nothing.
* Paths are etils `epath.Path`, the type Orbax uses: `gs://bucket/run` stays a bucket path
  (`pathlib` would turn it into the local folder `gs:/bucket/run`).
* The data stream is (data.seed, batch.global_size, batch.length, data.kind/path): resuming with
  any of them changed is allowed but said in one line (`meshpar.train.loop.data_changes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from etils import epath

from meshpar.core.config import CheckpointConfig
from meshpar.core.errors import MeshparError
from meshpar.io.failures import one_line, quiet_abandoned_reads
from meshpar.io.fingerprint import fingerprint, tree_signature

ITEMS = ("state", "data", "meta")
FORMAT = 1


class CheckpointError(MeshparError):
    """No usable checkpoint, or one that does not fit this run."""


class FingerprintMismatch(ValueError):
    """Restored contents differ from the fingerprint saved with them (silent corruption)."""


def local_or_remote(path) -> epath.Path:
    """`checkpoint.dir` as the path type Orbax uses; local paths made absolute, URLs kept as they are."""
    p = epath.Path(path)
    return p if "://" in str(path) else epath.Path(p.expanduser().absolute())


def aside_path(path: epath.Path, stamp: str) -> epath.Path:
    """Where a damaged `<dir>/<step>` is moved: `<dir>/<step>.damaged-<stamp>`, same file system."""
    return path.with_name(f"{path.name}.damaged-{stamp}")


@dataclass
class Restored:
    step: int
    state: Any
    data: dict
    meta: dict
    path: str
    damaged: list[dict]  # newer checkpoints that could not be used: {"step", "path", "reason"}


# ----------------------------------------------------------------------------------------------


def _restore_verified(ocp, manager, step: int, target, meta: dict):
    """Checkpoint `step`'s state (into `target`'s shardings) and data position, its contents checked
    against the fingerprint saved with them -> (state, data)."""
    out = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    )
    got = fingerprint(out["state"])
    bad = [k for k, v in meta.get("fingerprint", {}).items() if got.get(k) != v]
    if bad:
        raise FingerprintMismatch(
            f"fingerprint mismatch: contents differ from the fingerprint saved with them (first: state{bad[0]})"
        )
    return out["state"], out["data"]


class Checkpointer:
    """Save / restore the train state of one run (see the module docstring).

    `options`: the run's `cfg.checkpoint` (dir, every, keep). `trainer`: the run whose state it saves
    (its abstract state is the restore target; its `run_facts()`, the config and layout, go in `meta`)."""

    def __init__(self, options: CheckpointConfig, trainer, info: Callable[[str], None] = print):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.trainer, self.info, self.every = trainer, info, options.every
        self.root = local_or_remote(options.dir)
        self.directory = str(self.root)
        self.manager = ocp.CheckpointManager(
            self.root,
            item_names=ITEMS,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=options.keep, create=True, enable_async_checkpointing=True
            ),
        )
        self.damaged_steps: set[int] = set()  # found damaged and still in place (could not be moved)
        self.target = trainer.abstract_state()  # shapes, dtypes and this run's shardings
        self.signature = tree_signature(self.target)
        self.last_saved: int | None = None

    # -- paths -----------------------------------------------------------------------------------
    def path(self, step: int) -> str:
        return f"{self.directory}/{step}"

    def steps(self) -> list[int]:
        """Complete checkpoints (temporary folders of unfinished saves are never listed)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    # -- save ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, state, data_state: dict, *, wait: bool = False, run: dict | None = None) -> str:
        """Start an asynchronous save of `state` at `step` (all processes call it). Returns the path.
        The previous save, if still writing, is finished first (Orbax), so at most one is in flight.
        `run`: facts of the run so far kept in meta (the loop's `initial_loss`)."""
        if step in self.damaged_steps:
            self._replace_damaged(step)
        if step in self.manager.all_steps():  # e.g. the end of a run that resumed at its last step
            return self.path(step)
        ocp = self.ocp
        meta = {
            "format": FORMAT,
            "step": step,
            "time": time.time(),
            **self.trainer.run_facts(),
            "processes": jax.process_count(),
            "signature": self.signature,
            "fingerprint": fingerprint(state),
            **(run or {}),
        }
        try:
            self.manager.save(
                step,
                force=True,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(dict(data_state)),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        except Exception as e:  # noqa: BLE001 - e.g. a full disk surfacing from the previous async save
            raise CheckpointError(
                f"could not write checkpoint step {step} at {self.path(step)} ({one_line(e)}); "
                f"complete checkpoints in {self.directory} are untouched"
            ) from e
        self.last_saved = step
        if wait:
            self.wait()
        return self.path(step)

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"writing checkpoint step {self.last_saved} in {self.directory} failed "
                f"({one_line(e)}); complete checkpoints there are untouched"
            ) from e

    def close(self) -> None:
        self.wait()
        self.manager.close()

    # -- restore ---------------------------------------------------------------------------------
    def _restore_meta(self, step: int) -> dict:
        ocp = self.ocp
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _restore_one(self, step: int):
        meta = self._restore_meta(step)
        check_fits(self.signature, meta, step, self.path(step))
        return (*_restore_verified(self.ocp, self.manager, step, self.target, meta), meta)

    def restore_latest(self) -> Restored | None:
        """Restore the newest usable checkpoint into this run's shardings; None if there is none (a
        damaged one is reported and set aside, the next older one tried: `_restore_newest`)."""
        return _restore_newest(self)

    def _replace_damaged(self, step: int) -> None:
        """A damaged step still in the manager's list would make `save` skip that step forever: move
        it aside (or, failing that, delete it) so the save writes a good one in its place."""
        self.wait()
        set_aside([{"step": step, "path": self.path(step)}], self.info)
        self.manager.reload()
        if step in self.manager.all_steps():
            if jax.process_index() == 0:
                self.info(f"deleting damaged checkpoint step {step} at {self.path(step)} to write it again")
            self.manager.delete(step)
            self.manager.reload()
        self.damaged_steps.discard(step)


def _restore_newest(ckpt: Checkpointer) -> Restored | None:
    """Restore the newest usable checkpoint into this run's shardings; None if there is none.

    Tries complete checkpoints newest first. A damaged one is reported (step, path, reason) and
    the next older one tried; the damaged folders are then renamed aside (never deleted). If
    checkpoints exist but none is usable, raises CheckpointError and changes nothing."""
    steps = ckpt.steps()
    if not steps:
        return None
    quiet_abandoned_reads()  # a damaged step's restore fails part-way: its other reads are said nothing of
    damaged = []
    for step in reversed(steps):
        try:
            ok, result, reason = True, ckpt._restore_one(step), ""
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any read/decode/verify failure marks this one damaged
            ok, result, reason = False, None, one_line(e)
        ok = _all_processes(ok)
        if ok:
            state, data, meta = result
            set_aside(damaged, ckpt.info)
            ckpt.manager.reload()
            ckpt.damaged_steps = {d["step"] for d in damaged} & set(ckpt.steps())
            return Restored(step, state, data, meta, ckpt.path(step), damaged)
        reason = reason or "damaged on another process"
        damaged.append({"step": step, "path": ckpt.path(step), "reason": reason})
        ckpt.info(f"checkpoint step {step} at {ckpt.path(step)} is damaged ({reason}); trying the previous one")
    listing = "; ".join(f"step {d['step']} at {d['path']}: {d['reason']}" for d in damaged)
    raise CheckpointError(
        f"no usable checkpoint in {ckpt.directory} ({listing}); nothing was deleted. "
        f"Repair or move those folders, or set checkpoint.dir to a new folder to start over"
    )


def check_fits(mine: dict, meta: dict, step: int, path: str) -> None:
    """A checkpoint of a different model is a user error, not damage: stop, naming the leaf."""
    theirs = meta.get("signature") or {}
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        if mine.get(key) != theirs.get(key):
            raise CheckpointError(
                f"checkpoint step {step} at {path} does not fit this run: state{key} is "
                f"{theirs.get(key, 'absent')} there and {mine.get(key, 'absent')} here; use the model "
                f"settings it was saved with (its config is in {path}/meta) or a new checkpoint.dir"
            )


def set_aside(damaged: list[dict], info: Callable[[str], None]) -> None:
    """Rename each damaged `<dir>/<step>` aside (`aside_path`; never deleted), on process 0, then wait
    for every process."""
    if not damaged:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if jax.process_index() == 0:
        for d in damaged:
            src = epath.Path(d["path"])
            try:
                if src.exists():
                    dst = aside_path(src, stamp)
                    src.rename(dst)
                    d["moved_to"] = str(dst)
                    info(f"moved damaged checkpoint {src} to {dst} (kept, not deleted)")
            except OSError as e:
                info(
                    f"could not move damaged checkpoint {src} aside ({one_line(e)}); the next save of "
                    f"step {d['step']} replaces it"
                )
    _barrier("meshpar-checkpoint-set-aside")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _all_processes(ok: bool) -> bool:
    """True on every process iff `ok` on every process (restores read process-local shards)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


# ----------------------------------------------------------------------------------------------
# Weights only (serving): a part of the train state, read straight into another layout.


def _existing(directory) -> epath.Path:
    root = local_or_remote(directory)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint.dir '{directory}' does not exist; give the folder `meshpar train "
            "checkpoint.dir=...` wrote (or leave checkpoint.dir unset for a fresh init)"
        )
    return root


def saved_config(directory) -> tuple[int, dict] | None:
    """(step, resolved config) saved with the newest checkpoint in `directory`; None if it holds none."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(_existing(directory), item_names=ITEMS)
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception:  # noqa: BLE001 - a damaged step: its predecessor's config
                continue
            return step, meta.get("config") or {}
    finally:
        manager.close()
    return None


def restore_weights(directory, target: dict, info: Callable[[str], None] = print):
    """The newest usable checkpoint's `params` and `vars` in `directory`, read straight into
    `target`'s shardings (a dict {"params", "vars"} of ShapeDtypeStructs carrying them): optimizer
    state is never read, each process reads only its slices. Returns (tree, step, meta), or None
    when the folder holds no checkpoint; a folder that does not exist is an error (a mistyped path
    must not serve a random model), and so is a checkpoint of another model (naming the leaf)."""
    import orbax.checkpoint as ocp

    root = _existing(directory)
    manager = ocp.CheckpointManager(root, item_names=ITEMS)
    steps = sorted(manager.all_steps())
    target = {k: v for k, v in target.items() if jax.tree.leaves(v)}  # e.g. no non-Param variables
    mine = tree_signature(target)
    reasons = []
    quiet_abandoned_reads()
    try:
        for step in reversed(steps):
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            theirs = meta.get("signature") or {}
            for key, want in mine.items():
                if theirs.get(key, [None])[0] != want[0]:
                    have = theirs.get(key, ["absent"])[0]
                    raise CheckpointError(
                        f"checkpoint step {step} at {root}/{step} holds another model: state{key} has shape {have} "
                        f"there and {want[0]} here; pass the model settings it was trained with (its config is in "
                        f"{root}/{step}/meta)"
                    )
            try:
                restore_args = ocp.checkpoint_utils.construct_restore_args(target)
                tree = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
                    ),
                )["state"]
            except Exception as e:  # noqa: BLE001 - a damaged step: try the previous one
                reasons.append(f"step {step}: {one_line(e)}")
                info(
                    f"checkpoint step {step} at {root}/{step} could not be read ({one_line(e)}); "
                    "trying the previous one"
                )
                continue
            return tree, step, meta
    finally:
        manager.close()
    if steps:
        raise CheckpointError(f"no readable checkpoint in {root} ({'; '.join(reasons)})")
    return None
