"""The target tier's fixtures (`test_targets.py`, `test_target_paths.py`): the compilers, installed once
into their own folder if they are not there (the one place the tier may skip, with one line), the 8-device
targets, and a tiny config compiled for one. A module takes the compilers with
`pytestmark = pytest.mark.usefixtures("target_compilers")`."""

import pytest

from meshpar.core.config import load_config
from meshpar.runtime import compilers

TINY = ["precision=bf16", "batch.length=256", "batch.global_size=8"]


@pytest.fixture(scope="module")
def target_compilers():
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
def h100(target_compilers):
    return _target("h100")


@pytest.fixture(scope="module")
def v5p(target_compilers):
    return _target("tpu-v5p")
