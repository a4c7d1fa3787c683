"""Run by tests/parallel/test_pipeline_lockstep.py in a subprocess (a deadlock makes XLA:CPU abort the
process, which must fail a test, not kill the test worker): `python -m tests.parallel.lockstep_run
STRATEGY SCHEDULE...` prints one JSON line {SCHEDULE: {"strays": [op names], "loss", "ce", "grads"}}:
the tiny LM pipelined on pipeline=2 x data=2 x tensor=2 under STRATEGY against one device, from the
same parameters and batch (norm-wise relative errors). A program with strays (collectives its stages
would wait in apart, `meshpar.parallel.lockstep`) is not run: its errors are null.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from meshpar.parallel import lockstep  # noqa: E402
from meshpar.train.step import Trainer  # noqa: E402
from tests.conftest import rel  # noqa: E402
from tests.parallel.pipelines import pp_cfg, reference  # noqa: E402


def run(strategy: str, schedule: str) -> dict:
    """One pipelined forward and backward (M = 2 microbatches, 4 layers) against one device."""
    cfg = pp_cfg(schedule, 2, 2, 1, 4, {"pipeline": 2, "data": 2, "tensor": 2}, f"strategy={strategy}")
    tr = Trainer(cfg, devices=jax.devices()[:8])
    params, tokens, loss0, grads0 = reference(4)
    params, tokens = jax.device_put(params, tr.param_shardings), jax.device_put(tokens, tr.batch_sharding)
    compiled = jax.jit(tr._grads).lower(params, tokens).compile()
    strays = [s.op_name for s in lockstep.strays(compiled.as_text(), lockstep.stage_of(tr.mesh), True)]
    if strays:
        return {"strays": strays, "loss": None, "ce": None, "grads": None}
    (loss, aux), grads = compiled(params, tokens)
    return {
        "strays": [],
        "loss": abs(float(loss) - loss0) / loss0,
        "ce": abs(float(aux["ce"]) - loss0) / loss0,
        "grads": rel(jax.device_get(grads), grads0),
    }


if __name__ == "__main__":
    print(json.dumps({schedule: run(sys.argv[1], schedule) for schedule in sys.argv[2:]}))
