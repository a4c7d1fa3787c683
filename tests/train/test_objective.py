"""One objective per step (meshpar/core/objective.py): a batch of packed documents, whose rows count
very different numbers of targets, gives the whole batch's token-weighted mean loss and its gradients
however the step cuts it: accumulation microbatches (1, 2, 4) under ZeRO-1 (its per-replica
accumulation), ZeRO-2 (its sharded accumulator) and FSDP, and GPipe / 1F1B / interleaved pipelines
(manual over `data`, with accumulation around 1F1B);
so does a user's loss that declares its weights (`meshpar.weighted`), pipelined. Each equals one device
on the whole batch. An equal mean of the parts' means (the old objective) misses by far more.

What is compared after one step: the logged loss and grad norm, and AdamW's first moment, which after
one step is (1 - b1) x the (clipped) gradient: the gradients themselves, not the sign-like update.
(Accumulation under ZeRO-2 of unweighted rows, which test_equivalence.py held, is the case of equal
weights.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshpar
from meshpar.core.batch import Leaf, lm_batch_spec
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, rel, tiered
from tests.parallel.pipelines import TINY

B, T = 16, 8


def documents(seed: int = 0) -> dict:
    """A packed-documents batch [B, T+1]: row r holds r % 5 + 1 documents, so the targets each row
    counts (those inside their input's document) run from T down to T - 4."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T + 1), np.int32)
    for r in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T + 1), r % 5, replace=False))
        for c in cuts:
            seg[r, c:] += 1
    pos = np.zeros_like(seg)
    for r in range(B):
        for t in range(1, T + 1):
            pos[r, t] = 0 if seg[r, t] != seg[r, t - 1] else pos[r, t - 1] + 1
    return {"tokens": rng.integers(0, 64, (B, T + 1)).astype(np.int32), "segment_ids": seg, "positions": pos}


def first_moment(opt_state):
    """AdamW's mu after the first step: (1 - b1) x the gradient."""
    import optax

    adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=adam) if adam(s)).mu


def one_step(cfg, n: int, model=None, loss=None, batch=None, spec=None):
    """One step from the init of `cfg` on n devices -> (loss, grad norm, AdamW's mu) on the host."""
    spec = lm_batch_spec(B, T, documents=True) if spec is None else spec
    tr = Trainer(cfg, devices=devices(n), model=model, loss=loss, batch_spec=spec)
    state = tr.init()
    batch = documents() if batch is None else batch
    state, metrics = tr.step(state, jax.device_put(batch, tr.batch_sharding))
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.device_get(first_moment(state["opt"]))


def assert_same(got, want, tol: float = 1e-5):
    (loss, norm, mu), (loss0, norm0, mu0) = got, want
    assert abs(loss - loss0) / loss0 <= tol, (loss, loss0)
    assert abs(norm - norm0) / norm0 <= tol, (norm, norm0)
    assert rel(mu, mu0) <= tol


LM = [*TINY, "model.layers=4", "steps=2"]


@pytest.fixture(scope="module")
def whole():
    """One device, the whole batch at once: the objective every cut must give."""
    return one_step(make_cfg(*LM, "strategy=dp", mesh={}), 1)


def test_the_batch_is_uneven_enough_to_tell_the_objectives_apart(whole):
    """The equal mean of two halves' (or of eight replicas') weighted means differs from the whole
    batch's weighted mean by far more than the tolerance the cuts below are held to."""
    from meshpar.nn.stages import lm_rows

    rows = lm_rows(documents())
    w = np.asarray(rows["weights"])
    assert len(set(w.sum(1).tolist())) == 5
    halves = [w[k::2].sum() for k in range(2)]  # accumulation's rows i*M + k
    assert abs(halves[0] - halves[1]) / sum(halves) > 0.02


CUTS = {
    # (strategy, mesh, batch.microbatches): ZeRO-1 accumulates per replica (a vmap over 8 replicas
    # of 1 row each), ZeRO-2 sums sharded microbatch gradients; microbatches=1 is GSPMD's own
    # global mean, which held before
    "zero1-M2": ("zero1", {"data": 8}, 2),
    "zero2-M4": ("zero2", {"data": 2, "fsdp": 2, "tensor": 2}, 4),
    "fsdp-M1": ("fsdp", {"data": 2, "fsdp": 4}, 1),
}


@pytest.mark.parametrize("case", tiered(sorted(CUTS), {"zero1-M2"}))
def test_accumulation_and_replicas_take_the_whole_batchs_weighted_mean(case, whole):
    strategy, mesh, m = CUTS[case]
    assert_same(one_step(make_cfg(*LM, f"strategy={strategy}", f"batch.microbatches={m}", mesh=mesh), 8), whole)


