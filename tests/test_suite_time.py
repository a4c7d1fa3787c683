"""The suite watches itself (tests/suite_watch.py): each file's time and XLA compiles are reported, and
a file over its budget fails the run only when asked to (MESHPAR_STRICT_SUITE_TIME=1), so a slow or
busy machine passes by its tests alone; a worker that dies fails the run at once, naming its test,
with its stacks kept."""

import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADDOPTS = shlex.split(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"])


def _pytest(tmp_path, budget: str, *args: str, strict: bool = False, env: dict | None = None):
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\npytest_plugins = ('tests.suite_watch',)\n"
    )
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(1.0)\n")
    (tmp_path / "test_compiles.py").write_text(
        "import jax\n\ndef test_compiles_two_programs():\n"
        "    assert jax.jit(lambda x: x + 1)(1) == 2 and jax.jit(lambda x: x * 3)(1) == 3\n"
    )
    env = {
        **os.environ,
        "MESHPAR_TEST_FILE_BUDGET_S": budget,
        "MESHPAR_STRICT_SUITE_TIME": "1" if strict else "0",
        "MESHPAR_TEST_BUDGET_SCALE": "1",
        **(env or {}),
    }  # the budget as given, however busy the machine
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )


def _row(stdout: str, name: str) -> list[str]:
    table = stdout.split("seconds per test file")[1]
    return next(line.split() for line in table.splitlines() if line.endswith(name))


def test_a_file_over_its_budget_is_reported_and_fails_the_run_only_when_strict(tmp_path):
    # the default: every test passes, so the run passes, however slow (a tiny budget stands in for a
    # loaded machine); the file over budget is reported by name
    report = _pytest(tmp_path, "0.5")
    assert report.returncode == 0, report.stdout[-2000:]
    assert "2 passed" in report.stdout and "seconds per test file (budget 0.5 s each" in report.stdout
    assert "suite time: test_sleepy.py took 1 s, over the 0.5 s budget (a report" in report.stdout
    assert "FAILED" not in report.stdout
    assert int(_row(report.stdout, "test_compiles.py")[1]) >= 2  # its two programs (and any JAX adds)
    strict = _pytest(tmp_path, "0.5", strict=True)
    assert strict.returncode == 1, strict.stdout[-2000:]
    assert [line for line in strict.stdout.splitlines() if line.startswith("FAILED suite time")] == [
        "FAILED suite time: test_sleepy.py took 1 s, over the 0.5 s a test file may take; share its compiled "
        "steps (module fixtures) or split it"
    ]
    for args in ((), ("-n", "2", "--dist", "loadfile")):
        within = _pytest(tmp_path, "30", *args, strict=True)
        assert within.returncode == 0 and "suite time:" not in within.stdout, within.stdout[-2000:]
        assert float(_row(within.stdout, "test_sleepy.py")[0]) >= 1.0
        assert int(_row(within.stdout, "test_compiles.py")[1]) >= 2, within.stdout[-2000:]


def test_the_budget_scales_with_a_slower_machine():
    """The calibration workload timed under load (two CPU-bound processes beside it on this machine's
    cores) takes longer, so a loaded machine's budget grows with it."""
    sys.path.insert(0, str(REPO))
    from tests.suite_watch import calibrate

    idle = calibrate()
    spin = "print('spinning', flush=True)\nwhile True: pass"
    hogs = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:  # each hog spinning before the clock starts (on a busy machine Python takes a while to start)
        assert all(h.stdout.readline().strip() == "spinning" for h in hogs)
        loaded = calibrate()
    finally:
        for h in hogs:
            h.kill()
    assert loaded > 1.3 * idle, (idle, loaded)


def test_a_worker_that_dies_fails_the_run_at_once_naming_its_test_with_its_stacks(tmp_path):
    """The repo's own addopts (xdist, --max-worker-restart=0): a test that aborts its process ends the
    run within a minute, non-zero, naming the test; its fault log holds the stack down to the abort,
    and the summary prints the last line the process wrote to its descriptor 2 (where XLA's C++ log
    writes its fatal "Check failed" line), which pytest's fd capture used to lose with the worker."""
    (tmp_path / "test_aborts.py").write_text(
        "import os\n\ndef test_aborts_its_process():\n"
        "    if os.environ.get('MESHPAR_TEST_ABORT'):\n"
        "        os.write(2, b'F1201 00:00:00 1 native.cc:7] Check failed: its own last words\\n')\n"
        "        os.abort()\n"
    )
    t = time.monotonic()
    run = _pytest(tmp_path, "30", *ADDOPTS, env={"MESHPAR_TEST_ABORT": "1"})
    assert time.monotonic() - t < 60
    assert run.returncode not in (0, 5), run.stdout[-3000:]
    assert "crashed while running 'test_aborts.py::test_aborts_its_process'" in run.stdout, run.stdout[-3000:]
    assert "a test process died while running test_aborts.py::test_aborts_its_process" in run.stdout
    assert (
        "Fatal Python error: Aborted" in run.stdout
        and 'test_aborts.py", line 6 in test_aborts_its_process' in run.stdout
    )
    assert "    F1201 00:00:00 1 native.cc:7] Check failed: its own last words" in run.stdout, run.stdout[-3000:]
    assert "--max-worker-restart=0" in ADDOPTS
    kept = next(
        line.split("every thread's: ")[1].rstrip("):") for line in run.stdout.splitlines() if "every thread's: " in line
    )
    shutil.rmtree(Path(kept).parent)  # the folder kept for the dead process's stacks


def test_a_fault_folder_removed_under_the_running_session_does_not_end_it(tmp_path):
    """A /tmp cleaner (or a person) removing the session's fault folder mid-run: the next test's name
    note is written into a folder made again, and the run passes (it ended in an INTERNALERROR)."""
    (tmp_path / "test_removes.py").write_text(
        "import shutil, sys\n\ndef test_removes_the_fault_folder():\n"
        "    watch = sys.modules['tests.suite_watch']\n    shutil.rmtree(watch._fault_dir[0])\n\n"
        "def test_after_it():\n    pass\n"
    )
    run = _pytest(tmp_path, "30", "-p", "no:randomly", str(tmp_path / "test_removes.py"))
    assert run.returncode == 0 and "INTERNALERROR" not in run.stdout + run.stderr, run.stdout[-3000:]
    assert "4 passed" in run.stdout, run.stdout[-2000:]
