"""The `meshpar` command line's parsers: one per command, flags and KEY=VALUE overrides intermixed."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    """The top-level parser (for --help and the command name); each command is parsed by its own
    parser with `parse_intermixed_args`, so flags and KEY=VALUE mix freely (argparse refuses
    intermixed parsing on a parser with subcommands, hence the two stages)."""
    from meshpar import __version__
    from meshpar.core.rules import PRESETS

    keys = "config keys: `meshpar config` prints every key with its value and meaning"
    p = argparse.ArgumentParser(
        prog="meshpar",
        description="Sharded training of Flax NNX models on a named device mesh.",
        epilog=f"strategies: {', '.join(PRESETS)}; {keys}",
    )
    p.add_argument("--version", action="version", version=f"meshpar {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "launch",
        add_help=False,
        help="N training processes on this machine: meshpar launch N [train args]; --print-slurm: a SLURM batch script",
    )
    sub.add_parser(
        "compilers",
        add_help=False,
        help="the GPU/TPU compilers --target uses: where they are; --install downloads them (about 1.1 GB)",
    )
    sub.add_parser(
        "plot",
        add_help=False,
        help="loss, eval loss, tokens/s and MFU of --metrics-out files: meshpar plot RUN.jsonl [...] -o out.png",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    common.add_argument("--devices", type=int, help="devices to fake on a CPU-only host (default: config `devices`)")
    common.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. mesh.tensor=2 (`meshpar config` lists every key)",
    )
    sub.add_parser(
        "config",
        parents=[common],
        help="print the resolved config as YAML, every key with its meaning "
        "(`meshpar config [--config F] [KEY=VALUE ...] > my.yaml` writes a config to edit)",
    )
    t = sub.add_parser(
        "train", parents=[common], help="train a model (default: the tiny LM on 8 fake CPU devices)", epilog=keys
    )
    t.add_argument("--metrics-out", help="write JSON Lines metrics (start/step/end records) to this file")
    mp = t.add_argument_group("multi-process (see meshpar/runtime/distributed.py; srun/mpirun/TPU pods are detected)")
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env MESHPAR_COORDINATOR)")
    mp.add_argument("--num-processes", type=int, metavar="N", help="processes in the job (env MESHPAR_NUM_PROCESSES)")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (env MESHPAR_PROCESS_ID)")
    i = sub.add_parser(
        "inspect",
        parents=[common],
        help="compile one train step without running it: shardings, collectives, memory, FLOPs",
    )
    i.add_argument(
        "--json", action="store_true", help="print one JSON object (mesh, warnings, params, collectives, memory, flops)"
    )
    i.add_argument(
        "--serve",
        action="store_true",
        help="compile the serving decode step (serve.*: one token for every "
        "slot, the KV cache in place) instead of the train step; no weights are made",
    )
    _target_flags(i)
    g = sub.add_parser(
        "generate",
        parents=[common],
        help="continue prompts with a trained model (checkpoint.dir=D) on the serving layout (serve.*)",
    )
    _generate_flags(g)
    sv = sub.add_parser(
        "serve",
        parents=[common],
        help="an OpenAI-compatible HTTP server (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) over the serving engine; SIGTERM drains it "
        "(exit 0; Ctrl-C: 130)",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port, 1..65535 (default 8000; 0: any free one, printed)")
    sv.add_argument("--model-name", help="the model id clients name (default: the checkpoint's or init_from's folder)")
    sv.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys; also "
        "MESHPAR_API_KEY=K1,K2); /health stays open",
    )
    pl = sub.add_parser(
        "plan",
        parents=[common],
        help="choose mesh, strategy, microbatches and remat for N devices "
        "of some hardware (cost model), write the winner as a config; --verify compiles the top K",
        epilog="KEY=VALUE overrides of mesh.* (the axis's size over all devices; -1: searched), mesh.dcn, "
        "strategy, model.remat, batch.microbatches and pipeline.* pin the search: only plans that agree are "
        "ranked. Without --verify nothing is compiled and no device is made.",
    )
    _plan_flags(pl)
    _target_flags(pl)
    ex = sub.add_parser(
        "export",
        parents=[common],
        help="write checkpoint.dir's newest weights (or model.init_from's) "
        "in another ecosystem's format: --format hf, a Hugging Face directory",
    )
    ex.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + safetensors (+ index)")
    ex.add_argument("--out", required=True, help="the directory to write")
    ex.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="tensor dtype (default bf16)")
    ex.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; 500MB, 2GiB ...)")
    return p


def _target_flags(p) -> None:
    t = p.add_argument_group(
        "deviceless target (compile for GPUs/TPUs this host does not have; `meshpar compilers --install` once)"
    )
    t.add_argument(
        "--target",
        metavar="HW",
        help="compile for --devices N of this hardware with its own compiler: "
        "h100, h200, a100-80g, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e or a YAML (see meshpar/plan/hardware.py)",
    )
    t.add_argument(
        "--topology",
        help="the target's shape: GPU SLICESxHOSTSxGPUS (1x8x8), TPU slice 4x4x4 "
        "(default: nodes of 8 GPUs; the most cubic TPU slice)",
    )
    t.add_argument("--slices", type=int, help="TPU slices joined over DCN (default: as many as --devices needs)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)  # prints usage / help / "invalid choice" and exits
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def _generate_flags(g) -> None:
    """`meshpar generate`'s own flags: the prompts, the budget, the sampling, the output."""
    g.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (data.tokenizer's tokens, else bytes; repeatable)",
    )
    g.add_argument(
        "--prompt-ids", action="append", default=[], metavar="1,2,3", help="a prompt as token ids (repeatable)"
    )
    g.add_argument(
        "--chat", action="store_true", help="each --prompt is a user message, wrapped by data.tokenizer's chat template"
    )
    g.add_argument("--max-new-tokens", type=int, help="tokens to generate per prompt (default: serve.max_new_tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    g.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the smallest set of mass >= p (default 1: off)"
    )
    g.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    g.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"tokens", "text", "ttft_s", "decode_tokens_per_s"} instead of streaming',
    )


def _plan_flags(pl) -> None:
    """`meshpar plan`'s own flags: the hardware, what to search and print, where the winner goes, --verify."""
    pl.add_argument(
        "--hardware", default="h100", help="h100, h200, a100-80g, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e or a YAML"
    )
    pl.add_argument("--top", type=int, default=10, help="plans to print, >= 1 (default 10)")
    pl.add_argument("--strategies", help="comma-separated presets to consider (default: all)")
    pl.add_argument("--all", action="store_true", help="keep the plans that do not fit (and every variant)")
    pl.add_argument("--json", action="store_true", help="print one JSON object (model, hardware, candidates)")
    pl.add_argument(
        "--bytes-per-param",
        metavar="W,G,O",
        help="weights, gradients, optimizer state bytes per "
        "parameter (default: the precision policy's, 4,4,8; ZeRO's accounting: 2,2,12)",
    )
    pl.add_argument(
        "--out", default="plan.yaml", help="where to write the winner's config (default plan.yaml; '-': none)"
    )
    pl.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="compile the top K plans on N (fake) devices and print predicted vs compiled memory and collective "
        "bytes (default 0: none, and no device is made)",
    )
