"""The target tier: tiny configs compiled for 8 NVIDIA H100s and 8 TPU v5p chips by their own compilers
(XLA:GPU with cuDNN and Triton, libtpu), on this CPU-only host, and what their programs hold.

The compilers are installed once into their own folder (`meshpar compilers --install`, ~1.1 GB from
PyPI) if they are not there; only where that install fails does this file skip, with one line.
Every program is compiled once (module fixtures) and asserted on many times.
"""

import json
import subprocess
import sys

import jax
import pytest

from meshpar.core.config import load_config
from meshpar.runtime import compilers

TINY = ["precision=bf16", "batch.length=256", "batch.global_size=8"]
PRESETS = ("dp", "zero1", "fsdp", "fsdp_tp", "tp_sp")


@pytest.fixture(scope="module", autouse=True)
def _compilers():
    if not all(compilers.installed().values()):
        try:
            compilers.install(quiet=True)
        except Exception as e:  # noqa: BLE001 - no PyPI here: the one place this tier may skip
            pytest.skip(f"the target compilers could not be installed into {compilers.folder()}: {e}")


def _target(name):
    from meshpar.plan.target import resolve

    return resolve(name, 8)


def _report(target, *overrides):
    from meshpar.plan.program import report

    return report(load_config(None, TINY + list(overrides)), target)


@pytest.fixture(scope="module")
def h100():
    return _target("h100")


@pytest.fixture(scope="module")
def v5p():
    return _target("tpu-v5p")


@pytest.fixture(scope="module")
def gpu_presets(h100):
    return {p: _report(h100, f"strategy={p}") for p in PRESETS}


@pytest.fixture(scope="module")
def tpu_presets(v5p):
    return {p: _report(v5p, f"strategy={p}") for p in PRESETS}


def test_the_targets_are_the_real_devices(h100, v5p):
    assert len(h100.devices) == 8 and {d.device_kind for d in h100.devices} == {"NVIDIA H100 80GB HBM3"}
    assert h100.topology == "1x1x8" and h100.platform == "gpu"
    assert len(v5p.devices) == 8 and {d.device_kind for d in v5p.devices} == {"TPU v5"}
    assert v5p.topology == "v5p:2x2x2"  # a 2x2x2 cube of chips, with their torus coordinates
    assert sorted(tuple(d.coords) for d in v5p.devices) == [(x, y, z) for x in (0, 1) for y in (0, 1) for z in (0, 1)]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_compiles_for_h100_with_cudnn_attention(gpu_presets, preset):
    rep = gpu_presets[preset]
    t = rep["target"]
    assert t["device_kind"] == "NVIDIA H100 80GB HBM3" and t["fits"] and 0 < t["peak_bytes"] < 80e9
    assert {"cudnn:fmhaSoftmax", "cudnn:fmhaSoftmaxBackward"} <= set(t["kernels"])  # auto -> cuDNN fused attention
    kinds = rep["collectives"]["summary"]
    if preset in ("fsdp", "fsdp_tp", "zero1"):  # XLA:GPU emits a real reduce-scatter, not all-reduce + slice
        rs = [op for op in rep["collectives"]["ops"] if op["kind"] == "reduce-scatter"]
        lowered = sum(op["bytes"] * op["times"] for op in rs if op.get("lowered_as"))
        # jax-cuda12-plugin 0.11.2 lowers one 8 KiB vector's (of fsdp_tp's 136 KiB) as all-reduce + slice
        assert rs and lowered <= 0.1 * sum(op["bytes"] * op["times"] for op in rs), rs
    if preset in ("fsdp", "fsdp_tp"):
        assert kinds["all-gather"]["bytes"] > 0
    if preset == "dp":
        assert "reduce-scatter" not in kinds and kinds["all-reduce"]["bytes"] > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_compiles_for_tpu_v5p_with_splash_attention(tpu_presets, preset):
    t = tpu_presets[preset]["target"]
    assert t["device_kind"] == "TPU v5" and t["fits"]
    # auto -> splash (Mosaic kernels, forward and both backward passes), each device on its own rows and heads
    assert {
        "mosaic:splash_mqa_fwd_residuals",
        "mosaic:splash_mqa_dq_no_residuals",
        "mosaic:splash_mqa_dkv_no_residuals",
    } <= set(t["kernels"])
    assert t["cost"]["flops"] > 0


