"""Global batches from a source (`meshpar.train.data`), sharded on arrival: each process builds only
the rows its devices hold (`jax.make_array_from_callback`), and `Prefetch` builds them ahead on a
background thread. A batch iterator's checkpointable state is one integer, the next step."""

from __future__ import annotations

import jax
import numpy as np

from meshpar.core.batch import is_leaf, lm_batch_spec
from meshpar.core.errors import user_code
from meshpar.train.data import check_rows


class Batches:
    """Iterator of global batches, sharded on arrival: a tree of arrays shaped like `batch_spec`
    (by default one [B, T+1] token array: inputs and shifted targets).

    Each process builds only the rows its devices hold, each row once per step whatever the number
    of local devices or leaves (one `source.rows` call per run of consecutive rows). `state()` /
    `restore(state)` checkpoint the position; nothing else is needed for exact resume. `Prefetch`
    wraps it to build batches ahead on a background thread.
    """

    def __init__(self, source, sharding, global_size: int, length: int, seed: int, step: int = 0, batch_spec=None):
        self.source, self.sharding = source, sharding
        self.length = length
        self.spec = batch_spec if batch_spec is not None else lm_batch_spec(global_size, length)
        self.seed, self.step = seed, step

    def probe(self) -> None:
        """Check the source against the batch spec on one row (before anything compiles)."""
        check_rows(self.spec, self._rows(self.step, range(0, 1)), 1, self.length)

    def _rows(self, step: int, rows: range):
        """`source.rows` of `step`, inside `user_code` (a user's source's exception: its frames, one line)."""
        with user_code(f"reading step {step + 1}'s rows {rows.start}..{rows.stop - 1} from {_name(self.source)}"):
            return self.source.rows(self.seed, step, rows, self.length)

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])

    def __iter__(self):
        return self

    def __next__(self):
        leaves, treedef = jax.tree.flatten(self.spec, is_leaf=is_leaf)
        shardings = jax.tree.leaves(self.sharding)
        rows, built = self._build(self.step, leaves, shardings)
        out = []
        for i, (leaf, sh) in enumerate(zip(leaves, shardings)):

            def local(index, i=i, leaf=leaf):
                want = np.arange(leaf.shape[0])[index[0]]
                tree = jax.tree.map(lambda a: a[np.searchsorted(rows, want)], built)
                part = jax.tree.leaves(tree)[i] if len(leaves) > 1 else tree
                return np.asarray(part, leaf.dtype)[(slice(None),) + tuple(index[1:])]

            out.append(jax.make_array_from_callback(tuple(leaf.shape), sh, local))
        self.step += 1
        return jax.tree.unflatten(treedef, out)

    def _build(self, step: int, leaves, shardings):
        """The rows this process's devices hold, each built once (one `source.rows` call per run of
        consecutive rows): -> (sorted row ids [R], tree of arrays [R, ...])."""
        need = set()
        for leaf, sh in zip(leaves, shardings):
            for index in sh.addressable_devices_indices_map(tuple(leaf.shape)).values():
                need.update(range(*index[0].indices(leaf.shape[0])))
        rows = np.array(sorted(need), np.int64)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        parts = []
        for run in np.split(rows, breaks):
            parts.append(self._rows(step, range(int(run[0]), int(run[-1]) + 1)))
            check_rows(self.spec, parts[-1], len(run), self.length)
        return rows, (parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: np.concatenate(a), *parts))


def _name(source) -> str:
    kind = type(source)
    return f"the data source {kind.__module__}.{kind.__qualname__}"


class Prefetch:
    """`Batches` built `depth` steps ahead on a background thread, so the host work of step s + 1
    (building rows, copying them to the devices) overlaps the devices computing step s.

    Batches are a pure function of (seed, step, row), so prefetching changes no value: the batch of
    step s is bit-identical with or without it. `state()` is the step of the next batch *handed out*
    (not the next one built), so a checkpoint records exactly what training consumed; `restore`
    drops whatever was built ahead and restarts from the restored step. A source error raised on the
    thread is raised again by the `next()` that would have returned that batch.
    """

    def __init__(self, batches: Batches, depth: int = 2):
        import queue
        import threading

        self.batches, self.depth = batches, max(1, depth)
        self.next_step = batches.step
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = None

    def state(self) -> dict:
        return {"step": self.next_step}

    def restore(self, state: dict) -> None:
        self.close()
        self.batches.restore(state)
        self.next_step = self.batches.step

    def _produce(self, stop, out) -> None:
        import queue

        while not stop.is_set():
            step = self.batches.step
            try:
                item = (step, next(self.batches), None)
            except Exception as e:  # noqa: BLE001 (handed to the consumer, raised there)
                item = (step, None, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self):
        import queue
        import threading

        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(
                target=self._produce, args=(self._stop, self._queue), name="meshpar-prefetch", daemon=True
            )
            self._thread.start()
        step, batch, err = self._queue.get()
        if err is not None:
            self.close()
            raise err
        assert step == self.next_step, (step, self.next_step)
        self.next_step += 1
        return batch

    def close(self) -> None:
        """Stop the thread; the batches it built ahead are dropped (the next `next()` rebuilds them)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.batches.restore({"step": self.next_step})
