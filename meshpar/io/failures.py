"""What a failed read of a checkpoint leaves behind, said in one line and nothing more.

    one_line(e)                 # "Exception: Encountered error while reading array index: (...)."
    quiet_abandoned_reads()     # before a restore that may fail part-way

Orbax restores a tree by many concurrent reads (`_read_array_index_and_device_put` tasks) on an
asyncio event loop of its own. When one read fails (a truncated file: a full disk, a killed writer),
the restore raises and its loop closes while the other reads are still out. Each of those ends later
and says so on stderr, after meshpar's one line naming the damaged step, in one of three ways:
- completing on TensorStore's thread, it reports to the closed loop: a raw "RuntimeError: Event loop
  is closed" traceback (`sys.unraisablehook`; in a test run, pytest pins it on whatever test runs next);
- failing too, its task (or TensorStore's future under it) is collected unread: asyncio's logger
  prints "Task exception was never retrieved" with the read's error and TensorStore's spec, about 100
  lines per read;
- or its coroutine, closed when collected, raises that error: "Exception ignored in: <coroutine object
  _read_array_index_and_device_put>" and the same 60-odd lines (`sys.unraisablehook`).
Either the task per array (`async_deserialize`) or the one per slice of it may be the one left.
Those reads have nothing left to tell: the restore that started them failed and was reported. So
meshpar drops exactly these messages, for orbax's reads, and hands every other one on.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback


def orbax_read(name: str, path: str) -> bool:
    """Whether coroutine `name`, defined in file `path`, is one of orbax's reads of an array (the task
    per array, `async_deserialize`, or per slice, `_read_array_index_and_device_put`)."""
    return "orbax" in path and ("deserialize" in name or "read" in name)


def one_line(e: BaseException) -> str:
    """`e` as one line of at most 300 characters (TensorStore's pointer to its details dropped)."""
    text = f"{type(e).__name__}: {e}".strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line.split(" See full TensorStore details")[0][:300]


def abandoned_read(unraisable) -> bool:
    """Whether an unraisable exception is an abandoned read: its coroutine's error when collected, or
    its report to its closed event loop."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and orbax_read(code.co_name, code.co_filename):
        return True
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed" or tb is None:
        return False
    return any(frame.name == "call_soon_threadsafe" for frame in traceback.extract_tb(tb))


# the errors of a checkpoint read: orbax's for an array slice, TensorStore's for a chunk of its database
READ_ERRORS = re.compile(r"Encountered error while reading array index|Error reading \"[^\"]*\" in OCDBT database")


class AbandonedReadTasks(logging.Filter):
    """asyncio's "Task (or Future) exception was never retrieved" for an orbax read (its message names
    the task's coroutine and file, or the error is a checkpoint read's), dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if not text.startswith(("Task exception was never retrieved", "Future exception was never retrieved")):
            return True
        task = re.search(r"coro=<(\w+)\(\) (?:done|running), defined at (\S+):\d+>", text)
        return not ((task and orbax_read(*task.groups())) or READ_ERRORS.search(text))


def quiet_abandoned_reads() -> None:
    """From now on, drop abandoned reads' messages (`abandoned_read`, `AbandonedReadTasks`); once per
    process, and a hook installed later by someone else keeps this one as its predecessor."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, AbandonedReadTasks) for f in asyncio_log.filters):
        asyncio_log.addFilter(AbandonedReadTasks())
    if getattr(sys.unraisablehook, "meshpar_abandoned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not abandoned_read(unraisable):
            previous(unraisable)

    hook.meshpar_abandoned_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