def test_the_peak_is_the_compilers_own(gpu_presets, tpu_presets):
    """The peak per device is what the target's compiler computed, not argument + output + temp - alias:
    libtpu's heap simulation (its `peak_memory_in_bytes`) differs from that sum either way, XLA:GPU's is
    at most the sum and within a few percent of it; on XLA:CPU (fake devices) the sum stands."""
    from meshpar.plan.inspect import memory

    def total(m):
        return m["argument"] + m["output"] + m["temp"] - m["alias"]

    tpu = [rep["memory"] for rep in tpu_presets.values()]
    assert all(rep["target"]["peak_bytes"] == rep["memory"]["peak_estimate"] for rep in tpu_presets.values())
    assert all(m["peak_estimate"] == m["compiler_peak"] > m["argument"] for m in tpu)
    assert any(abs(m["compiler_peak"] / total(m) - 1) > 0.02 for m in tpu)
    gpu = [rep["memory"] for rep in gpu_presets.values()]
    # within a few percent: 0.96-1.00 of the sum with jax-cuda12-plugin 0.10.2, 0.93-0.99 with 0.11.2
    assert all(0.9 * total(m) <= m["peak_estimate"] == m["compiler_peak"] <= total(m) for m in gpu)
    # XLA:CPU's own peak (here 2 of the sum's 3 MiB) is kept aside: the planner's "cpu" rules fit the sum
    square = jax.ShapeDtypeStruct((512, 512), "float32")
    cpu = memory(jax.jit(lambda a: jax.numpy.tanh(a @ a) @ a).lower(square).compile())
    assert cpu["compiler_peak"] < total(cpu) == cpu["peak_estimate"]


def test_the_target_memory_is_the_targets_own_not_the_cpu_upcast(gpu_presets, h100):
    """bf16 compute stays bf16 on the target: its peak is below the same step compiled in fp32 for it."""
    fp32 = _report(h100, "strategy=fsdp", "precision=fp32", "model.attention=flash")
    assert gpu_presets["fsdp"]["target"]["peak_bytes"] < 0.8 * fp32["target"]["peak_bytes"]


def test_the_schedule_shows_which_collectives_compute_hides(gpu_presets):
    ov = gpu_presets["fsdp"]["target"]["overlap"]
    assert ov["hidden_bytes"] > 0  # XLA:GPU's latency-hiding scheduler at work
    assert (
        sum(d["ops"] for d in ov["by_kind"].values())
        >= gpu_presets["fsdp"]["collectives"]["summary"]["all-gather"]["count"] / 4
    )


def test_a_gpu_target_compiles_with_the_flags_a_launched_job_runs_with(gpu_presets, tpu_presets, h100, monkeypatch):
    """`--target h100` compiles the program `meshpar train` on an H100 host runs: with meshpar's GPU XLA
    flags (`meshpar.runtime.xla_flags`), less those the user's own XLA_FLAGS names."""
    from meshpar.plan.target import compile_trainer

    lhs = "xla_gpu_enable_latency_hiding_scheduler"
    assert gpu_presets["fsdp"]["target"]["xla_flags"] == {lhs: True}
    assert tpu_presets["fsdp"]["target"]["xla_flags"] == {}
    seen = []

    class Step:  # a trainer's compile, recording the options it was given
        def compile(self, options=None):
            seen.append(options)
            return "compiled"

    from rich.console import Console

    from meshpar.plan.program import render_target

    for report, shown in ((gpu_presets, True), (tpu_presets, False)):
        console = Console(record=True, width=300)
        render_target(report["fsdp"]["target"], console)
        assert (f"XLA flags: --{lhs}=true" in console.export_text()) == shown
    assert compile_trainer(h100, Step(), {"xla_dump_to": "/d"}) == ("compiled", [])
    monkeypatch.setenv("XLA_FLAGS", f"--{lhs}=false")
    compile_trainer(h100, Step())
    assert seen == [{lhs: True, "xla_dump_to": "/d"}, {}]


# 1F1B for libtpu, GPipe for XLA:GPU (XLA:GPU takes 11 s over this 1F1B step, 7 s over GPipe's; libtpu 5 s)
@pytest.mark.parametrize("name, schedule", [("h100", "gpipe"), ("tpu-v5p", "1f1b")])
def test_pipelines_compile_for_both_targets(h100, v5p, name, schedule):
    target = h100 if name == "h100" else v5p
    rep = _report(
        target,
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=2",
        "strategy=fsdp_tp",
        f"pipeline.schedule={schedule}",
        "pipeline.microbatches=4",
        "batch.global_size=16",
    )
    assert rep["collectives"]["summary"]["collective-permute"]["bytes"] > 0  # activations between the stages
    assert rep["target"]["fits"]
    assert not any(k.startswith(("cudnn:", "mosaic:splash")) for k in rep["target"]["kernels"])  # xla/flash in stages
    assert any("inside pipeline stages uses flash (xla below 1024 keys), not" in w for w in rep["warnings"])


