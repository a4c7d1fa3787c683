"""Where a decode step's runtime peak is set: the process's memory after each phase of one engine.

    python bench/bench_serve_compile_peak.py [auto|scan|unrolled] [--tiny]

One slot of Llama-3 8B (bf16, 4096 positions) with `serve.decode_loop` as given: the weights built,
one prompt prefilled, the decode step compiled ahead of its first run, that run, then 10 timed steps.
After each phase it prints (GiB in use, the process's peak so far), so a peak set while compiling
(XLA:GPU's autotuner) is told apart from one the running step holds; run it again under
`XLA_FLAGS=--xla_gpu_autotune_level=0` for the control. Needs an accelerator for the 8B;
`--tiny` rehearses the script on a CPU (where memory is not reported).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_device import LLAMA3_8B  # noqa: E402  (the 8B's overrides, one list for the benches)


def main() -> None:
    import jax
    import numpy as np

    from meshpar.core.config import load_config
    from meshpar.serve.engine import Engine

    loop = next((a for a in sys.argv[1:] if not a.startswith("--")), "auto")
    model = ["model.size=tiny"] if "--tiny" in sys.argv else LLAMA3_8B
    serve = ["serve.slots=1", "serve.cache_length=4096", "serve.min_bucket=16", f"serve.decode_loop={loop}"]
    cfg = load_config(None, [*model, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "precision=bf16", *serve])
    dev, out = jax.devices()[0], {"loop": loop}

    def mark(phase: str) -> None:
        s = dev.memory_stats() or {"bytes_in_use": 0, "peak_bytes_in_use": 0}
        out[phase] = (round(s["bytes_in_use"] / 2**30, 2), round(s["peak_bytes_in_use"] / 2**30, 2))

    eng = Engine(cfg, devices=jax.devices()[:1], info=lambda m: None)
    jax.block_until_ready(eng.weights)
    mark("built")
    entry, _, _ = eng.prefill(list(range(16)))
    state = jax.block_until_ready(eng.insert(entry, eng.new_state(), 0))
    mark("prefilled")
    t = time.perf_counter()
    compiled = eng.programs.generate.lower(eng.weights, state).compile()
    out["compile_s"] = round(time.perf_counter() - t, 1)
    out["compiled_temp_gib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3)
    mark("compiled")
    state, toks, _ = eng.generate(state)
    jax.block_until_ready(toks)
    mark("first_step")
    times = []
    for _ in range(10):
        t = time.perf_counter()
        state, toks, _ = eng.generate(state)
        np.asarray(toks)
        times.append(time.perf_counter() - t)
    out["step_ms"] = round(1e3 * sorted(times)[len(times) // 2], 2)
    mark("stepped")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
