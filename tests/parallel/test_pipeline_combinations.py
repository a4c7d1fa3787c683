"""Pipeline schedules x models (decoder; MoE with top-1, top-2 and dropless routing, experts split over
`expert` inside each stage) train through `meshpar train`; with test_pipeline_moe.py (dropless x 1F1B,
held to the plain model) every schedule x routing pair is covered.
"""

import pytest

from tests.conftest import tiered
from tests.parallel.pipelines import TINY

MOE_TINY = [*TINY, "batch.global_size=8", "steps=1", "pipeline.microbatches=2"]
MODELS = {
    "decoder": ["model.name=decoder", "model.layers=4"],
    "moe-top1": ["model.name=moe", "model.layers=8", "moe.routing=top1"],
    "moe-top2": ["model.name=moe", "model.layers=8", "moe.routing=top2"],
    "moe-dropless": ["model.name=moe", "model.layers=8", "moe.capacity_factor=null"],
}
# dropless x 1F1B is not swept here: tests/parallel/test_pipeline_moe.py trains it and holds its loss and
# gradients to the plain model's (the stronger check, at the same compile cost)
SWEEP = [
    ("decoder", "1f1b"),
    ("moe-top1", "interleaved"),
    ("moe-top2", "1f1b"),
    ("moe-dropless", "gpipe"),
    ("moe-dropless", "interleaved"),
]


@pytest.mark.parametrize(
    "model,schedule",
    tiered(
        SWEEP,
        {("decoder", "1f1b"), ("moe-top1", "interleaved"), ("moe-dropless", "gpipe")},
        [f"{m}-{s}" for m, s in SWEEP],
    ),
)
def test_pipeline_with_moe_trains(capsys, model, schedule):
    from meshpar.cli import main

    v = 2 if schedule == "interleaved" else 1
    code = main(
        [
            "train",
            *MOE_TINY,
            *MODELS[model],
            f"pipeline.schedule={schedule}",
            f"pipeline.virtual_stages={v}",
            "mesh.pipeline=2",
            "mesh.expert=2",
            "mesh.tensor=2",
            "mesh.data=1",
            "mesh.fsdp=1",
        ]
    )
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err, out.err[-2000:]
