"""`meshpar plan`: the cost model against ZeRO's accounting and against the compiled step, the
ranking against the field's advice, the winner as a runnable config, bad input as one line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshpar.core.config import load_config
from meshpar.core.mesh import MESH_AXES
from meshpar.plan.costmodel import Candidate, ModelFacts, Resolver, state_bytes
from meshpar.plan.hardware import load_hardware
from meshpar.plan.search import estimate, plan, winner_yaml
from tests.conftest import tiered

REPO = Path(__file__).resolve().parents[2]
GPT3 = [
    "model.size=7b",
    "model.layers=96",
    "model.embed=12288",
    "model.heads=96",
    "model.kv_heads=96",
    "model.head_dim=128",
    "model.mlp=32768",
    "batch.global_size=256",
    "batch.length=2048",
]


def _mesh(**sizes):
    return tuple(sizes.get(a, 1) for a in MESH_AXES)


def test_zero_accounting_with_2_2_12_bytes_per_param():
    """Rajbhandari et al. 2020, sec. 5.1: 16Psi, 4Psi + 12Psi/N, 2Psi + 14Psi/N, 16Psi/N over N = 64,
    on meshpar's real layouts of a 7B-class model (norm scales stay replicated: well under 1%)."""
    cfg = load_config(None, ["model.size=7b", "model.mlp=12928"])
    facts, res, n = ModelFacts.from_config(cfg), Resolver(cfg.rules), 64
    psi = facts.params
    assert 7.0e9 < psi < 8.0e9
    want = {"dp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n, "fsdp": 16 * psi / n}
    for strategy, expected in want.items():
        mesh = _mesh(fsdp=n) if strategy == "fsdp" else _mesh(data=n)
        got = sum(state_bytes(facts, Candidate(mesh, _mesh(), strategy, "full"), res, (2, 2, 12)).values())
        assert abs(got / expected - 1) < 0.01, (strategy, got, expected)
    got_gb = {
        s: sum(
            state_bytes(
                facts, Candidate(_mesh(fsdp=n) if s == "fsdp" else _mesh(data=n), _mesh(), s, "full"), res, (2, 2, 12)
            ).values()
        )
        * 7.5e9
        / psi
        / 1e9
        for s in want
    }
    assert [round(got_gb[s], 1) for s in want] == [120.0, 31.4, 16.6, 1.9]  # the issue's numbers for Psi = 7.5e9


def test_zeros_update_gathers_every_layer_where_xla_gpu_has_room_and_fewer_where_not():
    """XLA:GPU's ZeRO update holds the gathered stacked weights: all of them under its scheduler's
    limit for temporaries, 0.95 (0.8 HBM - state); past it as much as the limit allows, and never less
    than the largest tensor, which must be whole once."""
    import dataclasses

    from meshpar.plan.steptime import zero_update_gather

    cfg = load_config(None, ["model.size=7b"])
    facts, res = ModelFacts.from_config(cfg), Resolver(cfg.rules)
    cand = Candidate(_mesh(data=8), _mesh(), "zero1", "full")
    stacked = [4 * lf.numel for lf in facts.leaves if lf.stacked]
    h100 = load_hardware("h100")
    assert zero_update_gather(facts, cand, res, h100, 0.0, 4) == sum(stacked)  # room for all
    state = 0.8 * h100.memory_bytes - sum(stacked) / 0.95 / 2  # room for half of them
    assert zero_update_gather(facts, cand, res, h100, state, 4) == pytest.approx(sum(stacked) / 2)
    small = dataclasses.replace(h100, memory_bytes=1e9)  # no room: the largest, whole
    assert zero_update_gather(facts, cand, res, small, 0.0, 4) == max(stacked)


# The compilers' own peaks (GiB) of bench/bench_targets.py's rows (the sweep of issue 39, bench/RESULTS.md):
# libtpu 0.0.42.1 on v5p (the seventh to twelfth sessions' tables), XLA:GPU of jax-cuda12-plugin
# 0.10.2 on H100 (one run, twelfth session)
PEAKS = {
    "tpu-v5p": {
        8: {
            **{"125m dp": 3.02, "125m zero1": 2.27, "125m fsdp": 1.46, "125m fsdp_tp": 1.85, "125m tp_sp": 1.68},
            **{"1b dp": 19.05, "1b zero1": 10.12, "1b fsdp": 3.89, "1b fsdp_tp": 5.31, "1b tp_sp": 6.03},
            **{"7b zero1": 56.48, "7b fsdp": 17.93, "7b fsdp_tp": 23.78, "7b tp_sp": 31.85},
            **{"8b zero1": 67.66, "8b fsdp": 20.45, "8b fsdp_tp": 26.18, "8b tp_sp": 36.65},
            **{"1b gpipe": 4.11, "1b 1f1b": 5.26, "1b context all_gather": 3.83, "1b context ring": 3.84},
            **{"1b moe capacity": 10.84, "1b moe dropless": 13.47},
        },
        64: {
            **{"125m dp": 3.02, "125m zero1": 1.59, "125m fsdp": 0.73, "125m fsdp_tp": 1.68, "125m tp_sp": 1.68},
            **{"1b dp": 19.05, "1b zero1": 8.74, "1b fsdp": 1.73, "1b fsdp_tp": 3.72, "1b tp_sp": 6.13},
            **{"7b zero1": 44.18, "7b fsdp": 5.06, "7b fsdp_tp": 12.03, "7b tp_sp": 32.62},
            **{"8b zero1": 58.97, "8b fsdp": 6.67, "8b fsdp_tp": 14.27, "8b tp_sp": 37.46},
            **{"1b gpipe": 16.57, "1b 1f1b": 7.06, "1b context all_gather": 3.44, "1b context ring": 1.88},
            **{"1b moe capacity": 3.91, "1b moe dropless": 6.42},
        },
    },
    "h100": {
        8: {
            **{"125m dp": 3.31, "125m zero1": 1.55, "125m fsdp": 1.37, "125m fsdp_tp": 1.51, "125m tp_sp": 1.31},
            **{"1b dp": 17.90, "1b zero1": 9.44, "1b fsdp": 4.09, "1b fsdp_tp": 5.55, "1b tp_sp": 5.95},
            **{"7b dp": 103.52, "7b zero1": 51.57, "7b fsdp": 17.57, "7b fsdp_tp": 23.94, "7b tp_sp": 29.56},
            **{"8b dp": 121.41, "8b zero1": 55.39, "8b fsdp": 21.42, "8b fsdp_tp": 26.52, "8b tp_sp": 33.86},
            **{"1b gpipe": 4.14, "1b 1f1b": 5.94, "1b context all_gather": 4.64, "1b context ring": 4.72},
            **{"1b moe capacity": 10.62, "1b moe dropless": 13.29},
        },
        64: {
            **{"125m dp": 3.31, "125m zero1": 1.38, "125m fsdp": 0.75, "125m fsdp_tp": 1.23, "125m tp_sp": 1.31},
            **{"1b dp": 17.90, "1b zero1": 7.92, "1b fsdp": 1.81, "1b fsdp_tp": 3.64, "1b tp_sp": 6.04},
            **{"7b dp": 103.52, "7b zero1": 50.60, "7b fsdp": 5.56, "7b fsdp_tp": 12.20, "7b tp_sp": 29.71},
            **{"8b dp": 121.41, "8b zero1": 57.24, "8b fsdp": 7.78, "8b fsdp_tp": 12.54, "8b tp_sp": 35.00},
            **{"1b gpipe": 16.09, "1b 1f1b": 10.16, "1b context all_gather": 4.20, "1b context ring": 2.19},
            **{"1b moe capacity": 3.79, "1b moe dropless": 6.87},
        },
    },
}
# the rows allowed outside 15%, each with its reason: none since the thirteenth session (libtpu's loss
# phase holding the logits and their cotangent in two slots brought v5p's 125m fsdp on 8 from 0.67 and
# 1b fsdp_tp on 8 from 1.16; FSDP's head across nodes on H100 was 1.32 and 1.22 at 125m and 1b on 64)
OFF: dict[str, set] = {"tpu-v5p": set(), "h100": set()}


@pytest.mark.parametrize("hw", ["tpu-v5p", "h100"])
def test_the_planner_is_within_15_percent_of_the_compilers_own_peaks_on_the_sweep(hw):
    """The planner's total (`search.estimate`, the hardware's compiler rules) against the peaks the
    target's compiler computed for the sweep's rows on 8 and 64 chips: within 15% on all but OFF. A
    rule that moves a row out of the band fails here, without a compile (libtpu takes minutes a row)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_targets", REPO / "bench" / "bench_targets.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hardware = load_hardware(hw)
    ratios = {}
    for n, peaks in PEAKS[hw].items():
        for name, overrides in bench.cases(n):
            if name in peaks:
                cfg = load_config(None, overrides)
                cfg.devices = n
                ratios[n, name] = estimate(cfg, hardware)["memory"]["total"] / 2**30 / peaks[name]
    assert len(ratios) == sum(map(len, PEAKS[hw].values())) == {"tpu-v5p": 48, "h100": 52}[hw]
    off = {row: round(r, 2) for row, r in ratios.items() if not 0.85 <= r <= 1.15}
    assert set(off) <= OFF[hw], off  # v5p's 7b zero1 on 64 was 1.18 while ZeRO's update counted every stack


def test_the_ring_holds_two_hops_of_keys_and_values_where_the_all_gather_holds_the_sequence():
    """Context parallelism's working set: the all-gather's gathered K/V [b, S, K, H] and their fp32
    gradients ((c + 4) bytes per element); the ring's two hops' shards and one fp32 dK/dV
    ((2c + 4) / cp), hop by hop (`meshpar.parallel.context._in_turn`; on 64 H100s the compiled peak
    of 1b at context=32 fell 4.46 -> 2.19 GiB with it, the planner 2.27)."""
    from meshpar.plan.costmodel import activation_parts

    cp, b, s, k, q = 32, 64, 4096, 8, 64  # 1b: 8 KV heads of 64; 128 sequences over fsdp=2
    parts = {}
    for strategy in ("all_gather", "ring"):
        cfg = load_config(None, ["model.size=1b", "batch.length=4096", "batch.global_size=128"])
        cfg.model.context_strategy = strategy
        facts = ModelFacts.from_config(cfg)
        cand = Candidate(_mesh(fsdp=2, context=cp), _mesh(), "fsdp", "full")
        parts[strategy] = activation_parts(facts, cand, 2, "gpu")["working"]
    kv = b * 2 * s * k * q
    assert parts["all_gather"] - parts["ring"] == pytest.approx((2 + 4) * kv - (2 * 2 + 4) * kv / cp)


def _winner(result):
    return result["candidates"][0]


def test_ranking_follows_the_costs_without_special_cases():
    h100 = load_hardware("h100")
    small = plan(load_config(None, ["model.size=125m", "batch.global_size=64", "batch.length=2048"]), 8, h100)
    w = _winner(small)  # a small model: data parallel in some form, no tensor or pipeline axis
    assert w["strategy"] in ("dp", "zero1", "zero2", "fsdp", "hsdp") and w["mesh"]["tensor"] == 1
    assert w["mesh"]["pipeline"] == 1
    # a sharded optimizer state shortens the update (AdamW reads and writes 7 w bytes per element at
    # memory bandwidth), so plain dp, whose collectives hide as well, ranks below the winner
    dp = next(c for c in small["candidates"] if c["strategy"] == "dp")
    assert dp["time"]["step_s"] > w["time"]["step_s"] and dp["time"]["vector_s"] > w["time"]["vector_s"]

    # 7B on one node. With the [s, s] attention scores stored (xla), ZeRO-2 over data=8 without remat
    # would not fit: H100's own compile of it peaks at 89.9 GiB (fp32 scores beside their bf16 cast;
    # bench/RESULTS.md), so the plan shards the state over 8 and recomputes or accumulates to fit with
    # the planner's margin. With flash (auto at 2k tokens) ZeRO-2 fits as it is, within a few percent
    # of FSDP over 8, which wins: ZeRO's gather of the updated weights waits for the whole backward,
    # with no compute left to hide it, where FSDP's gathers hide behind each pass.
    seven = plan(
        load_config(None, ["model.size=7b", "batch.global_size=64", "batch.length=2048", "model.attention=xla"]),
        8,
        h100,
        keep_all=True,
    )
    dp = [c for c in seven["candidates"] if c["strategy"] == "dp" and c["mesh"]["data"] == 8]
    assert dp and not any(c["fits"] for c in dp)  # pure DP: 16 bytes x 6.7B > 80 GB
    w = _winner(seven)
    assert w["fits"] and w["strategy"] in ("zero2", "fsdp") and 8 in (w["mesh"]["data"], w["mesh"]["fsdp"])
    assert w["memory"]["total"] * 1.15 < h100.memory_bytes and (w["remat"] != "none" or w["microbatches"] > 1)
    zero2 = [
        c for c in seven["candidates"] if c["strategy"] == "zero2" and c["remat"] == "none" and c["mesh"]["data"] == 8
    ]
    assert zero2 and all(c["memory"]["total"] * 1.15 > h100.memory_bytes for c in zero2)
    flash = plan(load_config(None, ["model.size=7b", "batch.global_size=64", "batch.length=2048"]), 8, h100)
    w2 = _winner(flash)
    assert w2["strategy"] == "fsdp" and w2["mesh"]["fsdp"] == 8 and w2["memory"]["total"] * 1.15 < h100.memory_bytes
    zero2 = next(c for c in flash["candidates"] if c["strategy"] == "zero2" and c["mesh"]["data"] == 8)
    assert zero2["fits"] and w2["time"]["step_s"] <= zero2["time"]["step_s"] <= w2["time"]["step_s"] * 1.05
    assert zero2["time"]["exposed_comm_s"] > 10 * w2["time"]["exposed_comm_s"]  # the updated weights' gather

    # 175B on 16 nodes of 8 H100s: the field's 3D recipe (Narayanan et al. 2021). 1F1B stashes each
    # microbatch's residuals (Megatron's selective recompute is save_dots), so a pipelined plan pays
    # its bubble and TP collectives, not full remat's extra forward; FSDP over every device pays that
    # forward and loses, though its gathers hide behind compute. (At 128 GPUs the winner needs every
    # device for pipeline x tensor: data parallelism would double the weights per device.)
    ranked = plan(load_config(None, GPT3), 128, h100, keep_all=True)["candidates"]
    fits = [c for c in ranked if c["fits"]]
    w = fits[0]
    assert w["mesh"]["pipeline"] > 1 and w["pipeline"]["schedule"] == "1f1b" and w["remat"] == "save_dots"
    assert 1 < w["mesh"]["tensor"] <= 8 and "tensor" not in w["dcn"]  # TP inside the NVLink node
    assert w["dcn"].get("pipeline", 1) > 1  # PP across nodes
    assert all(a in ("pipeline", "data") for a in w["dcn"])  # DP, if any, outermost too
    assert w["dcn"].get("data", 1) == w["mesh"]["data"]
    fsdp = next(c for c in fits if c["mesh"]["pipeline"] == 1)
    assert fsdp["strategy"] in ("fsdp", "fsdp_tp", "fsdp_tp_sp", "hsdp") and fsdp["remat"] == "full"
    assert fsdp["time"]["unhidden_s"] < 0.05 * fsdp["time"]["step_s"]  # its gathers hide behind each pass
    assert fsdp["time"]["compute_s"] > 1.3 * w["time"]["compute_s"]  # the extra forward of full remat
    assert fsdp["time"]["step_s"] > w["time"]["step_s"]
    assert all("tensor" not in c["dcn"] for c in fits[:6])  # TP across nodes costs:
    assert all(c["time"]["step_s"] > 1.2 * w["time"]["step_s"] for c in fits if "tensor" in c["dcn"])


# 8 fake devices: each config's prediction against its compiled step (fp32: on CPU a bf16 run
# upcasts its matmuls, so fp32 is the precision in which the CPU buffers mean what a GPU's would).
_BASE = ["precision=fp32", "batch.global_size=16", "batch.length=64", "model.vocab=1024", "model.layers=2"]
_T = _BASE + ["model.size=tiny"]
_S = _BASE + ["model.size=125m", "batch.length=128"]


def _m(**k):
    return [f"mesh.{a}={k.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")]


SWEEP = {  # name: (overrides, collective kinds the model must predict within 10%)
    "tiny dp": (_T + _m(data=8) + ["strategy=dp"], ["all-reduce"]),
    "tiny zero1": (_T + _m(data=8) + ["strategy=zero1"], ["all-gather", "reduce-scatter"]),
    "tiny zero2 4 microbatches": (
        _T + _m(data=8) + ["strategy=zero2", "batch.global_size=32", "batch.microbatches=4"],
        ["all-gather", "reduce-scatter"],
    ),
    "tiny fsdp": (_T + _m(fsdp=8) + ["strategy=fsdp"], ["all-gather", "reduce-scatter", "all-to-all"]),
    "tiny fsdp remat none": (
        _T + _m(fsdp=8) + ["strategy=fsdp", "model.remat=none"],
        ["all-gather", "reduce-scatter", "all-to-all"],
    ),
    "tiny hsdp": (
        _T + _m(data=2, fsdp=4) + ["strategy=hsdp"],
        ["all-gather", "all-reduce", "reduce-scatter", "all-to-all"],
    ),
    "tiny tp remat none": (_T + _m(data=2, tensor=4) + ["strategy=tp", "model.remat=none"], ["all-reduce"]),
    "tiny tp_sp": (_T + _m(data=2, tensor=4) + ["strategy=tp_sp"], ["all-gather", "reduce-scatter"]),
    "tiny fsdp_tp": (_T + _m(fsdp=4, tensor=2) + ["strategy=fsdp_tp"], []),
    "tiny pipeline 1f1b": (
        _T
        + _m(pipeline=2, data=4)
        + ["strategy=dp", "model.layers=4", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
        ["collective-permute", "all-reduce"],
    ),
    "tiny 1f1b tp": (
        _T
        + _m(pipeline=2, data=2, tensor=2)
        + ["strategy=tp", "model.layers=4", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
        ["collective-permute", "all-reduce"],
    ),
    "tiny 1f1b 4 stages tp": (
        _T
        + _m(pipeline=4, tensor=2)
        + ["strategy=tp", "model.layers=4", "pipeline.schedule=1f1b", "pipeline.microbatches=8"],
        ["collective-permute", "all-reduce"],
    ),
    "tiny 1f1b save_dots": (
        _T
        + _m(pipeline=2, data=2, tensor=2)
        + [
            "strategy=tp",
            "model.layers=4",
            "model.remat=save_dots",
            "pipeline.schedule=1f1b",
            "pipeline.microbatches=4",
        ],
        ["collective-permute", "all-reduce"],
    ),
    "tiny 1f1b tp_sp save_dots": (
        _T
        + _m(pipeline=2, data=2, tensor=2)
        + [
            "strategy=tp_sp",
            "model.layers=4",
            "model.remat=save_dots",
            "pipeline.schedule=1f1b",
            "pipeline.microbatches=4",
        ],
        ["collective-permute", "all-gather", "reduce-scatter"],
    ),
    "tiny gpipe remat none": (
        _T + _m(pipeline=2, data=4) + ["strategy=dp", "model.layers=4", "model.remat=none", "pipeline.schedule=gpipe"],
        ["collective-permute", "all-reduce"],
    ),
    "tiny gpipe tp": (
        _T + _m(pipeline=2, data=2, tensor=2) + ["strategy=tp", "model.layers=4", "pipeline.schedule=gpipe"],
        ["collective-permute", "all-reduce"],
    ),
    "tiny interleaved": (
        _T
        + _m(pipeline=2, data=4)
        + [
            "strategy=dp",
            "model.layers=4",
            "pipeline.schedule=interleaved",
            "pipeline.microbatches=4",
            "pipeline.virtual_stages=2",
        ],
        ["collective-permute", "all-reduce", "all-to-all"],
    ),
    "tiny moe expert=4": (
        _T + _m(data=2, expert=4) + ["strategy=dp", "model.name=moe", "model.layers=4"],
        ["all-to-all", "all-reduce"],
    ),
    "tiny moe expert=2 tp": (
        _T + _m(expert=2, tensor=2, data=2) + ["strategy=tp", "model.name=moe", "model.layers=4"],
        ["all-to-all", "all-reduce"],
    ),
    "tiny moe dropless expert=4": (
        _T + _m(data=2, expert=4) + ["strategy=dp", "model.name=moe", "model.layers=4", "moe.capacity_factor=null"],
        ["all-to-all", "all-reduce"],
    ),
    "tiny moe deepseek-style expert=4": (
        _T
        + _m(data=2, expert=4)
        + [
            "strategy=dp",
            "model.name=moe",
            "model.layers=4",
            "moe.num_experts=8",
            "moe.top_k=2",
            "moe.shared_experts=1",
            "moe.expert_mlp=32",
            "moe.score=sigmoid",
            "moe.balance=bias",
        ],
        ["all-to-all", "all-reduce"],
    ),
    "125m dp none": (_S + _m(data=8) + ["strategy=dp", "model.remat=none"], ["all-reduce"]),
    "125m dp 4 microbatches none": (
        _S + _m(data=8) + ["strategy=dp", "model.remat=none", "batch.global_size=32", "batch.microbatches=4"],
        ["all-reduce"],
    ),
    "125m zero1 4 microbatches": (
        _S + _m(data=8) + ["strategy=zero1", "batch.global_size=32", "batch.microbatches=4"],
        ["all-gather", "reduce-scatter"],
    ),
    "125m zero1 full": (_S + _m(data=8) + ["strategy=zero1"], ["all-gather", "reduce-scatter"]),
    "125m zero2 full": (_S + _m(data=8) + ["strategy=zero2"], ["all-gather", "reduce-scatter"]),
    "125m fsdp full": (_S + _m(fsdp=8) + ["strategy=fsdp"], ["all-gather", "reduce-scatter", "all-to-all"]),
    "125m hsdp full": (
        _S + _m(data=2, fsdp=4) + ["strategy=hsdp"],
        ["all-gather", "reduce-scatter", "all-reduce", "all-to-all"],
    ),
    "125m tp none": (_S + _m(data=2, tensor=4) + ["strategy=tp", "model.remat=none"], ["all-reduce"]),
    "125m tp_sp full": (_S + _m(data=2, tensor=4) + ["strategy=tp_sp"], ["all-gather", "reduce-scatter"]),
    "125m fsdp_tp none": (
        _S + _m(fsdp=4, tensor=2) + ["strategy=fsdp_tp", "model.remat=none"],
        ["all-gather", "reduce-scatter", "all-reduce"],
    ),
}


SWEEP_FAST = {"tiny fsdp", "tiny 1f1b tp", "tiny moe expert=4", "125m zero1 4 microbatches"}


def test_the_sweep_covers_presets_axes_remat_and_microbatches():
    """31 configs (tiny and 125m; MoE with capacity, dropless and DeepSeek-style; every preset; tensor, pipeline
    and expert axes; remat none, full and save_dots; microbatches 1 and 4), each checked against its compiled step
    below."""
    text = " ".join(" ".join(o) for o, _ in SWEEP.values())
    assert len(SWEEP) >= 20
    for needle in (
        "model.size=tiny",
        "model.size=125m",
        "mesh.tensor=4",
        "mesh.pipeline=2",
        "mesh.expert=4",
        "model.remat=none",
        "model.remat=save_dots",
        "batch.microbatches=4",
        *[f"strategy={s}" for s in ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp")],
    ):
        assert needle in text, needle


@pytest.mark.parametrize("name", tiered(SWEEP, SWEEP_FAST, [n.replace(" ", "-") for n in SWEEP]))
def test_predictions_match_the_compiled_step(name):
    """params + optimizer state = the step's argument bytes within 1% (the train state is the
    argument, the batch < 0.1%); total memory within 15% of `memory_analysis`; the collective bytes
    within 10% of the HLO's, and each kind the config lists within 10%."""
    from meshpar.plan.dryrun import compare

    overrides, kinds = SWEEP[name]
    pred, comp = compare(load_config(None, overrides))
    args_ratio = (pred["memory"]["params"] + pred["memory"]["optimizer"]) / comp["memory"]["argument"]
    assert abs(args_ratio - 1) < 0.01, (name, args_ratio)
    mem = pred["memory"]["total"] / comp["memory"]["peak_estimate"]
    assert abs(mem - 1) < 0.15, (name, mem, pred["memory"], comp["memory"])
    coll = sum(pred["collectives"].values()) / sum(comp["collectives"].values())
    assert abs(coll - 1) < 0.10, (name, coll, pred["collectives"], comp["collectives"])
    for kind in kinds:
        r = pred["collectives"].get(kind, 0) / comp["collectives"][kind]
        assert abs(r - 1) < 0.10, (name, kind, r, pred["collectives"], comp["collectives"])