@pytest.mark.parametrize("name, strategy", [("h100", "all_gather"), ("tpu-v5p", "ring")])
def test_context_parallelism_compiles_for_both_targets(h100, v5p, name, strategy):
    target = h100 if name == "h100" else v5p
    rep = _report(
        target,
        "mesh.context=4",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "model.attention=flash",
        f"model.context_strategy={strategy}",
        "batch.length=512",
    )
    kinds = rep["collectives"]["summary"]
    assert "context" in kinds["all-gather" if strategy == "all_gather" else "collective-permute"]["axes"]


def test_the_ring_holds_one_hops_partial_results_at_a_time_on_h100(h100, monkeypatch):
    """Ring attention at context=8: each hop's merged output and its dQ, dK, dV sums are made before
    the next hop's K/V shards are read (`meshpar.parallel.context._in_turn`). Without that XLA:GPU
    ran all eight hops' flash blocks first and summed them after, holding every hop's partials."""
    from meshpar.parallel import context

    ring = [
        "mesh.context=8",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "model.attention=flash",
        "model.context_strategy=ring",
        "batch.length=1024",
    ]
    in_turn = _report(h100, *ring)["memory"]["temp"]
    monkeypatch.setattr(context, "_in_turn", lambda done, arrived: (done, arrived))
    all_at_once = _report(h100, *ring)["memory"]["temp"]
    # one hop's dQ partial, fp32 [b, T / cp, N, H]: b = 8 sequences, 128 tokens, tiny's 8 heads of 8
    dq = 4 * 8 * 128 * 8 * 8
    assert all_at_once - in_turn > 4 * dq, (in_turn, all_at_once)


def test_dropless_moe_over_expert_uses_ragged_all_to_all_on_h100_and_gathers_no_expert_weights(h100):
    rep = _report(
        h100,
        "model.name=moe",
        "mesh.expert=8",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "strategy=dp",
        "moe.num_experts=8",
        "moe.capacity_factor=null",
    )
    assert rep["target"]["kernels"]["ragged-all-to-all"] >= 4  # dispatch and return, forward and backward
    assert any(k.startswith("triton:") or k.startswith("cublas:") for k in rep["target"]["kernels"])
    # tokens travel, weights stay: no all-gather over the expert axis
    assert not any(op["kind"] == "all-gather" and "expert" in op["axes"] for op in rep["collectives"]["ops"])
    assert not any("padded all-to-all" in w for w in rep["warnings"])


@pytest.mark.parametrize("name", ["h100", "tpu-v5p"])
def test_the_serving_decode_step_compiles_for_both_targets(h100, v5p, name):
    from meshpar.plan.program import serve_report
    from meshpar.serve.engine import Engine
    from meshpar.serve.placement import ABSTRACT

    target = h100 if name == "h100" else v5p
    serve = ["serve.slots=8", "serve.cache_length=512"]
    rep = serve_report(load_config(None, ["precision=bf16", *serve]), target)
    assert rep["target"]["device_kind"] == target.devices[0].device_kind and rep["target"]["fits"]
    d = rep["decode"]
    assert d["slots"] == 8 and d["cache_length"] == 512 and d["cache"] > 0
    # the program served: bf16 weights (half the fp32 bytes) are what the compiled decode step takes
    fp32 = Engine(load_config(None, ["precision=fp32", *serve]), devices=target.devices, weights=ABSTRACT, info=print)
    assert 2 * d["weights"] == fp32.bytes_per_device()["weights"]
    held = d["weights"] + d["cache"] + d["slot_state"]  # libtpu pads the small slot arrays to its tiles
    assert held <= 1.02 * rep["memory"]["argument"] < held + d["weights"]  # fp32 weights would be 2x
    # serve.decode_loop=auto: unrolled on the GPU, where the layers read the stacked weights in place,
    # scanned on the TPU, whose loop prefetches each layer's slice: no copy, no note on either
    assert not any("serve.decode_loop=unrolled" in w for w in rep["warnings"])
    if name == "h100":  # XLA:GPU's scanned decode loop copies each layer's weights every step; said once
        scanned = serve_report(load_config(None, ["precision=bf16", *serve, "serve.decode_loop=scan"]), target)
        assert len([w for w in scanned["warnings"] if "serve.decode_loop=unrolled" in w]) == 1
    # serve_tp: weights stay in place, heads split over `tensor`: every token all-reduces over tensor only
    assert "tensor" in rep["collectives"]["summary"]["all-reduce"]["axes"]


