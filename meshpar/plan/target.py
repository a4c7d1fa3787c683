"""Deviceless targets: the GPU or TPU devices a program is compiled for on a host that has none.

    target = resolve("h100", 8)                 # 8 NVIDIA H100s: one node
    target = resolve("tpu-v5p", 64)             # a v5p slice of 64 chips, 4x4x4
    trainer = trainer_for(cfg, devices=target.devices)   # the same Trainer, on a Mesh of those devices
    compiled, notes = compile_trainer(target, trainer)   # by the target's compiler, with its launch flags

`jax.experimental.topologies` builds compile-only devices from a description: for a GPU a
`GpuTargetConfigProto` (SM count, compute capability, clock, memory, shared memory, cuDNN version)
and a shape `slices x hosts x devices per host`; for a TPU libtpu's topology name `v5p:4x4x4`, whose
devices carry their torus coordinates (so `meshpar.core.mesh` lays axes on physical neighbours), and
a number of slices joined over DCN, with the wraparound links a real slice of that shape has
(`tpu_wrap`). Nothing is allocated: state and batch are `ShapeDtypeStruct`s.

What a deviceless compile proves: the program compiles for that chip, the memory XLA assigns per
device, the collectives and kernels it chose and the order it scheduled them in. What it does not:
speed, or how NCCL / ICI behave at run time.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field

from meshpar.core.errors import ConfigError, MeshparError
from meshpar.plan.hardware import Hardware, load_hardware
from meshpar.runtime import compilers, xla_flags

GPUS_PER_NODE = 8
TPU_HOST = {2: (2, 2), 3: (2, 2, 1)}  # the smallest TPU topology libtpu describes: one host of 4 chips


@dataclass
class Target:
    hardware: Hardware
    devices: list = field(repr=False)
    platform: str  # "gpu" or "tpu"
    topology: str  # "1x1x8" (GPU: slices x hosts x devices) or "v5p:2x2x2"
    slices: int = 1

    def describe(self) -> dict:
        d = self.devices[0]
        return {
            "name": self.hardware.name,
            "platform": self.platform,
            "device_kind": d.device_kind,
            "devices": len(self.devices),
            "topology": self.topology,
            "slices": self.slices,
            "memory_bytes": int(self.hardware.memory_bytes),
            "compiler": compilers.version(self.platform),
            "xla_flags": xla_flags.in_force(self.platform, os.environ.get("XLA_FLAGS", "")),
        }


def resolve(hw: str | Hardware, n: int, topology: str | None = None, slices: int | None = None) -> Target:
    """The `n` devices of hardware `hw` (a preset name or YAML path, see `meshpar.plan.hardware`)."""
    hardware = hw if isinstance(hw, Hardware) else load_hardware(hw)
    if not hardware.target:
        raise ConfigError(
            f"hardware '{hardware.name}' has no `target` description, so it cannot be compiled for: "
            "add target: {sm_count, compute_capability, clock_ghz, ...} (GPU) or {chip, dims} (TPU)"
        )
    hardware.check_devices(n)
    if slices is not None and slices < 1:
        raise ConfigError(f"--slices must be >= 1, got {slices}")
    kind = hardware.kind
    compilers.load(kind)
    return _tpu(hardware, n, topology, slices) if kind == "tpu" else _gpu(hardware, n, topology)


def gpu_target_config(hw: Hardware) -> str:
    """The GpuTargetConfigProto (text) that describes one `hw` GPU to XLA:GPU's compiler."""
    t = hw.target
    major, minor = (int(x) for x in str(t["compute_capability"]).split("."))
    return "\n".join(
        [
            "gpu_device_info {",
            "  threads_per_block_limit: 1024",
            "  threads_per_warp: 32",
            "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {int(t['shared_memory_per_sm'])}",
            "  threads_per_core_limit: 2048",
            f"  core_count: {int(t['sm_count'])}",
            "  fpus_per_core: 128",
            "  block_dim_limit_x: 2147483647",
            "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(t['memory_bandwidth'])}",
            f"  l2_cache_size: {int(t['l2_bytes'])}",
            f"  clock_rate_ghz: {float(t['clock_ghz'])}",
            f"  device_memory_size: {int(hw.memory_bytes)}",
            f"  shared_memory_per_block_optin: {int(t['shared_memory_per_sm']) - 1024}",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536",
            "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 8 patch: 0 }",
            f'device_description_str: "{t["device_kind"]}"',
            "",
        ]
    )


def _gpu(hw: Hardware, n: int, topology: str | None) -> Target:
    from jax.experimental import topologies

    if topology is None:
        per_node = min(n, GPUS_PER_NODE)
        topology = f"1x{n // per_node}x{per_node}"
    shape = _shape(topology, 3, "--topology for a GPU is SLICESxHOSTSxGPUS, e.g. 1x8x8")
    if math.prod(shape) != n:
        raise ConfigError(f"--topology {topology} holds {math.prod(shape)} GPUs, not --devices {n}")
    desc = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(hw), topology=topology)
    return Target(hw, list(desc.devices), "gpu", topology, shape[0])


