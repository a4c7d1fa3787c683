"""A user's model in the stage protocol (meshpar/nn/stages.py) pipelined on pipeline=2 x data=2 x
tensor=2 equals one device: a loss that takes `take_along_axis` of logits split over `tensor` (XLA's
partitioner aborted the process on it inside the pipeline's shard_map), and an encoder-decoder whose
stages pass a pytree of two lengths (tests/train/encdec_stages.py, run in a subprocess: an abort
must fail a test, not kill the test worker). Errors are norm-wise (see test_equivalence.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS = {"array": ("gpipe", "1f1b", "interleaved"), "head": ("gpipe", "1f1b"), "tied": ("1f1b",)}


@pytest.fixture(scope="module")
def runs():
    """One subprocess for every run below (the compiles it shares: each variant's reference)."""
    args = [f"{variant}={','.join(schedules)}" for variant, schedules in RUNS.items()]
    run = subprocess.run(
        [sys.executable, "-m", "tests.train.encdec_stages", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def _equal(out: dict, schedules) -> None:
    want = out["one device"]
    for schedule in schedules:
        got = out[schedule]
        assert abs(got["loss"] - want["loss"]) / want["loss"] <= 1e-5, (schedule, got, want)
        assert got["metrics"] == pytest.approx(want["metrics"], rel=1e-5), (schedule, got, want)
        assert got["grads"] <= 1e-5, (schedule, got)


def test_a_loss_gathering_over_a_tensor_split_vocab_pipelines_like_one_device(runs):
    """take_along_axis(log_softmax(logits [b, T, V / tensor]), targets [b / data, T]) in the last
    stage's loss, under every schedule: it aborted the process (spmd_partitioner_util.cc,
    PartitionGather) before the loss read its inputs whole."""
    _equal(runs["array"], RUNS["array"])


def test_an_encoder_decoder_passes_a_pytree_of_two_lengths_between_stages(runs):
    """(y [b, 4, E], {enc [b, 6, E], mask bool [b, 6]}) from pre through the stacked layers to post, under
    GPipe and 1F1B; `tied`: post gathers (a token per row) and the loss applies the embedding table
    (vocab split over tensor) itself."""
    _equal(runs["head"], RUNS["head"])
    _equal(runs["tied"], RUNS["tied"])
