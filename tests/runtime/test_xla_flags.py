"""meshpar's GPU XLA flags: one set, on the launch path (a CUDA host's `meshpar train`) and in a
deviceless GPU compile alike, with the user's own XLA_FLAGS winning flag by flag. (The flags' effect
on a compiled H100 program is asserted in tests/plan/test_targets.py.)"""

import os

import pytest

from meshpar.core.config import load_config
from meshpar.runtime import xla_flags

LHS = "xla_gpu_enable_latency_hiding_scheduler"


def test_every_flag_says_why_and_is_one_xla_knows():
    from meshpar.core.mesh import xla_knows

    for f in xla_flags.GPU_FLAGS:
        assert len(f.why) > 40 and xla_knows(f.name)  # XLA aborts on a flag it does not define


def test_the_gpu_flags_are_added_unless_the_user_names_them():
    assert xla_flags.with_gpu_flags("") == f"--{LHS}=true"
    assert xla_flags.with_gpu_flags("--xla_dump_to=/tmp/d") == f"--xla_dump_to=/tmp/d --{LHS}=true"
    mine = f"--{LHS}=false --xla_gpu_enable_triton_gemm=false"
    assert xla_flags.with_gpu_flags(mine) == mine  # the user's value stands, nothing doubled
    assert xla_flags.compiler_options("gpu") == {LHS: True}
    assert xla_flags.compiler_options("gpu", mine) == {}  # XLA read the user's from the environment already
    assert xla_flags.compiler_options("tpu") == {}
    # what a report lists: the flags in force, the user's own included
    assert xla_flags.in_force("gpu", mine) == {LHS: "false", "xla_gpu_enable_triton_gemm": "false"}
    assert xla_flags.in_force("gpu", "--xla_dump_to=/d") == {LHS: True}
    # XLA reads a value that does not start with "-" as a file of flags: the user's whole choice
    assert xla_flags.with_gpu_flags("/etc/xla_flags.txt") == "/etc/xla_flags.txt"
    assert xla_flags.compiler_options("gpu", "/etc/xla_flags.txt") == {}
    assert xla_flags.given("--a=1 --b") == {"a": "1", "b": "true"}


def _cli_on(monkeypatch, tmp_path, plugin: str, xla: str | None, platforms: str | None = "cuda") -> str:
    """XLA_FLAGS after the CLI's device set-up on a host whose jax has `plugin`, under JAX_PLATFORMS
    `platforms` (None: unset)."""
    from meshpar.cli import _setup_devices

    (tmp_path / plugin).mkdir()
    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if xla is not None:
        monkeypatch.setenv("XLA_FLAGS", xla)
    monkeypatch.setattr("meshpar.cli._has_accelerator", _finds_in(tmp_path))
    _setup_devices(load_config(None, []), 8)
    return os.environ.get("XLA_FLAGS", "")


def _finds_in(folder):
    """`meshpar.cli._has_accelerator` looking for the plugins in `folder` only (not this host's jax)."""

    from meshpar.cli import CUDA_PLUGINS

    def has(plugins=(*CUDA_PLUGINS, "libtpu")):
        return any((folder / p).is_dir() for p in plugins)

    return has


@pytest.mark.parametrize(
    "mine, expected",
    [
        (None, f"--{LHS}=true"),
        (f"--{LHS}=false", f"--{LHS}=false"),
        ("--xla_dump_to=/d", f"--xla_dump_to=/d --{LHS}=true"),
    ],
)
def test_a_cuda_host_launches_with_the_gpu_flags(monkeypatch, tmp_path, mine, expected):
    assert _cli_on(monkeypatch, tmp_path, "jax_cuda12_plugin", mine) == expected  # and no fake host devices


def test_a_cuda_host_without_jax_platforms_gets_them_beside_the_inert_fake_cpu_count(monkeypatch, tmp_path):
    flags = _cli_on(monkeypatch, tmp_path, "jax_cuda12_plugin", None, platforms=None)
    assert f"--{LHS}=true" in flags.split() and "--xla_force_host_platform_device_count=8" in flags.split()


def test_a_tpu_host_gets_no_gpu_flags(monkeypatch, tmp_path):
    assert _cli_on(monkeypatch, tmp_path, "libtpu", "--xla_dump_to=/tmp/x") == "--xla_dump_to=/tmp/x"