def tpu_wrap(shape: tuple[int, ...]) -> tuple[bool, ...]:
    """Which torus dimensions of a TPU slice have their wraparound links (Cloud TPU's topologies:
    a 3D slice (v4, v5p) is a torus when it is made of whole 4x4x4 cubes, every side a multiple of
    4, and a mesh below that; a 2D pod (v5e, v6e) wraps a side only at its full 16 chips). Without
    them a collective along an axis runs on a line, not a ring: libtpu then lowers an all-gather as
    a dynamic-update-slice into zeros plus an all-reduce, twice the bytes on the wire. libtpu takes
    three entries for a 2D chip too (the third False)."""
    if len(shape) == 3:
        return (all(d % 4 == 0 for d in shape),) * 3
    return tuple(d == 16 for d in shape) + (False,)


def tpu_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The slice shape of `chips` chips (a power of two >= 4): one host, then doubling the shortest side;
    its sides shortest first as Cloud TPU names them (v5p:2x2x4), unless a host no longer tiles that
    order (one v5p host is 2x2x1, not 1x2x2)."""
    host = TPU_HOST[dims]
    shape = list(host)
    while math.prod(shape) < chips:
        i = min(range(dims), key=lambda k: (shape[k], -k))
        shape[i] *= 2
    ordered = tuple(sorted(shape))
    return ordered if all(s % h == 0 for s, h in zip(ordered, host)) else tuple(shape)


def _tpu(hw: Hardware, n: int, topology: str | None, slices: int | None) -> Target:
    from jax.experimental import topologies

    chip, dims = hw.target["chip"], int(hw.target.get("dims", 3))
    per_chip = len(topologies.get_topology_desc(platform="tpu", topology_name=_name(chip, TPU_HOST[dims])).devices) // 4
    slices = slices or (1 if n <= hw.domain else n // hw.domain)
    if n % (slices * per_chip):
        raise ConfigError(f"--devices {n} cannot be split into {slices} {hw.name} slices of whole chips")
    chips = n // slices // per_chip
    if topology is not None:
        shape = _shape(
            topology.split(":")[-1],
            dims,
            f"--topology for {hw.name} is {'x'.join('N' * dims)}, e.g. {'x'.join(map(str, tpu_shape(8, dims)))}",
        )
        if math.prod(shape) != chips:
            raise ConfigError(
                f"--topology {topology} holds {math.prod(shape)} chips, but --devices {n} over "
                f"{slices} slice(s) needs {chips} per slice"
            )
    else:
        if chips < 4 or chips & (chips - 1):
            raise ConfigError(
                f"--devices {n}: a deviceless {hw.name} slice holds a power of two chips, at least one "
                f"host of 4 (--devices {4 * per_chip * slices} or more)"
            )
        shape = tpu_shape(chips, dims)
    name = _name(chip, shape)
    desc = topologies.get_topology_desc(platform="tpu", topology_name=name, num_slices=slices, wrap=tpu_wrap(shape))
    return Target(hw, list(desc.devices), "tpu", name, slices)


def _name(chip: str, shape) -> str:
    return f"{chip}:{'x'.join(str(s) for s in shape)}"


def _shape(text: str, dims: int, hint: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != dims or min(shape) < 1:
        raise ConfigError(f"--topology {text!r} is not a shape: {hint}")
    return shape


SPLIT_STATE = "split the state over more devices (strategy=fsdp, a larger mesh.fsdp) or ask `meshpar plan`"


class DoesNotFit(MeshparError):
    """libtpu's refusal of a program that needs more HBM than a chip has (it checks at compile time;
    XLA:GPU compiles the program and its peak says so): `needed` bytes per chip (the program's
    arguments, `held`, plus the temporaries libtpu asked for), `hbm` the chip's, and one line that says
    so, ending with `advice`."""

    def __init__(
        self,
        target: Target,
        needed: float,
        hbm: float,
        temp: float | None,
        arguments: float,
        config="",
        what: str = "the step",
        held: str = "state and batch",
        advice: str = SPLIT_STATE,
    ):
        self.needed, self.hbm, self.temp, self.arguments = needed, hbm, temp, arguments
        self.what, self.held, self.advice = what, held, advice
        gib = 2**30
        parts = f"{temp / gib:.2f} GiB of temporaries beside {arguments / gib:.2f} GiB of {held}, " if temp else ""
        super().__init__(
            f"does not fit on {len(target.devices)} x {target.hardware.name}: {what} needs {parts}"
            f"{needed / gib:.2f} GiB per chip in all, and the chip has {hbm / gib:.2f} GiB (libtpu refused to "
            f"compile it); {advice}" + (f"; config: {config}" if config else "")
        )


# libtpu's out-of-memory refusals, in the two forms its versions print (units binary: 95.74G = v5p's HBM):
# "the total memory required for HLO temporaries (115.14G) exceeds available HBM (95.74G)", and
# "Ran out of memory in memory space hbm. Used 120.49G of 95.74G hbm."
_TEMPS = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_USED = re.compile(r"memory space hbm\. Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_exhausted(message: str) -> dict | None:
    """{"temp" or "used", "hbm"} bytes from a libtpu out-of-memory message; None for any other error."""
    for pattern, key in ((_TEMPS, "temp"), (_USED, "used")):
        m = pattern.search(message)
        if m:
            a, ua, b, ub = m.groups()
            return {key: float(a) * _UNIT[ua], "hbm": float(b) * _UNIT[ub]}
    return None


def too_large(target: Target, error: Exception, arguments, **words) -> DoesNotFit | None:
    """`error` as `DoesNotFit` where it is libtpu's out-of-memory refusal, else None. `arguments()`: the
    program's argument bytes per chip; `words`: `DoesNotFit`'s what, held and advice."""
    oom = hbm_exhausted(str(error)) if target.platform == "tpu" else None
    if oom is None:
        return None
    args = arguments()
    return DoesNotFit(target, oom.get("used") or args + oom["temp"], oom["hbm"], oom.get("temp"), args, **words)


def _config_words(config) -> str:
    """The config that caused a refusal: the overrides, or a config object's strategy and mesh."""
    if isinstance(config, (list, tuple)):
        return " ".join(config) or "the defaults"
    return f"strategy={config.strategy} mesh={config.mesh}"


