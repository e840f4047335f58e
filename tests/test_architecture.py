"""The layering of docs/architecture.md holds: import-linter's contracts (.importlinter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run(
        [str(lint), "--no-cache", "--config", str(REPO / ".importlinter")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_a_layer_violation_is_reported(tmp_path: Path) -> None:
    """The check is live: a floor module importing a process package breaks the contract."""
    for pkg in ("common", "gateway"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "common" / "bad.py").write_text("import gateway\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    gateway\n    common\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    gateway\n    common\n"
    )
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run(
        [str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert res.returncode == 1
    assert "common.bad -> gateway" in res.stdout


def _edges(mermaid: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s+(\w+) -->\|\d+\| (\w+)$", mermaid, re.M))


def test_the_drawing_in_docs_is_current() -> None:
    """docs/architecture.md's "after" drawing shows the package imports the code has."""
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dev" / "import_graph.py"), str(REPO)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    doc = (REPO / "docs" / "architecture.md").read_text()
    drawings = re.findall(r"```mermaid\n(.*?)```", doc, re.S)
    assert drawings, "docs/architecture.md has no mermaid drawing"
    assert _edges(drawings[-1]) == _edges(res.stdout), (
        "regenerate it: python scripts/dev/import_graph.py"
    )