@pytest.mark.parametrize("name", ["h100", "tpu-v5p"])
def test_the_decode_step_updates_the_stacked_kv_cache_in_place(h100, v5p, name, monkeypatch):
    """The reference layers decode through meshpar.nn.kvcache views: no buffer the size of a layer's cache
    slice (copied out of the stack, written back whole) in the compiled step. A layer that returns its
    slice (the older contract) gets those copies, and the note naming the fix. GQA as in Llama (G = 4)."""
    from meshpar.models.layers import Block
    from meshpar.plan.program import serve_report

    target = h100 if name == "h100" else v5p
    cfg = [
        "precision=bf16",
        "serve.slots=8",
        "serve.cache_length=512",
        "model.embed=512",
        "model.heads=8",
        "model.kv_heads=2",
    ]
    rep = serve_report(load_config(None, cfg), target)
    assert rep["decode"]["cache_slice_copies"] == 0 and not any("KV cache slice" in w for w in rep["warnings"])
    if name == "h100":  # the slice-returning path, compiled once
        monkeypatch.setattr(Block, "cache_views", False)
        old = serve_report(load_config(None, cfg), target)
        assert old["decode"]["cache_slice_copies"] >= 2  # k and v, at least
        assert any("cache_views = True" in w for w in old["warnings"])


def test_a_users_pipelined_vit_compiles_for_h100(h100):
    """Library first: examples/vit.py (the stage protocol) in 2 pipeline stages, by XLA:GPU. Its small
    dots find no Triton tiling without a device under jaxlib 0.10.2, so they take cuBLAS, with a note;
    jaxlib 0.11's XLA:GPU tiles them with Triton, and there is nothing to note."""
    from pathlib import Path

    from meshpar.plan.program import report

    vit = Path(__file__).resolve().parents[2] / "examples" / "vit.yaml"
    rep = report(load_config(str(vit), ["mesh.pipeline=2", "mesh.fsdp=1", "precision=bf16"]), h100)
    assert rep["target"]["fits"] and rep["collectives"]["summary"]["collective-permute"]["bytes"] > 0
    noted = any("xla_gpu_enable_triton_gemm=false" in w for w in rep["warnings"])
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        assert any(k.startswith("cublas:") for k in rep["target"]["kernels"]) and noted
    else:
        assert any(k.startswith("triton:") for k in rep["target"]["kernels"]) and not noted


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "meshpar.cli", *args], capture_output=True, text=True, timeout=600)


