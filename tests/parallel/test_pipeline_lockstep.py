"""Pipeline stages never wait in different collectives (meshpar/parallel/lockstep.py): FSDP beside an
axis that splits nothing (strategy=fsdp on pipeline=2 x data=2 x tensor=2) pipelines like one device
under GPipe and 1F1B, where XLA resharded weights inside a stage's branch with a collective-permute
over all 8 devices and XLA:CPU aborted the process; a program that would still deadlock (a user's
layer mixing rows split over `data`, under 1F1B) is refused in one line before it runs; the HLO
reader's groups and branches. The runs are subprocesses with XLA:CPU's collective timeout at 60 s:
a deadlock fails a test instead of killing the worker.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from meshpar.core.mesh import MESH_AXES
from meshpar.parallel import lockstep

REPO = Path(__file__).resolve().parents[2]
WAIT = "--xla_cpu_collective_call_terminate_timeout_seconds"


def _env(**extra) -> dict:
    """This process's environment with XLA:CPU's collective wait cut to 60 s (a deadlock aborts soon)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(WAIT)]
    return {**os.environ, "XLA_FLAGS": " ".join(flags + [f"{WAIT}=60"]), **extra}


def test_fsdp_beside_an_idle_tensor_axis_pipelines_like_one_device():
    """strategy=fsdp splits nothing over `tensor`: XLA reached the weights it gathers at use (the
    stacked layers' in 1F1B's branches, the LM head's in GPipe's and 1F1B's last-stage branch) through
    a collective-permute over all devices, which the other stage never joined."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.parallel.lockstep_run", "fsdp", "gpipe", "1f1b"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for schedule, got in out.items():
        assert got["strays"] == [], (schedule, got["strays"][:3])
        assert got["loss"] <= 1e-5 and got["ce"] <= 1e-5 and got["grads"] <= 1e-5, (schedule, got)


ROLLING = '''
import jax.numpy as jnp
import numpy as np
from flax import nnx
import meshpar

class Block(nnx.Module):
    """Adds each row's neighbour: rows split over `data` make XLA send rows between devices."""
    def __init__(self, rngs):
        self.w = meshpar.param(rngs, (8, 8), ("embed", "mlp"), 0.1)
    def __call__(self, x):
        return jnp.tanh((x + jnp.roll(x, 1, axis=0)) @ self.w[...])

class Staged(nnx.Module):
    def __init__(self, rngs):
        self.layers = meshpar.stacked(Block, 2, rngs)
    def pre(self, batch):
        return meshpar.constrain(batch["x"], ("batch", None, None))
    def post(self, x):
        return x
    def loss(self, out, batch):
        return ((out - batch["y"]) ** 2).mean(), {}

def rolling(cfg, rngs): return Staged(rngs)

class Source:
    def batch_spec(self, global_size, length):
        leaf = meshpar.Leaf((global_size, 4, 8), np.float32, ("batch", None, None))
        return {"x": leaf, "y": leaf}
    def rows(self, seed, step, rows, length):
        return {k: np.ones((len(rows), 4, 8), np.float32) for k in ("x", "y")}

