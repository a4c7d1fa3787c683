"""The planner against published runs (`meshpar.plan.papers`: Narayanan et al. 2021, Tables 1 and 2,
on the `a100-80g` preset), so its calibration cannot drift silently. `bench/bench_plan_papers.py`
prints every row with the search's winners; bench/RESULTS.md holds the table."""

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


def test_table2_ptdp_within_10_percent_and_ahead_where_fsdp_turns_communication_bound(costed):
    """175B at batch 1536: PTD-P (t8 x p12) predicted within +-10% at 384, 768 and 1536 GPUs. The
    ZeRO-3 row costs meshpar's FSDP over every GPU: compute-bound while the per-GPU batch lasts, its
    gathers over NCCL's node-wide rings (a channel per NIC) outgrowing the compute at 1536, where
    PTD-P wins as measured. DeepSpeed's measured collapse at 768 (28%) is not this model's: it moved
    its 3 x 349 GB per step at 15.7 GB/s per GPU, one NIC's rate on the whole volume
    (bench/RESULTS.md)."""
    for n in (384, 768, 1536):
        assert 0.9 <= costed[f"175B PTD-P x{n}"]["ratio"] <= 1.1
    zero3 = [costed[f"175B ZeRO-3 x{n}"] for n in (384, 768, 1536)]
    assert zero3[0]["hfu"] >= zero3[1]["hfu"] > zero3[2]["hfu"]
    assert zero3[1]["time"]["comm_s"] < zero3[1]["time"]["compute_s"] < zero3[2]["time"]["comm_s"] * 2
    assert zero3[2]["time"]["comm_s"] > zero3[2]["time"]["compute_s"]
    assert costed["175B PTD-P x1536"]["hfu"] > zero3[2]["hfu"]


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
