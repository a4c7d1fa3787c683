"""8 fake CPU devices for every test (set before JAX initialises) and small shared helpers."""
import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from meshpar.config import load_config  # noqa: E402

# Small, fast settings shared by the tests: fp32 for exactness, 2 layers, short sequences.
FAST = ["precision=fp32", "model.layers=2", "batch.global_size=16", "batch.length=16", "steps=4",
        "train.warmup_steps=1", "train.log_every=1"]


def make_cfg(*overrides: str, mesh: dict | None = None, fast: bool = True):
    """The embedded default config + FAST + overrides; `mesh` replaces the whole mesh (unset axes = 1)."""
    items = list(FAST if fast else [])
    if mesh is not None:
        items += [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")]
    return load_config(None, items + list(overrides))


def devices(n: int):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")
    return jax.devices()[:n]


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
