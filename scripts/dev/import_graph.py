"""Draw the imports between the project's top-level packages (docs/architecture.md).

Run from a checkout: ``python scripts/dev/import_graph.py`` prints a Mermaid graph, one edge
per pair of packages with the number of module-level imports behind it. ``--gateway`` draws
the gateway's own modules instead (a front-end package is one node, ``frontends/x``). grimp
(import-linter's graph builder) reads the source; nothing is imported.
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
    "testkit",
    "loadgen",
    "orchestrator",
    "orpheus_client",
    "gateway",
    "llm_worker",
    "codec_worker",
    "common",
    "store",
    "shm",
    "orpheus_wire",
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


def _gateway_node(module: str) -> str | None:
    """``gateway.x`` -> ``x``; a front end's modules -> ``frontends/<name>``."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) < 2:
        return None
    if parts[1] == "frontends" and len(parts) > 2:
        name = parts[2]
        return f"frontends/{name}"
    return parts[1]


def gateway_edges(root: Path) -> Counter[tuple[str, str]]:
    sys.path.insert(0, str(root))
    graph = grimp.build_graph("gateway", cache_dir=None)
    counts: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        src = _gateway_node(module)
        if src is None:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            dst = _gateway_node(imported)
            if dst is not None and dst != src:
                counts[(src, dst)] += 1
    return counts


def _id(node: str) -> str:
    return node.replace("/", "__")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=".", type=Path)
    ap.add_argument("--gateway", action="store_true", help="the gateway's own modules")
    args = ap.parse_args()
    if args.gateway:
        print("```mermaid\nflowchart LR")
        for (src, dst), n in sorted(gateway_edges(args.root.resolve()).items()):
            print(f"  {_id(src)}[{src}] -->|{n}| {_id(dst)}[{dst}]")
        print("```")
        return
    print("```mermaid\nflowchart TD")
    for (src, dst), n in sorted(edges(args.root.resolve()).items()):
        print(f"  {src} -->|{n}| {dst}")
    print("```")


if __name__ == "__main__":
    main()
