"""The commands that are more than a call into a layer: `generate`, `serve`, `plan`, `export`, and the
settings a checkpoint carries (`generate`/`serve`/`export` read them back).

Imports of meshpar modules sit in the functions that use them (the one place they do, by design):
`meshpar --help`, `launch`, `compilers` and `plot` start without JAX, and a run fakes its devices
(XLA_FLAGS) before JAX starts.
"""

from __future__ import annotations

import json
import sys

from meshpar.core.errors import MeshparError

SAVED_SETTINGS = ("model", "data", "precision", "rules", "batch.length")


def with_saved_settings(cfg, args):
    """`generate` / `export`: the settings checkpoint.dir's newest checkpoint was trained with
    (`SAVED_SETTINGS`, kept in its meta), under the --config file and KEY=VALUE overrides given now."""
    from meshpar.core.config import load_config
    from meshpar.io.checkpoint import saved_config

    found = saved_config(cfg.checkpoint.dir)
    if found is None:
        return cfg
    under = {}
    for key in SAVED_SETTINGS:
        section, _, name = key.partition(".")
        if section in found[1]:
            under[section] = {name: found[1][section][name]} if name else found[1][section]
    return load_config(args.config, args.overrides, under=under)


def export(cfg, args) -> None:
    """`meshpar export`: checkpoint.dir's newest parameters (else model.init_from's), one array at a
    time, as a Hugging Face directory (meshpar/io/hf.py)."""
    from meshpar.io import hf
    from meshpar.train.step import trainer_for

    trainer = trainer_for(cfg)
    abstract = trainer.placed.abstract
    hf.hf_sources(abstract, export=True)  # what the model lacks, before any weights are read
    source, params = None, None
    if cfg.checkpoint.dir:
        import jax

        from meshpar.io.checkpoint import restore_weights

        target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            {"params": trainer.spec.shapes},
            {"params": trainer.param_shardings},
        )
        found = restore_weights(cfg.checkpoint.dir, target, lambda m: print(m, file=sys.stderr))
        if found is not None:
            params, source = found[0]["params"], f"checkpoint step {found[1]} in {cfg.checkpoint.dir}"
    if params is None and cfg.model.init_from:
        params, source = trainer.load_pretrained(), cfg.model.init_from
    if params is None:
        where = (
            f"checkpoint.dir '{cfg.checkpoint.dir}' holds no checkpoint" if cfg.checkpoint.dir else "no checkpoint.dir"
        )
        raise MeshparError(f"nothing to export: {where} and model.init_from is not set")
    extra, generation = hf.provenance(cfg.model.init_from, cfg.data.tokenizer)
    out = hf.export(params, abstract, args.out, args.dtype, args.max_shard_size, extra, generation)
    print(
        f"exported {source} to {args.out}: {out['tensors']} tensors, {out['bytes'] / 2**20:.1f} MiB in "
        f"{len(out['files'])} file(s) ({args.dtype})",
        file=sys.stderr,
    )


def plan_command(cfg, args, target=None) -> None:
    """`meshpar plan`: cost model search (meshpar/plan/search.py), table or JSON, --verify, then the YAML of
    the best plan: with --verify the best one that fits once compiled (with --target: by the target's own
    compiler, on its devices; the plan is then made for the target's hardware)."""
    from meshpar.core.config import Config, parse_override
    from meshpar.core.notices import given_keys
    from meshpar.plan.candidates import Pins
    from meshpar.plan.hardware import load_hardware
    from meshpar.plan.search import parse_bytes_per_param, plan, render, winner_yaml

    hw = target.hardware if target else load_hardware(args.hardware)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies else None
    given = given_keys({}, [parse_override(o) for o in args.overrides], Config())  # the keys set on the command line
    result = plan(
        cfg,
        cfg.devices,
        hw,
        strategies,
        parse_bytes_per_param(args.bytes_per_param, cfg.precision) if args.bytes_per_param else None,
        keep_all=args.all,
        top=max(args.top, args.verify),
        pins=Pins.of(given, cfg.mesh, cfg.pipeline, cfg.strategy, cfg.model.remat, cfg.batch.microbatches),
    )
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
        print(
            f"none of the top {args.verify} plans fits once compiled: nothing written (try a larger --verify)",
            file=sys.stderr,
        )
    elif best is not None and args.out != "-":
        with open(args.out, "w") as f:
            f.write(winner_yaml(result, args.config, args.overrides, best))
        print(f"wrote the best plan{why} to {args.out} (meshpar train --config {args.out})", file=sys.stderr)


def plan_estimate(cfg, target=None) -> dict:
    """`train`/`inspect`: the planner's per-device estimate for this config in bytes (`meshpar inspect
    --json`'s `plan_estimate`: total, params, grads, optimizer, activations, workspace), the device's
    memory where it is known (GPU/TPU, a --target; fake CPU devices have none) and whether the
    estimate exceeds it; `estimate_line` says it in words."""
    import jax

    from meshpar.plan.search import estimate

    ev = estimate(cfg, target.hardware if target else None)
    if ev is None:  # a tensor that does not divide its axes: the run itself will say so
        return {"bytes": None, "limit_bytes": None, "exceeds": False}
    parts = ("total", "params", "grads", "optimizer", "activations", "workspace")
    stats = getattr(jax.local_devices()[0], "memory_stats", lambda: None)() or {}
    limit = target.hardware.memory_bytes if target else stats.get("bytes_limit")
    total = int(ev["memory"]["total"])
    return {
        "bytes": {k: int(ev["memory"][k]) for k in parts},
        "limit_bytes": int(limit) if limit else None,
        "exceeds": bool(limit and total > limit),
    }


