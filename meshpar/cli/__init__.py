"""The `meshpar` command: train, config, inspect, launch, plot, generate, serve, plan, export.

    meshpar train [--config FILE] [--devices N] [--metrics-out FILE] [KEY=VALUE ...]
    meshpar config [--config FILE] [KEY=VALUE ...]    # the resolved config, every key with its meaning
    meshpar inspect [--config FILE] [--devices N] [--json] [--target HW [--topology T] [--slices S]] [KEY=VALUE ...]
    meshpar launch N [train arguments...]        # N loopback processes (meshpar/runtime/launch.py)
    meshpar launch --print-slurm [--nodes N --gpus-per-node G ...] [train arguments...]   # meshpar/runtime/slurm.py
    meshpar plot RUN.jsonl [RUN2.jsonl ...] [-o out.png] [--size 1200x800]   # meshpar/train/plot.py
    meshpar generate [--config FILE] [--devices N] [--prompt TEXT [--chat] | --prompt-ids 1,2,3] [--json]
                     [KEY=VALUE ...]
    meshpar serve [--host 127.0.0.1] [--port 8000] [--model-name NAME] [--api-key KEY] [--config FILE] [KEY=VALUE ...]
    meshpar plan [--config FILE] --devices N --hardware h100 [--top K] [--strategies a,b] [--all] [--json]
                 [--bytes-per-param W,G,O] [--out plan.yaml] [--verify K [--target HW]] [KEY=VALUE ...]
    meshpar compilers [--install [gpu|tpu|all]]     (the GPU/TPU compilers --target uses)
    meshpar export --format hf --out DIR [--dtype bf16|fp32] [--max-shard-size 5GB] [--config FILE] [KEY=VALUE ...]

KEY=VALUE are dotted config overrides: steps=20 strategy=fsdp mesh.tensor=2 mesh.data=-1
precision=fp32 model.layers=2 batch.global_size=16 train.log_every=1. Flags and overrides may come
in any order (`meshpar train steps=1 --devices 1 mesh.data=1`).

`plan` ranks meshes x presets x remat x microbatches by predicted step time (meshpar/plan/costmodel.py),
those that agree with the layout keys given as KEY=VALUE (mesh.*, strategy, pipeline.*: pins),
writes the winner as a config for `train --config`, and with --verify K compiles the top K on N
fake devices to print predicted vs compiled memory and collective bytes (without it, no device is
made). `inspect` prints the planner's memory estimate too; `train` warns when that estimate exceeds the device's memory.

`train` with checkpoint.dir=D resumes from D's newest usable checkpoint. Multi-process runs add
`--coordinator HOST:PORT --num-processes N --process-id I` (or MESHPAR_* variables, or srun/mpirun/
TPU-pod detection; see meshpar/runtime/distributed.py and launch/). Exit status: 0 done, 2 a user error
(one line), 3 a lost peer, 128 + signal after a SIGTERM/SIGINT that saved and stopped.

Imports of meshpar modules sit in the functions that use them (the one place they do, by design):
`meshpar --help`, `launch`, `compilers` and `plot` start without JAX, and a run fakes its devices
(XLA_FLAGS) before JAX starts.
"""

import json
import os
import sys

from meshpar.cli.commands import (
    estimate_line,
    export,
    generate,
    plan_command,
    plan_estimate,
    serve,
    with_saved_settings,
)
from meshpar.cli.parser import parse
from meshpar.core.errors import MeshparError


def _check_outputs(args) -> None:
    """The files and folders this command will write can be written (one line naming the flag if not)."""
    from meshpar.core.paths import check_output_dir, check_output_file

    if getattr(args, "metrics_out", None):
        check_output_file("--metrics-out", args.metrics_out)
    if args.command == "plan" and args.out != "-":
        check_output_file("--out", args.out)
    if args.command == "export":
        check_output_dir("--out", args.out)


def _check_counts(args) -> None:
    """The counts `plan` takes: --top K plans to print (>= 1), --verify K to compile (>= 0, 0: none)."""
    if args.command == "plan":
        for flag, value, least in (("--top", args.top, 1), ("--verify", args.verify, 0)):
            if value < least:
                raise MeshparError(f"{flag} must be >= {least}, got {value}")