def source(cfg): return Source()
'''


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_program_whose_stages_would_wait_apart_is_refused_in_one_line(tmp_path, schedule):
    """A stacked layer that rolls the batch (split over `data`) under 1F1B: a collective-permute inside
    the stages' branches, the process aborted by XLA:CPU (exit 134) in the first step; now exit 2 and
    one line naming the schedule, the mesh and the strategy. GPipe runs the layers outside any branch:
    it trains."""
    (tmp_path / "rollmod.py").write_text(ROLLING)
    cmd = [
        sys.executable,
        "-m",
        "meshpar.cli",
        "train",
        "model.name=rollmod:rolling",
        "train.loss=stages",
        "data.kind=rollmod:source",
        "batch.global_size=16",
        "model.layers=2",
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "strategy=fsdp",
        f"pipeline.schedule={schedule}",
        "pipeline.microbatches=2",
        "steps=1",
        "train.warmup_steps=1",
        "--devices",
        "4",
    ]
    run = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if schedule == "gpipe":
        assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"
        return
    assert run.returncode == 2 and run.stderr.count("\n") == 1, f"exit {run.returncode}: {run.stderr[-3000:]}"
    assert run.stderr.startswith(
        "meshpar: error: pipeline.schedule=1f1b on mesh pipeline=2 data=2 with strategy=fsdp "
        "compiled to a program that would deadlock: XLA placed a collective-permute over all "
        "4 devices (pipeline stages 0, 1) inside a branch"
    ), run.stderr
    assert (
        "jit(_roll_static)" in run.stderr
        and "Try pipeline.schedule=gpipe (it runs the stacked layers outside" in run.stderr
    ), run.stderr


HLO = """HloModule m

%inner (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %g = f32[4]{0} all-reduce(%a), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%sum
}

%branch0 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %r = f32[4]{0} all-reduce(%p), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%sum
  ROOT %c = f32[4]{0} call(%r), to_apply=%inner
}

%branch1 (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %cp = f32[4]{0} collective-permute(%q), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}, metadata={op_name="jit(f)/shard_map/cond/branch_1_fun/roll"}
}

%uniform (u: f32[4]) -> f32[4] {
  %u = f32[4]{0} parameter(0)
  ROOT %v = f32[4]{0} all-reduce(%u), channel_id=5, replica_groups={}, to_apply=%sum
}

ENTRY %main (x: f32[4], i: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  %y = f32[4]{0} all-reduce(%x), channel_id=4, replica_groups={}, to_apply=%sum
  %z = f32[4]{0} conditional(%i, %y, %y), branch_computations={%branch0, %branch1}, metadata={op_name="jit(f)/shard_map/cond"}
  ROOT %w = f32[4]{0} conditional(%i, %z, %z), branch_computations={%uniform, %uniform}, metadata={op_name="jit(f)/cond"}
}
"""


def test_the_hlo_reader_finds_collectives_that_join_stages_inside_branches():
    """4 devices, stages [0, 0, 1, 1]: in the shard_map's conditional, the all-reduce over {0,1},{2,3}
    stays in a stage, the one its call makes over the iota groups {0,2},{1,3} joins both; the permute's
    pairs stay in a stage, but XLA:CPU waits for every device. Collectives outside a branch, and in a
    conditional outside the shard_map, do not count."""
    stages = np.array([0, 0, 1, 1])
    assert [(s.op, s.devices, s.stages) for s in lockstep.strays(HLO, stages, False)] == [
        ("all-reduce", (0, 2), (0, 1))
    ]
    found = sorted((s.op, s.devices) for s in lockstep.strays(HLO, stages, True))
    assert found == [("all-reduce", (0, 2)), ("collective-permute", (0, 1, 2, 3))]
    assert lockstep.strays(HLO.replace("T(1,0)", ""), stages, False) == []


MESH = "mesh['pipeline'=2,'data'=2,'fsdp'=1,'context'=2,'expert'=1,'tensor'=1]"
NAMED = f"""HloModule m

%branch0 (p: f32[]) -> f32[] {{
  %p = f32[] parameter(0)
  %c = f32[] all-reduce(%p), channel_id=1, replica_groups={MESH} {{'context'}}, to_apply=%sum
  ROOT %d = f32[] all-reduce(%c), channel_id=2, replica_groups={MESH} {{'data','context'}}, to_apply=%sum
}}

%branch1 (q: f32[]) -> f32[] {{
  %q = f32[] parameter(0)
  ROOT %e = f32[] all-reduce(%q), channel_id=3, replica_groups={MESH} {{GROUPS}}, to_apply=%sum
}}

ENTRY %main (x: f32[], i: s32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %i = s32[] parameter(1)
  ROOT %z = f32[] conditional(%i, %x, %x), branch_computations={{%branch0, %branch1}}, metadata={{op_name="jit(f)/shard_map/cond"}}
}}
"""


@pytest.mark.parametrize(
    "groups, stray",
    [
        ("{'context'}", None),
        ("{'pipeline'}", (0, 4)),
        ("{'pipeline','context'}", (0, 1, 4, 5)),
    ],
)
def test_the_hlo_reader_reads_replica_groups_named_by_mesh_axes(groups, stray):
    """jaxlib 0.11 names a collective's groups by mesh axes (`mesh[...] {'context'}`): groups over
    `context` or `data` stay in a stage of [pipeline=2, data=2, context=2] (ids 0-3 stage 0, 4-7 stage
    1), one over `pipeline` joins both. Read as every device (jax 0.11's pipelines with mesh.context > 1
    were all refused), a psum over `context` in the loss's branch looked like a deadlock."""
    stages = lockstep.stage_of(SimpleNamespace(devices=np.zeros((2, 2, 1, 2, 1, 1)), axis_names=MESH_AXES))
    found = lockstep.strays(NAMED.replace("{GROUPS}", groups), stages, False)
    assert [s.devices for s in found] == ([] if stray is None else [stray])
