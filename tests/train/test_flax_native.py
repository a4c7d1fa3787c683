"""A model written with Flax's own sharding API only (tests/train/flax_native.py: no meshpar import;
mesh-axis constraints with `jax.lax.with_sharding_constraint`, logical ones with
`flax.linen.with_logical_constraint`) trains inside meshpar: its step under fsdp, tp_sp and 1F1B
equals one device (loss, grad norm and the gradients, as AdamW's first moment after one step), and
its logical constraints land where `meshpar.constrain` puts the same names. A parameter annotated with
mesh-axis names gets one warning line saying how to map them."""

import jax
import numpy as np
import pytest
from flax import nnx

import meshpar
from meshpar.core.batch import Leaf
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel, tiered
from tests.train.flax_native import VOCAB, FlaxNative

B, T = 16, 8
SPEC = {k: Leaf((B, T), np.int32, ("batch", "length")) for k in ("inputs", "targets")}


def _batch():
    rng = np.random.default_rng(0)
    return {k: rng.integers(0, VOCAB, (B, T)).astype(np.int32) for k in SPEC}


def _first_moment(opt_state):
    import optax

    adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=adam) if adam(s)).mu


def _one_step(cfg, n: int):
    tr = Trainer(cfg, devices=devices(n), model=FlaxNative, loss=meshpar.stage_loss, batch_spec=SPEC)
    state, metrics = tr.step(tr.init(), jax.device_put(_batch(), tr.batch_sharding))
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(_first_moment(state["opt"]))


COMMON = ["precision=fp32", "steps=2", f"batch.global_size={B}", f"batch.length={T}"]


@pytest.fixture(scope="module")
def one_device():
    return _one_step(make_cfg(*COMMON, "strategy=dp", mesh={}), 1)


CASES = {
    "fsdp": ("strategy=fsdp", {"data": 2, "fsdp": 4}),
    "tp_sp": ("strategy=tp_sp", {"data": 2, "tensor": 4}),
    "1f1b": ("strategy=fsdp_tp", {"pipeline": 2, "fsdp": 2, "tensor": 2}, "pipeline.schedule=1f1b"),
}


@pytest.mark.parametrize("case", tiered(sorted(CASES), {"tp_sp", "1f1b"}))
def test_a_flax_native_model_trains_like_one_device(case, one_device):
    strategy, mesh, *extra = CASES[case]
    loss, norm, mu = _one_step(make_cfg(*COMMON, strategy, "pipeline.microbatches=2", *extra, mesh=mesh), 8)
    loss0, norm0, mu0 = one_device
    assert abs(loss - loss0) / loss0 <= 1e-5
    assert abs(norm - norm0) / norm0 <= 1e-5
    assert rel(mu, mu0) <= 1e-5


def test_flax_logical_constraints_land_where_meshpar_puts_them():
    """Under tp_sp on data=2 x tensor=4, tracing the block under the step's layout: each
    `with_logical_constraint` in the jaxpr carries the spec `Layout.spec` gives its names."""
    import flax.linen as nn

    from meshpar.core.layout import Layout, use_layout
    from meshpar.core.mesh import make_mesh
    from meshpar.core.rules import get_strategy

    cfg = make_cfg(*COMMON, "strategy=tp_sp", mesh={"data": 2, "tensor": 4})
    layout = Layout(make_mesh(cfg.mesh, devices(8)), get_strategy("tp_sp"))
    names = [("batch", "length", "embed"), ("batch", "seq", "mlp"), ("batch", "length", "heads", "kv")]

    def f(*xs):
        with use_layout(layout):
            return [nn.with_logical_constraint(x, n) for x, n in zip(xs, names)]

    jaxpr = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct((8,) * len(n), np.float32) for n in names])
    trim = lambda spec: tuple(spec)[: max([0] + [i + 1 for i, p in enumerate(spec) if p is not None])]  # noqa: E731
    got = [trim(e.params["sharding"].spec) for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert got == [tuple(layout.spec(n)) for n in names]
    assert got[0] == ("data", "tensor")  # sequence parallel: length over tensor


def test_parameters_named_by_mesh_axes_get_one_line_saying_how_to_map_them():
    class MeshNamed(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), (16, 32)), sharding=("data", "tensor"))

        def __call__(self, x):
            return x @ self.w[...]

    cfg = make_cfg(*COMMON, "strategy=fsdp_tp", mesh={"data": 2, "fsdp": 2, "tensor": 2})
    tr = Trainer(
        cfg,
        devices=devices(8),
        model=MeshNamed,
        loss=lambda m, b: ((m(b) ** 2).mean(), {}),
        batch_spec=Leaf((B, 16), np.float32, ("batch", None)),
    )
    lines = [w for w in tr.warnings() if "mesh axes" in w]
    assert len(lines) == 1 and "\n" not in lines[0], tr.warnings()
    assert "'w'" in lines[0] and "('data', 'tensor')" in lines[0]
    assert "rules=[[data, data], [tensor, tensor]]" in lines[0]


def test_a_mesh_axis_constraint_over_an_axis_the_pipeline_holds_manual_is_one_line():
    """Under dp on pipeline=2 x data=2 x tensor=2 the pipeline is manual over `data`, where JAX refuses
    `pre`'s P(("data", "fsdp"), ...): one line saying what to write instead."""
    from meshpar.core.errors import ConfigError

    cfg = make_cfg(*COMMON, "strategy=dp", "pipeline.schedule=1f1b", mesh={"pipeline": 2, "data": 2, "tensor": 2})
    tr = Trainer(cfg, devices=devices(8), model=FlaxNative, loss=meshpar.stage_loss, batch_spec=SPEC)
    with pytest.raises(ConfigError, match=r"over mesh axis 'data', which this pipeline runs manual .* logical names"):
        tr.lower()
