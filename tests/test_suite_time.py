"""The suite watches its own time: a test file over its budget fails the run, with one line naming
it, also when pytest-xdist's workers run the files; each file's XLA compiles are counted beside it."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pytest(tmp_path, budget: str, *args: str):
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.conftest import (pytest_runtest_logreport, pytest_runtest_makereport, pytest_sessionfinish,\n"
        "                            pytest_terminal_summary)\n")
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(1.0)\n")
    (tmp_path / "test_compiles.py").write_text(
        "import jax\n\ndef test_compiles_two_programs():\n"
        "    assert jax.jit(lambda x: x + 1)(1) == 2 and jax.jit(lambda x: x * 3)(1) == 3\n")
    env = {**os.environ, "MESHPAR_TEST_FILE_BUDGET_S": budget}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args,
                           str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def _row(stdout: str, name: str) -> list[str]:
    table = stdout.split("seconds per test file")[1]
    return next(line.split() for line in table.splitlines() if line.endswith(name))


def test_a_test_file_over_its_budget_fails_the_suite_and_says_which(tmp_path):
    over = _pytest(tmp_path, "0.5")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "2 passed" in over.stdout and "seconds per test file (budget 0.5 s each)" in over.stdout
    assert "FAILED suite time: test_sleepy.py took 1 s alone, over the 0.5 s a test file may take" in over.stdout
    assert int(_row(over.stdout, "test_compiles.py")[1]) >= 2       # its two programs (and any JAX adds)
    for args in ((), ("-n", "2", "--dist", "loadfile")):
        within = _pytest(tmp_path, "30", *args)
        assert within.returncode == 0 and "FAILED suite time" not in within.stdout, within.stdout[-2000:]
        assert float(_row(within.stdout, "test_sleepy.py")[0]) >= 1.0
        assert int(_row(within.stdout, "test_compiles.py")[1]) >= 2, within.stdout[-2000:]
