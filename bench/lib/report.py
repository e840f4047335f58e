"""What every benchmark's output shares: the header of its JSON (the machine and versions it
was measured on), the one JSON writer, and its rich tables."""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from bench.lib.environment import machine, versions

if TYPE_CHECKING:  # rich (the bench extra) is imported where a table is drawn
    from rich.console import JustifyMethod
    from rich.table import Table


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def environment(
    machine_extra: dict[str, Any] | None = None, versions_extra: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """``{"machine": ..., "versions": ...}`` of a result, with a benchmark's own additions
    (its load average, its cores, the versions of what it drives)."""
    return {
        "machine": {**msgspec.to_builtins(machine()), **(machine_extra or {})},
        "versions": {**(versions_extra or {}), **msgspec.to_builtins(versions())},
    }


def write_json(report: Any, path: Path | str | None, *, announce: TextIO | None = None) -> None:
    """A result (a dict or a msgspec Struct) as indented JSON; the folder is created.
    ``path`` None: nothing is written. ``announce``: where to say "wrote PATH"."""
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    if announce is not None:
        print(f"wrote {path}", file=announce)


def table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str] | None],
    *,
    left: Collection[str] = (),
    no_wrap: bool = False,
    title_justify: JustifyMethod = "center",
) -> Table:
    """Columns right-justified except those named in ``left``; a ``None`` row ends a section."""
    from rich.table import Table

    t = Table(title=title, title_justify=title_justify)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", no_wrap=no_wrap)
    for row in rows:
        if row is None:
            t.add_section()
        else:
            t.add_row(*row)
    return t


def show(*renderables: Table | str, min_width: int | None = None) -> None:
    """Tables (and lines) on standard output; ``min_width``: at least that wide, or the
    terminal's width."""
    from rich.console import Console

    if min_width is None:
        console = Console()
    else:
        console = Console(width=max(min_width, shutil.get_terminal_size().columns))
    for r in renderables:
        console.print(r)