def test_inspect_json_target_end_to_end():
    """The issue's own command, at 1b and 4096 tokens: H100s, the peak under 80 GB, cuDNN attention."""
    out = _cli(
        "inspect",
        "--json",
        "--target",
        "h100",
        "--devices",
        "8",
        "model.size=1b",
        "batch.length=4096",
        "batch.global_size=8",
        "strategy=fsdp",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    t = json.loads(out.stdout)["target"]
    assert t["devices"] == 8 and t["device_kind"] == "NVIDIA H100 80GB HBM3" and t["peak_bytes"] < 80e9 and t["fits"]
    assert any(k.startswith("cudnn:fmha") for k in t["kernels"]) and t["compile_s"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "h10"], "unknown hardware 'h10' (did you mean 'h100'?)"),
        (["--target", "h100", "--devices", "12"], "--devices 12 cannot be formed from h100 nodes of 8"),
        (
            ["--target", "tpu-v5p", "--devices", "2"],
            "a deviceless tpu-v5p slice holds a power of two chips, at least one host of 4",
        ),
        (["--target", "tpu-v5p", "--topology", "2x2"], "--topology '2x2' is not a shape"),
        (["--topology", "1x1x8"], "--topology and --slices describe a --target"),
        (["--target", "tpu-v5p", "--slices", "0"], "--slices must be >= 1, got 0"),
        (["--target", "h100", "--topology", "1x2x8"], "--topology 1x2x8 holds 16 GPUs, not --devices 8"),
        (["--target", "h100", "model.attention=splash"], "model.attention=splash needs a TPU (this backend is gpu"),
    ],
)
def test_bad_target_input_is_one_line(capsys, args, message):
    from meshpar.cli import main

    code = main(["inspect", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and message in err[-1], err


def test_a_compiler_refusal_is_one_line_with_the_config(h100):
    from meshpar.core.errors import MeshparError
    from meshpar.plan.target import compile_errors

    with pytest.raises(MeshparError) as e:
        with compile_errors(h100, ["strategy=fsdp", "mesh.tensor=2"]):
            raise RuntimeError("INTERNAL: RET_CHECK failure (xla/service/spmd.cc:1) bad\nstack frames ...")
    assert str(e.value) == (
        "the h100 compiler refused this step (RuntimeError: INTERNAL: RET_CHECK failure "
        "(xla/service/spmd.cc:1) bad); config: strategy=fsdp mesh.tensor=2"
    )


def test_a_step_too_large_for_the_tpu_is_a_verdict_with_the_numbers_and_verify_goes_on(v5p, monkeypatch):
    """libtpu refuses at compile time a step that needs more HBM than the chip has (XLA:GPU compiles it,
    and its peak says so). That refusal is the plan's verdict: one line with the bytes asked for and the
    chip's, and under `plan --verify` that plan's row, with the other plans still compiled."""
    from rich.console import Console

    from meshpar.plan import dryrun
    from meshpar.plan.search import plan
    from meshpar.plan.target import DoesNotFit, argument_bytes, compile_errors, compile_trainer, hbm_exhausted
    from meshpar.train.step import trainer_for

    # the two forms libtpu versions print (jax 0.10.2's first), and any other error is not one
    assert hbm_exhausted(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(115.14G) exceeds available HBM (95.74G)."
    ) == {"temp": 115.14 * 2**30, "hbm": 95.74 * 2**30}
    assert hbm_exhausted(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 120.49G of 95.74G hbm. Exceeded hbm capacity by 24.75G."
    ) == {"used": 120.49 * 2**30, "hbm": 95.74 * 2**30}
    assert hbm_exhausted("INTERNAL: RET_CHECK failure") is None

    overrides = ["strategy=dp", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]
    trainer = trainer_for(load_config(None, TINY + overrides), devices=v5p.devices)
    state = argument_bytes(trainer)  # the tiny model's state and batch per chip: replicated, and split 8 ways
    fsdp = ["strategy=fsdp", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"]
    assert state <= 8 * argument_bytes(trainer_for(load_config(None, TINY + fsdp), devices=v5p.devices)) < 1.2 * state

    def refuse(options=None):
        raise RuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
            "(115.14G) exceeds available HBM (95.74G).\nstack frames ..."
        )

    trainer.compile = refuse
    with pytest.raises(DoesNotFit) as e:
        with compile_errors(v5p, overrides):
            compile_trainer(v5p, trainer)
    assert e.value.needed == pytest.approx(state + 115.14 * 2**30) and e.value.hbm == pytest.approx(95.74 * 2**30)
    line = str(e.value)
    assert "\n" not in line and line.startswith("does not fit on 8 x tpu-v5p: the step needs 115.14 GiB of temporaries")
    assert line.endswith("config: strategy=dp mesh.data=8 mesh.fsdp=1 mesh.tensor=1")

    # `plan --verify 2 --target`: the first plan refused, the second compiled; both rows, in rank order
    cfg = load_config(None, TINY)
    result = plan(cfg, 8, v5p.hardware, top=2)
    calls = []

    def compile_step(cfg, target=None):
        calls.append(cfg.strategy)
        if len(calls) == 1:
            with compile_errors(target, cfg):
                raise DoesNotFit(target, 120 * 2**30, 95.74 * 2**30, 100 * 2**30, 20 * 2**30)
        return _Compiled.trainer, _Compiled()

    class _Compiled:  # a compiled step's text and memory, as `compiled_numbers` reads them
        trainer = trainer_for(cfg, devices=v5p.devices)

        def as_text(self):
            return ""

        def memory_analysis(self):
            return None

    monkeypatch.setattr(dryrun, "compile_step", compile_step)
    rows = dryrun.verify(result, None, TINY, 2, v5p)
    assert len(calls) == 2 and [r["rank"] for r in rows] == [1, 2]
    assert not rows[0]["fits_compiled"] and rows[0]["target_peak"] == 120 * 2**30
    assert rows[0]["refused"].startswith("does not fit on 8 x tpu-v5p") and rows[1]["fits_compiled"]
    console = Console(record=True, width=300)
    dryrun.render(rows, console)
    assert "compiled: does not fit" in console.export_text()


def test_a_decode_step_too_large_for_the_tpu_is_a_verdict_that_names_the_serving_knobs(v5p, monkeypatch):
    """`inspect --serve --target tpu-*`: libtpu's refusal of a decode step too large for the chip is the
    same one-line verdict as a train step's, counting the weights and KV cache per chip and naming what
    shrinks them (no compile: the refusal is injected, with the form jax 0.10.2's libtpu prints)."""
    from meshpar.plan.program import serve_report
    from meshpar.plan.target import DoesNotFit, compile_errors
    from meshpar.serve.engine import Engine

    def refuse(self, options=None):
        held.append(sum(self.bytes_per_device().values()))
        raise RuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
            "(128.80G) exceeds available HBM (95.74G).\nstack frames ..."
        )

    held: list[int] = []
    monkeypatch.setattr(Engine, "compiled_generate", refuse)
    overrides = TINY + ["serve.slots=4"]
    with pytest.raises(DoesNotFit) as e:
        with compile_errors(v5p, overrides):
            serve_report(load_config(None, overrides), v5p)
    line = str(e.value)
    assert held[0] > 0 and e.value.needed == pytest.approx(held[0] + 128.80 * 2**30)
    assert "\n" not in line and line.startswith("does not fit on 8 x tpu-v5p: the decode step needs 128.80 GiB")
    assert "of weights and KV cache" in line and "serve.slots, serve.cache_length" in line
    assert line.endswith("config: " + " ".join(overrides))


def test_every_tpu_slice_size_is_a_topology_libtpu_accepts():
    """From one host (v5p: 2x2x1 chips, not 1x2x2, which libtpu refuses) up, sides shortest first where
    a host still tiles them (v5p:2x2x4), each described by libtpu without a compile."""
    from meshpar.plan.target import resolve, tpu_shape

    assert [tpu_shape(c, 3) for c in (4, 8, 16, 64)] == [(2, 2, 1), (2, 2, 2), (2, 2, 4), (4, 4, 4)]
    assert [tpu_shape(c, 2) for c in (4, 8, 256)] == [(2, 2), (2, 4), (16, 16)]
    for n in (4, 16):
        target = resolve("tpu-v5p", n)
        assert len(target.devices) == n and target.topology == f"v5p:{'x'.join(map(str, tpu_shape(n, 3)))}"


def test_a_missing_compiler_names_the_command_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPAR_COMPILERS", str(tmp_path))
    out = _cli("inspect", "--target", "tpu-v5p")
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"the TPU compiler is not installed in {tmp_path}: run `meshpar compilers --install tpu` once "
            "(it downloads about 0.2 GB from PyPI)"
        )
    )


