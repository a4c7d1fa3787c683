"""The planner against published runs (`meshpar.plan.papers`: Narayanan et al. 2021, Tables 1 and 2,
on the `a100-80g` preset), so its calibration cannot drift silently. `bench/bench_plan_papers.py`
prints every row with the search's winners; bench/RESULTS.md holds the table."""

import dataclasses

import pytest

from meshpar.core.config import load_config
from meshpar.plan.hardware import load_hardware
from meshpar.plan.papers import TABLE1, TABLE2, cost
from meshpar.plan.search import plan


@pytest.fixture(scope="module")
def costed():
    return {r.name: cost(r) for r in TABLE1 + TABLE2}


def test_table1_as_run_is_within_10_percent_of_the_measured_hfu(costed):
    """All ten rows, 1.7B on 32 GPUs to 1T on 3072: the paper's layout (tensor x pipeline x data,
    full recompute, 1F1B, microbatches of one sequence) predicted within +-10% of its measured
    hardware FLOPs utilization (eq. 3 over the step), and the rise with size keeps its sign."""
    ratios = {r.name: costed[r.name]["ratio"] for r in TABLE1}
    assert all(0.9 <= v <= 1.1 for v in ratios.values()), ratios
    assert costed["1008B"]["hfu"] > costed["1.7B"]["hfu"]


def test_table2_zero3_collapses_as_measured_and_ptdp_wins_at_every_point(costed):
    """175B at batch 1536 on 384, 768 and 1536 GPUs. PTD-P (t8 x p12) within +-10%. ZeRO-3, costed as
    DeepSpeed ran it (`papers.DEEPSPEED`: fp16 on the wire, gathers on demand, one ring through each
    GPU's NIC), follows the measured 46% -> 28% -> 14% within +-25% at each point, its step flat from
    768 to 1536 GPUs (the gathers' volume per GPU does not shrink), and PTD-P ahead at every point,
    as measured."""
    for n in (384, 768, 1536):
        assert 0.9 <= costed[f"175B PTD-P x{n}"]["ratio"] <= 1.1
        zero3 = costed[f"175B ZeRO-3 x{n}"]
        assert 0.75 <= zero3["ratio"] <= 1.25, (n, zero3["ratio"])
        assert costed[f"175B PTD-P x{n}"]["hfu"] > zero3["hfu"]
        assert zero3["time"]["exposed_comm_s"] > 0.3 * zero3["step_s"]  # the gathers wait
    flat = costed["175B ZeRO-3 x1536"]["step_s"] / costed["175B ZeRO-3 x768"]["step_s"]
    assert 0.85 < flat < 1.15  # measured: 66.7 s at both


def test_zero3_as_meshpar_runs_it_keeps_its_gathers_behind_compute():
    """The same ZeRO-3 rows as meshpar's own FSDP program (fp32 weights gathered beside compute, as
    the H100 target's schedule shows; rings over a node's 8 NICs): compute-bound while the per-GPU
    batch lasts, so the planner does not carry DeepSpeed's collapse over to meshpar's plans."""
    rows = [dataclasses.replace(r, runtime="meshpar") for r in TABLE2 if r.runtime == "deepspeed"]
    own = [cost(r) for r in rows]
    assert all(c["time"]["exposed_comm_s"] < 0.01 * c["step_s"] for c in own)
    assert own[0]["hfu"] > 0.5 and own[1]["hfu"] > 0.5


def test_the_search_finds_the_papers_layout_or_better_inside_the_node():
    """310B on 1920 GPUs (the issue's row: the powers-of-two search returned MFU 0.253 with tensor
    parallelism across two nodes): searched with the paper's toolbox (`tp`), every microbatch count
    that divides the rows, the winner keeps tensor parallelism inside the node and predicts at least
    the paper layout's MFU; branch and bound costs a fraction of the candidates."""
    run = next(r for r in TABLE1 if r.name == "310.1B")
    cfg = load_config(None, [o for o in run.overrides() if not o.startswith(("mesh.", "strategy=", "pipeline."))])
    cfg.devices = run.gpus
    result = plan(cfg, run.gpus, load_hardware("a100-80g"), strategies=["tp"], top=3)
    w = result["candidates"][0]
    assert w["mesh"]["tensor"] <= 8 and "tensor" not in w["dcn"]
    assert w["time"]["mfu"] >= cost(run)["time"]["mfu"]
    assert w["pipeline"]["microbatches"] & (w["pipeline"]["microbatches"] - 1)  # not a power of two
    assert result["costed"] < result["searched"] / 4


def test_the_largest_rows_winner_is_the_papers_layout_with_selective_recompute():
    """529.6B on 2520 GPUs, every preset searched: the winner keeps the paper's recipe (tensor
    parallelism inside the node, a 1F1B pipeline across nodes, data parallelism outermost) and is
    predicted within 5% of the paper's own layout run with Korthikanti et al. 2022's sequence
    parallelism and selective recompute (the same group's next step, measured there at 530B: MFU
    42.1% with full recompute, 54.2% with these). What it gains over the paper's layout as run is
    that recompute, not a different layout."""
    run = next(r for r in TABLE1 if r.name == "529.6B")
    cfg = load_config(None, [o for o in run.overrides() if not o.startswith(("mesh.", "strategy=", "pipeline."))])
    cfg.devices = run.gpus
    w = plan(cfg, run.gpus, load_hardware("a100-80g"), top=3)["candidates"][0]
    assert w["mesh"]["pipeline"] > 1 and w["pipeline"]["schedule"] == "1f1b" and w["remat"] == "save_dots"
    assert w["mesh"]["tensor"] <= 8 and "tensor" not in w["dcn"]
    selective = cost(run, selective=True)
    assert selective["fits"] and abs(w["time"]["mfu"] / selective["time"]["mfu"] - 1) < 0.05
    assert selective["time"]["mfu"] > 1.2 * cost(run)["time"]["mfu"]
