"""`meshpar plan` against published runs (`meshpar.plan.papers`: Narayanan et al. 2021, Tables 1 and 2).

    python bench/bench_plan_papers.py [--no-search] [--rows 1.7B,1008B] [--out table.md]

For each row: the paper's own layout costed as it ran (predicted against measured hardware FLOPs
utilization, eq. 3 of the paper), then the planner's search over the same GPUs and batch, twice:
with every preset, and with the paper's own toolbox (`--strategies tp`: tensor x pipeline x data,
no sequence parallelism or sharded state; meshpar's context axis, which the paper did not have, is
searched too). Each winner is given with its predicted MFU (model FLOPs,
no recompute) beside the paper layout's, so the winners compare on useful work; where the first
winner's step is shorter than the paper layout's (compute, bubble, collectives on the critical
path, as shares of the paper layout's step); the paper's layout with Korthikanti et al. 2022's
sequence parallelism and selective recompute (`tp_sp`, `save_dots`), the same group's next step;
and the search's wall time. The hardware is the
`a100-80g` preset (the paper's DGX A100 80GB).
"""

from __future__ import annotations

import argparse
import time


def layout(c: dict) -> str:
    m = " ".join(f"{a[0]}{v}" for a, v in c["mesh"].items() if v > 1)
    pp = c["pipeline"]
    sched = (
        f" {pp['schedule']} M={pp['microbatches']}" + (f" v={pp['virtual_stages']}" if pp["virtual_stages"] > 1 else "")
        if pp
        else (f" acc={c['microbatches']}" if c["microbatches"] > 1 else "")
    )
    return f"{c['strategy']} {m} {c['remat']}{sched}"


def gain(paper: dict, best: dict) -> str:
    """Where the winner's step is shorter than the paper layout's, as shares of the paper layout's
    step: compute (recomputation, matmul shapes), bubble, and collectives on the critical path."""
    a, b = paper["time"], best["time"]
    parts = {
        "compute": b["compute_s"] - a["compute_s"],
        "bubble": b["bubble_s"] - a["bubble_s"],
        "comm": b["exposed_comm_s"] + b["unhidden_s"] - a["exposed_comm_s"] - a["unhidden_s"],
    }
    return ", ".join(f"{k} {v / a['step_s']:+.0%}" for k, v in parts.items() if abs(v) >= 0.005 * a["step_s"])


def search(run, strategies=None) -> tuple[dict, float]:
    from meshpar.core.config import load_config
    from meshpar.plan.hardware import load_hardware
    from meshpar.plan.search import plan

    cfg = load_config(None, [o for o in run.overrides() if not o.startswith(("mesh.", "strategy=", "pipeline."))])
    cfg.devices = run.gpus
    start = time.perf_counter()
    res = plan(cfg, run.gpus, load_hardware("a100-80g"), strategies=strategies, top=3)
    return res["candidates"][0], time.perf_counter() - start


def main() -> None:
    from meshpar.plan.papers import SOURCE, TABLE1, TABLE2, cost

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-search", action="store_true", help="cost the papers' layouts only")
    ap.add_argument("--rows", help="comma-separated row names (default: all)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    runs = [r for r in TABLE1 + TABLE2 if not args.rows or r.name in args.rows.split(",")]
    lines = [
        f"Source: {SOURCE}, Tables 1 and 2; hardware `a100-80g`. HFU: eq. 3 of the paper over the step "
        f"(recompute counted); MFU: model FLOPs only.",
        "",
        "| row | GPUs | paper layout | measured HFU | predicted HFU | ratio | predicted MFU | GiB |"
        + (
            ""
            if args.no_search
            else " paper layout, SP + selective MFU | winner (every preset) | MFU | step vs the paper's layout |"
            " winner (`tp` only) | MFU | search s |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|" + ("" if args.no_search else "---:|---|---:|---|---|---:|---:|"),
    ]
    for run in runs:
        c = cost(run)
        mfu = c["time"]["mfu"]
        row = (
            f"| {run.name} | {run.gpus} | t{run.tensor} p{run.pipeline} d{run.data} {run.strategy} | "
            f"{c['measured_hfu']:.3f} | {c['hfu']:.3f} | {c['ratio']:.3f} | {mfu:.3f} | {c['memory_gib']:.1f} |"
        )
        if not args.no_search:
            best, secs = search(run)
            tp, secs_tp = search(run, ["tp"])
            sel = cost(run, selective=True) if run.strategy == "tp" else None
            sel_mfu = "-" if sel is None else f"{sel['time']['mfu']:.3f}" + ("" if sel["fits"] else " (does not fit)")
            row += (
                f" {sel_mfu} | {layout(best)} | {best['time']['mfu']:.3f} | {gain(c, best)} | {layout(tp)} | "
                f"{tp['time']['mfu']:.3f} | {secs:.0f} / {secs_tp:.0f} |"
            )
        print(row, flush=True)
        lines.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
