"""The host's matmul rate: what MFU divides by on CPU, where fake devices have no datasheet figure.

Measured once per machine and kept, so two runs on one machine report comparable MFU. (A single
0.1 s timing, as before, took in whatever else the host was doing: two identical Quickstarts
reported MFU 19% and 59% at the same tokens/s.) The measurement is a 1024 x 1024 fp32 matmul on one
device, the best of repeated ~50 ms windows over about a second (the least disturbed window), and
it is stored in `$XDG_CACHE_HOME/meshpar/host_peak.json` (default `~/.cache/meshpar/`), keyed by the
CPU model, the core count and the jax version. Delete the file to measure again; an unwritable
cache only means measuring every run. Processes that start together (`meshpar launch`) take turns
through a lock on the file: the first measures, the others read its result.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

N = 1024  # matrix side: 2 GFLOP a product, tens of ms on a laptop core
WINDOW_S, TOTAL_S = 0.05, 1.0


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "meshpar" / "host_peak.json"


def machine_key() -> str:
    """CPU model, core count, jax version: what the measured rate depends on."""
    import jax

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cores | jax {jax.__version__}"


def measure(device=None, seconds: float = TOTAL_S) -> float:
    """FLOP/s of an N x N fp32 matmul on `device`: the best ~WINDOW_S window within `seconds`."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((N, N), jnp.float32), device or jax.local_devices()[0])
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        reps, t0 = 0, time.perf_counter()
        while reps == 0 or time.perf_counter() - t0 < WINDOW_S:
            f(a).block_until_ready()
            reps += 1
        best = max(best, 2.0 * N**3 * reps / (time.perf_counter() - t0))
    return best


def host_flops() -> tuple[float, str]:
    """(the host's matmul FLOP/s, where it came from): the cached measurement of this machine, else
    a new one (then cached)."""
    path, key = cache_file(), machine_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            _lock(f)
            f.seek(0)
            try:
                table = json.loads(f.read() or "{}")
            except ValueError:
                table = {}
            table = table if isinstance(table, dict) else {}
            kept = table.get(key)
            if isinstance(kept, dict) and isinstance(kept.get("flops"), (int, float)) and kept["flops"] > 0:
                return float(kept["flops"]), f"measured once on this machine, {path}"
            flops = measure()
            table[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
            f.seek(0)
            f.truncate()
            f.write(json.dumps(table, indent=1) + "\n")
            return flops, f"measured now, kept in {path}"
    except OSError:  # no writable cache: measure every run
        return measure(), "measured now (no writable cache)"


def _lock(f) -> None:
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
    except ImportError:
        pass
