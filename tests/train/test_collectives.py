"""Each strategy's compiled step holds the collectives (by bytes) and the memory it promises.

One compile per strategy (module fixture), fp32, remat off (so the backward's collectives are the
strategy's own, not a recomputed forward's). Bytes are whole-tensor sizes per step, loop trip
counts applied (meshpar.plan.inspect). BLE = batch x length x embed activation bytes.
"""

import math

import jax
import numpy as np
import pytest

from meshpar.core.sharding import bytes_per_device, sharding_table
from meshpar.plan import inspect as I
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg

LAYERS, B, T, E = 2, 16, 16, 64
BLE = B * T * E * 4
SETUPS = {
    "dp": ({"data": 8}, 8, []),
    "fsdp": ({"data": 8}, 8, []),
    "zero1": ({"data": 8}, 8, ["batch.microbatches=2"]),
    "zero1_m1": ({"data": 8}, 8, []),
    "zero1_m4": ({"data": 8}, 8, ["batch.microbatches=4", "batch.global_size=32"]),
    "zero2": ({"data": 8}, 8, ["batch.microbatches=2"]),
    "dp_acc": ({"data": 8}, 8, ["batch.microbatches=2"]),
    "tp": ({"tensor": 4}, 4, []),
    "tp_sp": ({"tensor": 4}, 4, []),
}


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            mesh, n, extra = SETUPS[name]
            strategy = {"dp_acc": "dp", "zero1_m1": "zero1", "zero1_m4": "zero1"}.get(name, name)
            tr = Trainer(make_cfg(f"strategy={strategy}", "model.remat=none", *extra, mesh=mesh), devices=devices(n))
            c = tr.compile()
            ops = I.collectives(c.as_text(), tr.describe()["mesh"])
            cache[name] = (tr, ops, I.summarize(ops), I.memory(c))
        return cache[name]

    return get


def kind_bytes(summary, kind):
    return summary.get(kind, {"bytes": 0})["bytes"]


def param_bytes(tr):
    return tr.spec.num_params * 4


def test_dp_all_reduces_exactly_the_gradient_bytes(compiled):
    tr, _, s, _ = compiled("dp")
    assert set(s) == {"all-reduce"}
    assert param_bytes(tr) <= kind_bytes(s, "all-reduce") <= param_bytes(tr) * 1.001  # + the loss scalar
    assert s["all-reduce"]["axes"] == ["data"]


def test_fsdp_gathers_weights_scatters_gradients_and_holds_one_nth(compiled):
    tr, _, s, mem = compiled("fsdp")
    pb = param_bytes(tr)
    norms = sum(r["bytes"] for r in sharding_table(tr.spec, tr.layout) if r["spec"] == "replicated")
    assert kind_bytes(s, "all-gather") >= pb - norms  # every sharded weight gathered for use
    assert kind_bytes(s, "reduce-scatter") >= 0.9 * pb  # gradients reduce-scattered ...
    assert kind_bytes(s, "all-reduce") <= norms + 1024  # ... only norm scales and scalars all-reduced
    held = sum(r["bytes_per_device"] for r in sharding_table(tr.spec, tr.layout))
    assert held <= pb / 8 + norms
    _, _, _, dp_mem = compiled("dp")  # params + Adam state per device: 1/N
    assert mem["argument"] <= dp_mem["argument"] / 8 * 1.15


def _layer_ops(ops, kind):
    """Bytes per step of `kind` ops on [B, T, E] activations inside the scanned layer loop."""
    return sum(o["bytes"] * o["times"] for o in ops if o["kind"] == kind and o["times"] == LAYERS and o["bytes"] == BLE)


def test_tp_all_reduces_activations_twice_per_layer_each_way_and_never_gathers_weights(compiled):
    _, ops, s, _ = compiled("tp")
    assert _layer_ops(ops, "all-reduce") == 4 * LAYERS * BLE  # Megatron f/g: 2 forward + 2 backward
    assert kind_bytes(s, "all-gather") == 0
    assert s["all-reduce"]["axes"] == ["tensor"]


def test_tp_sp_replaces_all_reduces_with_gathers_and_scatters(compiled):
    _, tp_ops, _, _ = compiled("tp")
    _, ops, s, _ = compiled("tp_sp")
    tp_volume = 2 * _layer_ops(tp_ops, "all-reduce")  # ring all-reduce = reduce-scatter + all-gather
    assert _layer_ops(ops, "all-reduce") == 0
    rs, ag = _layer_ops(ops, "reduce-scatter"), _layer_ops(ops, "all-gather")
    assert rs == 4 * LAYERS * BLE  # each all-reduce became one reduce-scatter ...
    assert 4 * LAYERS * BLE <= ag <= 6 * LAYERS * BLE  # ... and one all-gather (XLA may regather the
    assert tp_volume <= rs + ag <= tp_volume * 1.5  # column-parallel input for the weight grad)


