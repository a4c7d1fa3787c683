"""The platform a program is built for: "cpu", "gpu" or "tpu".

Usually the backend JAX runs on. A deviceless compile for a target (`meshpar inspect --target h100`)
traces on a CPU host for GPU or TPU devices, so every choice that depends on the hardware (which
attention kernel, which grouped matmul, whether 16-bit gathers are safe) asks `platform()`, and the
code that lowers a program for a mesh wraps its tracing in `compiling_for(of_mesh(mesh))`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshpar.core import scopes

_TARGET = scopes.PLATFORM
_NAMES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def platform() -> str:
    """The platform being compiled for: the innermost `compiling_for`, else JAX's default backend."""
    target = _TARGET.get()
    if target is not None:
        return target
    import jax

    return _NAMES.get(jax.default_backend(), jax.default_backend())


def of_devices(devices) -> str:
    """ "cpu", "gpu" or "tpu" for a list (or array) of JAX devices (CUDA and ROCm devices are "gpu")."""
    import numpy as np

    first = np.asarray(devices, dtype=object).flat[0]
    return _NAMES.get(first.platform, first.platform)


def of_mesh(mesh) -> str:
    return of_devices(mesh.devices)


@contextlib.contextmanager
def compiling_for(name: str) -> Iterator[str]:
    """Make `name` ("cpu", "gpu", "tpu") what `platform()` answers while a program is traced."""
    token = _TARGET.set(_NAMES.get(name, name))
    try:
        yield name
    finally:
        _TARGET.reset(token)
