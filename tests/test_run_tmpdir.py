"""The test run's temporary directory (tests/conftest.py, ``_own_temporary_directory``): every
process of the run makes its temporary files in a directory the run removes at its end, and
what is meant to outlive a run stays in the system's temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


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
