"""`meshpar train`, `meshpar inspect`, `meshpar launch` and `meshpar generate`.

    meshpar train [--config FILE] [--devices N] [--metrics-out FILE] [KEY=VALUE ...]
    meshpar inspect [--config FILE] [--devices N] [--json] [KEY=VALUE ...]
    meshpar launch N [train arguments...]        # N loopback processes (meshpar/launch.py)
    meshpar generate [--config FILE] [--devices N] [--prompt TEXT | --prompt-ids 1,2,3] [--json] [KEY=VALUE ...]

KEY=VALUE are dotted config overrides: steps=20 strategy=fsdp mesh.tensor=2 mesh.data=-1
precision=fp32 model.layers=2 batch.global_size=16 train.log_every=1. Flags and overrides may come
in any order (`meshpar train steps=1 --devices 1 mesh.data=1`).

`train` with checkpoint.dir=D resumes from D's newest usable checkpoint. Multi-process runs add
`--coordinator HOST:PORT --num-processes N --process-id I` (or MESHPAR_* variables, or srun/mpirun/
TPU-pod detection; see meshpar/distributed.py and launch/). Exit status: 0 done, 2 a user error
(one line), 3 a lost peer, 128 + signal after a SIGTERM/SIGINT that saved and stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from meshpar.errors import MeshparError


def _parser() -> argparse.ArgumentParser:
    """The top-level parser (for --help and the command name); each command is parsed by its own
    parser with `parse_intermixed_args`, so flags and KEY=VALUE mix freely (argparse refuses
    intermixed parsing on a parser with subcommands, hence the two stages)."""
    from meshpar.rules import PRESETS
    p = argparse.ArgumentParser(prog="meshpar", description="Sharded training of Flax NNX models on a named device mesh.",
                                epilog="strategies: " + ", ".join(PRESETS))
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", add_help=False, help="N training processes on this machine: meshpar launch N [train args]")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    common.add_argument("--devices", type=int, help="devices to fake on a CPU-only host (default: config `devices`)")
    common.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. mesh.tensor=2")
    t = sub.add_parser("train", parents=[common], help="train a model (default: the tiny LM on 8 fake CPU devices)")
    t.add_argument("--metrics-out", help="write JSON Lines metrics (start/step/end records) to this file")
    mp = t.add_argument_group("multi-process (see meshpar/distributed.py; srun/mpirun/TPU pods are detected)")
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env MESHPAR_COORDINATOR)")
    mp.add_argument("--num-processes", type=int, metavar="N", help="processes in the job (env MESHPAR_NUM_PROCESSES)")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env MESHPAR_PROCESS_ID)")
    i = sub.add_parser("inspect", parents=[common],
                       help="compile one train step without running it: shardings, collectives, memory, FLOPs")
    i.add_argument("--json", action="store_true", help="print one JSON object (mesh, params, collectives, memory, flops)")
    g = sub.add_parser("generate", parents=[common],
                       help="continue prompts with a trained model (checkpoint.dir=D) on the serving layout (serve.*)")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a text prompt (byte-level tokens; repeatable)")
    g.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3", help="a prompt as token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, help="tokens to generate per prompt (default: serve.max_new_tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of mass >= p (default 1: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"tokens", "text", "ttft_s", "decode_tokens_per_s"} instead of streaming')
    return p


def _generate(cfg, args) -> None:
    """`meshpar generate`: prompts -> Engine.run, streamed (one prompt) or as JSON."""
    from meshpar.sampling import Sampling
    from meshpar.serve import Engine, Request
    from meshpar.tokenizer import ByteTokenizer
    engine = Engine(cfg, info=lambda m: print(m, file=sys.stderr))
    for note in engine.notes:
        print(note, file=sys.stderr)
    tok = ByteTokenizer(engine.vocab) if args.prompt or cfg.data.kind == "text" else None
    prompts = [tok.encode(p) for p in args.prompt]
    for ids in args.prompt_ids:
        try:
            prompts.append([int(x) for x in ids.replace(" ", "").split(",") if x])
        except ValueError:
            raise MeshparError(f"--prompt-ids '{ids}' is not a comma-separated list of integers") from None
    if not prompts:
        raise MeshparError("no prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    n = args.max_new_tokens if args.max_new_tokens is not None else cfg.serve.max_new_tokens
    reqs = [Request(p, n, Sampling(args.temperature, args.top_k, args.top_p, args.seed + i)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.check(r)
    print(f"serving {engine.source} on {engine.mesh.devices.size} devices ({cfg.serve.strategy}, "
          f"{engine.slots} slots, cache {engine.length})", file=sys.stderr)
    engine.warmup(reqs)
    show = (lambda ids: tok.decode(ids)) if tok else (lambda ids: "".join(f"{t} " for t in ids))
    stream = None
    if not args.json and len(reqs) == 1:        # one prompt: stream its tokens as they come
        sys.stdout.write(show(reqs[0].tokens))

        def stream(i, t):
            sys.stdout.write(show([t]))
            sys.stdout.flush()
    out = engine.run(reqs, on_token=stream)
    rate = engine.decode_steps and sum(max(0, len(c.tokens) - 1) for c in out) / max(engine.decode_s, 1e-9)
    if args.json:
        rec = {"tokens": [c.tokens for c in out], "text": [tok.decode(c.tokens) for c in out] if tok else None,
               "ttft_s": round(out[0].ttft_s, 6), "ttft_s_each": [round(c.ttft_s, 6) for c in out],
               "decode_tokens_per_s": round(float(rate), 3),
               "finish": [c.finish for c in out]}
        json.dump(rec, sys.stdout)
        sys.stdout.write("\n")
        return
    for r, c in zip(reqs, out):                 # several prompts decode together: each printed whole
        print("" if stream else show(r.tokens) + show(c.tokens))
    print(f"first token {out[0].ttft_s:.3f} s, decode {rate:.1f} tokens/s", file=sys.stderr)


def _setup_devices(cfg, devices_flag: int | None, processes: int = 1) -> None:
    """Fake host devices before JAX initialises (only CPU-only hosts are affected). `devices` counts
    all processes together; each of `processes` fakes its share."""
    from meshpar.mesh import fake_cpu_devices
    n = devices_flag if devices_flag is not None else cfg.devices
    if n < 1:
        raise MeshparError(f"--devices must be >= 1, got {n}")
    if n % processes:
        raise MeshparError(f"--devices {n} (all processes) is not divisible by the {processes} processes")
    cfg.devices = n
    if os.environ.get("JAX_PLATFORMS", "cpu") in ("cpu", "") or not _has_accelerator():
        fake_cpu_devices(n // processes)


def _has_accelerator() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)            # prints usage / help / "invalid choice" and exits
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from meshpar.launch import main as launch_main
        return launch_main(argv[1:])
    args = _parse(argv)
    try:
        from meshpar.config import load_config
        cfg = load_config(args.config, args.overrides)
        from meshpar import distributed
        multi = distributed.resolve(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                    getattr(args, "process_id", None))
        _setup_devices(cfg, args.devices, (multi.num_processes or 1) if multi else 1)
        if multi:
            distributed.initialize(multi)
        import jax
        if jax.device_count() < cfg.devices and jax.default_backend() == "cpu":
            raise MeshparError(f"asked for {cfg.devices} devices but JAX already initialised with {jax.device_count()}")
        if args.command == "train":
            from meshpar.loop import run
            run(cfg, metrics_out=args.metrics_out)
        elif args.command == "generate":
            _generate(cfg, args)
        else:
            from meshpar.inspect import render_report, report
            rep = report(cfg)
            if args.json:
                json.dump(rep, sys.stdout, default=str)
                sys.stdout.write("\n")
            else:
                from rich.console import Console
                render_report(rep, Console())
    except MeshparError as e:
        from meshpar.distributed import Preempted
        if isinstance(e, Preempted):     # saved and stopped on SIGTERM/SIGINT: 128 + signal, like a shell
            print(f"meshpar: {e}", file=sys.stderr)
            return 128 + e.signum
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshpar: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
