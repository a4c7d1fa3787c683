"""Long sequences (issue 22): attention memory and FLOPs, flash vs xla step time, context-parallel
collectives and training, and the planner's choices. Each part prints a markdown table.

    python bench/bench_long.py memory      # meshpar inspect --devices 1: temp bytes, S = 2k .. 16k
    python bench/bench_long.py flops       # attention matmul FLOPs, causal vs unmasked (flash's tiles)
    python bench/bench_long.py step        # CPU step time of the default model at 4096 tokens, flash vs xla
    python bench/bench_long.py collectives # inspect mesh.context=4: bytes over `context` vs the formula
    python bench/bench_long.py long        # batch.length=32768 on mesh.context=8: 20 steps, temp vs 4k on 1 device
    python bench/bench_long.py ring        # all_gather vs ring context parallelism, side by side
    python bench/bench_long.py plan        # meshpar plan: 1M tokens, 2k x 256, 128k-token 8B on 8 and 64 H100s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
MiB = 2**20


def inspect(*overrides: str, devices: int = 1) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "meshpar.cli", "inspect", "--json", "--devices", str(devices), *overrides],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def timed_steps(tr, rows: int, length: int, steps: int = 5) -> tuple[float, int, float]:
    """(ms per step over `steps` steps after one warm-up, compiled temp bytes, compile seconds)."""
    import jax

    from meshpar.train.data import MarkovLanguage

    t0 = time.perf_counter()
    temp = tr.compile().memory_analysis().temp_size_in_bytes
    comp = time.perf_counter() - t0
    src, state = MarkovLanguage(tr.spec.model_config.vocab, 4, 1), tr.init()
    batches = [jax.device_put(src.rows(0, i, range(rows), length), tr.batch_sharding) for i in range(steps + 1)]
    state, m = tr.step(state, batches[0])
    jax.block_until_ready(m["loss"])
    t0 = time.perf_counter()
    for b in batches[1:]:
        state, m = tr.step(state, b)
    jax.block_until_ready(m["loss"])
    return (time.perf_counter() - t0) / steps * 1e3, temp, comp


def memory() -> None:
    print("| S | xla temp (MiB) | flash temp (MiB) | flash / xla |")
    print("|---:|---:|---:|---:|")
    for s in (2048, 4096, 8192, 16384):
        temps = [
            inspect(f"batch.length={s}", "batch.global_size=1", f"model.attention={a}")["memory"]["temp"]
            for a in ("xla", "flash")
        ]
        print(f"| {s} | {temps[0] / MiB:,.1f} | {temps[1] / MiB:,.1f} | {temps[1] / temps[0]:.3f} |", flush=True)


def flops() -> None:
    import jax
    import jax.numpy as jnp

    import meshpar
    from meshpar.train.flops import matmul_flops

    print("| S | block | causal tiles | all tiles | causal / unmasked FLOPs (fwd + bwd) |")
    print("|---:|---:|---:|---:|---:|")
    for s in (2048, 8192):
        q = jax.ShapeDtypeStruct((1, s, 8, 64), jnp.float32)

        def count(causal, q=q):
            f = lambda q: jnp.sum(meshpar.attention(q, q, q, causal=causal, implementation="flash"))
            return matmul_flops(jax.make_jaxpr(jax.value_and_grad(f))(q))

        n = s // 512
        print(f"| {s} | 512 | {n * (n + 1) // 2} | {n * n} | {count(True) / count(False):.4f} |", flush=True)


def step() -> None:
    import jax

    from meshpar.core.config import load_config
    from meshpar.train.step import Trainer

    print("| attention | step (ms), batch 8 x 4096, 8 fake devices | tokens/s | compile (s) |")
    print("|---|---:|---:|---:|")
    base = None
    for impl in ("xla", "flash"):
        cfg = load_config(None, ["batch.length=4096", "batch.global_size=8", f"model.attention={impl}"])
        tr = Trainer(cfg, devices=jax.devices()[:8])
        ms, _, comp = timed_steps(tr, 8, 4096)
        base = base or ms
        print(
            f"| {impl} | {ms:,.0f} ({base / ms:.2f}x xla's speed) | {8 * 4096 / ms * 1e3:,.0f} | {comp:.1f} |",
            flush=True,
        )


def collectives() -> None:
    over = [
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "mesh.context=4",
        "precision=fp32",
        "model.attention=flash",
        "batch.length=512",
        "batch.global_size=8",
    ]
    rep = inspect(*over, devices=8)
    ops = [c for c in rep["collectives"]["ops"] if "context" in c["axes"]]
    print("Command: `meshpar inspect --json " + " ".join(over) + "` (tiny: 2 layers, K=4 kv heads, H=8)\n")
    print("| kind | bytes (whole gathered tensor) | runs per step |")
    print("|---|---:|---:|")
    for c in ops:
        print(f"| {c['kind']} | {c['bytes']:,} | {c['times']:g} |")
    b, s, k, h = 8 // 2, 512, 4, 8
    print(
        f"\nFormula: K or V of one device's rows, gathered whole: b S K H x 4 bytes = {b * s * k * h * 4:,}; each "
        "device receives (cp-1)/cp of it per gather."
    )


def long() -> None:
    import jax

    from meshpar.core.config import load_config
    from meshpar.train.data import MarkovLanguage
    from meshpar.train.step import Trainer

    over = [
        "model.attention=flash",
        "batch.global_size=1",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "train.warmup_steps=2",
        "train.lr=0.01",
        "precision=fp32",  # XLA:CPU emulates bf16 matmuls slowly
        "model.heads=2",
        "model.kv_heads=1",
        "model.head_dim=32",
        "model.remat=none",
    ]  # 32k^2 scores on 2 cores
    one = Trainer(load_config(None, over + ["batch.length=4096", "devices=1"]), devices=jax.devices()[:1])
    temp_one = one.compile().memory_analysis().temp_size_in_bytes
    cfg = load_config(None, over + ["batch.length=32768", "mesh.context=8"])
    tr = Trainer(cfg, devices=jax.devices()[:8])
    temp = tr.compile().memory_analysis().temp_size_in_bytes
    print(f"compiled: temp {temp / MiB:.1f} MiB vs {temp_one / MiB:.1f} MiB", file=sys.stderr, flush=True)
    src, state, losses = MarkovLanguage(tr.spec.model_config.vocab, 4, 1), tr.init(), []
    t0 = time.perf_counter()
    for i in range(20):
        state, m = tr.step(state, jax.device_put(src.rows(0, i, range(1), 32768), tr.batch_sharding))
        losses.append(float(m["loss"]))
        print(f"step {i}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    dt = (time.perf_counter() - t0) / 20
    print(f"losses every 5 steps: {[round(x, 3) for x in losses[::5]]} ... {losses[-1]:.3f} ({dt:.1f} s/step)")
    print(
        f"temp per device: 32768 on context=8: {temp / MiB:.1f} MiB; 4096 on one device: {temp_one / MiB:.1f} MiB; "
        f"ratio {temp / temp_one:.2f}"
    )


def ring() -> None:
    import jax

    from meshpar.core.config import load_config
    from meshpar.train.step import Trainer

    print("| context strategy | step (ms), 2 x 8192 tokens, context=8 | temp per device (MiB) | compile (s) |")
    print("|---|---:|---:|---:|")
    for strategy in ("all_gather", "ring"):
        cfg = load_config(
            None,
            [
                "model.attention=flash",
                "batch.global_size=2",
                "batch.length=8192",
                "mesh.data=1",
                "mesh.fsdp=1",
                "mesh.tensor=1",
                "mesh.context=8",
                f"model.context_strategy={strategy}",
                "precision=fp32",
            ],
        )
        tr = Trainer(cfg, devices=jax.devices()[:8])
        ms, temp, comp = timed_steps(tr, 2, 8192)
        print(f"| {strategy} | {ms:,.0f} | {temp / MiB:.1f} | {comp:.1f} |", flush=True)


def plan() -> None:
    from meshpar.core.config import load_config
    from meshpar.plan.hardware import load_hardware
    from meshpar.plan.search import plan as search

    cases = [
        ("7b, 1 x 1M tokens", ["model.size=7b", "batch.length=1048576", "batch.global_size=1"], 64),
        ("7b, 256 x 2048", ["model.size=7b", "batch.length=2048", "batch.global_size=256"], 64),
    ]
    llama8b = ["model.size=7b", "model.kv_heads=8", "model.mlp=14336", "model.vocab=128256", "batch.length=131072"]
    cases += [
        ("8B (Llama 3 shape), 8 x 128k", llama8b + ["batch.global_size=8"], 8),
        ("8B (Llama 3 shape), 64 x 128k", llama8b + ["batch.global_size=64"], 64),
    ]
    print("| case | devices | winner | remat | step (s) | MFU | memory (GiB) | runner-up without context |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    for name, over, n in cases:
        r = search(load_config(None, over), n, load_hardware("h100"))
        c = r["candidates"][0]
        mesh = " x ".join(f"{a}={v}" for a, v in c["mesh"].items() if v > 1)
        alt = next((x for x in r["candidates"] if x["mesh"].get("context", 1) == 1), None)
        alt_s = (
            (
                f"{' x '.join(f'{a}={v}' for a, v in alt['mesh'].items() if v > 1)} {alt['strategy']}: "
                f"{alt['time']['step_s']:.3g} s"
            )
            if alt
            else "none fits"
        )
        print(
            f"| {name} | {n} | {mesh} {c['strategy']} | {c['remat']} | {c['time']['step_s']:.3g} | "
            f"{c['time']['mfu']:.3f} | {c['memory']['total'] / 2**30:.1f} | {alt_s} |",
            flush=True,
        )


if __name__ == "__main__":
    parts = {
        "memory": memory,
        "flops": flops,
        "step": step,
        "collectives": collectives,
        "long": long,
        "ring": ring,
        "plan": plan,
    }
    for name in sys.argv[1:] or parts:
        print(f"\n### {name}\n", flush=True)
        parts[name]()
