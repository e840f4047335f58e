"""The test run's temporary directory (tests/conftest.py, ``_own_temporary_directory``): every
process of the run makes its temporary files in a directory the run removes at its end, and
what is meant to outlive a run stays in the system's temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def test_the_run_and_what_it_starts_use_a_temporary_directory_of_the_runs_own() -> None:
    run, system = os.environ["TESTS_RUN_TMPDIR"], os.environ["TESTS_SYSTEM_TMPDIR"]
    assert Path(run).parent == Path(system) and Path(run).is_dir()
    assert tempfile.gettempdir() == os.environ["TMPDIR"] == run
    child = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    assert child.stdout.strip() == run


def test_what_outlives_a_run_stays_in_the_system_temporary_directory(tmp_path: Path) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    run, system = Path(os.environ["TESTS_RUN_TMPDIR"]), Path(os.environ["TESTS_SYSTEM_TMPDIR"])
    # torch's compiled kernels, shared by the runs (a cold cache compiles them again)
    assert Path(cache_dir()).parent == system
    # pytest's base temporary directories, the last three kept to look into after a failure
    assert tmp_path.is_relative_to(system) and not tmp_path.is_relative_to(run)


_LEAVES = """
import os, socket, tempfile, uuid

def test_leaves():
    what, where = os.environ["LEAVE"].split(":")
    root = tempfile.gettempdir() if where == "run" else os.environ["TESTS_SYSTEM_TMPDIR"]
    if what == "rendezvous":  # what an engine core killed leaves
        open(os.path.join(root, "vllm_dist_" + uuid.uuid4().hex), "w").close()
    else:  # an ipc socket of an engine that made it in the temporary directory
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(root, str(uuid.uuid4())))
"""


@pytest.mark.parametrize(
    ("leave", "code", "says"),
    [
        ("rendezvous:run", 0, "1 rendezvous file(s) of vLLM engine cores that were killed"),
        ("socket:run", 1, "the tests left 1 vLLM socket(s) in the run's temporary directory"),
        ("rendezvous:system", 1, "the tests left 1 vLLM socket(s) or file(s) in "),
    ],
)
def test_the_end_of_run_check(leave: str, code: int, says: str) -> None:
    """A run of this conftest whose one test passes and leaves a file behind: a rendezvous
    file in the run's directory is counted and removed with it; a socket there, or anything of
    vLLM's in the system's temporary directory, fails the run. Its "system" directory is a
    private one (short: a socket path in the run's directory under it must fit 107 bytes)."""
    system = tempfile.mkdtemp(prefix="s-")
    try:
        project = Path(system, "project")
        project.mkdir()
        shutil.copy(Path(__file__).with_name("conftest.py"), project / "conftest.py")
        (project / "test_leaves.py").write_text(_LEAVES)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TESTS_", "PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}  # fmt: skip
        env.update(TMPDIR=system, PYTEST_DEBUG_TEMPROOT=system, LEAVE=leave)
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project)],
            capture_output=True, text=True, env=env, cwd=project, timeout=120,
        )  # fmt: skip
        assert r.returncode == code and says in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
        assert "1 passed" in r.stdout
        assert not [p.name for p in Path(system).iterdir() if p.name.startswith("ot-")]
    finally:
        shutil.rmtree(system, ignore_errors=True)
