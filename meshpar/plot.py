"""`meshpar plot RUN.jsonl [RUN2.jsonl ...] -o out.png [--size 1200x800]`: runs side by side.

Three panels from the JSON Lines of `meshpar train --metrics-out`: loss against step (solid:
training, dashed with markers: `eval` records, dotted grey: the entropy floor of the synthetic
language when the start record knows it), tokens/s (examples/s for a non-LM loss) and MFU against
step. One colour per run, labelled by file name. Needs matplotlib (`pip install 'meshpar[plot]'`);
drawn with the non-interactive Agg backend, so no display is needed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshpar.errors import MeshparError


def read_run(path: str) -> dict:
    """{"name", "steps": [step records], "evals": [eval records], "floor"} of one JSON Lines file."""
    p = Path(path)
    if not p.is_file():
        raise MeshparError(f"metrics file '{path}' does not exist")
    out = {"name": p.stem, "steps": [], "evals": [], "floor": None}
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):     # a run still writing its last line
                break
            raise MeshparError(f"metrics file '{path}' line {i} is not JSON; is it a --metrics-out file?") from None
        kind = rec.get("event") if isinstance(rec, dict) else None
        if kind == "start":
            out["floor"] = rec.get("entropy_floor")
        elif kind == "step":
            out["steps"].append(rec)
        elif kind == "eval":
            out["evals"].append(rec)
    if not out["steps"] and not out["evals"]:
        raise MeshparError(f"metrics file '{path}' has no step or eval records; is it a --metrics-out file?")
    return out


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise MeshparError(f"--size '{text}' must look like WIDTHxHEIGHT in pixels, e.g. 1200x800") from None
    if not (100 <= w <= 10000 and 100 <= h <= 10000):
        raise MeshparError(f"--size '{text}': width and height must be 100..10000 pixels")
    return w, h


def plot(paths: list[str], out: str, size: tuple[int, int] = (1200, 800), dpi: int = 100) -> str:
    """Draw the runs of `paths` into the PNG `out` of exactly `size` pixels; returns `out`."""
    runs = [read_run(p) for p in paths]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MeshparError("meshpar plot needs matplotlib: pip install 'meshpar[plot]'") from None
    fig, axes = plt.subplots(1, 3, figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi)
    loss_ax, rate_ax, mfu_ax = axes
    floors = set()
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps = [r["step"] for r in run["steps"]]
        loss_ax.plot(steps, [r.get("loss") for r in run["steps"]], color=color, label=f"{run['name']} train")
        if run["evals"]:
            loss_ax.plot([r["step"] for r in run["evals"]], [r["loss"] for r in run["evals"]], color=color,
                         linestyle="--", marker="o", markersize=3, label=f"{run['name']} eval")
        if run["floor"] is not None and run["floor"] not in floors:
            floors.add(run["floor"])
            loss_ax.axhline(run["floor"], color="grey", linestyle=":", label=f"entropy floor {run['floor']:.3f}")
        lm = any(r.get("tokens_per_s") is not None for r in run["steps"])
        rate_key = "tokens_per_s" if lm else "examples_per_s"
        rate_ax.plot(steps, [r.get(rate_key) for r in run["steps"]], color=color,
                     label=f"{run['name']} ({'tokens' if lm else 'examples'}/s)")
        mfu_ax.plot(steps, [100 * r["mfu"] if r.get("mfu") is not None else None for r in run["steps"]],
                    color=color, label=run["name"])
    for ax, title, ylabel in ((loss_ax, "loss", "nats/token"), (rate_ax, "throughput", "per second"),
                              (mfu_ax, "MFU", "% of peak")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshpar plot", description="Plot loss, eval loss, tokens/s and MFU of runs.")
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="--metrics-out files of meshpar train")
    p.add_argument("-o", "--out", default="runs.png", help="PNG to write (default runs.png)")
    p.add_argument("--size", default="1200x800", help="WIDTHxHEIGHT in pixels (default 1200x800)")
    args = p.parse_args(argv)
    try:
        path = plot(args.runs, args.out, parse_size(args.size))
    except MeshparError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({', '.join(args.runs)})")
    return 0
