"""The target tier's accelerator code paths, compiled for 8 H100s and 8 TPU v5p chips by their own
compilers: pipelines, context parallelism (the ring's hops in turn), dropless MoE's ragged all-to-all,
the serving decode step with its KV cache in place, a user's pipelined ViT, and the LM head's order
around the layer stack. Fixtures: `tests/plan/conftest.py`."""

import jax
import pytest

from meshpar.core.config import load_config
from tests.plan.conftest import TINY, _report

pytestmark = pytest.mark.usefixtures("target_compilers")


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
