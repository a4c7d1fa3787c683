"""The GPU and TPU compilers, for deviceless compiles on a host without the hardware.

    meshpar compilers --install          # once: the CUDA plugin (+ ptxas, cuDNN) and libtpu, ~1.1 GB
    load("gpu"); load("tpu")             # then jax.experimental.topologies can describe those devices

They live in a folder of their own (`folder()`: $MESHPAR_COMPILERS, else a cache folder keyed by
the jax version and the Python tag), not in site-packages: installed beside jax, the CUDA plugin and
libtpu announce themselves on every start of every JAX program on a machine without the hardware
(their absl log lines on stderr), and JAX would try to start their backends. `load` adds the folder to
the import path only for a target compile, after JAX has started its own (CPU) backend, and then
registers the plugin by hand: JAX's plugin discovery ran already, so the CUDA plugin is initialised
here, the custom-call partitioners JAX registers per plugin (cuDNN attention's) are given to it, and
jax's record of the CUDA library versions (read by cuDNN attention) is pointed at the plugin's.

The versions follow the installed jax: the CUDA plugin and PJRT of jax's own version, libtpu as
jax's `tpu` extra pins it, ptxas (nvidia-cuda-nvcc) and cuDNN as the plugin's `with-cuda` extra
bounds them. cuBLAS, NCCL and the rest of the CUDA runtime are left out: compiling needs none of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from meshpar.core.errors import MeshparError

KINDS = ("gpu", "tpu")
_PROBE = {"gpu": "jax_plugins/xla_cuda12/__init__.py", "tpu": "libtpu/libtpu.so"}
_LOADED: dict[str, bool] = {}
_SET_BY_MESHPAR = "MESHPAR_SET_TPU_LIBRARY_PATH"  # the TPU_LIBRARY_PATH meshpar itself set, not the user


def folder() -> Path:
    """Where the compilers are (or go): $MESHPAR_COMPILERS, else ~/.cache/meshpar/compilers/jax-V-cpXY."""
    if os.environ.get("MESHPAR_COMPILERS"):
        return Path(os.environ["MESHPAR_COMPILERS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "meshpar" / "compilers" / f"jax-{_jax_version()}-cp{sys.version_info[0]}{sys.version_info[1]}"


def installed() -> dict[str, bool]:
    """Which target compilers `folder()` holds: {"gpu": bool, "tpu": bool}."""
    return {k: (folder() / probe).exists() for k, probe in _PROBE.items()}


def missing_line(kind: str) -> str:
    """One line for a target whose compiler is not installed, naming the command that installs it."""
    return (
        f"the {'CUDA (GPU)' if kind == 'gpu' else 'TPU'} compiler is not installed in {folder()}: run "
        f"`meshpar compilers --install {kind}` once (it downloads about "
        f"{'0.9' if kind == 'gpu' else '0.2'} GB from PyPI)"
    )


def _jax_version() -> str:
    return importlib.metadata.version("jax")


def requirements(kind: str) -> list[str]:
    """pip requirements of the `kind` compiler for the installed jax."""
    v = _jax_version()
    if kind == "tpu":
        pins = [
            r.split(";")[0].strip()
            for r in importlib.metadata.requires("jax") or []
            if r.startswith("libtpu") and 'extra == "tpu"' in r
        ]
        return pins or ["libtpu"]
    # the plugin's own `with-cuda` bounds for the two libraries a compile needs (names, then its pins)
    return [
        f"jax-cuda12-plugin=={v}",
        f"jax-cuda12-pjrt=={v}",
        "nvidia-cuda-nvcc-cu12>=12.6.85",
        "nvidia-cudnn-cu12>=9.8,<10",
    ]


def install(kinds=KINDS, quiet: bool = False) -> Path:
    """pip-install the compilers of `kinds` into `folder()` (no dependencies: exactly these wheels)."""
    dest = folder()
    dest.mkdir(parents=True, exist_ok=True)
    reqs = [r for k in kinds for r in requirements(k)]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(dest), *reqs]
    if quiet:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None)
    if done.returncode:
        raise MeshparError(
            f"installing the compilers ({' '.join(reqs)}) into {dest} failed (pip exit "
            f"{done.returncode}); see pip's message above"
        )
    return dest


def load(kind: str) -> None:
    """Make the `kind` ("gpu" or "tpu") compiler usable by `jax.experimental.topologies` in this
    process (idempotent). JAX's own backend is started first, so its plugin discovery never sees them."""
    if kind not in KINDS:
        raise MeshparError(f"unknown compiler '{kind}': choose gpu or tpu")
    if _LOADED.get(kind):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # (a libtpu installed beside jax names itself in TPU_LIBRARY_PATH)

    if not (installed()[kind] or kind == "tpu" and _own_libtpu()):
        raise MeshparError(missing_line(kind))
    from jax._src import xla_bridge as xb

    if not xb.backends_are_initialized() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")  # this host's own backend: the CPU
    jax.devices()  # JAX's backends first: discovery without the compilers
    path = str(folder())
    if path not in sys.path:
        sys.path.append(path)
    if kind == "tpu":
        _load_tpu(path)
    else:
        _load_gpu()
    _LOADED[kind] = True


