"""A live progress line per load level (rich), fed by the runner's hooks."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.load.trace import Outcome, StreamTrace


class LevelProgress:
    """Measured requests finished out of those expected, requests in flight, failures."""

    def __init__(self, console: Console, label: str, expected: int | None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.fields[expected]} measured"),
            TextColumn("in flight {task.fields[active]}"),
            TextColumn("issued {task.fields[issued]}"),
            TextColumn("[red]failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task(
            label,
            total=expected,
            expected=expected if expected is not None else "?",
            active=0,
            issued=0,
            failed=0,
        )
        self._active = 0
        self._issued = 0
        self._failed = 0
        self._measured_issued = 0
        self._bounded = expected is not None

    def on_issue(self, trace: StreamTrace) -> None:
        self._active += 1
        self._issued += 1
        if trace.measured:
            self._measured_issued += 1
        fields: dict[str, object] = {"active": self._active, "issued": self._issued}
        if not self._bounded:
            fields["expected"] = f"{self._measured_issued}+"
        self._progress.update(self._task, **fields)

    def on_done(self, trace: StreamTrace) -> None:
        self._active -= 1
        if trace.measured and trace.outcome is not Outcome.OK:
            self._failed += 1
        self._progress.update(
            self._task,
            advance=1 if trace.measured else 0,
            active=self._active,
            failed=self._failed,
        )

    def __enter__(self) -> LevelProgress:
        self._progress.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()