PIPELINES = {
    # (schedule, virtual stages, pipeline microbatches, batch.microbatches) on pipeline=2 x data=2 x
    # tensor=2 under dp: manual over `data`, so each replica's microbatches count their own shares
    "gpipe": ("gpipe", 1, 4, 1),
    "1f1b-accumulating": ("1f1b", 1, 2, 2),
    "interleaved": ("interleaved", 2, 4, 1),
    # manual over `context` too: a microbatch's weight is its sequences' shards' summed
    "1f1b-context": ("1f1b", 1, 2, 1, {"pipeline": 2, "context": 2, "data": 2}),
}


@pytest.mark.parametrize("case", tiered(sorted(PIPELINES), {"1f1b-accumulating"}))
def test_pipelines_take_the_whole_batchs_weighted_mean(case, whole):
    schedule, v, m, k, *mesh = PIPELINES[case]
    cfg = make_cfg(
        *LM,
        "strategy=dp",
        f"pipeline.schedule={schedule}",
        f"pipeline.virtual_stages={v}",
        f"pipeline.microbatches={m}",
        f"batch.microbatches={k}",
        mesh=mesh[0] if mesh else {"pipeline": 2, "data": 2, "tensor": 2},
    )
    assert_same(one_step(cfg, 8), whole)


# -- a user's loss that declares its weights -------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.w = meshpar.param(rngs, (16, 16), ("embed", "mlp"), std=0.3)

    def __call__(self, x):
        return jnp.tanh(x @ self.w[...])


class Masked(nnx.Module):
    """A stage-protocol model whose loss is a masked mean: sum(mask l) / sum(mask), declared as such."""

    def __init__(self, rngs):
        self.embed = meshpar.param(rngs, (8, 16), ("vocab", "embed"), std=0.5)
        self.layers = meshpar.stacked(Block, 2, rngs)

    def pre(self, batch):
        return jnp.take(self.embed[...], batch["ids"], axis=0)

    def post(self, x):
        return x.sum(-1)  # [b, T]

    @meshpar.weighted(lambda batch: batch["mask"].sum())
    def loss(self, outputs, batch):
        mask = batch["mask"]
        return (mask * (outputs - batch["target"]) ** 2).sum() / mask.sum(), {}


def _masked_batch():
    rng = np.random.default_rng(1)
    mask = (np.arange(T)[None, :] < (np.arange(B) % 7 + 1)[:, None]).astype(np.float32)  # 1..7 tokens a row
    return {
        "ids": rng.integers(0, 8, (B, T)).astype(np.int32),
        "target": rng.normal(size=(B, T)).astype(np.float32),
        "mask": mask,
    }


MASKED_SPEC = {
    "ids": Leaf((B, T), np.int32, ("batch", "length")),
    "target": Leaf((B, T), np.float32, ("batch", "length")),
    "mask": Leaf((B, T), np.float32, ("batch", "length")),
}


def test_a_users_declared_weights_hold_through_1f1b_and_accumulation():
    """Masked's loss, declared weighted by its mask: 1F1B over pipeline=2 x data=2 x tensor=2 with 2
    accumulation microbatches of 2 pipeline microbatches equals one device on the whole batch."""
    run = lambda cfg, n: one_step(  # noqa: E731
        cfg, n, Masked, meshpar.stage_loss, _masked_batch(), MASKED_SPEC
    )
    common = ["precision=fp32", "steps=2", "batch.global_size=16", "strategy=dp"]
    want = run(make_cfg(*common, mesh={}), 1)
    got = run(
        make_cfg(
            *common,
            "pipeline.schedule=1f1b",
            "pipeline.microbatches=2",
            "batch.microbatches=2",
            mesh={"pipeline": 2, "data": 2, "tensor": 2},
        ),
        8,
    )
    assert_same(got, want)


def test_evaluation_takes_one_weighted_mean_over_its_held_out_batches():
    """Two held-out batches of packed documents, one with far fewer counted targets: the eval loss is
    their targets' mean, sum(l_k w_k) / sum(w_k), not the mean of the two batches' means."""
    from meshpar.nn.stages import lm_weight
    from meshpar.train.evaluate import Evaluator

    cfg = make_cfg(*LM, "strategy=dp", mesh={})
    tr = Trainer(cfg, devices=devices(1), batch_spec=lm_batch_spec(B, T, documents=True))
    state = tr.init()
    few = documents(1)
    few["segment_ids"] = np.tile(np.arange(T + 1, dtype=np.int32), (B, 1)) // 2  # documents of 2 tokens
    few["positions"] = np.tile(np.arange(T + 1, dtype=np.int32) % 2, (B, 1))
    ev = Evaluator(tr, None, cfg.eval, cfg.batch, 0)
    ev.batches = [jax.device_put(b, tr.batch_sharding) for b in (documents(0), few)]
    losses = [float(ev._step(state["params"], state["vars"], b)[0]) for b in ev.batches]
    w = [float(lm_weight(b)) for b in (documents(0), few)]
    assert w[1] < 0.7 * w[0]
    want = (losses[0] * w[0] + losses[1] * w[1]) / sum(w)
    assert ev(state)["loss"] == pytest.approx(want, rel=1e-6)
    assert abs(want - sum(losses) / 2) > 1e-5 * want  # far beyond the tolerance: the two means differ