def estimate_line(est: dict) -> str:
    """`plan_estimate` as the line `inspect` prints (and `train` when it warns), in units that show
    its figures: GiB, MiB or KiB."""
    b = est["bytes"]
    if b is None:
        return "planner estimate: none (a tensor does not divide its mesh axes)"
    unit, size = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20)) if b["total"] >= s), ("KiB", 2**10))
    show = lambda k: f"{b[k] / size:.3f}"  # noqa: E731
    line = (
        f"planner estimate per device: {show('total')} {unit} (params {show('params')}, grads {show('grads')}, "
        f"optimizer {show('optimizer')}, activations {show('activations')}, workspace {show('workspace')})"
    )
    if est["exceeds"]:
        line += (
            f"\nwarning: the estimate exceeds this device's {est['limit_bytes'] / 2**30:.1f} GiB; see `meshpar plan`"
        )
    return line


def generate(cfg, args) -> None:
    """`meshpar generate`: prompts -> Engine.run, streamed (one prompt) or as JSON."""
    from meshpar.io.tokenizer import ByteTokenizer, HFTokenizer
    from meshpar.serve.engine import Engine
    from meshpar.serve.requests import Request
    from meshpar.serve.sampling import Sampling

    texts = bool(args.prompt) or cfg.data.kind == "text" or bool(cfg.data.tokenizer)
    hf_tok = HFTokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if args.chat and not hf_tok:
        raise MeshparError(
            "--chat needs data.tokenizer=DIR (a tokenizer whose tokenizer_config.json has a chat_template)"
        )
    if args.chat:
        prompts = [hf_tok.chat([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = [hf_tok.prompt(p) if hf_tok else ByteTokenizer.encode(p) for p in args.prompt]  # default: bytes
    for ids in args.prompt_ids:
        try:
            prompts.append([int(x) for x in ids.replace(" ", "").split(",") if x])
        except ValueError:
            raise MeshparError(f"--prompt-ids '{ids}' is not a comma-separated list of integers") from None
    if not prompts:
        raise MeshparError("no prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    n = args.max_new_tokens if args.max_new_tokens is not None else cfg.serve.max_new_tokens
    from meshpar.io.hf import end_tokens

    eos = end_tokens(hf_tok, cfg.model.init_from)  # every end id the tokenizer and config.json name
    reqs = [
        Request(p, n, Sampling(args.temperature, args.top_k, args.top_p, args.seed + i), eos=eos)
        for i, p in enumerate(prompts)
    ]
    vocab = Engine.precheck(cfg, reqs, byte_text=bool(args.prompt) and not hf_tok)  # before loading: no weights
    _check_tokenizer(hf_tok, vocab)
    engine = Engine(cfg, info=lambda m: print(m, file=sys.stderr))
    for note in engine.notes:
        print(note, file=sys.stderr)
    _check_tokenizer(hf_tok, engine.vocab)
    tok = (hf_tok or ByteTokenizer(engine.vocab)) if texts else None
    for r in reqs:
        engine.check(r)
    saved = " with the settings it was trained with" if engine.source.startswith("checkpoint") else ""
    print(
        f"serving {engine.source}{saved} on {engine.mesh.devices.size} devices ({cfg.serve.strategy}, "
        f"{engine.slots} slots, cache {engine.length})",
        file=sys.stderr,
    )
    engine.warmup(reqs)
    show = (lambda ids: tok.decode(ids)) if tok else (lambda ids: "".join(f"{t} " for t in ids))

    def stream(i, t):
        sys.stdout.write(show([t]))
        sys.stdout.flush()

    one = not args.json and len(reqs) == 1  # one prompt: stream its tokens as they come
    if one:
        sys.stdout.write(show(reqs[0].tokens))
    out = engine.run(reqs, on_token=stream if one else None)
    rate = engine.decode_steps and sum(max(0, len(c.tokens) - 1) for c in out) / max(engine.decode_s, 1e-9)
    if args.json:
        rec = {
            "tokens": [c.tokens for c in out],
            "text": [tok.decode(c.tokens) for c in out] if tok else None,
            "ttft_s": round(out[0].ttft_s, 6),
            "ttft_s_each": [round(c.ttft_s, 6) for c in out],
            "decode_tokens_per_s": round(float(rate), 3),
            "finish": [c.finish for c in out],
        }
        json.dump(rec, sys.stdout)
        sys.stdout.write("\n")
        return
    for r, c in zip(reqs, out):  # several prompts decode together: each printed whole
        print("" if one else show(r.tokens) + show(c.tokens))
    for i, c in enumerate(out):
        if c.finish == "cache_full":
            print(
                f"note: prompt {i + 1} stopped after {len(c.tokens)} tokens: the KV cache holds "
                f"{engine.length} positions (serve.cache_length); raise it for longer output",
                file=sys.stderr,
            )
    print(f"first token {out[0].ttft_s:.3f} s, decode {rate:.1f} tokens/s", file=sys.stderr)


def _check_tokenizer(hf_tok, vocab: int | None) -> None:
    if hf_tok and vocab and hf_tok.vocab_size > vocab:
        raise MeshparError(f"data.tokenizer has {hf_tok.vocab_size} tokens, more than the model's vocabulary {vocab}")


def serve(cfg, args) -> None:
    """`meshpar serve`: the OpenAI-compatible API until SIGTERM or Ctrl-C (meshpar/serve/api.py)."""
    from meshpar.serve.api import serve_http

    serve_http(cfg, args.host, getattr(args, "socket", None), args.model_name, args.api_key)
