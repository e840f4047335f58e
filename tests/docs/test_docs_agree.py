"""The docs say what the code has (issue 32): each package's docstring lists its modules, the
process count and table of README.md and docs/architecture.md are the orchestrator's, the
configuration page names every table of ``ServeConfig``, and README gives one demo figure.

A package docstring names every module and subpackage of its package in double backticks
(``name``, ``name.attr``, ``name/`` or ``name.py``), and every dotted name it writes that way
exists: a module of the package or a path from a top-level package, and where it goes on to
an attribute (``registry.HTTP_FRONTENDS``), a name that module defines. The code is read,
not imported (the worker packages import vLLM and torch).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgspec
import pytest

from common.config import ServeConfig
from orchestrator.child import ROLES

ROOT = Path(__file__).resolve().parents[2]
TOP_PACKAGES = sorted(
    p.name
    for p in ROOT.iterdir()
    if (p / "__init__.py").exists() and p.name not in ("tests", "scripts", "deploy", "docs")
)
PACKAGES = sorted(
    init.parent.relative_to(ROOT)
    for top in TOP_PACKAGES
    for init in (ROOT / top).rglob("__init__.py")
    if "__pycache__" not in init.parts
)
CODE_NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\.py|/)?$")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _modules(package: Path) -> set[str]:
    """The modules and subpackages of a package directory (``__main__`` is its command)."""
    return {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()
    }


def _defines(module: Path) -> set[str]:
    """The names a module defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _resolves(base: Path, parts: list[str]) -> bool:
    """Whether ``parts`` (a dotted name) is a module under ``base``, or a name one defines."""
    here = base
    for i, part in enumerate(parts):
        if (here / part / "__init__.py").exists():
            here = here / part
            continue
        if (here / f"{part}.py").exists():
            rest = parts[i + 1 :]
            return not rest or rest[0] in _defines(here / f"{part}.py")
        if (here / "__init__.py").exists() and here != base:
            return part in _defines(here / "__init__.py")
        return False
    return True


def _unresolved(package: Path, doc: str) -> list[str]:
    bad = []
    for token in re.findall(r"``([^`]+)``", doc):
        if not CODE_NAME.match(token):
            continue  # a command, a route, an expression: not a module name
        if (ROOT / package / token).exists():
            continue  # a file or folder of the package (``corpus/``, ``static/index.html``)
        parts = token.removesuffix("/").removesuffix(".py").split(".")
        if parts[0] in _modules(ROOT / package):
            ok = _resolves(ROOT / package, parts)
        elif parts[0] in TOP_PACKAGES:
            ok = _resolves(ROOT, parts)
        else:
            ok = False
        if not ok:
            bad.append(token)
    return bad


def module_list_errors(package: Path, doc: str) -> list[str]:
    named = {t.split(".")[0].split("/")[0] for t in re.findall(r"``([^`]+)``", doc)}
    errors = [f"{m} is not named" for m in sorted(_modules(ROOT / package) - named)]
    errors += [f"``{t}`` is no module or name of the code" for t in _unresolved(package, doc)]
    return errors


@pytest.mark.parametrize("package", PACKAGES, ids=str)
def test_a_package_docstring_lists_its_modules(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
    errors = module_list_errors(package, doc)
    assert not errors, f"{package}/__init__.py: {errors}"


def test_the_module_list_check_sees_a_missing_and_a_stale_module() -> None:
    """It fails on the old text: a docstring that leaves a module out, or names one gone."""
    shm = Path("shm")
    old = '"""The wire contract between the processes: SPSC rings [...] (records)."""'
    assert "ring is not named" in module_list_errors(shm, old)
    stale = "``records``, ``ring``, ``rings``, ``records.FRAME_CODES``, ``records.NO_SUCH``"
    errors = module_list_errors(shm, stale)
    assert "``rings`` is no module or name of the code" in errors
    assert "``records.NO_SUCH`` is no module or name of the code" in errors
    assert "``records.FRAME_CODES`` is no module or name of the code" not in errors


def _worker_packages() -> set[str]:
    """The packages the orchestrator starts as processes: those with a ``main.run``."""
    return {p for p in TOP_PACKAGES if "run" in _defines_if(ROOT / p / "main.py")}


def _defines_if(module: Path) -> set[str]:
    return _defines(module) if module.exists() else set()


def process_count_errors(text: str) -> list[str]:
    kinds = 1 + len(ROLES)  # the orchestrator and one kind per role it starts
    return [
        f"{m.group(0)!r}: the code has {NUMBER_WORDS[kinds]}"
        for m in re.finditer(r"\b(\w+) kinds of process", text, re.I)
        if m.group(1).lower() != NUMBER_WORDS[kinds]
    ]


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_process_count_is_the_code_s(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert re.search(r"\b\w+ kinds of process", text), f"{doc} no longer says how many"
    assert not process_count_errors(text)


def test_the_process_count_check_sees_the_old_text() -> None:
    assert process_count_errors("Three kinds of process share one GPU")
    assert process_count_errors("orpheus-serve is five kinds of process on one host.")


def test_the_process_table_has_a_row_per_process() -> None:
    assert len(_worker_packages()) == len(ROLES)
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| process | owns |") :].split("\n\n")[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    named = {m for r in rows for m in re.findall(r"\(`(\w+)/`\)", r.split("|")[1])}
    assert named == _worker_packages() | {"orchestrator"}, rows


def test_the_configuration_page_names_every_table() -> None:
    tables = {
        f.name for f in msgspec.structs.fields(ServeConfig) if isinstance(f.default, msgspec.Struct)
    }
    intro = (ROOT / "docs" / "configuration.md").read_text().split("\n\n")[1]
    assert set(re.findall(r"`\[(\w+)\]`", intro)) == tables, intro


def test_readme_gives_one_demo_figure() -> None:
    """The demo's output shown under *The two commands* and the row of *Measured* agree."""
    text = (ROOT / "README.md").read_text()
    shown = re.search(r"time to first audio (\d+) ms; real-time factor ([\d.]+)", text)
    assert shown, "README shows no demo result"
    (row,) = [r for r in text.splitlines() if r.startswith("| demo, one stream")]
    assert f"TTFB {shown.group(1)} ms" in row and f"RTF {shown.group(2)}" in row, row


def test_the_serving_page_names_what_exists() -> None:
    """docs/serving.md: the vLLM of the ``gpu`` extra, the metrics and the alerts it names."""
    import tomllib

    page = (ROOT / "docs" / "serving.md").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = project["project"]["optional-dependencies"]["gpu"]
    version = pin.removeprefix("vllm==")
    assert f"`vllm=={version}`" in page and f"| {version} (`[gpu]`) |" in page
    code = "".join(
        p.read_text()
        for pkg in ("gateway", "codec_worker", "llm_worker")
        for p in (ROOT / pkg).glob("metrics.py")
    )
    for metric in set(re.findall(r"`(orpheus_[a-z_]+)", page)):
        names = (f'"{metric}"', f'"{metric.removesuffix("_total")}"')  # a counter's either way
        assert any(n in code for n in names), f"{metric} is no metric of the code"
    alerts = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    for alert in set(re.findall(r"\b(Orpheus[A-Z]\w+)", page)):
        assert f"alert: {alert}" in alerts, f"{alert} is no rule of alerts.yml"