def test_ties_go_to_memory_headroom():
    """1B on 64 H100s, batch 256 x 2048 (issue 20): on one mesh, zero1 and zero2 tie on time and
    bytes, and the one with the most headroom ranks first. The winner shards its weights (FSDP-style):
    ZeRO's gather of the updated weights waits for the whole backward, and dp (71.8 GiB predicted
    once, did not fit compiled) ties with nothing: its replicated update is slower."""
    result = plan(
        load_config(None, ["model.size=1b", "batch.global_size=256", "batch.length=2048"]),
        64,
        load_hardware("h100"),
        top=40,
    )
    ranked = result["candidates"]
    w = ranked[0]
    assert w["strategy"] in ("fsdp", "hsdp") and w["memory"]["total"] < 30 * 2**30
    zero = [c for c in ranked if c["strategy"] in ("zero1", "zero2") and c["microbatches"] == 1]
    pairs = [(a, b) for a in zero for b in zero if a["strategy"] == "zero1" != b["strategy"] and a["mesh"] == b["mesh"]]
    assert pairs
    for z1, z2 in pairs:  # ZeRO-2 holds less: its gradients are scattered
        assert z1["time"]["step_s"] == pytest.approx(z2["time"]["step_s"], rel=1e-3)
        first, second = sorted((z1, z2), key=ranked.index)
        assert first["memory"]["total"] <= second["memory"]["total"]
    assert all(c["time"]["step_s"] > w["time"]["step_s"] * 1.001 for c in ranked[1:] if c["strategy"] == "dp")


