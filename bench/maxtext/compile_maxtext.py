"""MaxText's own deviceless compile of its training step (`train_compile`), kept for comparison.

Runs in MaxText's venv (bench/maxtext/README.md), not meshpar's:

    /path/to/maxtext-venv/bin/python bench/maxtext/compile_maxtext.py OUT KEY=VALUE ...

KEY=VALUE are MaxText's own config overrides (`model_name=llama2-7b compile_topology=v5p-128 ...`),
applied to the base.yml MaxText ships. Writes OUT.json (memory analysis, cost analysis, mesh, compile
seconds) and OUT.hlo (the optimized, scheduled program text), which `bench/bench_target.py` reads with
meshpar's own HLO readers, so both frameworks' programs are measured by the same code.

GPU (`MESHPAR_GPU_TARGET=h100:64`): MaxText's own GPU branch (`compile_topology=a3`) is not
deviceless: it compiles for `jax.devices()` under `mock_num_gpu_processes`, so it needs the local GPUs.
Here `jax.devices()` (and its counts) return meshpar's deviceless CUDA topology instead
(`meshpar.plan.target.resolve`: XLA:GPU for H100s, loaded from `meshpar compilers --install gpu` for
this venv's jax), and MaxText is run with `compile_topology=a3 compile_topology_num_slices=N/8
num_slices=1`, so its mesh is one slice of the N devices.
"""

import json
import os
import sys
import time


def _gpu_devices(spec: str) -> str:
    """Point jax's device queries at meshpar's deviceless `spec` ("h100:64") devices; the compiler's name."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin then looks for no driver
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import jax

    from meshpar.plan.target import resolve
    from meshpar.runtime import compilers

    name, n = spec.split(":")
    devices = list(resolve(name, int(n)).devices)
    jax.devices = jax.local_devices = lambda *a, **k: devices
    jax.device_count = jax.local_device_count = lambda *a, **k: len(devices)
    return compilers.version("gpu")


COMPILER = _gpu_devices(os.environ["MESHPAR_GPU_TARGET"]) if os.environ.get("MESHPAR_GPU_TARGET") else None

from maxtext.trainers.pre_train import train_compile as tc  # noqa: E402

captured = {}
_compile = tc.jit_and_compile


def _grab(*args, **kwargs):
    start = time.perf_counter()
    compiled = _compile(*args, **kwargs)
    captured["compiled"], captured["seconds"] = compiled, time.perf_counter() - start
    mesh = args[3] if len(args) > 3 else kwargs.get("mesh")
    captured["mesh"] = dict(zip(mesh.axis_names, mesh.devices.shape)) if mesh is not None else {}
    return compiled


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    base = os.path.join(os.path.dirname(tc.__file__), "..", "..", "configs", "base.yml")
    tc.jit_and_compile = _grab
    tc.main([sys.argv[0], os.path.normpath(base), *overrides])
    compiled = captured["compiled"]
    mem = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else None) if isinstance(ca, (list, tuple)) else ca
    ca = ca or {}  # XLA:GPU gives none
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    m = {f: int(getattr(mem, f)) for f in fields}
    # the compiler's own peak where it gives one, as meshpar.plan.inspect.memory reads meshpar's program
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or (
        m["argument_size_in_bytes"] + m["output_size_in_bytes"] + m["temp_size_in_bytes"] - m["alias_size_in_bytes"]
    )
    if COMPILER is None:
        import libtpu

        compiler = f"libtpu {libtpu.__version__}"
    else:
        compiler = COMPILER
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "overrides": overrides,
                "compiler": compiler,
                "memory": m,
                "peak_bytes": peak,
                "mesh": captured["mesh"],
                "compile_s": round(captured["seconds"], 1),
                "cost": {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed")},
            },
            f,
            indent=1,
        )
    with open(out + ".hlo", "w") as f:
        f.write(compiled.as_text())


if __name__ == "__main__":
    main()
