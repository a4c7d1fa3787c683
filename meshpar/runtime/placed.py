"""A model on its mesh: what training (`meshpar.train.state.TrainSetup`) and serving
(`meshpar.serve.placement.Placement`) both build on, set up once.

    placed = PlacedModel.from_config(cfg, model=factory, devices=devices)
    placed.mesh, placed.policy, placed.spec     # the device mesh, the precision policy, shapes + logical axes
    placed.init(key)                             # {"params", "vars"}: the model born (trace it under jit)
    placed.pretrained(shardings, shapes)         # model.init_from's parameters, each read into its shard
    placed.module(params, vars)                  # the nnx.Module of given state

The layout (which mesh axes each logical name takes) is not part of it: training lays the model out
by `strategy` and serving by `serve.strategy`, each over this mesh.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from meshpar.core import precision as precision_lib
from meshpar.core.mesh import make_mesh
from meshpar.core.registry import default_model
from meshpar.core.sharding import building, model_spec


class PlacedModel:
    """`factory(rngs) -> nnx.Module` traced once on `mesh` under the precision `policy` (`spec`:
    `meshpar.core.sharding.ModelSpec`); `init_from`: `model.init_from` (hf:DIR) or None."""

    def __init__(
        self, mesh, policy, factory: Callable, init_from: str | None = None, require_annotations: bool = False
    ):
        self.mesh, self.policy, self.factory, self.init_from = mesh, policy, factory, init_from
        self.spec = model_spec(factory, policy, require_annotations)

    @classmethod
    def from_config(cls, cfg, model: Callable | None = None, devices=None, strict: bool | None = None) -> PlacedModel:
        """The model a run config names (`cfg.model`, or the factory `model`) on its mesh (`cfg.mesh`
        over `devices`, default all) in its precision (`cfg.precision`); `strict`: a variable without
        logical axis names is an error (default: `train.require_annotations`)."""
        strict = cfg.train.require_annotations if strict is None else strict
        return cls(
            make_mesh(cfg.mesh, devices),
            precision_lib.get_policy(cfg.precision),
            model or default_model(cfg),
            cfg.model.init_from,
            strict,
        )

    @property
    def abstract(self):
        """The model traced without memory (`nnx.eval_shape`): its methods and config, no arrays (the
        trace `model_spec` made)."""
        return self.spec.abstract

    def init(self, key) -> dict:
        """The model born from `key`: {"params": nnx.Param state, "vars": the rest}, pure dicts."""
        with building(self.policy):
            model = self.factory(nnx.Rngs(key))
        return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "vars": self.spec.vars_of(model)}

    def pretrained(self, shardings, shapes, info: Callable[[str], None] | None = None) -> dict:
        """`init_from`'s parameters as a pure dict like `shapes`, each array born in `shardings`."""
        from meshpar.io import hf  # local: the safetensors reader loads only for a run that reads one

        return hf.load(self.init_from, self.abstract, shardings, shapes, info)

    def module(self, params, vars=None):
        """The nnx.Module of these parameters and variables."""
        return self.spec.merge(params, {} if vars is None else vars)
