"""Context parallelism in training: 3 steps of the tiny decoder (flash attention, fp32) with
sequences split over `context` alone and combined with data, fsdp x tensor, pipeline (GPipe, 1F1B,
interleaved: the stages manual over `context`), expert parallelism (dropless, and with capacity,
where the balanced order must not change which tokens are dropped), accumulation, packed documents
and the ring give the losses of the 1-device run (relative difference <= 1e-5). A pipeline averages
its microbatches' losses as gradient accumulation does, so packed documents (whose microbatches
weigh different numbers of targets) are compared with a 1-device run accumulating as many."""

import numpy as np
import pytest

from meshpar.core.batch import lm_batch_spec
from meshpar.train.data import MarkovLanguage, Span
from meshpar.train.step import Trainer
from tests.conftest import devices, make_cfg, stacked_stages, train_steps

COMMON = ["model.attention=flash", "batch.length=32", "batch.global_size=8", "model.layers=2"]
MOE = ["model.name=moe", "moe.num_experts=4", "moe.capacity_factor=null"]
CAPACITY_MOE = ["model.name=moe", "moe.num_experts=4", "moe.capacity_factor=1.25"]  # drops tokens: order matters


def packed_source(vocab: int):
    """Random tokens cut into documents of 5..40 tokens: rows carry segment ids and positions."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, vocab, 4096).astype(np.int32)
    starts = np.unique(np.concatenate([[0], np.cumsum(rng.integers(5, 40, 200))]))
    return Span(tokens, "packed", starts[starts < len(tokens)])


def losses(extra, mesh, n, docs=False, trainer=False):
    """Per-step losses of 3 steps (and the Trainer, with `trainer`) of COMMON + `extra` on `mesh`."""
    cfg = make_cfg(*COMMON, *extra, mesh=mesh)
    spec = lm_batch_spec(cfg.batch.global_size, cfg.batch.length, documents=True) if docs else None
    tr = Trainer(cfg, devices=devices(n), batch_spec=spec)
    vocab = tr.spec.model_config.vocab
    source = packed_source(vocab) if docs else MarkovLanguage(vocab, 4, 1)
    got = train_steps(tr, source, cfg, 3)[1]
    return (got, tr) if trainer else got


_REF: dict = {}


def reference(extra, docs):
    key = (tuple(extra), docs)
    if key not in _REF:
        _REF[key] = losses(extra, {}, 1, docs)
    return _REF[key]


PIPE = ["pipeline.microbatches=2"]
CASES = {  # name: (config, mesh, packed documents?, what the 1-device reference adds)
    "context=8": ([], {"context": 8}, False, []),
    "context=4 x data=2": ([], {"context": 4, "data": 2}, False, []),
    "fsdp_tp: context=2 x fsdp=2 x tensor=2": (["strategy=fsdp_tp"], {"context": 2, "fsdp": 2, "tensor": 2}, False, []),
    "tp_sp: context=2 x tensor=2, remat, accumulation": (
        ["strategy=tp_sp", "model.remat=save_dots", "batch.microbatches=2"],
        {"context": 2, "tensor": 2, "data": 2},
        False,
        [],
    ),
    "moe: context=2 x expert=2 x data=2": (MOE, {"context": 2, "expert": 2, "data": 2}, False, []),
    "capacity moe: context=2 x data=4": (CAPACITY_MOE, {"context": 2, "data": 4}, False, []),
    "capacity moe: context=4 x expert=2": (CAPACITY_MOE, {"context": 4, "expert": 2}, False, []),
    "packed documents: context=4 x data=2": ([], {"context": 4, "data": 2}, True, []),
    "ring: context=4 x data=2": (["model.context_strategy=ring"], {"context": 4, "data": 2}, False, []),
    "gpipe: context=2 x pipeline=2 x data=2": (PIPE, {"context": 2, "pipeline": 2, "data": 2}, False, []),
    "1f1b, tp_sp: context=2 x pipeline=2 x tensor=2": (
        ["strategy=tp_sp", "pipeline.schedule=1f1b", *PIPE],
        {"context": 2, "pipeline": 2, "tensor": 2},
        False,
        [],
    ),
    "interleaved, ring, packed documents: context=2 x pipeline=2 x data=2": (
        [
            "pipeline.schedule=interleaved",
            "pipeline.virtual_stages=2",
            "model.layers=4",
            "model.context_strategy=ring",
            *PIPE,
        ],
        {"context": 2, "pipeline": 2, "data": 2},
        True,
        ["batch.microbatches=2"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_training_equals_one_device(name):
    extra, mesh, docs, ref_more = CASES[name]
    ref_extra = [e for e in extra if not e.startswith(("strategy=", "pipeline.", "model.context_strategy"))] + ref_more
    got, ref = losses(extra, mesh, 8, docs), reference(ref_extra, docs)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)


def test_context_with_pipeline_needs_the_lm_loss():
    """A user's stage protocol (its own batch) cannot be split over `context` by the pipeline: one line."""
    from flax import nnx

    import meshpar
    from meshpar.core.batch import Leaf
    from meshpar.core.errors import ConfigError

    Stages = stacked_stages(lambda r: nnx.Linear(4, 4, rngs=r), 2)
    cfg = make_cfg(*COMMON, mesh={"pipeline": 2, "context": 2, "data": 2})
    with pytest.raises(ConfigError, match="mesh.context=2 with mesh.pipeline > 1 needs the built-in LM loss"):
        Trainer(
            cfg,
            devices=devices(8),
            model=Stages,
            loss=meshpar.stage_loss,
            batch_spec=Leaf((8, 32, 4), np.float32, ("batch", "length", None)),
        )


def test_a_user_moe_model_in_a_pipeline_split_over_context_is_refused():
    """`model.name=moe` with pipeline x context is refused by the config check; a user's factory of the
    same layers is refused in one line when traced: a stage would route only its share of each sequence."""
    from meshpar.core.errors import ConfigError
    from meshpar.models import REGISTRY

    cfg = make_cfg(*COMMON, *PIPE, *CAPACITY_MOE[1:], "model.layers=4", mesh={"pipeline": 2, "context": 2, "data": 2})
    tr = Trainer(cfg, devices=devices(8), model=lambda rngs: REGISTRY["moe"](cfg, rngs))
    with pytest.raises(
        ConfigError,
        match="an MoE layer inside a pipeline stage split over mesh.context would route "
        "only the stage's share of each sequence",
    ):
        tr.lower()


def test_the_sharding_table_shows_length_over_context():
    tr = Trainer(make_cfg(*COMMON, mesh={"context": 4, "data": 2}), devices=devices(8))
    row = next(r for r in tr.sharding_table() if r["kind"] == "activation")
    assert row["logical"] == ["batch", "length"] and row["spec"] == "data, context", row
