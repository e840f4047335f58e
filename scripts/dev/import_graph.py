"""Draw the imports between the project's top-level packages (docs/architecture.md).

Run from a checkout: ``python scripts/dev/import_graph.py`` prints a Mermaid graph, one edge
per pair of packages with the number of module-level imports behind it. grimp (import-linter's
graph builder) reads the source; nothing is imported.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import grimp

PACKAGES = (
    "orpheus_serve",
    "bench",
    "loadgen",
    "orchestrator",
    "gateway",
    "llm_worker",
    "codec_worker",
    "common",
    "shm",
)


def edges(root: Path) -> Counter[tuple[str, str]]:
    sys.path.insert(0, str(root))
    present = [p for p in PACKAGES if (root / p / "__init__.py").exists()]
    graph = grimp.build_graph(*present, cache_dir=None)
    counts: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        src = module.split(".")[0]
        for imported in graph.find_modules_directly_imported_by(module):
            dst = imported.split(".")[0]
            if dst != src and dst in present:
                counts[(src, dst)] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=".", type=Path)
    args = ap.parse_args()
    print("```mermaid\nflowchart TD")
    for (src, dst), n in sorted(edges(args.root.resolve()).items()):
        print(f"  {src} -->|{n}| {dst}")
    print("```")


if __name__ == "__main__":
    main()