@contextlib.contextmanager
def compile_errors(target: Target | None, config):
    """A target compiler's refusal as one line: its first line of error, and the config that caused it
    (`config`: the overrides, or a config object whose mesh and strategy are named); a step too large
    for the chip as `DoesNotFit`, with the numbers."""
    if target is None:
        yield
        return
    try:
        yield
    except DoesNotFit as e:
        raise DoesNotFit(
            target, e.needed, e.hbm, e.temp, e.arguments, _config_words(config), e.what, e.held, e.advice
        ) from None
    except MeshparError:
        raise
    except Exception as e:  # noqa: BLE001 - XLA's errors (JaxRuntimeError, NotImplementedError...) are the point
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise MeshparError(
            f"the {target.hardware.name} compiler refused this step ({type(e).__name__}: {first}); "
            f"config: {_config_words(config)}"
        ) from None


def argument_bytes(trainer) -> int:
    """Bytes per device of the step's arguments: the train state and the batch, as sharded."""
    import jax

    from meshpar.core.sharding import bytes_per_device  # local: JAX and Flax load only for a compile

    leaves = jax.tree.leaves((trainer.abstract_state(), trainer.abstract_batch()))
    return sum(bytes_per_device(x.shape, x.dtype, x.sharding) for x in leaves)


# XLA:GPU without a device cannot autotune, and for some small dots its Triton GEMM emitter finds no
# tiling ("Couldn't find output tile sizes that satisfy", jaxlib 0.10.2: a user's ViT in pipeline
# stages); cuBLAS serves those dots instead
_NO_TILING = "Couldn't find output tile sizes"
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def launch_options(target: Target) -> dict:
    """The XLA flags a job launched on `target`'s hardware runs with (`meshpar.runtime.xla_flags`), as
    compiler options, so that the deviceless compile is that job's program."""
    return xla_flags.compiler_options(target.platform, os.environ.get("XLA_FLAGS", ""))


def compile_trainer(target: Target, trainer, options: dict | None = None) -> tuple[object, list[str]]:
    """(the trainer's step compiled for `target`, with its launch flags and XLA compiler `options`,
    notes): on GPU targets a step whose dots XLA:GPU's Triton GEMM cannot tile without a device is
    compiled again with cuBLAS GEMMs, and says so; on TPU targets a step libtpu finds too large for the
    chip raises `DoesNotFit`."""
    options = {**launch_options(target), **(options or {})}
    try:
        return trainer.compile(options), []
    except Exception as e:  # noqa: BLE001 - only this one XLA:GPU refusal is retried
        refused = too_large(target, e, lambda: argument_bytes(trainer))
        if refused:
            raise refused from None
        if target.platform != "gpu" or _NO_TILING not in str(e):
            raise
    return trainer.compile({**(options or {}), **NO_TRITON_GEMM}), [
        "note: XLA:GPU found no Triton tiling for some dots without a device to autotune on; compiled with "
        "xla_gpu_enable_triton_gemm=false (cuBLAS GEMMs), as a run on the GPU may autotune differently"
    ]
