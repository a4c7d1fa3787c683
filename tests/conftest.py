"""8 fake CPU devices for every test (set before JAX initialises) and small shared helpers.

Compiling is most of the suite's time (bench/RESULTS.md, "Suite time"), so:
- the in-process tests compile with XLA:CPU's cheapest code generation (LLVM -O0, no expensive LLVM
  passes, the classic fusion emitter; each flag only where this jaxlib knows it): the partitioner,
  its collectives, the HLO the tests read and `memory_analysis` (buffer assignment) come before
  code generation; each compile takes about half as long. Subprocesses (the end-to-end CLI tests)
  drop XLA_FLAGS and compile as users' runs do.
- the session shares one persistent compilation cache (JAX's `jax_compilation_cache_dir`), in a
  fresh temporary directory removed at the end, with pytest-xdist's workers and the subprocesses
  it starts: a program compiled twice (the same step in another test, a resumed run) is compiled
  once. `MESHPAR_TEST_XLA_CACHE=0` turns it off.
- `-n auto` runs one worker per core (capped below), each test file on one worker (`--dist
  loadfile`) so that a module fixture compiles once; the summary prints each file's seconds and
  programs, and a file over its budget fails the run.
"""
import os
import shutil
import tempfile


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA defines `flag` (XLA aborts on an unknown flag in XLA_FLAGS)."""
    import glob
    import importlib.util
    import mmap
    spec = importlib.util.find_spec("jaxlib")
    for lib in glob.glob(os.path.join(os.path.dirname(spec.origin), "**", "*.so"), recursive=True):
        if os.path.getsize(lib) > 50_000_000:                # the library that holds XLA
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(flag.encode()) >= 0:
                    return True
    return False


# How XLA:CPU generates machine code, not what it partitions: fewer LLVM passes and its classic
# fusion emitter compile in about half the time (bench/RESULTS.md, "Suite time").
FAST_CODEGEN = [f"--{name}={value}" for name, value in (("xla_backend_optimization_level", 0),
                                                         ("xla_llvm_disable_expensive_passes", "true"),
                                                         ("xla_cpu_use_fusion_emitters", "false")) if _xla_knows(name)]
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if "host_platform_device_count" not in f and not any(f.split("=")[0] == g.split("=")[0] for g in FAST_CODEGEN)]
    + ["--xla_force_host_platform_device_count=8", *FAST_CODEGEN])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

XLA_CACHE = os.environ.get("MESHPAR_TEST_XLA_CACHE_DIR")      # set: a session above this one made it
_OWN_CACHE = XLA_CACHE is None and os.environ.get("MESHPAR_TEST_XLA_CACHE", "1") != "0"
if _OWN_CACHE:
    XLA_CACHE = os.environ["MESHPAR_TEST_XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshpar-tests-xla-cache-")
if XLA_CACHE:
    for option, value in (("jax_compilation_cache_dir", XLA_CACHE), ("jax_persistent_cache_min_compile_time_secs", 0),
                          ("jax_persistent_cache_min_entry_size_bytes", 0)):
        jax.config.update(option, value)
        os.environ[option.upper()] = str(value)      # subprocesses and xdist's workers read the same settings

from meshpar.core.config import load_config  # noqa: E402

# Small, fast settings shared by the tests: fp32 for exactness, 2 layers, short sequences.
FAST = ["precision=fp32", "model.layers=2", "batch.global_size=16", "batch.length=16", "steps=4",
        "train.warmup_steps=1", "train.log_every=1"]


def make_cfg(*overrides: str, mesh: dict | None = None, fast: bool = True):
    """The embedded default config + FAST + overrides; `mesh` replaces the whole mesh (unset axes = 1)."""
    items = list(FAST if fast else [])
    if mesh is not None:
        items += [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert", "context")]
    return load_config(None, items + list(overrides))


def devices(n: int):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")
    return jax.devices()[:n]


def tiered(cases, fast, ids=None) -> list:
    """Parametrize `cases` for both tiers: the full suite runs them all, `pytest -m "not slow"` (the
    inner loop) only those in `fast`, which still cover what the test proves."""
    cases = list(cases)
    ids = ids or [str(c) for c in cases]
    out = []
    for case, name in zip(cases, ids):
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values, id=name, marks=() if case in fast else pytest.mark.slow))
    return out


def train_steps(trainer, source, cfg, steps: int):
    """`steps` optimizer steps of `trainer` from its init on `source`'s batches (as the loop builds
    them); the final state and each step's loss."""
    from meshpar.train.data import Batches
    data = Batches(source, trainer.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed,
                   batch_spec=trainer.batch_spec)
    state, losses = trainer.init(), []
    for _ in range(steps):
        state, m = trainer.step(state, next(data))
        losses.append(float(m["loss"]))
    return state, losses


