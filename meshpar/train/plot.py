"""`meshpar plot RUN.jsonl [RUN2.jsonl ...] -o out.png [--size 1200x800]`: runs side by side.

Three panels from the JSON Lines of `meshpar train --metrics-out`: loss against step on a log scale
(solid: training, dashed with markers: `eval` records, dotted grey: the entropy floor of the
synthetic language when the start record knows it), tokens/s (examples/s for a non-LM loss) and MFU
against step. A file a resumed run appended to is one run: each `start` record with `resumed_from`
R replaces what the file held after step R. Throughput and MFU leave out the first logged step after
each start (it waits for the first execution's warm-up). One colour per run, labelled by file name,
strategy and mesh. Needs matplotlib (`pip install 'meshpar[plot]'`); drawn with the non-interactive
Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshpar.core.errors import MeshparError
from meshpar.core.paths import check_output_file


def read_run(path: str) -> dict:
    """{"name", "label", "steps": [step records], "evals": [eval records], "floor", "warmup": [steps]}
    of one JSON Lines file; a resume (a start record with `resumed_from` R) drops what came after R."""
    p = Path(path)
    if not p.is_file():
        raise MeshparError(f"metrics file '{path}' does not exist")
    out = {"name": p.stem, "label": p.stem, "steps": [], "evals": [], "floor": None, "warmup": []}
    lines = p.read_text().splitlines()
    first = False
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # a run still writing its last line
                break
            raise MeshparError(f"metrics file '{path}' line {i} is not JSON; is it a --metrics-out file?") from None
        kind = rec.get("event") if isinstance(rec, dict) else None
        if kind == "start":
            out["floor"] = rec.get("entropy_floor", out["floor"])
            mesh = rec.get("mesh_str") or " ".join(f"{a}={n}" for a, n in (rec.get("mesh") or {}).items() if n > 1)
            out["label"] = " ".join(x for x in (p.stem, rec.get("strategy"), mesh and f"({mesh})") if x)
            resumed = rec.get("resumed_from")
            if resumed is not None:  # the steps a resumed run redoes replace the ones the file holds
                for key in ("steps", "evals", "warmup"):
                    out[key] = [r for r in out[key] if (r if key == "warmup" else r["step"]) <= resumed]
            first = True
        elif kind == "step":
            out["steps"].append(rec)
            if first:
                out["warmup"].append(rec["step"])
            first = False
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
    fig = draw([read_run(p) for p in paths], size, dpi)  # says so when matplotlib is missing
    import matplotlib.pyplot as plt

    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return out


def draw(runs: list[dict], size: tuple[int, int] = (1200, 800), dpi: int = 100):
    """The matplotlib figure of `read_run` results: loss, throughput and MFU panels."""
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
        loss_ax.plot(steps, [r.get("loss") for r in run["steps"]], color=color, label=f"{run['label']} train")
        if run["evals"]:
            loss_ax.plot(
                [r["step"] for r in run["evals"]],
                [r["loss"] for r in run["evals"]],
                color=color,
                linestyle="--",
                marker="o",
                markersize=3,
                label=f"{run['label']} eval",
            )
        if run["floor"] is not None and run["floor"] not in floors:
            floors.add(run["floor"])
            loss_ax.axhline(run["floor"], color="grey", linestyle=":", label=f"entropy floor {run['floor']:.3f}")
        lm = any(r.get("tokens_per_s") is not None for r in run["steps"])
        rate_key = "tokens_per_s" if lm else "examples_per_s"
        timed = [r for r in run["steps"] if r["step"] not in run["warmup"]] or run["steps"]
        rate_ax.plot(
            [r["step"] for r in timed],
            [r.get(rate_key) for r in timed],
            color=color,
            label=f"{run['label']} ({'tokens' if lm else 'examples'}/s)",
        )
        mfu_ax.plot(
            [r["step"] for r in timed],
            [100 * r["mfu"] if r.get("mfu") is not None else None for r in timed],
            color=color,
            label=run["label"],
        )
    for ax, title, ylabel in (
        (loss_ax, "loss", "nats/token"),
        (rate_ax, "throughput", "per second"),
        (mfu_ax, "MFU", "% of peak"),
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    losses = [r.get("loss") for run in runs for r in run["steps"] + run["evals"]]
    if all(isinstance(v, (int, float)) and v > 0 for v in losses):
        from matplotlib.ticker import FuncFormatter

        loss_ax.set_yscale("log")  # step 1's loss would flatten the range where training happens
        for axis in (loss_ax.yaxis.set_major_formatter, loss_ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:.3g}"))
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshpar plot", description="Plot loss, eval loss, tokens/s and MFU of runs.")
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="--metrics-out files of meshpar train")
    p.add_argument("-o", "--out", default="runs.png", help="PNG to write (default runs.png)")
    p.add_argument("--size", default="1200x800", help="WIDTHxHEIGHT in pixels (default 1200x800)")
    args = p.parse_args(argv)
    try:
        check_output_file("-o", args.out)
        path = plot(args.runs, args.out, parse_size(args.size))
    except MeshparError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({', '.join(args.runs)})")
    return 0