@pytest.mark.parametrize(
    "devices,remat,seqs",
    [(8, "none", 16), (8, "full", 16), (1, "full", 4)],
    ids=["fsdp8-none", "fsdp8-full", "one-device-full"],
)
def test_the_planner_counts_what_the_h100_compile_keeps(h100, devices, remat, seqs):
    """The planner's memory against XLA:GPU's own buffer assignment, with and without recomputation:
    under `none` the target keeps the norms in fp32 and six [.., F] per layer, and `auto` attention at
    1k tokens is cuDNN's there (no [s, s] scores); before those rules the planner put a 1b `none`
    plan at 68 GiB that needed 95 GiB and ran out of memory on a real H100 (bench/RESULTS.md). On one
    device the loss and the layers' backward use one slot in turn and no weight is cast ahead of its
    GEMM: the planner said a whole Llama-3 8B does not fit on one H200 (143.95 GiB), and it trained
    there in 124.19 GiB; this row was 1.22x over before those rules."""
    from meshpar.plan.program import report
    from meshpar.plan.search import estimate
    from meshpar.plan.target import resolve

    target = h100 if devices == 8 else resolve("h100", devices)
    cfg = load_config(
        None,
        [
            "precision=bf16",
            "model.size=125m",
            "batch.length=1024",
            f"batch.global_size={seqs}",
            "strategy=fsdp",
            "mesh.data=1",
            f"mesh.fsdp={devices}",
            "mesh.tensor=1",
            f"model.remat={remat}",
        ],
    )
    cfg.devices = devices
    rep = report(cfg, target)
    compiled = rep["target"]["peak_bytes"]
    predicted = estimate(cfg, target.hardware)["memory"]["total"]
    assert 0.92 < predicted / compiled < 1.1, (predicted / 2**20, compiled / 2**20)
    if devices == 1:  # the logits and their cotangent share one slot (the live-range dump's own peak line
        # counts it twice and is at the loss); the heap peaks in the layers' backward, the loss's slot reused
        peak = rep["target"]["peak_buffers"]
        assert peak and not any(b["shape"] in ("bf16[4096,32000]", "bf16[4,1024,32000]") for b in peak)
        assert sum(b["bytes"] for b in peak if "slot_of" not in b) <= rep["memory"]["temp"]


