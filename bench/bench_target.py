"""The training step compiled for a pod, read from the target's own program (issue 43).

    python bench/bench_target.py [--only NAME,...] [--vocab-tiles N] [--planner-first] [--out F.md] [--json F.json]

Per configuration (bf16, full remat), one deviceless compile by the target's compiler
(`meshpar.plan.program.report`, what `meshpar inspect --target` runs) and, per device:
  * peak HBM (the compiler's own peak, `meshpar.plan.inspect.memory`) against the device's memory;
  * FLOPs and bytes from XLA's `cost_analysis()` (a while loop's body counted once: for a scanned
    model these undercount by about the layer count, so the roofline uses meshpar's own count of the
    executed FLOPs, `meshpar.plan.steptime.executed_flops`, beside them);
  * collective bytes by kind and mesh axes (async start/done counted once, loop bodies times their
    trip counts);
  * exposed collective bytes: those with no compute scheduled between start and done, or
    synchronous (`meshpar.plan.program.overlap`; libtpu writes every collective synchronously unless its
    async collective fusion is on, LIBTPU_INIT_ARGS);
  * a roofline step: max(executed FLOPs / peak, cost_analysis bytes x layers / HBM bandwidth) plus
    the exposed bytes at the bandwidth of the slowest link their kind's axes cross
    (`meshpar/plan/hardware.py`), and its MFU (model FLOPs over that step at peak); beside it the
    planner's own step (`meshpar.plan.search.estimate`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from meshpar.runtime import xla_flags

LLAMA2_7B = ["model.size=7b"]
LLAMA3_8B = ["model.size=7b", "model.kv_heads=8", "model.mlp=14336", "model.vocab=128256", "model.rope_theta=500000"]
MIXTRAL = [
    "model.name=moe",
    "model.size=7b",
    "model.kv_heads=8",
    "model.mlp=14336",
    "model.vocab=32000",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.every=1",
    "moe.capacity_factor=null",
]


def mesh(**axes) -> list[str]:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "context": 1, "expert": 1, **axes}
    return [f"mesh.{a}={v}" for a, v in sizes.items()]


def maxtext_overrides(name: str, n: int, overrides: list[str], gpu: bool = False) -> list[str] | None:
    """The same step in MaxText's own config keys, or None where there is no counterpart.
    Both: bf16 compute over fp32 weights and AdamW state, full remat, the same global batch, the same
    vocabulary tiling (`--vocab-tiles`). TPU: splash attention (MaxText's `autoselected`, meshpar's
    `auto`); MaxText's v5p-N counts cores (two per chip), so 64 chips are `v5p-128`. GPU (`gpu`):
    cuDNN's fused attention (MaxText's `cudnn_flash_jax`, meshpar's `auto` on H100), MaxText's
    `a3` nodes of 8 as one slice (bench/maxtext/compile_maxtext.py), its experts by `ragged_dot`."""
    ov = dict(o.split("=", 1) for o in overrides)
    model = {"llama2-7b": "llama2-7b", "llama3-8b": "llama3-8b", "mixtral-8x7b": "mixtral-8x7b"}.get(name.split()[0])
    if model is None or "context" in name or "pipeline" in name or name.endswith(" fsdp_tp"):
        return None  # MaxText's fsdp x tensor splits the residual stream over tensor: the fsdp_tp_sp row
    per_device = int(ov["batch.global_size"]) / n
    where = (
        ["compile_topology=a3", f"compile_topology_num_slices={n // 8}", "num_slices=1", "hardware=gpu"]
        + ["attention=cudnn_flash_jax"]
        if gpu
        else [f"compile_topology=v5p-{2 * n}", "compile_topology_num_slices=1"]
    )
    out = [
        f"model_name={model}",
        *where,
        f"per_device_batch_size={per_device:g}",
        f"max_target_length={ov['batch.length']}",
        "remat_policy=full",
        f"ici_fsdp_parallelism={ov.get('mesh.fsdp', 1)}",
        f"ici_tensor_parallelism={ov.get('mesh.tensor', 1)}",
        f"ici_expert_parallelism={ov.get('mesh.expert', 1)}",
    ]
    if int(ov.get("train.loss_chunks", 1)) > 1:
        out.append(f"num_vocab_tiling={ov['train.loss_chunks']}")
    if model == "mixtral-8x7b":
        out += ["sparse_matmul=true", "capacity_factor=-1"] + (["megablox=false"] if gpu else [])
    return out


def gpu_flags() -> str:
    """The XLA:GPU flags both sides compile with: meshpar's launch flags (`meshpar.runtime.xla_flags`) and
    the `--xla_gpu_*` ones of this process's XLA_FLAGS (--gpu-flags added), which win flag by flag."""
    import os

    mine = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_gpu_"))
    return xla_flags.with_gpu_flags(mine)


