"""Every benchmark's PNG set-up: matplotlib on its file-only backend (Agg), and the figure
written where the benchmark was asked, then closed. matplotlib (the bench extra) is imported
when a plot is drawn, not when a benchmark is."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, *, dpi: int = 110) -> None:
    """``fig`` as a PNG at ``path`` (its folder created), then closed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
