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
  programs, and the files over their budget (a report; `MESHPAR_STRICT_SUITE_TIME=1` fails the run).
- a worker that dies (an abort in XLA, say) fails the run at once (`--max-worker-restart=0`), and
  its fatal-error stacks, all threads, are kept in a file the summary names and prints.
"""

import contextlib
import os
import shutil
import tempfile

from meshpar.core.mesh import fake_cpu_flags, xla_knows

# How XLA:CPU generates machine code, not what it partitions: fewer LLVM passes and its classic
# fusion emitter compile in about half the time (bench/RESULTS.md, "Suite time"). Each flag: (this
# suite's value, XLA's default), where this jaxlib knows it.
CODEGEN = {
    name: values
    for name, values in (
        ("xla_backend_optimization_level", (0, 3)),
        ("xla_llvm_disable_expensive_passes", (True, False)),
        ("xla_cpu_use_fusion_emitters", (False, True)),
    )
    if xla_knows(name)
}
FAST_CODEGEN = [f"--{name}={str(fast).lower()}" for name, (fast, _) in CODEGEN.items()]
# 8 fake devices whose collectives wait out a busy machine (meshpar.core.mesh.fake_cpu_flags: XLA's
# own 60 s limit aborted a worker, issue 46)
os.environ["XLA_FLAGS"] = fake_cpu_flags(
    8,
    " ".join(
        [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not any(f.split("=")[0] == g.split("=")[0] for g in FAST_CODEGEN)
        ]
        + FAST_CODEGEN
    ),
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

XLA_CACHE = os.environ.get("MESHPAR_TEST_XLA_CACHE_DIR")  # set: a session above this one made it
_OWN_CACHE = XLA_CACHE is None and os.environ.get("MESHPAR_TEST_XLA_CACHE", "1") != "0"
if _OWN_CACHE:
    XLA_CACHE = os.environ["MESHPAR_TEST_XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshpar-tests-xla-cache-")
if XLA_CACHE:
    for option, value in (
        ("jax_compilation_cache_dir", XLA_CACHE),
        ("jax_persistent_cache_min_compile_time_secs", 0),
        ("jax_persistent_cache_min_entry_size_bytes", 0),
    ):
        jax.config.update(option, value)
        os.environ[option.upper()] = str(value)  # subprocesses and xdist's workers read the same settings

from meshpar.core.config import load_config  # noqa: E402

pytest_plugins = ("tests.suite_watch",)  # each file's time and programs; a dead worker's stacks

# Small, fast settings shared by the tests: fp32 for exactness, 2 layers, short sequences.
FAST = [
    "precision=fp32",
    "model.layers=2",
    "batch.global_size=16",
    "batch.length=16",
    "steps=4",
    "train.warmup_steps=1",
    "train.log_every=1",
]


def make_cfg(*overrides: str, mesh: dict | None = None, fast: bool = True):
    """The embedded default config + FAST + overrides; `mesh` replaces the whole mesh (unset axes = 1)."""
    items = list(FAST if fast else [])
    if mesh is not None:
        items += [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert", "context")]
    return load_config(None, items + list(overrides))


@contextlib.contextmanager
def usual_codegen():
    """Within it, `meshpar.Trainer` compiles its steps with XLA:CPU's default code generation (per
    compile, `CODEGEN`'s defaults as compiler options): for a test that runs tens of steps in this
    process, where FAST_CODEGEN's slower code costs more than its compile saves (moe-tiny's 40 steps:
    23.6 -> 12.5 s)."""
    from meshpar.train.step import Trainer

    compile_ = Trainer.compile

    def compile(self, options=None):
        return compile_(self, {**{name: usual for name, (_, usual) in CODEGEN.items()}, **(options or {})})

    Trainer.compile = compile
    try:
        yield
    finally:
        Trainer.compile = compile_


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
    from meshpar.train.batches import Batches

    data = Batches(
        source,
        trainer.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
        batch_spec=trainer.batch_spec,
    )
    state, losses = trainer.init(), []
    for _ in range(steps):
        state, m = trainer.step(state, next(data))
        losses.append(float(m["loss"]))
    return state, losses


def evaluator(cfg, trainer):
    """The evaluator `meshpar.train.loop.run` builds for `cfg` (its data source, its held-out stream)."""
    from meshpar.train.data import make_source
    from meshpar.train.loop import make_evaluator

    source = make_source(cfg.data, cfg.batch, cfg.eval, trainer.spec.model_config.vocab)
    return make_evaluator(cfg.data, cfg.batch, cfg.eval, cfg.model, trainer, source)


def stacked_stages(make, depth: int, name: str = "Stages"):
    """A user model class of the stage protocol and nothing more: `depth` stacked `make(rngs)` blocks
    between an identity `pre` and `post`, and the mean as its loss; named `name` (messages name it)."""
    from flax import nnx

    import meshpar

    class Stages(nnx.Module):
        def __init__(self, rngs):
            self.layers = meshpar.stacked(make, depth, rngs)

        def pre(self, batch):
            return batch

        def post(self, x):
            return x

        def loss(self, outputs, batch):
            return outputs.mean(), {}

    Stages.__name__ = Stages.__qualname__ = name
    return Stages


def rel(a, b) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| over all leaves of two pytrees (in float64)."""
    num = sum(
        float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def barrier_operands(trainer) -> list[str]:
    """The operand types of each optimization barrier in `trainer`'s lowered step (no compile), one
    string per barrier: "tensor<16x16x64xbf16>, tensor<64x512xf32>"."""
    import re

    return re.findall(r"stablehlo\.optimization_barrier [^\n]*: (.*)$", trainer.lower().as_text(), re.M)


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


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may use, at most one per 4 GiB of memory (a worker
    holds 8 fake devices' programs and buffers) and at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = 4.0 * cores
    return max(1, min(cores, int(memory_gib // 4), 8))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(XLA_CACHE, ignore_errors=True)