def _opt_bytes_per_device(tr):
    abstract = tr.abstract_state()["opt"]
    return sum(bytes_per_device(a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(abstract))


def test_zero1_keeps_params_whole_and_optimizer_state_at_one_nth(compiled):
    tr, _, s, mem = compiled("zero1")
    dp, _, _, dp_mem = compiled("dp_acc")
    assert all(r["bytes_per_device"] == r["bytes"] for r in sharding_table(tr.spec, tr.layout))
    assert _opt_bytes_per_device(tr) <= _opt_bytes_per_device(dp) / 8 * 1.1
    pb = param_bytes(tr)
    assert mem["argument"] <= dp_mem["argument"] - 0.8 * 2 * pb * (1 - 1 / 8)  # Adam's m and v: 2 x params


def _reduced(s):
    return kind_bytes(s, "all-reduce") + kind_bytes(s, "reduce-scatter")


@pytest.mark.parametrize("name", ["zero1_m1", "zero1", "zero1_m4", "zero2"])
def test_zero_reduce_scatters_gradients_and_all_gathers_parameters(compiled, name):
    """ZeRO (Rajbhandari et al. 2020) per step: gradients reduce-scattered (Psi), the update on 1/N,
    updated parameters all-gathered (Psi); no full-gradient all-reduce."""
    tr, _, s, _ = compiled(name)
    pb = param_bytes(tr)
    assert kind_bytes(s, "all-reduce") <= 0.01 * pb
    assert kind_bytes(s, "reduce-scatter") >= 0.95 * pb
    assert 0.95 * pb <= kind_bytes(s, "all-gather") <= 1.05 * pb


def test_zero1_reduces_once_per_step_whatever_the_accumulation(compiled):
    """ZeRO-1 accumulates each replica's own gradients and reduces once: M = 1, 2, 4 move the same bytes."""
    one = _reduced(compiled("zero1_m1")[2])
    for name in ("zero1", "zero1_m4"):
        assert abs(_reduced(compiled(name)[2]) - one) <= 0.05 * one


def test_zero2_reduce_scatters_gradients_into_a_sharded_accumulator(compiled):
    tr, _, s, mem = compiled("zero2")
    _, _, _, z1_mem = compiled("zero1")
    pb = param_bytes(tr)
    assert kind_bytes(s, "reduce-scatter") >= 0.95 * 2 * pb  # each of 2 microbatches reduce-scattered
    assert kind_bytes(s, "all-reduce") <= 0.01 * pb
    assert mem["temp"] < z1_mem["temp"]  # 1/N gradient accumulator


def test_sharded_init_never_materialises_the_whole_model_on_one_device():
    tr = Trainer(make_cfg("strategy=fsdp", mesh={"data": 8}), devices=devices(8))
    init = tr._init.lower(jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
    mem = I.memory(init)
    state_bytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tr.abstract_state()))
    assert mem["output"] <= state_bytes / 8 * 1.1
    assert mem["temp"] < state_bytes / 4


def test_layers_axis_survives_into_optimizer_state_shardings():
    tr = Trainer(make_cfg("strategy=fsdp", mesh={"data": 8}), devices=devices(8))
    params = tr.state_shardings["params"]
    adam = tr.state_shardings["opt"][1][0]  # chain(clip, adamw) -> ScaleByAdamState
    for tree in (adam.mu, adam.nu):
        for (_path, sh), (_, psh), (_, _shape) in zip(
            jax.tree_util.tree_leaves_with_path(tree),
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree_util.tree_leaves_with_path(tr.spec.shapes),
        ):
            assert sh.spec == psh.spec
    wq = tr.spec.logical["layers"]["attn"]["wqkv"]
    assert wq[0] == "layers" and tr.spec.shapes["layers"]["attn"]["wqkv"].shape[0] == LAYERS


def test_fsdp_gradients_are_reduce_scattered_under_bf16_compute_too():
    """bf16 weights' gradients pass through converts before the per-device slice; still a reduce-scatter."""
    tr = Trainer(make_cfg("strategy=fsdp", "precision=bf16", mesh={"data": 8}), devices=devices(8))
    s = I.summarize(I.collectives(tr.compile().as_text(), tr.describe()["mesh"]))
    assert kind_bytes(s, "reduce-scatter") >= 0.9 * param_bytes(tr)