def rel(a, b) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| over all leaves of two pytrees (in float64)."""
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def metrics_records(path: Path) -> list[dict]:
    """The complete JSON Lines records of a `--metrics-out` file (none if it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def metrics_losses(path: Path) -> dict[int, float]:
    """step -> loss of the `step` records of a `--metrics-out` file."""
    return {r["step"]: r["loss"] for r in metrics_records(path) if r["event"] == "step"}


def checkpoint_steps(d: Path) -> list[int]:
    """Steps of the complete checkpoints in checkpoint.dir `d` (Orbax names them by step)."""
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


# -- suite time: each test file within a budget, checked by the suite itself ---------------------
# Next to each file's seconds the summary prints what they went on: the XLA programs it compiled
# (JAX's monitoring events: backend compiles, compiles answered by the cache, tracing + lowering to
# StableHLO), so a slow file shows whether it compiles too many programs or runs too many steps.
# Each test report carries its phase's counts (user_properties), so they reach the summary from
# pytest-xdist's workers too.

# seconds a test file may take, as measured beside the other worker (which slows it ~1.2-1.3x; the
# largest files take 75-100 s so measured on this machine)
FILE_BUDGET_S = float(os.environ.get("MESHPAR_TEST_FILE_BUDGET_S", 150))
_XLA_KEY = "xla_programs"              # (compiled, compile s, trace + lower s, cache hits) of one report
_BACKEND = "/jax/core/compile/backend_compile_duration"
_FRONT = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_HIT = "/jax/compilation_cache/cache_hits"
_phase = [0, 0.0, 0.0, 0]              # counts since the last report, in this process
_file_seconds: dict[str, float] = {}
_file_xla: dict[str, list] = {}


def _on_duration(event: str, seconds: float, **_):
    if event == _BACKEND:
        _phase[0] += 1
        _phase[1] += seconds
    elif event in _FRONT:
        _phase[2] += seconds


def _on_event(event: str, **_):
    if event == _HIT:
        _phase[3] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


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


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may use, at most one per 4 GiB of memory (a worker
    holds 8 fake devices' programs and buffers) and at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        memory_gib = 4.0 * cores
    return max(1, min(cores, int(memory_gib // 4), 8))


def over_budget() -> dict[str, float]:
    return {f: t for f, t in _file_seconds.items() if t > FILE_BUDGET_S}


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(XLA_CACHE, ignore_errors=True)
    if over_budget() and session.exitstatus == 0:
        session.exitstatus = 1          # the suite fails: a file grew past its budget


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _file_seconds:
        return
    tr = terminalreporter
    tr.write_sep("=", f"seconds per test file (budget {FILE_BUDGET_S:g} s each)")
    tr.write_line(f"{'seconds':>8}  {'compiled':>8}  {'cached':>6}  {'compile':>8}  {'trace':>8}  file   "
                  "(in-process programs: compiled, taken from the session's cache; seconds compiling, tracing + lowering)")
    total = [0, 0.0, 0.0, 0]
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1]):
        row = _file_xla.get(path, (0, 0.0, 0.0, 0))
        total = [a + b for a, b in zip(total, row)]
        tr.write_line(f"{seconds:8.1f}  {row[0]:8d}  {row[3]:6d}  {row[1]:8.1f}  {row[2]:8.1f}  {path}")
    tr.write_line(f"{sum(_file_seconds.values()):8.1f}  {total[0]:8d}  {total[3]:6d}  {total[1]:8.1f}  {total[2]:8.1f}  total")
    for path, seconds in over_budget().items():
        tr.write_line(f"FAILED suite time: {path} took {seconds:.0f} s alone, over the {FILE_BUDGET_S:g} s a test "
                      "file may take; share its compiled steps (module fixtures) or split it", red=True)