def _setup_devices(
    cfg, devices_flag: int | None, processes: int = 1, planning: bool = False, compiles: bool = True
) -> list[str]:
    """Fake host devices before JAX initialises (only CPU-only hosts are affected; where jax has a CUDA
    plugin, meshpar's GPU XLA flags are added too, `meshpar.runtime.xla_flags`). `devices` counts all processes
    together; each of `processes` fakes its share, at most `MAX_FAKE_DEVICES`. One device (not for
    `planning`: `plan`, which searches meshes of `devices` itself) collapses the configured mesh; a
    command that `compiles` nothing (`plan` without --verify) makes no device. -> the warnings to show."""
    from meshpar.core.mesh import MAX_FAKE_DEVICES, fake_cpu_devices

    n = devices_flag if devices_flag is not None else cfg.devices
    if n < 1:
        raise MeshparError(f"--devices must be >= 1, got {n}")
    if n % processes:
        raise MeshparError(f"--devices {n} (all processes) is not divisible by the {processes} processes")
    cfg.devices = n
    if not compiles:
        return []
    notes = [_one_device(cfg.mesh, cfg.strategy)] if n == 1 and not planning else []
    if os.environ.get("JAX_PLATFORMS", "cpu") in ("cpu", "") or not _has_accelerator():
        if n // processes > MAX_FAKE_DEVICES:
            each = f" ({n // processes} in each of {processes} processes)" if processes > 1 else ""
            raise MeshparError(
                f"--devices {n}{each}: a process fakes at most {MAX_FAKE_DEVICES} CPU devices (XLA starts a "
                "thread per device; 4096 take over a minute to start and stop, 8192 over 5 minutes); `meshpar "
                "plan` needs none without --verify, and --target HW compiles for more devices without making them"
            )
        fake_cpu_devices(n // processes)
    if _has_accelerator(CUDA_PLUGINS):  # the flags GPU programs run with (inert on CPU)
        from meshpar.runtime.xla_flags import with_gpu_flags

        os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))
    return [line for line in notes if line]


def _one_device(mesh, strategy: str) -> str | None:
    """On one device every mesh axis is 1, whatever the config asked for (said in one line)."""
    from meshpar.core.mesh import MESH_AXES

    asked = [f"{a}={getattr(mesh, a)}" for a in MESH_AXES if getattr(mesh, a) != 1]
    asked += [f"dcn.{a}={v}" for a, v in mesh.dcn.items() if v != 1]
    for a in MESH_AXES:
        setattr(mesh, a, 1)
    mesh.dcn = {}
    if asked:
        return (
            f"warning: one device: the mesh ({' '.join(asked)}) collapses to a single device; {strategy} runs unsharded"
        )
    return None


CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _has_accelerator(plugins=(*CUDA_PLUGINS, "libtpu")) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in plugins)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from meshpar.runtime.launch import main as launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["compilers"]:  # no devices, no config: the target compilers' folder
        from meshpar.runtime.compilers import main as compilers_main

        return compilers_main(argv[1:])
    if argv[:1] == ["plot"]:  # no devices, no config: files in, a PNG out
        from meshpar.train.plot import main as plot_main

        return plot_main(argv[1:])
    args = parse(argv)
    from meshpar.runtime.distributed import interrupts_exit

    with interrupts_exit():
        return _run(args)


