"""The `meshpar` command: train, config, inspect, launch, plot, generate, serve, plan, export.

    meshpar train [--config FILE] [--devices N] [--metrics-out FILE] [KEY=VALUE ...]
    meshpar config [--config FILE] [KEY=VALUE ...]    # the resolved config, every key with its meaning
    meshpar inspect [--config FILE] [--devices N] [--json] [--target HW [--topology T] [--slices S]] [KEY=VALUE ...]
    meshpar launch N [train arguments...]        # N loopback processes (meshpar/runtime/launch.py)
    meshpar launch --print-slurm [--nodes N --gpus-per-node G ...] [train arguments...]   # meshpar/runtime/slurm.py
    meshpar plot RUN.jsonl [RUN2.jsonl ...] [-o out.png] [--size 1200x800]   # meshpar/train/plot.py
    meshpar generate [--config FILE] [--devices N] [--prompt TEXT [--chat] | --prompt-ids 1,2,3] [--json] [KEY=VALUE ...]
    meshpar serve [--host 127.0.0.1] [--port 8000] [--model-name NAME] [--api-key KEY] [--config FILE] [KEY=VALUE ...]
    meshpar plan [--config FILE] --devices N --hardware h100 [--top K] [--strategies a,b] [--all] [--json]
                 [--bytes-per-param W,G,O] [--out plan.yaml] [--verify K [--target HW]] [KEY=VALUE ...]
    meshpar compilers [--install [gpu|tpu|all]]     (the GPU/TPU compilers --target uses)
    meshpar export --format hf --out DIR [--dtype bf16|fp32] [--max-shard-size 5GB] [--config FILE] [KEY=VALUE ...]

KEY=VALUE are dotted config overrides: steps=20 strategy=fsdp mesh.tensor=2 mesh.data=-1
precision=fp32 model.layers=2 batch.global_size=16 train.log_every=1. Flags and overrides may come
in any order (`meshpar train steps=1 --devices 1 mesh.data=1`).

`plan` ranks meshes x presets x remat x microbatches by predicted step time (meshpar/plan/costmodel.py),
writes the winner as a config for `train --config`, and with --verify K compiles the top K on N
fake devices to print predicted vs compiled memory and collective bytes. `inspect` prints the
planner's memory estimate too; `train` warns when that estimate exceeds the device's memory.

`train` with checkpoint.dir=D resumes from D's newest usable checkpoint. Multi-process runs add
`--coordinator HOST:PORT --num-processes N --process-id I` (or MESHPAR_* variables, or srun/mpirun/
TPU-pod detection; see meshpar/runtime/distributed.py and launch/). Exit status: 0 done, 2 a user error
(one line), 3 a lost peer, 128 + signal after a SIGTERM/SIGINT that saved and stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from meshpar.core.errors import MeshparError


def _parser() -> argparse.ArgumentParser:
    """The top-level parser (for --help and the command name); each command is parsed by its own
    parser with `parse_intermixed_args`, so flags and KEY=VALUE mix freely (argparse refuses
    intermixed parsing on a parser with subcommands, hence the two stages)."""
    from meshpar import __version__
    from meshpar.core.rules import PRESETS
    keys = "config keys: `meshpar config` prints every key with its value and meaning"
    p = argparse.ArgumentParser(prog="meshpar", description="Sharded training of Flax NNX models on a named device mesh.",
                                epilog=f"strategies: {', '.join(PRESETS)}; {keys}")
    p.add_argument("--version", action="version", version=f"meshpar {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", add_help=False, help="N training processes on this machine: meshpar launch N [train args]; --print-slurm: a SLURM batch script")
    sub.add_parser("compilers", add_help=False, help="the GPU/TPU compilers --target uses: where they are; --install "
                   "downloads them (about 1.1 GB)")
    sub.add_parser("plot", add_help=False, help="loss, eval loss, tokens/s and MFU of --metrics-out files: "
                   "meshpar plot RUN.jsonl [...] -o out.png")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    common.add_argument("--devices", type=int, help="devices to fake on a CPU-only host (default: config `devices`)")
    common.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. mesh.tensor=2 "
                        "(`meshpar config` lists every key)")
    sub.add_parser("config", parents=[common], help="print the resolved config as YAML, every key with its meaning "
                   "(`meshpar config [--config F] [KEY=VALUE ...] > my.yaml` writes a config to edit)")
    t = sub.add_parser("train", parents=[common], help="train a model (default: the tiny LM on 8 fake CPU devices)",
                       epilog=keys)
    t.add_argument("--metrics-out", help="write JSON Lines metrics (start/step/end records) to this file")
    mp = t.add_argument_group("multi-process (see meshpar/runtime/distributed.py; srun/mpirun/TPU pods are detected)")
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env MESHPAR_COORDINATOR)")
    mp.add_argument("--num-processes", type=int, metavar="N", help="processes in the job (env MESHPAR_NUM_PROCESSES)")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env MESHPAR_PROCESS_ID)")
    i = sub.add_parser("inspect", parents=[common],
                       help="compile one train step without running it: shardings, collectives, memory, FLOPs")
    i.add_argument("--json", action="store_true", help="print one JSON object (mesh, warnings, params, collectives, memory, flops)")
    i.add_argument("--serve", action="store_true", help="compile the serving decode step (serve.*: one token for every "
                   "slot, the KV cache in place) instead of the train step; no weights are made")
    _target_flags(i)
    g = sub.add_parser("generate", parents=[common],
                       help="continue prompts with a trained model (checkpoint.dir=D) on the serving layout (serve.*)")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (data.tokenizer's tokens, else bytes; repeatable)")
    g.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3", help="a prompt as token ids (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, wrapped by data.tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, help="tokens to generate per prompt (default: serve.max_new_tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of mass >= p (default 1: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object {"tokens", "text", "ttft_s", "decode_tokens_per_s"} instead of streaming')
    sv = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP server (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health) over the serving engine; SIGTERM drains it")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port, 1..65535 (default 8000; 0: any free one, printed)")
    sv.add_argument("--model-name", help="the model id clients name (default: the checkpoint's or init_from's folder)")
    sv.add_argument("--api-key", action="append", metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys; also "
                         "MESHPAR_API_KEY=K1,K2); /health stays open")
    pl = sub.add_parser("plan", parents=[common], help="choose mesh, strategy, microbatches and remat for N devices "
                        "of some hardware (cost model), write the winner as a config; --verify compiles the top K")
    pl.add_argument("--hardware", default="h100", help="h100, h200, a100-80g, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e or a YAML")
    pl.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    pl.add_argument("--strategies", help="comma-separated presets to consider (default: all)")
    pl.add_argument("--all", action="store_true", help="keep the plans that do not fit (and every variant)")
    pl.add_argument("--json", action="store_true", help="print one JSON object (model, hardware, candidates)")
    pl.add_argument("--bytes-per-param", metavar="W,G,O", help="weights, gradients, optimizer state bytes per "
                    "parameter (default: the precision policy's, 4,4,8; ZeRO's accounting: 2,2,12)")
    pl.add_argument("--out", default="plan.yaml", help="where to write the winner's config (default plan.yaml; '-': none)")
    pl.add_argument("--verify", type=int, default=0, metavar="K", help="compile the top K plans on N (fake) devices "
                    "and print predicted vs compiled memory and collective bytes")
    _target_flags(pl)
    ex = sub.add_parser("export", parents=[common], help="write checkpoint.dir's newest weights (or model.init_from's) "
                        "in another ecosystem's format: --format hf, a Hugging Face directory")
    ex.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + safetensors (+ index)")
    ex.add_argument("--out", required=True, help="the directory to write")
    ex.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="tensor dtype (default bf16)")
    ex.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; 500MB, 2GiB ...)")
    return p


def _target_flags(p) -> None:
    t = p.add_argument_group("deviceless target (compile for GPUs/TPUs this host does not have; "
                             "`meshpar compilers --install` once)")
    t.add_argument("--target", metavar="HW", help="compile for --devices N of this hardware with its own compiler: "
                   "h100, h200, a100-80g, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e or a YAML (see meshpar/plan/hardware.py)")
    t.add_argument("--topology", help="the target's shape: GPU SLICESxHOSTSxGPUS (1x8x8), TPU slice 4x4x4 "
                   "(default: nodes of 8 GPUs; the most cubic TPU slice)")
    t.add_argument("--slices", type=int, help="TPU slices joined over DCN (default: as many as --devices needs)")


SAVED_SETTINGS = ("model", "data", "precision", "rules", "batch.length")


def _with_saved_settings(cfg, args):
    """`generate` / `export`: the settings checkpoint.dir's newest checkpoint was trained with
    (`SAVED_SETTINGS`, kept in its meta), under the --config file and KEY=VALUE overrides given now."""
    from meshpar.io.checkpoint import saved_config
    from meshpar.core.config import load_config
    found = saved_config(cfg.checkpoint.dir)
    if found is None:
        return cfg
    under = {}
    for key in SAVED_SETTINGS:
        section, _, name = key.partition(".")
        if section in found[1]:
            under[section] = {name: found[1][section][name]} if name else found[1][section]
    return load_config(args.config, args.overrides, under=under)


def _export(cfg, args) -> None:
    """`meshpar export`: checkpoint.dir's newest parameters (else model.init_from's), one array at a
    time, as a Hugging Face directory (meshpar/io/hf.py)."""
    from flax import nnx

    from meshpar.io import hf
    from meshpar.core.sharding import building
    from meshpar.train.step import trainer_for
    trainer = trainer_for(cfg)
    with building(trainer.policy):
        abstract = nnx.eval_shape(lambda: trainer.factory(nnx.Rngs(0)))
    hf.hf_sources(abstract, export=True)        # what the model lacks, before any weights are read
    source, params = None, None
    if cfg.checkpoint.dir:
        import jax
        from meshpar.io.checkpoint import restore_weights
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              {"params": trainer.spec.shapes}, {"params": trainer.param_shardings})
        found = restore_weights(cfg.checkpoint.dir, target, lambda m: print(m, file=sys.stderr))
        if found is not None:
            params, source = found[0]["params"], f"checkpoint step {found[1]} in {cfg.checkpoint.dir}"
    if params is None and cfg.model.init_from:
        params, source = trainer.load_pretrained(), cfg.model.init_from
    if params is None:
        where = f"checkpoint.dir '{cfg.checkpoint.dir}' holds no checkpoint" if cfg.checkpoint.dir else "no checkpoint.dir"
        raise MeshparError(f"nothing to export: {where} and model.init_from is not set")
    extra, generation = hf.provenance(cfg.model.init_from, cfg.data.tokenizer)
    out = hf.export(params, abstract, args.out, args.dtype, args.max_shard_size, extra, generation)
    print(f"exported {source} to {args.out}: {out['tensors']} tensors, {out['bytes'] / 2**20:.1f} MiB in "
          f"{len(out['files'])} file(s) ({args.dtype})", file=sys.stderr)


def _plan(cfg, args, target=None) -> None:
    """`meshpar plan`: cost model search (meshpar/plan/search.py), table or JSON, --verify, then the YAML of
    the best plan: with --verify the best one that fits once compiled (with --target: by the target's own
    compiler, on its devices; the plan is then made for the target's hardware)."""
    from meshpar.plan.hardware import load_hardware
    from meshpar.plan.search import parse_bytes_per_param, plan, render, winner_yaml
    hw = target.hardware if target else load_hardware(args.hardware)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies else None
    result = plan(cfg, cfg.devices, hw, strategies, parse_bytes_per_param(args.bytes_per_param, cfg) if
                  args.bytes_per_param else None, keep_all=args.all, top=max(args.top, args.verify))
    best, why = next((c for c in result["candidates"] if c["fits"]), None), ""
    if args.verify:
        from meshpar.plan.dryrun import verify
        result["verify"] = verify(result, args.config, args.overrides, args.verify, target)
        ok = [r["rank"] for r in result["verify"] if r["fits_compiled"]]
        best = result["candidates"][ok[0] - 1] if ok else None
        lost = "" if not ok or ok[0] == 1 else "; #1 does not" if ok[0] == 2 else f"; #1..#{ok[0] - 1} do not"
        why = f" (#{ok[0]}, the best that fits once compiled{lost})" if ok else ""
    if args.json:
        json.dump(result, sys.stdout, default=str)
        sys.stdout.write("\n")
    else:
        from meshpar.train.metrics import make_console
        console = make_console()
        render(result, console, args.top)
        if args.verify:
            from meshpar.plan.dryrun import render as render_verify
            render_verify(result["verify"], console)
    if best is None and args.verify:
        print(f"none of the top {args.verify} plans fits once compiled: nothing written (try a larger --verify)",
              file=sys.stderr)
    elif best is not None and args.out != "-":
        with open(args.out, "w") as f:
            f.write(winner_yaml(result, args.config, args.overrides, best))
        print(f"wrote the best plan{why} to {args.out} (meshpar train --config {args.out})", file=sys.stderr)


def _plan_estimate(cfg, target=None) -> str:
    """`train`/`inspect`: the planner's per-device estimate for this config, warning when it exceeds
    the device's memory (known on GPU/TPU and for a --target; fake CPU devices have no limit)."""
    import jax
    from meshpar.plan.search import estimate
    ev = estimate(cfg, target.hardware if target else None)
    if ev is None:                       # a tensor that does not divide its axes: the run itself will say so
        return "planner estimate: none (a tensor does not divide its mesh axes)"
    m = ev["memory"]
    line = (f"planner estimate per device: {m['total'] / 2**30:.3f} GiB (params {m['params'] / 2**30:.3f}, grads "
            f"{m['grads'] / 2**30:.3f}, optimizer {m['optimizer'] / 2**30:.3f}, activations {m['activations'] / 2**30:.3f}, "
            f"workspace {m['workspace'] / 2**30:.3f})")
    stats = getattr(jax.local_devices()[0], "memory_stats", lambda: None)() or {}
    limit = target.hardware.memory_bytes if target else stats.get("bytes_limit")
    if limit and m["total"] > limit:
        line += f"\nwarning: the estimate exceeds this device's {limit / 2**30:.1f} GiB; see `meshpar plan`"
    return line


def _generate(cfg, args) -> None:
    """`meshpar generate`: prompts -> Engine.run, streamed (one prompt) or as JSON."""
    from meshpar.serve.sampling import Sampling
    from meshpar.serve.batching import Request
    from meshpar.serve.engine import Engine
    from meshpar.io.tokenizer import ByteTokenizer, HFTokenizer
    texts = bool(args.prompt) or cfg.data.kind == "text" or bool(cfg.data.tokenizer)
    hf_tok = HFTokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if args.chat and not hf_tok:
        raise MeshparError("--chat needs data.tokenizer=DIR (a tokenizer whose tokenizer_config.json has a chat_template)")
    if args.chat:
        prompts = [hf_tok.chat([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = [hf_tok.prompt(p) if hf_tok else ByteTokenizer.encode(p) for p in args.prompt]   # default: bytes
    for ids in args.prompt_ids:
        try:
            prompts.append([int(x) for x in ids.replace(" ", "").split(",") if x])
        except ValueError:
            raise MeshparError(f"--prompt-ids '{ids}' is not a comma-separated list of integers") from None
    if not prompts:
        raise MeshparError("no prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    n = args.max_new_tokens if args.max_new_tokens is not None else cfg.serve.max_new_tokens
    from meshpar.io.hf import end_tokens
    eos = end_tokens(hf_tok, cfg.model.init_from)      # every end id the tokenizer and config.json name
    reqs = [Request(p, n, Sampling(args.temperature, args.top_k, args.top_p, args.seed + i), eos=eos)
            for i, p in enumerate(prompts)]
    vocab = Engine.precheck(cfg, reqs)           # before loading anything: what needs no weights
    _check_tokenizer(hf_tok, vocab)
    engine = Engine(cfg, info=lambda m: print(m, file=sys.stderr))
    for note in engine.notes:
        print(note, file=sys.stderr)
    _check_tokenizer(hf_tok, engine.vocab)
    tok = (hf_tok or ByteTokenizer(engine.vocab)) if texts else None
    for r in reqs:
        engine.check(r)
    saved = " with the settings it was trained with" if engine.source.startswith("checkpoint") else ""
    print(f"serving {engine.source}{saved} on {engine.mesh.devices.size} devices ({cfg.serve.strategy}, "
          f"{engine.slots} slots, cache {engine.length})", file=sys.stderr)
    engine.warmup(reqs)
    show = (lambda ids: tok.decode(ids)) if tok else (lambda ids: "".join(f"{t} " for t in ids))
    def stream(i, t):
        sys.stdout.write(show([t]))
        sys.stdout.flush()

    one = not args.json and len(reqs) == 1      # one prompt: stream its tokens as they come
    if one:
        sys.stdout.write(show(reqs[0].tokens))
    out = engine.run(reqs, on_token=stream if one else None)
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
        print("" if one else show(r.tokens) + show(c.tokens))
    for i, c in enumerate(out):
        if c.finish == "cache_full":
            print(f"note: prompt {i + 1} stopped after {len(c.tokens)} tokens: the KV cache holds "
                  f"{engine.length} positions (serve.cache_length); raise it for longer output", file=sys.stderr)
    print(f"first token {out[0].ttft_s:.3f} s, decode {rate:.1f} tokens/s", file=sys.stderr)


def _check_tokenizer(hf_tok, vocab: int | None) -> None:
    if hf_tok and vocab and hf_tok.vocab_size > vocab:
        raise MeshparError(f"data.tokenizer has {hf_tok.vocab_size} tokens, more than the model's vocabulary {vocab}")


def _serve(cfg, args) -> None:
    """`meshpar serve`: the OpenAI-compatible API until SIGTERM or Ctrl-C (meshpar/serve/api.py)."""
    from meshpar.serve.api import serve_http
    serve_http(cfg, args.host, getattr(args, "socket", None), args.model_name, args.api_key)


def _check_outputs(args) -> None:
    """The files and folders this command will write can be written (one line naming the flag if not)."""
    from meshpar.core.paths import check_output_dir, check_output_file
    if getattr(args, "metrics_out", None):
        check_output_file("--metrics-out", args.metrics_out)
    if args.command == "plan" and args.out != "-":
        check_output_file("--out", args.out)
    if args.command == "export":
        check_output_dir("--out", args.out)


def _setup_devices(cfg, devices_flag: int | None, processes: int = 1, planning: bool = False) -> list[str]:
    """Fake host devices before JAX initialises (only CPU-only hosts are affected). `devices` counts
    all processes together; each of `processes` fakes its share. One device (not for `plan`, which
    searches meshes of `devices` itself) collapses the configured mesh. -> the warnings to show."""
    from meshpar.core.mesh import fake_cpu_devices
    n = devices_flag if devices_flag is not None else cfg.devices
    if n < 1:
        raise MeshparError(f"--devices must be >= 1, got {n}")
    if n % processes:
        raise MeshparError(f"--devices {n} (all processes) is not divisible by the {processes} processes")
    cfg.devices = n
    notes = [_one_device(cfg)] if n == 1 and not planning else []
    if os.environ.get("JAX_PLATFORMS", "cpu") in ("cpu", "") or not _has_accelerator():
        fake_cpu_devices(n // processes)
    return [line for line in notes if line]


def _one_device(cfg) -> str | None:
    """On one device every mesh axis is 1, whatever the config asked for (said in one line)."""
    from meshpar.core.mesh import MESH_AXES
    asked = [f"{a}={getattr(cfg.mesh, a)}" for a in MESH_AXES if getattr(cfg.mesh, a) != 1]
    asked += [f"dcn.{a}={v}" for a, v in cfg.mesh.dcn.items() if v != 1]
    for a in MESH_AXES:
        setattr(cfg.mesh, a, 1)
    cfg.mesh.dcn = {}
    if asked:
        return (f"warning: one device: the mesh ({' '.join(asked)}) collapses to a single device; "
                f"{cfg.strategy} runs unsharded")
    return None


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
        from meshpar.runtime.launch import main as launch_main
        return launch_main(argv[1:])
    if argv[:1] == ["compilers"]:                # no devices, no config: the target compilers' folder
        from meshpar.runtime.compilers import main as compilers_main
        return compilers_main(argv[1:])
    if argv[:1] == ["plot"]:                     # no devices, no config: files in, a PNG out
        from meshpar.train.plot import main as plot_main
        return plot_main(argv[1:])
    args = _parse(argv)
    from meshpar.runtime.distributed import interrupts_exit
    with interrupts_exit():
        return _run(args)


def _run(args) -> int:
    """One parsed command; user errors become one line and exit status 2."""
    try:
        from meshpar.core.config import load_config
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":             # no devices: the configuration only
            from meshpar.core.annotate import annotated_yaml
            cfg.devices = args.devices if args.devices is not None else cfg.devices
            sys.stdout.write(annotated_yaml(cfg))
            return 0
        from meshpar.runtime import distributed
        multi = distributed.resolve(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                    getattr(args, "process_id", None))
        if multi is None or not multi.process_id:   # process 0 writes the files: their folders, before any work
            _check_outputs(args)
        if args.command == "serve" and (multi is None or not multi.process_id):
            from meshpar.serve.api import listen     # before the processes meet: a port in use fails process 0 alone
            args.socket = listen(args.host, args.port)
        target = None
        if getattr(args, "target", None):
            from meshpar.plan.target import resolve
            cfg.devices = args.devices if args.devices is not None else cfg.devices
            target = resolve(args.target, cfg.devices, args.topology, args.slices)
        elif getattr(args, "topology", None) or getattr(args, "slices", None):
            raise MeshparError("--topology and --slices describe a --target; add --target HW (h100, tpu-v5p, ...)")
        notes = [] if target else _setup_devices(cfg, args.devices, (multi.num_processes or 1) if multi else 1,
                                                 args.command == "plan")
        if args.command != "inspect":            # inspect reports them among its warnings (--json: in its list)
            for line in notes:
                print(line, file=sys.stderr)
        if multi:
            distributed.initialize(multi)
        if args.command in ("generate", "serve", "export") and cfg.checkpoint.dir:
            # read after the devices are faked: Orbax initialises JAX (before: one device, and the run refused)
            devices, mesh = cfg.devices, cfg.mesh
            cfg = _with_saved_settings(cfg, args)
            cfg.devices, cfg.mesh = devices, mesh             # the mesh is not a saved setting
        import jax
        planning = args.command == "plan" and not args.verify      # a plan without --verify uses no devices
        if jax.device_count() < cfg.devices and jax.default_backend() == "cpu" and not planning and not target:
            raise MeshparError(f"asked for {cfg.devices} devices but JAX already initialised with {jax.device_count()}")
        if args.command == "train":
            from meshpar.train.loop import run
            estimate = _plan_estimate(cfg)
            if "warning:" in estimate:       # said only when the planner expects the step not to fit
                print(estimate, file=sys.stderr)
            run(cfg, metrics_out=args.metrics_out)
        elif args.command == "generate":
            _generate(cfg, args)
        elif args.command == "serve":
            _serve(cfg, args)
        elif args.command == "plan":
            _plan(cfg, args, target)
        elif args.command == "export":
            _export(cfg, args)
        else:
            from meshpar.plan.inspect import render_report, report
            from meshpar.plan import program
            from meshpar.plan.target import compile_errors
            with compile_errors(target, args.overrides):
                rep = (program.serve_report(cfg, target) if args.serve else
                       program.report(cfg, target) if target else report(cfg))
            rep["warnings"] = notes + rep["warnings"]
            if not args.serve:
                rep["plan_estimate"] = _plan_estimate(cfg, target)
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
                    print(rep["plan_estimate"])
                if target:
                    program.render_target(rep["target"], console)
    except MeshparError as e:
        from meshpar.runtime.distributed import Preempted
        if isinstance(e, Preempted):     # saved and stopped on SIGTERM/SIGINT: 128 + signal, like a shell
            print(f"meshpar: {e}", file=sys.stderr)
            return 128 + e.signum
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


if __name__ == "__main__":
    entry()
