"""Config loading/overrides and mesh construction, with the exact error messages users see."""

import jax
import pytest
from jax.sharding import AxisType

from meshpar.core.config import ConfigError, load_config
from meshpar.core.mesh import MESH_AXES, make_mesh, resolve_axis_sizes
from tests.conftest import devices, make_cfg


def test_overrides_are_typed_and_dotted():
    cfg = load_config(
        None,
        [
            "steps=20",
            "strategy=fsdp",
            "mesh.tensor=2",
            "mesh.data=-1",
            "precision=fp32",
            "model.layers=2",
            "batch.global_size=16",
            "train.log_every=1",
            "train.lr=1e-3",
        ],
    )
    assert (cfg.steps, cfg.strategy, cfg.mesh.tensor, cfg.mesh.data, cfg.model.layers) == (20, "fsdp", 2, -1, 2)
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.batch.global_size == 16


@pytest.mark.parametrize(
    "override, message",
    [
        (["mesh.tensr=2"], "unknown config key 'mesh.tensr' (did you mean 'mesh.tensor'?)"),
        (["stesp=3"], "unknown config key 'stesp' (did you mean 'steps'?)"),
        (["strategy=fsdpp"], "config key 'strategy' has unknown value 'fsdpp' (did you mean 'fsdp'?)"),
        (["precision=fp8"], "config key 'precision' has unknown value 'fp8'"),
        (["steps=many"], "config key 'steps' must be an integer, got 'many'"),
        (["steps=0"], "config key 'steps' must be >= 1, got 0"),
        (["model.remat=some"], "config key 'model.remat' has unknown value 'some'"),
        (
            ["serve.decode_loop=unroll"],
            "config key 'serve.decode_loop' has unknown value 'unroll' (did you mean 'unrolled'?)",
        ),
        (["mesh.tensor"], "override 'mesh.tensor' must look like KEY=VALUE"),
    ],
)
def test_bad_config_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert message in str(e.value)


def test_yaml_base_composes(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 7\nmesh: {data: 4, tensor: 2}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmesh: {tensor: 1}\nstrategy: dp\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.steps, cfg.mesh.data, cfg.mesh.tensor, cfg.strategy) == (7, 4, 1, "dp")


def test_fill_axis_and_size_checks():
    assert resolve_axis_sizes({"data": -1, "tensor": 2}, 8)["data"] == 4
    with pytest.raises(ConfigError, match=r"mesh axes multiply to 12 \(data=3 x tensor=4\) but there are 8 devices"):
        resolve_axis_sizes({"data": 3, "tensor": 4}, 8)
    with pytest.raises(ConfigError, match="only one mesh axis may be -1 .*mesh.data, mesh.tensor"):
        resolve_axis_sizes({"data": -1, "tensor": -1}, 8)
    with pytest.raises(ConfigError, match="unknown mesh axis 'mesh.tensr' .did you mean 'mesh.tensor'"):
        resolve_axis_sizes({"tensr": 2}, 8)
    with pytest.raises(ConfigError, match="cannot fill mesh.data=-1: the other axes multiply to 3"):
        resolve_axis_sizes({"data": -1, "tensor": 3}, 8)


def test_mesh_has_named_auto_axes_over_all_devices():
    mesh = make_mesh(make_cfg(mesh={"data": 2, "fsdp": 2, "tensor": 2}).mesh, devices(8))
    assert mesh.axis_names == MESH_AXES
    assert dict(zip(mesh.axis_names, mesh.devices.shape)) == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices()[:8])


def test_hybrid_dcn_mesh_multiplies_ici_and_dcn_sizes():
    cfg = make_cfg(mesh={"fsdp": 4})
    cfg.mesh.dcn = {"data": 2}
    mesh = make_mesh(cfg.mesh, devices(8))
    assert dict(zip(mesh.axis_names, mesh.devices.shape))["data"] == 2
    assert dict(zip(mesh.axis_names, mesh.devices.shape))["fsdp"] == 4


