"""The suite watches itself: each test file's seconds and XLA programs, a per-file time budget, and the
stacks of a worker that dies. A pytest plugin (tests/conftest.py loads it).

- **Time, as a report.** The summary prints each file's seconds beside what they went on: the XLA
  programs it compiled (JAX's monitoring events: backend compiles, compiles answered by the cache,
  tracing + lowering to StableHLO), so a slow file shows whether it compiles too many programs or
  runs too many steps. Each test report carries its phase's counts (user_properties), so they reach
  the summary from pytest-xdist's workers too. Files over their budget are listed; they fail the run
  only with `MESHPAR_STRICT_SUITE_TIME=1` (a developer's check on a quiet machine): a user's run on a
  slow or busy machine passes or fails by its tests alone.
- **The budget scales with the machine.** A fixed CPU workload is timed at session start; a machine
  k times slower than the one the budget was set on (k > 1) gets k times the budget
  (`MESHPAR_TEST_BUDGET_SCALE` fixes k instead).
- **A dead worker is a failure with a reason.** pyproject's addopts stop pytest-xdist from replacing
  a crashed worker (`--max-worker-restart=0`): the run fails at once, naming the test. Every test
  process writes Python's fatal-error stacks (faulthandler, all threads) to a file of its own, with
  the test it was running beside it, and a worker's native stderr (XLA's C++ log, its fatal line
  too) to another; the summary names the files of processes that died and prints the last lines of
  that log, then their stacks, and keeps them (the folder is removed when nothing died).
"""

import faulthandler
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pytest

# seconds a test file may take, as measured beside the other worker (which slows it ~1.2-1.3x; the
# largest files take 75-100 s so measured on this machine)
FILE_BUDGET_S = float(os.environ.get("MESHPAR_TEST_FILE_BUDGET_S", 150))
STRICT = os.environ.get("MESHPAR_STRICT_SUITE_TIME", "0") not in ("", "0")
# seconds the calibration workload takes on the idle 2-core machine the budget was measured on
REFERENCE_S = 0.20

_XLA_KEY = "xla_programs"  # (compiled, compile s, trace + lower s, cache hits) of one report
_BACKEND = "/jax/core/compile/backend_compile_duration"
_FRONT = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_HIT = "/jax/compilation_cache/cache_hits"
_phase = [0, 0.0, 0.0, 0]  # counts since the last report, in this process
_file_seconds: dict[str, float] = {}
_file_xla: dict[str, list] = {}
_slowdown = [1.0]  # this machine against the reference, measured at session start

_fault_dir = []  # the session's fatal-error folder: made by the controller (or the
_fault_file = []  # only process), read by xdist's workers; this process's open log


