from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shm.layout import InstanceLayout
from shm.segments import destroy_instance


@pytest.fixture
def layout() -> Iterator[InstanceLayout]:
    """A private instance layout (socket dir and segment names) for one test."""
    run_dir = tempfile.mkdtemp(prefix="orpheus-test-")
    # Names carry this pid so a crashed test's leftovers are cleaned as stale later.
    lay = InstanceLayout(instance=f"orpheus-{os.getpid()}-t{os.urandom(3).hex()}", run_dir=run_dir)
    os.makedirs(lay.socket_dir)
    yield lay
    destroy_instance(lay)
    os.rmdir(run_dir) if not os.listdir(run_dir) else None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and its SNAC (``orpheus-serve tiny-model``), one per test module."""
    from e2e_harness import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