def test_meshpar_config_prints_every_key_with_its_meaning_as_yaml_train_reads(capsys, tmp_path):
    """`meshpar config [--config F] [KEY=VALUE ...]`: the resolved config, each key with a comment,
    and the text is a config file that resolves to the same config."""
    import dataclasses

    from meshpar.cli import main

    assert main(["config", "steps=7", "mesh.dcn={data: 2}", "rules=[[embed, [tensor]]]"]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.strip()]
    leaves = [ln for ln in lines if not ln.rstrip().split("#")[0].rstrip().endswith(":")]
    assert all(" # " in ln for ln in lines), [ln for ln in lines if " # " not in ln]  # keys and sections

    def keys(obj):
        return sum(
            (
                keys(getattr(obj, f.name)) if dataclasses.is_dataclass(getattr(obj, f.name)) else 1
                for f in dataclasses.fields(obj)
            ),
            0,
        )

    assert len(leaves) == keys(load_config()) > 70 and "steps: 7" in text and "checkpoint:" in text
    assert any(ln.startswith("  every: 0") and "only at the end" in ln for ln in lines)
    (tmp_path / "c.yaml").write_text(text)
    want = load_config(None, ["steps=7", "mesh.dcn={data: 2}", "rules=[[embed, [tensor]]]"])
    assert dataclasses.asdict(load_config(tmp_path / "c.yaml")) == dataclasses.asdict(want)
    assert main(["config", "stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err == "meshpar: error: unknown config key 'stepz' (did you mean 'steps'?)\n"


def test_a_file_meshpar_config_wrote_reads_back_without_warnings(capsys, tmp_path):
    """`meshpar config > my.yaml` then `--config my.yaml`: every moe.* and pipeline.* key is in the
    file at its default, and none of them warns; one the user changes (in the file or as an
    override) still does, on a dense model."""
    from meshpar.cli import main
    from meshpar.core.notices import config_warnings

    assert main(["config"]) == 0
    path = tmp_path / "my.yaml"
    path.write_text(capsys.readouterr().out)
    assert "  num_experts: 4" in path.read_text() and "  schedule: gpipe" in path.read_text()
    cfg = load_config(path)
    assert cfg.ignored == [] and config_warnings(cfg) == []
    assert load_config(path, ["moe.num_experts=4"]).ignored == ["moe.num_experts"]  # typed: given, even at its default
    path.write_text(path.read_text().replace("  num_experts: 4", "  num_experts: 8"))
    assert config_warnings(load_config(path)) == [
        "warning: ignoring moe.num_experts: moe.* needs model.name=moe (model.name=decoder)"
    ]


def test_a_warmup_longer_than_the_run_warns_in_one_line():
    """The README's 5-step runs under the default warmup of 10: lr never reaches its peak, said once
    among the run's warnings (train and inspect print them)."""
    from meshpar.train.step import Trainer

    lines = Trainer(make_cfg("steps=5", "train.warmup_steps=10", "train.lr=0.01"), devices=devices(8)).warnings()
    assert lines == [
        "warning: train.warmup_steps=10 is more than steps=5: the learning rate rises to only 50% of "
        "train.lr=0.01; set train.warmup_steps <= 5"
    ]
    assert Trainer(make_cfg("steps=5", "train.warmup_steps=5"), devices=devices(8)).warnings() == []


def test_meshpar_version_and_help_point_to_the_keys(capsys):
    from meshpar import __version__
    from meshpar.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"meshpar {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "`meshpar config` prints every key" in capsys.readouterr().out


LATE_DEVICE = """
import os, sys, time
mesh_lib = __import__("meshpar.core.mesh", fromlist=["x"])
os.environ["XLA_FLAGS"] = mesh_lib.fake_cpu_flags(4, sys.argv[1], int(sys.argv[2]))
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

def late(i):            # device 1 reaches the all-reduce 3 s after the others (a busy machine's thread)
    if int(i) == 1:
        time.sleep(3)
    return np.float32(1)

def f(x):
    w = jax.pure_callback(late, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("x"))
    return jax.lax.psum(x * w, "x")

mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
print("sum", float(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P()))(jnp.ones(4)).sum()))
"""


def test_fake_devices_wait_out_a_late_collective_where_xla_would_abort_the_process(tmp_path):
    """XLA:CPU ends the process (SIGABRT) when one collective's fake devices arrive more than its
    rendezvous timeout apart (20 s + 40 s by default): the worker abort of issue 46, on a busy machine.
    Scaled down (a 1 s warning): a device 3 s late aborts the process when fake_cpu_flags' wait is 1 s
    and is waited for at 30 s, so the flag it writes is the one XLA obeys; by default it waits
    COLLECTIVE_WAIT_S, and a timeout the user set is left alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from meshpar.core.mesh import COLLECTIVE_WAIT_S, fake_cpu_flags

    name = "--xla_cpu_collective_call_terminate_timeout_seconds"
    assert f"{name}={COLLECTIVE_WAIT_S}" in fake_cpu_flags(8).split() and COLLECTIVE_WAIT_S >= 300
    assert fake_cpu_flags(8, f"{name}=7").split().count(
        f"{name}=7"
    ) == 1 and f"{name}={COLLECTIVE_WAIT_S}" not in fake_cpu_flags(8, f"{name}=7")
    (tmp_path / "late.py").write_text(LATE_DEVICE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(wait_s: int):
        return subprocess.run(
            [sys.executable, "late.py", "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1", str(wait_s)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    short = run(1)
    assert short.returncode == -6 and "Termination timeout" in short.stderr, (short.returncode, short.stderr[-1500:])
    patient = run(30)
    assert patient.returncode == 0 and "sum 4.0" in patient.stdout, patient.stderr[-1500:]
