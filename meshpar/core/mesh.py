"""The device mesh: named axes, sizes resolved against the devices, GSPMD (Auto) axis types.

Axis order is outermost -> innermost: `pipeline, data, fsdp, context, expert, tensor`. Devices that are
neighbours in the physical topology land on the innermost axes, so `tensor` (an all-reduce per
layer) gets the fastest links, `context` (K/V gathered per layer) the next, and `pipeline`/`data`
(one transfer/all-reduce per step) the slowest.
Multi-slice/multi-node runs add DCN sizes per axis: the full axis size is ICI size x DCN size.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

from meshpar.core.errors import ConfigError, suggest

MESH_AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")


# XLA:CPU ends the whole process (SIGABRT, rendezvous.cc "Termination timeout ... Exiting to ensure a
# consistent program state") when the fake devices of one collective arrive more than its timeout
# apart (20 s of warnings, then 40 s): on a busy laptop or CI machine a correct program can be that
# slow. Fake devices wait this long instead; a real deadlock still ends, with XLA's message.
COLLECTIVE_WAIT_S = 600
_COLLECTIVE_WAIT_FLAG = "xla_cpu_collective_call_terminate_timeout_seconds"


@functools.cache  # each call scans jaxlib's XLA library (hundreds of MB); a process asks a few times
def xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA defines `flag` (XLA aborts on an unknown flag in XLA_FLAGS): its name
    as a C string of its own (NUL on both sides), as XLA's flag table holds it. A name that is only in
    DebugOptions' descriptor (a field kept, or reserved, after its flag was removed: jaxlib 0.11's
    `xla_cpu_use_fusion_emitters`) does not count."""
    import glob
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return False
    for lib in glob.glob(os.path.join(os.path.dirname(spec.origin), "**", "*.so"), recursive=True):
        if os.path.getsize(lib) > 50_000_000:  # the library that holds XLA
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(b"\0" + flag.encode() + b"\0") >= 0:
                    return True
    return False


def fake_cpu_flags(n: int, flags: str = "", wait_s: int = COLLECTIVE_WAIT_S) -> str:
    """XLA_FLAGS `flags` with `n` host devices, and their collectives' patience (`wait_s` seconds past
    XLA's 20 s warning) unless the flags set it or this XLA does not know it."""
    out = [f for f in flags.split() if "xla_force_host_platform_device_count" not in f]
    out.append(f"--xla_force_host_platform_device_count={n}")
    if not any(f.lstrip("-").startswith(_COLLECTIVE_WAIT_FLAG) for f in out) and xla_knows(_COLLECTIVE_WAIT_FLAG):
        out.append(f"--{_COLLECTIVE_WAIT_FLAG}={wait_s}")
    return " ".join(out)


# The most host devices one process fakes. XLA:CPU starts a thread per device, and the time to start and
# stop them grows faster than their number: on this 2-core machine a process that imports jax and lists
# its devices ran 3 s with 1 device, 7 s with 1024, 8-13 s with 2048, 40-82 s with 4096 and over 5 minutes
# with 8192 (never exiting: its threads spin at shutdown); bench/RESULTS.md, "Fake devices". Deviceless
# targets (`--target HW`) compile for more devices without making them.
MAX_FAKE_DEVICES = 2048


