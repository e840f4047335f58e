"""TEST FIXTURE for the tests that the import contracts are live: the project's contracts
(.importlinter), and import-linter run on a made-up tree of packages under a test's
temporary directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def contract(name: str) -> str:
    """The section of the project's contract ``name`` (``[importlinter:contract:name]`` up
    to the blank line that ends it)."""
    config = (REPO / ".importlinter").read_text()
    section = config[config.index(f"[importlinter:contract:{name}]") :]
    return section[: section.index("\n\n")]


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter run in ``root`` on its ``.importlinter`` and the packages under it."""
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def lint_gateway_with(root: Path, name: str) -> subprocess.CompletedProcess[str]:
    """``lint`` of the ``gateway`` package under ``root`` with the project's contract
    ``name`` alone."""
    (root / ".importlinter").write_text(
        f"[importlinter]\nroot_packages =\n    gateway\n\n{contract(name)}\n"
    )
    return lint(root)
