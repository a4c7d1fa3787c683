"""What users run, the way they run it: a regular (non-editable) install, every entry point run from
the repository root (where the source tree shadows the installed package) and from elsewhere.

One wheel and one virtual environment serve the module. The environment sees the test
environment's packages (jax, flax, ...) through a `.pth` line, but not its editable meshpar (an
editable install is a finder that `.pth` lines do not start), so `meshpar` there is the wheel's.
"""

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    d = tmp_path_factory.mktemp("install")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(d), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(d.glob("meshpar-*.whl"))
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {"wheel": wheel, "bin": venv / "bin", "site": site}


def _run(installed, argv, cwd, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=300, env={**environ, **env})


@pytest.mark.slow
def test_reference_models_install_as_meshpar_models_only(installed, tmp_path):
    """The wheel holds meshpar/models/* and no top-level `models`; installed (run from a folder
    outside the repository) `import meshpar.models` works and `models` does not."""
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "meshpar/models/decoder.py" in names and "meshpar/models/__init__.py" in names
    assert not [n for n in names if n.startswith("models/")]
    code = textwrap.dedent("""
        import importlib.util, meshpar, meshpar.models
        assert sorted(meshpar.models.REGISTRY) == ["decoder", "moe"]
        assert importlib.util.find_spec("models") is None, importlib.util.find_spec("models")
        print(meshpar.__file__)
    """)
    run = _run(installed, [str(installed["bin"] / "python"), "-c", code], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith(str(installed["site"]))  # the wheel's meshpar


@pytest.mark.slow
def test_every_entry_point_runs_from_the_repository_root_and_elsewhere(installed, tmp_path):
    """`meshpar launch` from the repository root used to fail: its processes imported the source
    tree's meshpar, which has no `models` (issue 20). Now the checkout is a whole package too.
    Also: `--devices 1` collapses the configured mesh with one warning line; `meshpar launch`
    shows whole lines, process i > 0 prefixed, and none of Gloo's ~40 connection reports."""
    meshpar, python = str(installed["bin"] / "meshpar"), str(installed["bin"] / "python")
    for cwd in (REPO, tmp_path):
        run = _run(installed, [meshpar, "--version"], cwd)
        assert run.returncode == 0 and run.stdout.startswith("meshpar "), run.stderr
    # python -m meshpar.cli from the root imports the checkout, on one device
    run = _run(installed, [python, "-m", "meshpar.cli", "train", "--devices", "1", "steps=1"], REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("warning: one device: the mesh (data=2 fsdp=2 tensor=2) collapses") == 1
    assert "done: loss" in run.stdout
    # meshpar launch from the root: two processes train, and the output is lines, not chatter
    run = _run(installed, [meshpar, "launch", "2", "steps=2", "train.log_every=1"], REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    both = run.stdout + run.stderr
    assert "step     2/2" in run.stdout and "Gloo" not in both and "peer ranks" not in both
    assert not [ln for ln in both.splitlines() if re.fullmatch(r"(\[process \d+\] )?\s*\d+\s*", ln)]
    # launch/local.sh, with an error: one whole line per process, the second one prefixed
    run = _run(
        installed, [str(REPO / "launch" / "local.sh"), "2", "steps=1", "model.name=nope"], tmp_path, PYTHON=python
    )
    assert run.returncode == 2
    errors = sorted(ln for ln in run.stderr.splitlines() if "error:" in ln)  # in either order
    assert len(errors) == 2 and errors[1].startswith("meshpar: error: unknown model.name 'nope'"), run.stderr
    assert errors[0].startswith("[process 1] meshpar: error: unknown model.name 'nope'"), run.stderr
    # a user script from elsewhere
    run = _run(installed, [python, str(REPO / "examples" / "vision.py"), "steps=2", "train.log_every=1"], tmp_path)
    assert run.returncode == 0 and "loss" in run.stdout.splitlines()[-1], run.stderr[-2000:]


def test_the_checkout_s_reference_models_win_over_an_editable_install_of_another():
    """From a checkout, `meshpar.models` is that checkout's `models/`, even when the environment holds an
    editable install of another checkout (whose finder maps `meshpar.models` to its own folder): the
    checkout's models are the ones its tests and its `python -m meshpar.cli` run."""
    code = "import meshpar.models, sys; sys.stdout.write(meshpar.models.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout) == REPO / "models" / "__init__.py", run.stdout