@pytest.mark.parametrize(
    "strategy,mesh",
    [("zero1", ("mesh.data=8", "mesh.tensor=1")), ("tp_sp", ("mesh.data=2", "mesh.tensor=4"))],
    ids=["zero1", "tp_sp"],
)
def test_the_planner_counts_the_loss_phase_as_xla_gpu_schedules_it(h100, strategy, mesh):
    """125m at 4k tokens on 8 H100s, where the 500 MiB logits set the peak. ZeRO-1: XLA computes the
    head's weight gradient straight after the loss, so the loss and the layers' backward are two phases
    and the larger counts (the planner said 1.25x before). TP+SP: the same, as meshpar finishes a
    vocab-parallel head's backward before the layers' (`meshpar.nn.layers.after`; XLA:GPU left it until
    after them, holding the logits' cotangent through that backward, 1.38x the compiled peak with the
    old rule). `meshpar.plan.steptime.loss_phase`, bench/RESULTS.md."""
    from meshpar.plan.program import report
    from meshpar.plan.search import estimate

    cfg = load_config(
        None,
        ["precision=bf16", "model.size=125m", "batch.length=4096", "batch.global_size=16", f"strategy={strategy}"]
        + ["mesh.fsdp=1", *mesh],
    )
    cfg.devices = 8
    compiled = report(cfg, h100)["target"]["peak_bytes"]
    predicted = estimate(cfg, h100.hardware)["memory"]["total"]
    assert 0.9 < predicted / compiled < 1.1, (predicted / 2**20, compiled / 2**20)


def test_a_full_v5p_cube_is_a_torus_and_gathers_fsdp_weights_with_all_gather():
    """64 v5p chips (4x4x4) have their wraparound links, 16 (2x2x4) do not (Cloud TPU's topologies;
    MaxText's accelerator map). Without them libtpu lowered FSDP's weight gathers as
    dynamic-update-slice + all-reduce, twice the bytes on the wire (bench/RESULTS.md, issue 43)."""
    from meshpar.plan.target import resolve, tpu_wrap

    assert tpu_wrap((4, 4, 4)) == (True,) * 3 and tpu_wrap((2, 2, 4)) == (False,) * 3
    assert tpu_wrap((8, 16)) == (False, True, False) and tpu_wrap((16, 16)) == (True, True, False)
    assert len(resolve("tpu-v5e", 256).devices) == 256  # a 2D pod's wrap as libtpu takes it
    cube = resolve("tpu-v5p", 64)
    rep = _report(cube, "strategy=fsdp", "mesh.data=1", "mesh.fsdp=64", "mesh.tensor=1", "batch.global_size=64")
    kinds = rep["collectives"]["summary"]
    assert kinds["all-gather"]["bytes"] > 0
    assert kinds.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * kinds["all-gather"]["bytes"]


def test_a_users_libtpu_is_the_compiler_and_is_named(tmp_path, monkeypatch):
    """TPU_LIBRARY_PATH (JAX's convention) picks the libtpu, as MaxText's venv would; its version is
    read from the wheel beside it; a path that is no file is one line; meshpar's own setting, inherited
    by a child process, is not mistaken for the user's."""
    from meshpar.core.errors import MeshparError
    from meshpar.runtime import compilers

    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "libtpu.so").write_bytes(b"")
    (tmp_path / "libtpu-9.9.9.dist-info").mkdir()
    monkeypatch.delenv(compilers._SET_BY_MESHPAR, raising=False)
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(tmp_path / "libtpu" / "libtpu.so"))
    assert compilers._own_libtpu() == str(tmp_path / "libtpu" / "libtpu.so")
    assert compilers.version("tpu") == "libtpu 9.9.9"
    monkeypatch.setenv(compilers._SET_BY_MESHPAR, str(tmp_path / "libtpu" / "libtpu.so"))
    assert compilers._own_libtpu() is None
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(tmp_path / "nowhere.so"))
    with pytest.raises(MeshparError, match=r"^TPU_LIBRARY_PATH names .*nowhere.so, which is not a file: point it at"):
        compilers._own_libtpu()