def _load_tpu(path: str) -> None:
    # libtpu reads the host's TPU settings at start and complains about each one it lacks: a compile-only
    # client needs none, so say so; the library itself is named explicitly
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu lets one process at a time hold /tmp/libtpu_lockfile (its chips): a compile-only client
    # holds no chip, and two compiles (a test worker and a CLI run) must not refuse each other
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    lib = _own_libtpu() or os.path.join(path, "libtpu", "libtpu.so")
    os.environ["TPU_LIBRARY_PATH"] = os.environ[_SET_BY_MESHPAR] = lib


def _own_libtpu() -> str | None:
    """The user's TPU_LIBRARY_PATH (JAX's own convention for naming a libtpu), checked, or None. The
    compiler's version moves the program: libtpu 0.0.42.1 (jax 0.10.2's pin) and 0.0.52 (jax 0.11.2's)
    compile the same step with different temporaries and weight gathers, so a comparison names one."""
    own = os.environ.get("TPU_LIBRARY_PATH")
    if not own or own == os.environ.get(_SET_BY_MESHPAR):  # unset, or meshpar's own (a child inherits it)
        return None
    if not os.path.isfile(own):
        raise MeshparError(
            f"TPU_LIBRARY_PATH names {own}, which is not a file: point it at a libtpu.so, or unset "
            f"it to compile with meshpar's own libtpu (`meshpar compilers --install tpu`)"
        )
    return own


def version(kind: str) -> str:
    """The loaded `kind` compiler as `name version` ("libtpu 0.0.52", "jax-cuda12-plugin 0.10.2"), read from
    the wheel's metadata beside the library; "name (version unknown)" where there is none."""
    if kind == "tpu":
        lib = Path(os.environ.get("TPU_LIBRARY_PATH") or folder() / "libtpu" / "libtpu.so")
        name, where = "libtpu", lib.parent.parent
    else:
        name, where = "jax-cuda12-plugin", folder()
    found = sorted(where.glob(f"{name.replace('-', '_')}-*.dist-info"))
    return f"{name} {found[-1].name[len(name) + 1 : -len('.dist-info')]}" if found else f"{name} (version unknown)"


def _load_gpu() -> None:
    import jax._src.lib as jax_lib
    from jax._src import xla_bridge as xb

    importlib.invalidate_caches()
    plugin = importlib.import_module("jax_plugins.xla_cuda12")
    if "cuda" not in xb._backend_factories:
        # no driver or runtime to check versions against: a compile needs neither
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        plugin.initialize()  # registers the "cuda" PJRT plugin and its topology
    c_api = xb._backend_factories["cuda"].c_api
    for callback in list(getattr(xb, "_plugin_callbacks", [])):  # custom-call partitioners (cuDNN attention)
        callback(c_api=c_api)
    versions = importlib.import_module("jax_cuda12_plugin._versions")
    jax_lib.cuda_versions = versions
    for name, module in list(sys.modules.items()):  # modules that imported jax's (empty) record by name
        if name.startswith("jax.") and getattr(module, "cuda_versions", versions) is None:
            module.cuda_versions = versions


def main(argv: list[str]) -> int:
    """`meshpar compilers [--install [gpu|tpu|all]]`: where the target compilers are, and installing them."""
    import argparse

    p = argparse.ArgumentParser(
        prog="meshpar compilers",
        description="The GPU (CUDA) and TPU compilers that "
        "`inspect --target` and `plan --verify --target` compile with, on a host without "
        f"the hardware. Folder: $MESHPAR_COMPILERS, default {folder()}",
    )
    p.add_argument(
        "--install",
        nargs="?",
        const="all",
        choices=("gpu", "tpu", "all"),
        help="download and install them there (default all: about 1.1 GB from PyPI)",
    )
    args = p.parse_args(argv)
    if args.install:
        try:
            install(KINDS if args.install == "all" else (args.install,))
        except MeshparError as e:
            print(f"meshpar: error: {e}", file=sys.stderr)
            return 2
    for kind, ok in installed().items():
        print(f"{kind}: {'installed' if ok else 'not installed'} ({', '.join(requirements(kind))})")
    print(f"folder: {folder()}")
    return 0
