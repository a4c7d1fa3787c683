"""Pipeline x data parallelism: gradient traffic over `data` and peak memory of one compiled step.

    python bench/bench_pipeline_dp.py [KEY=VALUE ...]

Config (default): the 125m decoder cut to 4 layers, vocab 8192, fp32, strategy dp, mesh
pipeline=2 x data=4, mini-batch 32 x 128 in 8 pipeline microbatches; every schedule (GPipe, 1F1B,
interleaved v=2). Printed per schedule, one JSON line: the bytes per step of all-reduces over `data`
(as `meshpar inspect` counts them: loop bodies x trip count, every `lax.switch` branch of 1F1B
counted), every collective kind, and `memory_analysis()` peak and temp. The parameters' gradient is
~126 MB per device here, so a step that reduces it once over `data` moves ~126 MB. Nothing runs:
every number is from compiling one train step on 8 fake CPU devices.
To compare with another checkout, run the same command with PYTHONPATH pointing at it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402

from meshpar.core.config import load_config  # noqa: E402
from meshpar.plan import inspect  # noqa: E402
from meshpar.train.step import trainer_for  # noqa: E402

BASE = [
    "model.size=125m",
    "model.layers=4",
    "model.vocab=8192",
    "precision=fp32",
    "strategy=dp",
    "mesh.pipeline=2",
    "mesh.data=4",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "batch.global_size=32",
    "batch.length=128",
    "pipeline.microbatches=8",
]


def main(overrides: list[str]) -> None:
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        cfg = load_config(None, BASE + [f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}"] + overrides)
        tr = trainer_for(cfg, devices=jax.devices()[: cfg.devices])
        compiled = tr.lower().compile({"xla_backend_optimization_level": 0})
        ops = inspect.collectives(compiled.as_text(), tr.describe()["mesh"])
        over_data = sum(
            o["bytes"] * o.get("times", 1) for o in ops if o["kind"] == "all-reduce" and "data" in o["axes"]
        )
        mem = inspect.memory(compiled)
        print(
            json.dumps(
                {
                    "schedule": schedule,
                    "data_allreduce_MB": round(over_data / 1e6, 1),
                    "collectives_MB": {k: round(s["bytes"] / 1e6, 1) for k, s in inspect.summarize(ops).items()},
                    "peak_MB": round(mem["peak_estimate"] / 1e6, 1),
                    "temp_MB": round(mem["temp"] / 1e6, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