def maxtext_row(name: str, n: int, python: str, overrides: list[str], hw) -> dict:
    """MaxText's compile of the same step, read by meshpar's own HLO readers."""
    import os
    import subprocess
    import tempfile

    from meshpar.plan import inspect, program

    base = os.path.join(tempfile.mkdtemp(), "maxtext")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext", "compile_maxtext.py")
    env = {
        k: v
        for k, v in os.environ.items()  # its own jax and libtpu, not the ones meshpar's process loaded
        if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_PLATFORMS", "TPU_LIBRARY_PATH")
    }
    if hw.kind == "gpu":  # meshpar's deviceless CUDA devices in MaxText's process, and the XLA:GPU flags
        env["MESHPAR_GPU_TARGET"] = f"{hw.name}:{n}"  # meshpar's compile got: --gpu-flags, then meshpar's own
        env["XLA_FLAGS"] = gpu_flags()
    start = time.perf_counter()
    proc = subprocess.run([python, script, base, *overrides], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return {"name": name, "target": hw.name, "framework": "maxtext", "error": tail[0][:160]}
    meta = json.load(open(base + ".json"))
    hlo = open(base + ".hlo").read()
    summary = inspect.summarize(inspect.collectives(hlo, meta["mesh"]))
    ov = program.overlap(hlo)
    return {
        "name": name,
        "target": hw.name,
        "framework": "maxtext",
        "devices": n,
        "peak_gib": meta["peak_bytes"] / 2**30,
        "hbm_gib": hw.memory_bytes / 2**30,
        "xla_flops": meta["cost"]["flops"],
        "xla_bytes": meta["cost"]["bytes_accessed"],
        "collectives": {k: {"bytes": v["bytes"], "axes": v.get("axes")} for k, v in summary.items()},
        "hidden_bytes": ov["hidden_bytes"],
        "exposed_bytes": ov["exposed_bytes"],
        "compile_s": round(time.perf_counter() - start, 1),
        "kernels": sorted(program.kernels(hlo)),
        "overrides": overrides,
    }


def maxtext_libtpu(python: str) -> str:
    """The libtpu.so of MaxText's venv: meshpar's rows are compiled by it too, so that a difference
    between the two programs is the frameworks', not two compiler versions'."""
    import subprocess

    out = subprocess.run(
        [python, "-c", "import libtpu; print(libtpu.get_library_path())"], capture_output=True, text=True, timeout=120
    )
    if out.returncode:
        sys.exit(
            f"bench_target: {python} has no libtpu ({out.stderr.strip().splitlines()[-1:]}); "
            "see bench/maxtext/README.md"
        )
    return out.stdout.strip()


def configs() -> list[tuple[str, str, int, list[str]]]:
    """(name, target, devices, overrides): the issue's table, one sequence per device unless said."""
    out = []
    for model, base in (("llama2-7b", LLAMA2_7B), ("llama3-8b", LLAMA3_8B)):
        for length in (4096, 8192):
            tokens = [f"batch.length={length}", "batch.global_size=64"]  # one sequence per device
            out += [
                (f"{model} {length} fsdp", "tpu-v5p", 64, base + tokens + ["strategy=fsdp"] + mesh(fsdp=64)),
                (
                    f"{model} {length} fsdp_tp_sp",
                    "tpu-v5p",
                    64,
                    base + tokens + ["strategy=fsdp_tp_sp"] + mesh(fsdp=16, tensor=4),
                ),
                (
                    f"{model} {length} fsdp_tp",
                    "tpu-v5p",
                    64,
                    base + tokens + ["strategy=fsdp_tp"] + mesh(fsdp=16, tensor=4),
                ),
                (f"{model} {length} fsdp", "h100", 64, base + tokens + ["strategy=fsdp"] + mesh(fsdp=64)),
                (
                    f"{model} {length} fsdp_tp_sp",
                    "h100",
                    64,
                    base + tokens + ["strategy=fsdp_tp_sp"] + mesh(fsdp=8, tensor=8),
                ),
                (
                    f"{model} {length} fsdp_tp",
                    "h100",
                    64,
                    base + tokens + ["strategy=fsdp_tp"] + mesh(fsdp=8, tensor=8),
                ),
                (
                    f"{model} {length} pipeline x fsdp_tp",
                    "h100",
                    64,
                    base
                    + tokens
                    + ["strategy=fsdp_tp", "pipeline.schedule=1f1b", "pipeline.microbatches=8"]
                    + mesh(pipeline=4, fsdp=4, tensor=4),
                ),
            ]
    out += [
        (
            "mixtral-8x7b dropless ep8",
            "h100",
            64,
            MIXTRAL + ["batch.length=4096", "batch.global_size=64", "strategy=fsdp"] + mesh(fsdp=8, expert=8),
        ),
        (
            "mixtral-8x7b dropless ep8",
            "tpu-v5p",
            128,
            MIXTRAL + ["batch.length=4096", "batch.global_size=128", "strategy=fsdp"] + mesh(fsdp=16, expert=8),
        ),
        (
            "llama3-8b 128k context",
            "h100",
            64,
            LLAMA3_8B
            + [
                "batch.length=131072",
                "batch.global_size=2",
                "strategy=fsdp",
                "model.attention=flash",
                "model.context_strategy=ring",
            ]
            + mesh(fsdp=2, context=32),
        ),
    ]
    return out


def _link(hw, axes: list, dcn: dict) -> float:
    """The slowest link a collective over `axes` crosses: DCN when any of them leaves the node/slice."""
    return hw.dcn_bw if any(dcn.get(a, 1) > 1 for a in axes) else hw.ici_bw


def planner_first(overrides: list[str], target) -> list[str]:
    """`meshpar plan`'s first plan that fits for this configuration on `target`, as overrides (what its
    winner YAML holds): the row that asks whether the planner ranks the best compiled layout first."""
    from meshpar.core.config import load_config
    from meshpar.plan.search import plan

    cfg = load_config(None, ["precision=bf16"] + overrides)
    best = next((c for c in plan(cfg, len(target.devices), target.hardware)["candidates"] if c["fits"]), None)
    if best is None:
        raise ValueError("no plan fits")
    return overrides + [o for o in best["overrides"] if not o.startswith("devices=")]


def row(name: str, target, overrides: list[str]) -> dict:
    from meshpar.core.config import load_config
    from meshpar.plan.program import report
    from meshpar.plan.search import estimate

    cfg = load_config(None, ["precision=bf16", "model.remat=full"] + overrides)
    cfg.devices = len(target.devices)
    start = time.perf_counter()
    try:
        rep = report(cfg, target)
    except Exception as e:  # noqa: BLE001 - a row that does not compile says why and the table goes on
        return {"name": name, "target": target.hardware.name, "error": str(e).splitlines()[0][:160]}
    hw, t = target.hardware, rep["target"]
    pred = estimate(cfg, hw)
    summary = rep["collectives"]["summary"]
    from meshpar.core.mesh import MESH_AXES
    from meshpar.plan.candidates import split_ici_dcn

    sizes = tuple(rep["mesh"].get(a, 1) for a in MESH_AXES)
    dcn = dict(zip(MESH_AXES, split_ici_dcn(sizes, cfg.devices, hw.domain) or (1,) * len(sizes)))
    exposed_s = sum(
        d["exposed_bytes"] / (_link(hw, summary.get(kind, {}).get("axes", []), dcn) * hw.comm_efficiency)
        for kind, d in t["overlap"]["by_kind"].items()
    )
    flops = pred["time"]["flops"] if pred else 0.0
    model_flops = rep["flops"]["model_per_step"] / cfg.devices
    ca = t["cost"] or {}
    from meshpar.plan.costmodel import ModelFacts

    layers = ModelFacts.from_config(cfg).dims.get("layers") or 1  # the layer loop's trip count
    memory_s = (ca.get("bytes_accessed") or 0) * layers / hw.hbm_bw if hw.hbm_bw else 0.0
    roof = max(flops / hw.peak_flops, memory_s) + exposed_s
    return {
        "name": name,
        "target": hw.name,
        "devices": cfg.devices,
        "peak_gib": t["peak_bytes"] / 2**30,
        "hbm_gib": hw.memory_bytes / 2**30,
        "fits": t["fits"],
        "xla_flops": ca.get("flops"),
        "xla_bytes": ca.get("bytes_accessed"),
        "executed_flops": flops,
        "model_flops": model_flops,
        "collectives": {k: {"bytes": v["bytes"], "axes": v.get("axes")} for k, v in summary.items()},
        "hidden_bytes": t["overlap"]["hidden_bytes"],
        "exposed_bytes": t["overlap"]["exposed_bytes"],
        "roofline_s": roof,
        "roofline_mfu": model_flops / (roof * hw.peak_flops) if roof else None,
        "planner_s": pred["time"]["step_s"] if pred else None,
        "planner_mfu": pred["time"]["mfu"] if pred else None,
        "planner_gib": pred["memory"]["total"] / 2**30 if pred else None,
        "compile_s": round(time.perf_counter() - start, 1),
        "kernels": sorted(t["kernels"]),
        "peak_buffers": t.get("peak_buffers"),
    }


def line(r: dict) -> str:
    who = r.get("framework", "meshpar")
    if "error" in r:
        return f"| {r['target']} | {r['name']} | {who} | refused: {r['error']} |"
    gb = 1e9
    coll = ", ".join(f"{k} {v['bytes'] / gb:.1f}" for k, v in sorted(r["collectives"].items()))
    if who == "maxtext":
        return (
            f"| {r['target']} x{r['devices']} | {r['name']} | maxtext | {r['peak_gib']:.1f} / {r['hbm_gib']:.0f} | - | "
            f"{(r['xla_flops'] or 0) / 1e12:.1f} / - | {coll} | {r['exposed_bytes'] / gb:.2f} | - | - | - | - | "
            f"{r['compile_s']:.0f} |"
        )
    return (
        f"| {r['target']} x{r['devices']} | {r['name']} | meshpar | {r['peak_gib']:.1f} / {r['hbm_gib']:.0f} | "
        f"{r['planner_gib']:.1f} | {(r['xla_flops'] or 0) / 1e12:.1f} / {r['executed_flops'] / 1e12:.0f} | "
        f"{coll} | {r['exposed_bytes'] / gb:.2f} | {r['roofline_s']:.3f} | {r['roofline_mfu']:.3f} | "
        f"{r['planner_s']:.3f} | {r['planner_mfu']:.3f} | {r['compile_s']:.0f} |"
    )


HEADER = [
    "| target | config | framework | peak / HBM (GiB) | planner (GiB) | XLA / executed TFLOP per device "
    "| collectives (GB by kind) | exposed (GB) | roofline s | roofline MFU | planner s | planner MFU | compile s |",
    "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated config names (as printed) to run")
    ap.add_argument("--targets", default="h100,tpu-v5p")
    ap.add_argument("--out", help="append the markdown table here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--maxtext",
        metavar="PYTHON",
        help="MaxText venv's python (bench/maxtext/README.md): compile each TPU and H100 row with MaxText too, "
        "side by side",
    )
    ap.add_argument(
        "--vocab-tiles",
        type=int,
        default=1,
        metavar="N",
        help="the LM head and loss in N token slices on "
        "both sides: meshpar's train.loss_chunks=N, MaxText's num_vocab_tiling=N (default 1: whole logits)",
    )
    ap.add_argument(
        "--own-libtpu",
        action="store_true",
        help="with --maxtext, compile meshpar's rows with meshpar's "
        "own libtpu (jax's pin), not MaxText's: by default both sides use the one compiler",
    )
    ap.add_argument(
        "--planner-first",
        action="store_true",
        help="after each dense fsdp row, compile `meshpar plan`'s own first plan for that model, length and target "
        "(its mesh, strategy and remat), meshpar only",
    )
    ap.add_argument(
        "--gpu-flags",
        default="",
        metavar="FLAGS",
        help="XLA:GPU flags for both sides' H100 compiles, beside meshpar's launch flags "
        "(meshpar.runtime.xla_flags), which both sides get unless FLAGS names them "
        "(e.g. '--xla_gpu_enable_latency_hiding_scheduler=false')",
    )
    args = ap.parse_args()
    import os

    if args.gpu_flags:  # read by XLA:GPU when the CUDA compiler loads; MaxText's process gets the same
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.gpu_flags}".strip()

    if args.maxtext and not args.own_libtpu and "tpu" in args.targets:
        os.environ["TPU_LIBRARY_PATH"] = maxtext_libtpu(args.maxtext)
    from meshpar.plan.target import resolve
    from meshpar.runtime import compilers

    rows, lines = [], list(HEADER)
    if "tpu" in args.targets:
        compilers.load("tpu")
        print(
            f"TPU rows compiled by {compilers.version('tpu')} ({os.environ['TPU_LIBRARY_PATH']}), "
            f"LIBTPU_INIT_ARGS: {os.environ.get('LIBTPU_INIT_ARGS', '')!r}",
            flush=True,
        )
    if "h100" in args.targets:
        print(f"GPU rows compiled by {compilers.version('gpu')}, flags: {gpu_flags()}", flush=True)
    print("\n".join(HEADER), flush=True)
    targets = {}
    for name, hw, n, ov in configs():
        if hw not in args.targets.split(",") or (args.only and name not in args.only.split(",")):
            continue
        if args.vocab_tiles > 1:
            ov = ov + [f"train.loss_chunks={args.vocab_tiles}"]
        if (hw, n) not in targets:
            targets[hw, n] = resolve(hw, n)
        found = [row(name, targets[hw, n], ov)]
        mx = maxtext_overrides(name, n, ov, gpu=hw == "h100") if args.maxtext else None
        if mx:
            found.append(maxtext_row(name, n, args.maxtext, mx, targets[hw, n].hardware))
        if args.planner_first and name.endswith(" fsdp") and not name.startswith("mixtral"):
            label = f"{name.removesuffix(' fsdp')} planner's first"
            try:
                first = planner_first([o for o in ov if not o.startswith(("strategy=", "mesh."))], targets[hw, n])
            except Exception as e:  # noqa: BLE001 - a plan that cannot be made says why and the table goes on
                found.append({"name": label, "target": hw, "error": str(e).splitlines()[0][:160]})
            else:
                layout = " ".join(o for o in first if o.startswith(("strategy=", "mesh.", "model.remat=")))
                found.append(row(f"{label}: {layout}", targets[hw, n], first))
        for r in found:
            rows.append(r)
            lines.append(line(r))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