def test_verify_writes_the_best_plan_that_fits_once_compiled(tmp_path, capsys, monkeypatch):
    from meshpar.cli import main
    from meshpar.plan import dryrun

    seen = {}

    def fake(result, config_path, overrides, k, target=None):
        seen["k"], seen["candidates"], seen["target"] = k, result["candidates"], target
        return [
            {
                "rank": i + 1,
                "mesh": c["mesh"],
                "strategy": c["strategy"],
                "predicted": {},
                "compiled": {},
                "target_peak": 0,
                "fits_compiled": i == 1,
            }
            for i, c in enumerate(result["candidates"][:k])
        ]

    monkeypatch.setattr(dryrun, "verify", fake)
    out = tmp_path / "p.yaml"
    argv = ["plan", "--devices", "8", "--json", "--verify", "2", "--out", str(out), "model.layers=2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"wrote the best plan (#2, the best that fits once compiled; #1 does not) to {out}" in err
    second = seen["candidates"][1]
    back = load_config(out)
    assert back.strategy == second["strategy"] and {a: getattr(back.mesh, a) for a in second["mesh"]} == second["mesh"]
    monkeypatch.setattr(dryrun, "verify", lambda *a: [dict(r, fits_compiled=False) for r in fake(*a)])
    out.unlink()
    assert main(argv) == 0
    assert "none of the top 2 plans fits once compiled: nothing written" in capsys.readouterr().err
    assert not out.exists()


def test_verify_of_a_bf16_plan_judges_the_target_not_the_cpu_upcast():
    """XLA:CPU computes bf16 matmuls in f32 and holds buffers a GPU does not, so the compiled peak is
    an fp32 XLA:CPU step's; the verdict scales it by the planner's target bf16 / XLA:CPU fp32 ratio,
    and lands nearer the target's prediction."""
    from meshpar.plan.dryrun import verify

    over = ["model.layers=2", "batch.global_size=32", "batch.length=512"]
    result = plan(load_config(None, over), 8, load_hardware("h100"), ["dp"])
    row = verify(result, None, over, 1)[0]
    pred, peak = result["candidates"][0]["memory"]["total"], row["compiled"]["memory"]["peak_estimate"]
    on_cpu = estimate(
        load_config(None, over + result["candidates"][0]["overrides"] + ["precision=fp32"]), compiler="cpu"
    )["memory"]["total"]
    assert row["target_peak"] == pytest.approx(peak * pred / on_cpu, rel=1e-6)
    assert abs(row["target_peak"] / pred - 1) < abs(peak / pred - 1) and row["target_peak"] < peak
    assert row["predicted"]["memory"]["total"] == pytest.approx(on_cpu, rel=1e-6)  # shown: what XLA:CPU compiles


def test_winner_yaml_is_a_config_train_accepts(tmp_path):
    cfg = load_config(None, ["model.layers=2"])
    result = plan(cfg, 8, load_hardware("h100"))
    path = tmp_path / "plan.yaml"
    path.write_text(winner_yaml(result, None, ["model.layers=2"]))
    back = load_config(path)
    best = result["candidates"][0]
    assert back.strategy == best["strategy"] and back.model.remat == best["remat"]
    assert {a: getattr(back.mesh, a) for a in best["mesh"]} == best["mesh"] and back.model.layers == 2
    assert back.batch.microbatches == best["microbatches"] and back.devices == 8


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "meshpar.cli", "plan", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=600,
    )


def test_verify_compiles_the_top_plan_on_16_fake_devices(tmp_path):
    run = _cli(
        "--devices",
        "16",
        "--hardware",
        "h100",
        "--verify",
        "1",
        "--json",
        "--out",
        str(tmp_path / "p.yaml"),
        "precision=fp32",
        "model.layers=2",
        "batch.global_size=32",
        "batch.length=32",
        "--strategies",
        "dp,fsdp",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    row = result["verify"][0]
    assert row["fits_compiled"] and row["compiled"]["memory"]["argument"] > 0
    pm = row["predicted"]["memory"]
    assert abs((pm["params"] + pm["optimizer"]) / row["compiled"]["memory"]["argument"] - 1) < 0.01
    assert set(row["predicted"]["collectives"]) & set(row["compiled"]["collectives"])
    assert load_config(tmp_path / "p.yaml").devices == 16


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hardware", "h10"], "unknown hardware 'h10' (did you mean 'h100'?)"),
        (["--devices", "12"], "--devices 12 cannot be formed from h100 nodes of 8"),
        (["--strategies", "dp,fdsp"], "unknown strategy 'fdsp' in --strategies (did you mean 'fsdp'?)"),
        (["--devices", "1", "model.size=7b", "batch.length=2048"], "fits on no plan of 1 h100: the smallest needs"),
        (["--top", "-3"], "--top must be >= 1, got -3"),
        (["--top", "0"], "--top must be >= 1, got 0"),
        (["--verify", "-1"], "--verify must be >= 0, got -1"),
        (["strategy=tp", "--strategies", "fsdp,dp"], "strategy=tp is not among --strategies fsdp,dp"),
        (
            ["mesh.tensor=3"],
            "no mesh of 8 devices can shard this model with --strategies dp,zero1,zero2,fsdp,hsdp,tp,tp_sp,"
            "fsdp_tp,fsdp_tp_sp and mesh.tensor=3 (sizes must divide",
        ),
        (["model.remat=offload"], "model.remat=offload: `meshpar plan` costs model.remat none, save_dots, full"),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    from meshpar.cli import main

    argv = ["plan", "--devices", "8", "--out", "-", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def _plan_json(capsys, *args) -> dict:
    from meshpar.cli import main

    assert main(["plan", "--out", "-", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_pinned_keys_constrain_the_search(capsys):
    """KEY=VALUE overrides of what the search chooses pin it (they were ignored: `mesh.tensor=8
    strategy=tp` printed the fsdp=8 winner): every plan listed keeps them, and the rest is searched."""
    seven_b = ["model.size=7b", "batch.global_size=64", "batch.length=2048"]
    tp = _plan_json(capsys, "--devices", "8", "--top", "3", *seven_b, "mesh.tensor=8", "strategy=tp", "mesh.data=-1")
    assert tp["pinned"] == ["mesh.tensor=8", "strategy=tp"]  # -1 fills: left to the search
    assert tp["candidates"] and all(c["strategy"] == "tp" and c["mesh"]["tensor"] == 8 for c in tp["candidates"])
    small = ["model.size=125m", "batch.global_size=64", "batch.length=2048"]
    pp = _plan_json(
        capsys, "--devices", "16", "--top", "3", *small, "pipeline.schedule=gpipe", "model.remat=full",
        "mesh.dcn={pipeline: 2}",
    )  # fmt: skip
    assert pp["pinned"] == ["mesh.dcn={pipeline: 2}", "model.remat=full", "pipeline.schedule=gpipe"]
    assert len({c["strategy"] for c in pp["candidates"]}) > 1  # the strategy is still searched
    for c in pp["candidates"]:
        assert c["pipeline"]["schedule"] == "gpipe" and c["remat"] == "full" and c["dcn"] == {"pipeline": 2}
        assert "pipeline.schedule=gpipe" in c["overrides"] and "mesh.dcn={pipeline: 2}" in c["overrides"]


def test_a_plan_without_verify_makes_no_device_and_exits_at_16384_devices():
    """`plan --devices 16384` printed its plan and never exited (the CPU client's 16k threads at
    shutdown): without --verify it compiles nothing, so it makes no device. A process of its own,
    which must end well within its timeout."""
    run = subprocess.run(
        [sys.executable, "-m", "meshpar.cli", "plan", "--devices", "16384", "--hardware", "h100", "--top", "1"]
        + ["--strategies", "dp", "--json", "--out", "-", "model.size=tiny", "batch.global_size=16384"]
        + ["batch.length=64"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["devices"] == 16384 and math.prod(result["candidates"][0]["mesh"].values()) == 16384


def test_a_hardware_file_is_read_with_its_time_keys_and_a_bad_latency_is_one_line(tmp_path):
    from meshpar.core.errors import ConfigError

    keys = "peak_flops: 1e15\nmemory_bytes: 8e10\ndomain: 8\nici_bw: 4e11\ndcn_bw: 5e10\n"
    good = tmp_path / "gpu.yaml"
    good.write_text(keys + "hbm_bw: 3e12\nlatency: [1e-5, 2e-6, 8e-6]\n")
    hw = load_hardware(str(good))
    assert hw.latency == (1e-5, 2e-6, 8e-6) and hw.hbm_bw == 3e12 and hw.name == "gpu"
    bad = tmp_path / "bad.yaml"
    bad.write_text(keys + "latency: 5e-6\n")
    with pytest.raises(ConfigError, match=r"hardware file '.*bad.yaml': latency must be three seconds"):
        load_hardware(str(bad))


def test_plan_modules_sit_on_their_floor():
    """The planner prices a run without running one: it never imports the loop, checkpoints, metrics,
    serving, the launcher or the CLI (the layers themselves: tests/test_layout.py), and the hardware
    presets import nothing but the errors."""
    import ast

    above = {
        "meshpar.train.loop",
        "meshpar.io.checkpoint",
        "meshpar.train.metrics",
        "meshpar.serve",
        "meshpar.cli",
        "meshpar.models",
        "meshpar.runtime.launch",
    }
    for name in ("hardware", "costmodel", "search", "dryrun"):
        tree = ast.parse((REPO / "meshpar" / "plan" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for m in mods:
                assert not any(m == a or m.startswith(a + ".") for a in above), (name, m)
        if name == "hardware":
            assert all(
                not (m.startswith("meshpar.") and m != "meshpar.core.errors")
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)
                for m in [node.module or ""]
            )


def test_embed_and_heads_imply_head_dim_for_every_command():
    """`model.head_dim: None` means embed / heads, not the size preset's value (issue 44: 1024 / 16
    planned with the tiny preset's 8-wide heads). Every command builds its model through
    `registry.default_model`, so the planner's facts, the dense and MoE models agree; an explicit
    head_dim still wins, and a width heads do not divide is one line."""
    from meshpar.core.errors import ConfigError
    from meshpar.core.precision import get_policy
    from meshpar.core.registry import default_model
    from meshpar.core.sharding import model_spec

    dims = [
        "model.layers=2",
        "model.embed=1024",
        "model.heads=16",
        "model.kv_heads=16",
        "model.mlp=4096",
        "model.vocab=32000",
        "batch.global_size=8",
        "batch.length=512",
    ]
    implied, explicit = (ModelFacts.from_config(load_config(None, dims + x)) for x in ([], ["model.head_dim=64"]))
    assert implied.dims["head_dim"] == 64 and implied.params == explicit.params
    assert abs(implied.params / 1e9 - 0.0991) < 5e-4  # the issue's `meshpar plan` figure
    for name in ("decoder", "moe"):
        cfg = load_config(None, ["model.name=" + name, "model.embed=96", "model.heads=4", "model.kv_heads=2"])
        assert model_spec(default_model(cfg), get_policy(cfg.precision)).model_config.head_dim == 24, name
    wide = load_config(None, ["model.embed=96", "model.heads=4", "model.kv_heads=2", "model.head_dim=8"])
    assert model_spec(default_model(wide), get_policy(wide.precision)).model_config.head_dim == 8
    with pytest.raises(ConfigError, match="model.embed=100 is not a multiple of model.heads=8: set model.head_dim"):
        ModelFacts.from_config(load_config(None, ["model.embed=100"]))


def test_the_layer_being_computed_keeps_its_experts_split():
    """FSDP x expert parallelism: the layer being computed is gathered over `fsdp`, its expert weights
    never over `expert` (each device runs its own experts), so the weight-sized workspace halves when
    the expert axis doubles. Counting all experts gathered put Mixtral 8x7B on 128 v5p chips at 16.5
    GiB against 11.8 compiled (bench/RESULTS.md); 11.9 now."""
    ws = {}
    for e in (2, 4):
        cfg = load_config(
            None,
            ["model.name=moe", "model.size=1b", "moe.num_experts=8", "strategy=fsdp", "precision=bf16"]
            + ["batch.length=1024", f"batch.global_size={2 * e}", "mesh.data=1", "mesh.fsdp=2", f"mesh.expert={e}"]
            + ["mesh.tensor=1"],
        )
        cfg.devices = 2 * e
        ws[e] = estimate(cfg, load_hardware("h100"))["memory"]["workspace"]
    assert ws[4] / ws[2] == pytest.approx(0.5, abs=0.06), ws


_DECODE_SLICES = """HloModule m

%fused_copy (p0: bf16[2,64,128], p1: s32[]) -> bf16[1,64,128] {
  %p0 = bf16[2,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %dynamic-slice.1 = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={1,64,128}
  ROOT %copy.1 = bf16[1,64,128]{2,1,0} copy(%dynamic-slice.1)
}

%fused_dynamic_slice (p2: bf16[2,64], p3: s32[]) -> bf16[1,64] {
  %p2 = bf16[2,64]{1,0} parameter(0)
  %p3 = s32[] parameter(1)
  ROOT %dynamic_slice.2 = bf16[1,64]{1,0} dynamic-slice(%p2, %p3), dynamic_slice_sizes={1,64}
}

%fused_prefetch (p4: bf16[2,64,256], p5: s32[]) -> bf16[1,64,256] {
  %p4 = bf16[2,64,256]{2,1,0} parameter(0)
  %p5 = s32[] parameter(1)
  ROOT %dynamic-slice.3 = bf16[1,64,256]{2,1,0:T(2,128)S(1)} dynamic-slice(%p4, %p5), dynamic_slice_sizes={1,64,256}
}

%fused_index (p6: s32[8], p7: s32[]) -> s32[2] {
  %p6 = s32[8]{0} parameter(0)
  %p7 = s32[] parameter(1)
  ROOT %dynamic-slice.4 = s32[2]{0} dynamic-slice(%p6, %p7), dynamic_slice_sizes={2}
}

ENTRY %main (w: bf16[2,64,128], n: bf16[2,64], u: bf16[2,64,256], i: s32[8], l: s32[]) -> bf16[1,64] {
  %w = bf16[2,64,128]{2,1,0} parameter(0)
  %n = bf16[2,64]{1,0} parameter(1)
  %u = bf16[2,64,256]{2,1,0} parameter(2)
  %i = s32[8]{0} parameter(3)
  %l = s32[] parameter(4)
  %a = bf16[1,64,128]{2,1,0} fusion(%w, %l), kind=kLoop, calls=%fused_copy
  %b = ((bf16[2,64]{1,0}, s32[]), bf16[1,64]{1,0}, u32[]) fusion-start(%n, %l), kind=kLoop, calls=%fused_dynamic_slice
  %c = bf16[1,64,256]{2,1,0} fusion(%u, %l), kind=kLoop, calls=%fused_prefetch
  %d = s32[2]{0} fusion(%i, %l), kind=kLoop, calls=%fused_index
  ROOT %e = bf16[1,64]{1,0} fusion-done(%b)
}
"""


def test_the_decode_steps_weight_copies_are_read_in_either_compilers_form():
    """A layer's weights sliced out of their stack [L, ...] into a buffer of their own, as XLA:GPU's
    scanned decode loop does: jaxlib 0.10 fuses copy(dynamic-slice), jaxlib 0.11 a fusion (here an
    asynchronous one) rooted at the slice. Not copies: libtpu's slice into on-chip memory (S(1)), a
    slice of something other than one layer."""
    from meshpar.plan.program import sliced_copies

    assert sorted(sliced_copies(_DECODE_SLICES)) == ["bf16[1,64,128]{2,1,0}", "bf16[1,64]"]
    # a KV cache slice's shape is left to `cache_copies`, in either form (with its layout or without)
    assert sliced_copies(_DECODE_SLICES, skip={"1,64,128"}) == ["bf16[1,64]"]
    assert sliced_copies(_DECODE_SLICES, skip={"1,64"}) == ["bf16[1,64,128]{2,1,0}"]


def _fused_hlo(channels=(7,), compute: bool = True, done: bool = True) -> str:
    """libtpu's async collective fusion, one bf16[64,16] all-gather (2 KiB) per channel id, each written
    three times: in its start fusion's computation, in a compute fusion over `async_collective_fusion.*`
    carrying a piece of it (with a dot), and in its done fusion's; `compute`: that fusion scheduled
    between the start and the done; `done`: the done written at all."""
    comps, body = [], []
    for c in channels:
        ag = f"bf16[64,16]{{1,0}} all-gather(%p{c}), channel_id={c}, replica_groups=[1,8]<=[8], dimensions={{0}}"
        comps.append(f"%start{c} (p{c}: bf16[8,16]) -> bf16[64,16] {{\n  %p{c} = bf16[8,16]{{1,0}} parameter(0)\n")
        comps.append(f"  ROOT %ag{c} = {ag}\n}}\n\n")
        comps.append(f"%async_collective_fusion.{c} (p{c}: bf16[8,16]) -> bf16[64,16] {{\n")
        comps.append(f"  %p{c} = bf16[8,16]{{1,0}} parameter(0)\n  %d{c} = bf16[8,8]{{1,0}} dot(%p{c}, %p{c}), ")
        comps.append(f"lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}\n  ROOT %ag{c} = {ag}\n}}\n\n")
        if done:
            comps.append(f"%done{c} (p{c}: bf16[8,16]) -> bf16[64,16] {{\n  %p{c} = bf16[8,16]{{1,0}} parameter(0)\n")
            comps.append(f"  ROOT %ag{c} = {ag}\n}}\n\n")
        body.append(f"  %async-collective-start.{c} = bf16[64,16]{{1,0}} fusion(%a), kind=kCustom, calls=%start{c}\n")
    for c in channels:
        if compute:
            body.append(
                f"  %fusion.{c} = bf16[64,16]{{1,0}} fusion(%a), kind=kOutput, calls=%async_collective_fusion.{c}\n"
            )
        if done:
            body.append(f"  %async-collective-done.{c} = bf16[64,16]{{1,0}} fusion(%a), kind=kCustom, calls=%done{c}\n")
    entry = "ENTRY %main (a: bf16[8,16]) -> bf16[8,16] {\n  %a = bf16[8,16]{1,0} parameter(0)\n"
    return "HloModule m\n\n" + "".join(comps) + entry + "".join(body) + "  ROOT %r = bf16[8,16]{1,0} copy(%a)\n}\n"


def test_libtpus_fused_async_collectives_count_once_and_overlap_the_compute_between():
    """libtpu's async collective fusion (some of MaxText's LIBTPU_INIT_ARGS) writes one all-gather three
    times under one channel id (`_fused_hlo`). Its bytes count once; hidden behind the compute fusion
    scheduled between its start and done; exposed with nothing between, where another collective's
    start and done fusions are not compute; exposed, not lost, when the computation holds no done."""
    from meshpar.plan.inspect import collectives
    from meshpar.plan.program import overlap

    assert [(op["kind"], op["bytes"]) for op in collectives(_fused_hlo())] == [("all-gather", 2048)]
    assert overlap(_fused_hlo()) | {"by_kind": None} == {"by_kind": None, "hidden_bytes": 2048, "exposed_bytes": 0}
    two = _fused_hlo((7, 9), compute=False)
    assert sum(op["bytes"] for op in collectives(two)) == 2 * 2048
    assert (overlap(two)["hidden_bytes"], overlap(two)["exposed_bytes"]) == (0, 2 * 2048)
    assert (overlap(_fused_hlo(done=False))["hidden_bytes"], overlap(_fused_hlo(done=False))["exposed_bytes"]) == (
        0,
        2048,
    )


def test_libtpus_loss_phase_holds_the_logits_and_their_cotangent_where_the_cotangent_has_two_consumers():
    """libtpu writes the logits' cotangent to its own slot where it feeds a windowed dW loop (an FSDP
    head over at most 32 chips; v5p dumps: 8, 16 and 32 hold the loop, 64 not) or a vocab-parallel
    head's two GEMMs: the loss phase holds two [b, s, V / t] buffers there, one elsewhere and on GPU."""
    from meshpar.plan.costmodel import activation_parts
    from meshpar.plan.steptime import loss_phase, tpu_windowed_head

    def held(compiler, strategy, **mesh):  # (logit bytes the phase holds, one logits buffer, windowed)
        n = math.prod(mesh.values())
        cfg = load_config(None, ["model.size=125m", "batch.length=4096", f"batch.global_size={2 * n}"])
        facts, res = ModelFacts.from_config(cfg), Resolver(cfg.rules)
        cand = Candidate(_mesh(**mesh), _mesh(), strategy, "full")
        parts = activation_parts(facts, cand, 2, compiler)
        with_logits, without = (
            loss_phase(facts, cand, res, (4, 4), 2, p, compiler) for p in (parts, {**parts, "logits": 0.0})
        )
        return with_logits - without, parts["logits"], tpu_windowed_head(facts, cand, res)

    for n, windowed in ((8, True), (32, True), (64, False)):
        logit_bytes, one, w = held("tpu", "fsdp", fsdp=n)
        assert w is windowed and logit_bytes == (2 if windowed else 1) * one > 0, n
    tp = held("tpu", "fsdp_tp", fsdp=2, tensor=4)
    assert tp[0] == 2 * tp[1] > 0 and not tp[2]  # a vocab-parallel head: dh's and dW's GEMMs
    dp = held("tpu", "dp", data=8)
    assert dp[0] == dp[1] > 0  # DP's replicated head: no windowed loop, the cotangent fused in
    gpu = held("gpu", "fsdp_tp", fsdp=2, tensor=4)
    assert gpu[0] == gpu[1] > 0