def fake_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices. Must run before JAX initialises its backends."""
    os.environ["XLA_FLAGS"] = fake_cpu_flags(n, os.environ.get("XLA_FLAGS", ""))
    try:  # jax may be imported already (but not initialised): the config option wins then
        import jax

        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # noqa: BLE001 - backends already initialised; the env flag above is all we can do
        pass


def resolve_axis_sizes(
    sizes: dict[str, int], n_devices: int, what: str = "mesh", slices: int = 1, dcn: str = ""
) -> dict[str, int]:
    """Fill a single -1 size so that the product equals `n_devices`; check everything else.
    `slices` > 1: the mesh fills one of that many DCN slices (`dcn`: their sizes, 'data=2'), each of
    `n_devices`; the messages name the slices, all the devices and the count that would fit."""
    for name in sizes:
        if name not in MESH_AXES:
            raise ConfigError(f"unknown mesh axis '{what}.{name}'" + suggest(name, MESH_AXES, f"{what}."))
    sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ConfigError(f"only one {what} axis may be -1 (fill), got {', '.join(what + '.' + a for a in fill)}")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ConfigError(f"{what}.{a} must be a positive size or -1 (fill), got {s}")
    known = math.prod(s for s in sizes.values() if s != -1)
    each = f" in each of the {slices} DCN slices (mesh.dcn {dcn}) of the {n_devices * slices}" if slices > 1 else ""
    per = f"{n_devices} devices{each}"
    if fill:
        if n_devices % known:
            raise ConfigError(
                f"cannot fill {what}.{fill[0]}=-1: the other axes multiply to {known}, which does not divide the {per}"
            )
        sizes[fill[0]] = n_devices // known
    elif known != n_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        raise ConfigError(
            f"{what} axes multiply to {known} ({shape}) but there are {per}; "
            f"set one axis to -1 to fill, or run with --devices {known * slices}"
        )
    return sizes


def split_sizes(mesh_cfg, n: int) -> tuple[dict[str, int], dict[str, int]]:
    """(ICI sizes, DCN sizes) of every axis of a `MeshConfig` over `n` devices: the DCN sizes
    (`mesh.dcn`, absent axes 1) cut the devices into slices, and the ICI sizes fill one slice; one
    line naming the real counts when they do not fit."""
    dcn = dict(getattr(mesh_cfg, "dcn", {}) or {})
    ici_req = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
    if not dcn:
        return resolve_axis_sizes(ici_req, n), dict.fromkeys(MESH_AXES, 1)
    dcn_sizes = resolve_axis_sizes(dcn, max(1, math.prod(v for v in dcn.values() if v > 0)), "mesh.dcn")
    n_slices = math.prod(dcn_sizes.values())
    shape = " ".join(f"{a}={v}" for a, v in dcn_sizes.items() if v != 1)
    if n % n_slices:
        raise ConfigError(
            f"mesh.dcn sizes multiply to {n_slices} ({shape}), which does not divide the {n} devices; "
            f"use DCN sizes whose product divides {n}, or run with a multiple of {n_slices} devices"
        )
    return resolve_axis_sizes(ici_req, n // n_slices, slices=n_slices, dcn=shape), dcn_sizes


def make_mesh(mesh_cfg, devices: Sequence | None = None):
    """Build a `jax.sharding.Mesh` from a `MeshConfig` (ICI sizes, optional DCN sizes).

    All axes are `AxisType.Auto`, so XLA's partitioner (GSPMD/Shardy) propagates shardings and inserts
    the collectives; only pipelining enters `shard_map` and goes manual over `pipeline` (and `data`).
    """
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    ici, dcn_sizes = split_sizes(mesh_cfg, n)
    if getattr(mesh_cfg, "dcn", None):
        ici_shape = [ici[a] for a in MESH_AXES]
        dcn_shape = [dcn_sizes[a] for a in MESH_AXES]
        try:
            arr = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
        except Exception:  # noqa: BLE001 - fake/CPU devices have no slice_index: plain row-major
            arr = np.asarray(devices).reshape([i * d for i, d in zip(ici_shape, dcn_shape)])
    else:
        shape = [ici[a] for a in MESH_AXES]
        try:
            arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except Exception:  # noqa: BLE001 - topologies mesh_utils cannot map: row-major order
            arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_shape(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def describe(mesh) -> str:
    """'data=2 fsdp=2 tensor=2' (axes of size 1 left out)."""
    return " ".join(f"{a}={s}" for a, s in mesh_shape(mesh).items() if s > 1) or "single device"