def _run(args) -> int:
    """One parsed command; user errors become one line and exit status 2."""
    try:
        from meshpar.core.config import load_config

        _check_counts(args)
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":  # no devices: the configuration only
            from meshpar.core.annotate import annotated_yaml

            cfg.devices = args.devices if args.devices is not None else cfg.devices
            sys.stdout.write(annotated_yaml(cfg))
            return 0
        from meshpar.runtime import distributed

        multi = distributed.resolve(
            getattr(args, "coordinator", None), getattr(args, "num_processes", None), getattr(args, "process_id", None)
        )
        if multi is None or not multi.process_id:  # process 0 writes the files: their folders, before any work
            _check_outputs(args)
        if args.command == "serve" and (multi is None or not multi.process_id):
            from meshpar.serve.api import listen  # before the processes meet: a port in use fails process 0 alone

            args.socket = listen(args.host, args.port)
        target = None
        if getattr(args, "target", None):
            from meshpar.plan.target import resolve

            cfg.devices = args.devices if args.devices is not None else cfg.devices
            target = resolve(args.target, cfg.devices, args.topology, args.slices)
        elif getattr(args, "topology", None) or getattr(args, "slices", None):
            raise MeshparError("--topology and --slices describe a --target; add --target HW (h100, tpu-v5p, ...)")
        compiles = args.command != "plan" or bool(args.verify)  # a plan without --verify uses no devices
        processes = (multi.num_processes or 1) if multi else 1
        notes = [] if target else _setup_devices(cfg, args.devices, processes, args.command == "plan", compiles)
        if args.command != "inspect":  # inspect reports them among its warnings (--json: in its list)
            for line in notes:
                print(line, file=sys.stderr)
        if multi:
            distributed.initialize(multi)
        if args.command in ("generate", "serve", "export") and cfg.checkpoint.dir:
            # read after the devices are faked: Orbax initialises JAX (before: one device, and the run refused)
            devices, mesh = cfg.devices, cfg.mesh
            cfg = with_saved_settings(cfg, args)
            cfg.devices, cfg.mesh = devices, mesh  # the mesh is not a saved setting
        import jax

        if compiles and not target and jax.device_count() < cfg.devices and jax.default_backend() == "cpu":
            raise MeshparError(f"asked for {cfg.devices} devices but JAX already initialised with {jax.device_count()}")
        if args.command == "train":
            from meshpar.train.loop import run

            estimate = plan_estimate(cfg)
            if estimate["exceeds"]:  # said only when the planner expects the step not to fit
                print(estimate_line(estimate), file=sys.stderr)
            run(cfg, metrics_out=args.metrics_out)
        elif args.command == "generate":
            generate(cfg, args)
        elif args.command == "serve":
            serve(cfg, args)
        elif args.command == "plan":
            plan_command(cfg, args, target)
        elif args.command == "export":
            export(cfg, args)
        else:
            from meshpar.plan import program
            from meshpar.plan.inspect import render_report, report
            from meshpar.plan.target import compile_errors

            with compile_errors(target, args.overrides):
                rep = (
                    program.serve_report(cfg, target)
                    if args.serve
                    else program.report(cfg, target)
                    if target
                    else report(cfg)
                )
            rep["warnings"] = notes + rep["warnings"]
            if not args.serve:
                rep["plan_estimate"] = plan_estimate(cfg, target)
            if args.json:
                json.dump(rep, sys.stdout, default=str)
                sys.stdout.write("\n")
            else:
                from meshpar.train.metrics import make_console

                console = make_console()
                if args.serve:
                    program.render_serve(rep, console)
                else:
                    render_report(rep, console)
                    print(estimate_line(rep["plan_estimate"]))
                if target:
                    program.render_target(rep["target"], console)
    except MeshparError as e:
        from meshpar.runtime.distributed import Preempted

        if isinstance(e, Preempted):  # saved and stopped on SIGTERM/SIGINT: 128 + signal, like a shell
            print(f"meshpar: {e}", file=sys.stderr)
            return 128 + e.signum
        if getattr(e, "trace", None):  # an exception of the user's code: their frames, then the line
            sys.stderr.write(e.trace)
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshpar: interrupted", file=sys.stderr)
        return 130
    return 0


def entry() -> None:
    """The `meshpar` program (and `python -m meshpar.cli`): `main()`, then exit with its status.

    After Ctrl-C the exit skips interpreter finalization (`os._exit`, once the streams are flushed):
    a SIGINT that lands while XLA compiles leaves its compile threads running, and finalizing the
    interpreter under them crashes (SIGSEGV, exit 139). Nothing is left half-written by then: the
    loop closed its files and finished its checkpoint writes on the way out."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
