"""Evaluation on held-out data: `eval.every=N eval.batches=K`.

    ev = Evaluator(trainer, held_out_source, cfg.eval, cfg.batch, cfg.data.seed)   # meshpar.train.loop.make_evaluator
    rec = ev(state)      # {"loss", "perplexity", "batches", "tokens", "eval_s"}

The held-out stream (`meshpar.train.data.make_eval_source`): for the synthetic language and user sources,
the batches of steps EVAL_STEP .. EVAL_STEP + K - 1, which no training run reaches, so every
evaluation reads the same K batches and none of them is a training batch; for token/text data,
windows of `eval.path` or of the held-out last `eval.holdout` of `data.path` (training then reads
only the rest). The K batches are built once, at the first evaluation, and kept on the devices.

The eval step is the train step's loss without gradients or update: the model in eval mode
(`nnx.Module.eval()`: dropout off), its non-Param state left as it was. The loss is the one the step
logs as `loss` (for the built-in LM loss the cross-entropy, without the MoE auxiliary terms), one
weighted mean over the K batches as over a step's microbatches (`meshpar.core.objective`);
perplexity = exp(mean loss) (meaningful for the LM loss). One compiled program serves every call.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.core import precision as precision_lib
from meshpar.core.config import BatchConfig, EvalConfig
from meshpar.core.layout import use_layout
from meshpar.train.batches import Batches
from meshpar.train.data import EVAL_STEP


class Evaluator:
    """`evaluation.batches` held-out batches of `source` (`make_eval_source`), shaped as `batch`
    (`cfg.batch`) and drawn with `seed` (`data.seed`), scored by `trainer`'s loss."""

    def __init__(self, trainer, source, evaluation: EvalConfig, batch: BatchConfig, seed: int):
        self.trainer, self.source = trainer, source
        self.evaluation, self.batch, self.seed = evaluation, batch, seed
        self.batches = None
        tr = trainer
        replicated = NamedSharding(tr.mesh, P())
        self._step = jax.jit(
            self._loss,
            in_shardings=(tr.state_shardings["params"], tr.state_shardings["vars"], tr.batch_sharding),
            out_shardings=replicated,
        )

    def _loss(self, params, vars, batch):
        tr = self.trainer
        with use_layout(tr.layout), precision_lib.use_policy(tr.policy):
            model = tr.spec.merge(params, vars)
            if hasattr(model, "eval"):
                model.eval()  # deterministic: dropout off (a no-op for models without it)
            loss, metrics = tr.loss(model, batch)
            weight = tr.weight(batch)  # the batch's share of the held-out set's mean (meshpar.core.objective)
        return (metrics.get("ce", loss) if isinstance(metrics, dict) else loss), weight

    def _held_out(self):
        if self.batches is None:
            it = Batches(
                self.source,
                self.trainer.batch_sharding,
                self.batch.global_size,
                self.batch.length,
                self.seed,
                step=EVAL_STEP,
                batch_spec=self.trainer.batch_spec,
            )
            self.batches = [next(it) for _ in range(self.evaluation.batches)]
        return self.batches

    def __call__(self, state) -> dict:
        """The loss over the K held-out batches as one weighted mean (each batch counts its loss's
        weight, the targets it scores for the LM loss; one device->host read for all of them)."""
        t0 = time.perf_counter()
        losses, weights = zip(*[self._step(state["params"], state["vars"], b) for b in self._held_out()])
        w = jnp.stack(weights)
        loss = float(jax.device_get(jnp.sum(jnp.stack(losses) * w) / jnp.maximum(jnp.sum(w), 1e-30)))
        rows = self.batch.global_size * len(losses)
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "batches": len(losses),
            "tokens": rows * self.batch.length if self.trainer.is_lm else None,
            "eval_s": time.perf_counter() - t0,
        }