def calibrate() -> float:
    """Seconds of a fixed single-core workload (Python loops and small numpy matmuls, the median of 3):
    how fast this machine runs now, against REFERENCE_S."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((96, 96))

    def work():
        t = time.perf_counter()
        total = 0
        for i in range(1_500_000):
            total += i * i
        for _ in range(1200):
            a @ a
        return time.perf_counter() - t

    return statistics.median(work() for _ in range(3))


def budget_s() -> float:
    return FILE_BUDGET_S * _slowdown[0]


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:g}"


def _on_duration(event: str, seconds: float, **_):
    if event == _BACKEND:
        _phase[0] += 1
        _phase[1] += seconds
    elif event in _FRONT:
        _phase[2] += seconds


def _on_event(event: str, **_):
    if event == _HIT:
        _phase[3] += 1


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which writes to stderr
def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    if hasattr(config, "workerinput"):  # a worker: the controller made the folder
        _fault_dir.append(Path(config.workerinput.get("meshpar_fault_dir") or tempfile.mkdtemp()))
        name = config.workerinput["workerid"]
    else:
        _fault_dir.append(Path(tempfile.mkdtemp(prefix="meshpar-tests-faults-")))
        name = "main"
        fixed = os.environ.get("MESHPAR_TEST_BUDGET_SCALE")  # a fixed scale (this suite's own tests)
        _slowdown[0] = float(fixed) if fixed else max(1.0, calibrate() / REFERENCE_S)
    _fault_file.append(open(_fault_dir[0] / f"{name}-{os.getpid()}.log", "w"))
    faulthandler.enable(file=_fault_file[0], all_threads=True)
    if hasattr(config, "workerinput"):
        _native_stderr_to(Path(_fault_file[0].name + ".stderr"))


def _native_stderr_to(path: Path) -> None:
    """A worker's file descriptor 2, where XLA's C++ logging writes (its fatal line before an abort,
    "Check failed: ...", too), appended to `path`. pytest captures stderr at the sys level
    (`--capture=sys`, pyproject's addopts) and never redirects descriptor 2, so what XLA wrote last is
    in the file when the worker is gone (with the default fd capture it sat in pytest's unlinked
    temporary file and died with the worker). A worker's descriptor 2 was the controller's terminal,
    where nothing reads it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller: each worker writes its fault log into the session's folder."""
    node.workerinput["meshpar_fault_dir"] = str(_fault_dir[0])


def pytest_runtest_logstart(nodeid, location):
    """The test now running, beside this process's fault log (one short overwrite per test). A folder
    removed under the running session (a /tmp cleaner) is made again; the test's name is lost only
    if that fails, never the run (pytest turned the error into an INTERNALERROR that ended it)."""
    if _fault_file:
        note = Path(_fault_file[0].name + ".test")
        try:
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(nodeid)
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.user_properties.append((_XLA_KEY, list(_phase)))
    _phase[:] = [0, 0.0, 0.0, 0]


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    row = _file_xla.setdefault(path, [0, 0.0, 0.0, 0])
    for key, value in report.user_properties:
        if key == _XLA_KEY:
            row[:] = [x + y for x, y in zip(row, value)]


def over_budget() -> dict[str, float]:
    return {f: t for f, t in _file_seconds.items() if t > budget_s()}


def deaths() -> list[tuple[Path, str]]:
    """(fault log, the test it was running) of each test process that died of a fatal error."""
    if not _fault_dir or not _fault_dir[0].is_dir():
        return []
    out = []
    for log in sorted(_fault_dir[0].glob("*.log")):
        if log.stat().st_size:
            test = Path(str(log) + ".test")
            out.append((log, test.read_text() if test.exists() else "(before its first test)"))
    return out


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    if STRICT and over_budget() and session.exitstatus == 0:
        session.exitstatus = 1  # strict: a file grew past its budget


def pytest_unconfigure(config):
    if _fault_file:
        faulthandler.disable()
        _fault_file.pop().close()
    if not hasattr(config, "workerinput") and _fault_dir and not deaths():
        shutil.rmtree(_fault_dir[0], ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    for log, test in deaths():
        tr.write_sep("=", f"a test process died while running {test}", red=True)
        native = Path(str(log) + ".stderr")
        last = native.read_text(errors="replace").splitlines()[-12:] if native.exists() else []
        if last:  # XLA's own last words (its fatal line) before Python's stacks
            tr.write_line(f"the last lines it wrote to its stderr ({native}):")
            for line in last:
                tr.write_line("    " + line)
        lines = log.read_text().splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
        tr.write_line(f"{lines[0]}; the dying thread's stack (every thread's: {log}):")
        for line in lines[at : at + 40]:
            tr.write_line("    " + line)
    if not _file_seconds:
        return
    scaled = f", x{_slowdown[0]:.2f} for this machine's speed" if _slowdown[0] > 1 else ""
    tr.write_sep("=", f"seconds per test file (budget {_seconds(budget_s())} s each{scaled})")
    tr.write_line(
        f"{'seconds':>8}  {'compiled':>8}  {'cached':>6}  {'compile':>8}  {'trace':>8}  file   "
        "(in-process programs: compiled, taken from the session's cache; seconds compiling, tracing + lowering)"
    )
    total = [0, 0.0, 0.0, 0]
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1]):
        row = _file_xla.get(path, (0, 0.0, 0.0, 0))
        total = [a + b for a, b in zip(total, row)]
        tr.write_line(f"{seconds:8.1f}  {row[0]:8d}  {row[3]:6d}  {row[1]:8.1f}  {row[2]:8.1f}  {path}")
    tr.write_line(
        f"{sum(_file_seconds.values()):8.1f}  {total[0]:8d}  {total[3]:6d}  {total[1]:8.1f}  {total[2]:8.1f}  total"
    )
    for path, seconds in over_budget().items():
        if STRICT:
            tr.write_line(
                f"FAILED suite time: {path} took {seconds:.0f} s, over the {_seconds(budget_s())} s a test file may "
                "take; share its compiled steps (module fixtures) or split it",
                red=True,
            )
        else:
            tr.write_line(
                f"suite time: {path} took {seconds:.0f} s, over the {_seconds(budget_s())} s budget (a report: "
                "MESHPAR_STRICT_SUITE_TIME=1 fails the run on it)",
                yellow=True,
            )