def test_the_head_weight_is_gathered_after_the_layer_stack_not_held_across_it(v5p):
    """`meshpar.nn.layers.after`: the LM head's weight is read only once the stack's output exists, so
    libtpu's own live ranges start its gathered [E, V] after the forward layers. Without it libtpu
    gathered Llama-2 7B's head first and held it across every layer on 64 v5p chips (250 MB per device;
    peak 4.16 -> 4.07 GiB, bench/RESULTS.md, issue 43); at this size its scheduler does not, so this
    checks the order, and the bench the bytes. The forward layers are the forward `while` (jax 0.10's
    libtpu) or, where libtpu unrolls this 4-layer loop (jax 0.11's), its body's instructions."""
    import re

    from meshpar.plan.program import compile_with_live_ranges
    from meshpar.train.step import trainer_for

    cfg = load_config(
        None,
        TINY + ["strategy=fsdp", "model.vocab=4096", "model.layers=4", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"],
    )
    compiled, _, live, _ = compile_with_live_ranges(v5p, trainer_for(cfg, devices=v5p.devices))
    hlo = compiled.as_text()
    gather = next(
        m.group(1) for m in re.finditer(r"%(all-gather[.\d]*) = bf16\[(\d+),(\d+)\]", hlo) if "4096" in m.group(2, 3)
    )  # [E, V], V = 4096
    start = int(re.search(rf"^\s*{re.escape(gather)}\{{\}}:(\d+)-\d+$", live, re.M).group(1))
    op_names = dict(re.findall(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo, re.M))
    sequence = re.findall(r"^\s*(\d+):([\w.\-]+)$", live, re.M)  # the entry's schedule, as libtpu ran it
    forward = [int(at) for at, name in sequence if op_names.get(name, "").startswith("jit(_step_fn)/jvp()/while")]
    assert forward and start > max(forward), (start, forward)


def test_an_fsdp_head_finishes_its_backward_before_the_layers_on_tpu_only(h100, v5p):
    """`meshpar.nn.layers.head_backward_first`: under fsdp (the head's [E, V] gathered at its use) the
    training step meshpar writes for libtpu holds a barrier over the cotangents of the head's input
    and weight (two barriers with those types, the forward's and the backward's); for XLA:GPU, and
    under dp on either, only the forward's. Neither settles the logits' gradient: that is for a head
    split over the vocabulary. The bytes are the bench's (Llama-2 7B 4k on 64 v5p chips, 4.02 -> 3.72
    GiB); this reads the lowered program, no compile."""
    from meshpar.train.step import trainer_for
    from tests.conftest import barrier_operands

    x, w, logits = "tensor<8x256x64xbf16>", "tensor<64x512xf32>", "tensor<8x256x512xbf16>"

    def barriers(target, strategy, mesh):
        cfg = load_config(None, TINY + ["model.vocab=512", f"strategy={strategy}", *mesh])
        types = barrier_operands(trainer_for(cfg, devices=target.devices))
        return [t for t in types if x in t and w in t], [t for t in types if logits in t]

    fsdp, dp = ("mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"), ("mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1")
    assert [len(b) for b in barriers(v5p, "fsdp", fsdp)] == [2, 0]
    assert [len(b) for b in barriers(h100, "fsdp", fsdp)] == [1, 0]
    assert [len(b) for b in barriers(v5p, "dp", dp)] == [1, 0]


def test_inspect_target_names_the_buffers_live_at_the_compilers_peak(tpu_presets, gpu_presets):
    """Both compilers' own live ranges at their peak, read into the target report, largest first; the
    slots live at that instant cover the compiler's own peak (`meshpar.plan.buffers.peak_instant`)."""
    for rep in (tpu_presets["fsdp"], gpu_presets["fsdp"]):
        peak = rep["target"]["peak_buffers"]
        assert peak and [b["bytes"] for b in peak] == sorted((b["bytes"] for b in peak), reverse=True)
        assert all(b["bytes"] > 0 and b["shape"] != "?" and not b["name"].startswith("param") for b in peak)
        assert sum(b["bytes"] for b in peak) <= rep["memory"]["temp"]
    # the instant named holds the compiler's own peak (arguments, outputs and temporaries in their slots):
    # XLA:GPU's to 0.01%; libtpu's within 5%, its peak counting more than its dumps show (0.94-1.00 of it
    # over the five presets with libtpu 0.0.42.1 and with jax 0.11.2's; 0.997 for 125m fsdp on 8 chips)
    for rep, low in ((tpu_presets["fsdp"], 0.95), (gpu_presets["fsdp"], 0.999)):
        assert low * rep["target"]["peak_bytes"] <= rep["target"]["peak_buffers_held"] <= rep["target"]["peak_bytes"]


def test_the_planner_counts_zeros_gather_of_the_updated_weights_as_xla_gpu_schedules_it(h100):
    """ZeRO-1's update on 8 H100s for Llama-3 8B: XLA:GPU gathers the updated layers' fp32 weights into
    temporaries, but its scheduler's limit (0.95 (0.8 HBM - state) = 21.1 GiB here, below the 26 GiB
    of stacked weights) makes it gather them a few at a time. The planner used to hold a second whole
    copy of the weights (1.34 x the compiled peak); it now caps the gather at that limit."""
    from meshpar.plan.program import report
    from meshpar.plan.search import estimate

    llama3 = ["model.size=7b", "model.kv_heads=8", "model.mlp=14336", "model.vocab=128256"]
    cfg = load_config(None, TINY + llama3 + ["strategy=zero1", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"])
    cfg.devices = 8
    compiled = report(cfg, h100)["target"]["peak_bytes"]
    predicted = estimate(cfg, h100.hardware)["memory"]["total"]
    assert 0.95 < predicted / compiled < 1.1, (predicted / 2**30, compiled / 2**30)
