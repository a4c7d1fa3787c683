"""The XLA flags meshpar runs GPU programs with, one note per flag: the same set on every path that
compiles for a GPU, so that what `inspect --target h100` and `plan --verify --target h100` report is
the program a launched job runs.

    XLA_FLAGS=$(with_gpu_flags "$XLA_FLAGS")     # `meshpar train` (serve, ...) on a CUDA host, SLURM's tasks
    jit(f).lower(...).compile(compiler_options("gpu"))   # a deviceless compile for a GPU target

A flag the user's own XLA_FLAGS names is theirs: meshpar adds only the flags it does not name, flag by
flag (`--xla_gpu_enable_latency_hiding_scheduler=false` turns the first one off). Each flag was
measured on the compiled program before it was adopted (`bench/RESULTS.md`); MaxText's GPU flag set
was the reference, not a list to copy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    value: bool | int | str
    why: str  # the measurement that earned it its place

    def arg(self) -> str:
        return arg(self.name, self.value)


def arg(name: str, value: bool | int | str) -> str:
    """One flag as XLA_FLAGS spells it ("--name=true")."""
    return f"--{name}={str(value).lower() if isinstance(value, bool) else value}"


GPU_FLAGS: tuple[Flag, ...] = (
    Flag(
        "xla_gpu_enable_latency_hiding_scheduler",
        True,
        "schedule each collective's start early and its done late, around independent compute (XLA:GPU's "
        "default leaves most of them synchronous): Mixtral 8x7B on 64 H100s exposes 5.4 GB per step with "
        "it, 52.6 GB without; dense fsdp rows expose none either way",
    ),
)


def given(xla_flags: str) -> dict[str, str]:
    """The flags an XLA_FLAGS string sets, by name ("--a=1 --b" -> {"a": "1", "b": "true"})."""
    pairs = (f[2:].split("=", 1) for f in xla_flags.split() if f.startswith("--"))
    return {p[0]: p[1] if len(p) > 1 else "true" for p in pairs}


def from_file(xla_flags: str) -> bool:
    """Whether XLA reads `xla_flags` as the name of a file of flags (a value not starting with "-")."""
    return bool(xla_flags.strip()) and not xla_flags.strip().startswith("-")


def missing(flags: tuple[Flag, ...], xla_flags: str) -> list[Flag]:
    """`flags` that the user's `xla_flags` does not name (theirs win)."""
    mine = given(xla_flags)
    return [f for f in flags if f.name not in mine]


def with_gpu_flags(xla_flags: str = "") -> str:
    """`xla_flags` with meshpar's GPU flags appended where it does not name them (a file of flags, which
    XLA reads instead, is the user's whole choice: unchanged)."""
    if from_file(xla_flags):
        return xla_flags
    return " ".join([xla_flags.strip(), *(f.arg() for f in missing(GPU_FLAGS, xla_flags))]).strip()


def compiler_options(platform: str, xla_flags: str = "") -> dict:
    """XLA compiler options for a deviceless compile on `platform` ("gpu" or "tpu"): the flags a launched
    job on that platform runs with, less those the process's `xla_flags` names (XLA read them already)."""
    if platform != "gpu" or from_file(xla_flags):
        return {}
    return {f.name: f.value for f in missing(GPU_FLAGS, xla_flags)}


def in_force(platform: str, xla_flags: str = "") -> dict:
    """The GPU flags a program compiled with `compiler_options` has: meshpar's, and the user's own from
    `xla_flags` (name -> value), for a report to list; none on TPU (libtpu takes its own flags from
    LIBTPU_INIT_ARGS, and jaxlib's XLA refuses an `xla_tpu_*` in XLA_FLAGS)."""
    if platform != "gpu":
        return {}
    mine = {k: v for k, v in given(xla_flags).items() if k.startswith("xla_gpu_")}
    return {**compiler_options(platform, xla_flags), **mine}
