#!/usr/bin/env python3
"""Which third-party packages vLLM's engine path imports when it loads (static, from source).

How scripts/gpu/wheels.txt was made, and how to redo it for another vLLM (docs/gpu.md):

    pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d /tmp/w vllm==X
    mkdir /tmp/vsrc && cd /tmp/vsrc && unzip -q /tmp/w/vllm-*.whl 'vllm/*.py'
    python scripts/gpu/vllm_import_closure.py /tmp/vsrc --device-packages \\
        scripts/gpu/device_packages.txt [--lazy]

It follows module-level ``import vllm...`` statements from the roots (the modules the
llm_worker and the engine core load on a GPU) and lists the external top-level modules
those modules import: unconditionally ("hard"), inside try/except, ``contextlib.suppress``
or an ``if`` ("soft": optional or platform-gated), and, with --lazy, inside functions.
``TYPE_CHECKING`` blocks are skipped. Static analysis misses imports made through vLLM's
``LazyLoader`` that a class annotation forces at import time (llguidance, xgrammar in
0.25.1), so finish with an import test in a clean environment (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOTS = (
    "vllm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.logits_processor",
    "vllm.v1.metrics.loggers",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.platforms.cuda",
    "vllm.sampling_params",
    "vllm.inputs",
    "vllm.compilation.backends",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.structured_output",
)
IMPORT_TO_DIST = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "cv2": "opencv-python-headless",
    "cpuinfo": "py-cpuinfo",
    "google": "protobuf",
    "pydantic_core": "pydantic-core",
    "openai_harmony": "openai-harmony",
    "prometheus_client": "prometheus-client",
    "huggingface_hub": "huggingface-hub",
    "typing_extensions": "typing-extensions",
}


def _module_file(root: Path, name: str) -> tuple[Path | None, bool]:
    p = root.joinpath(*name.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py", True
    if p.with_suffix(".py").exists():
        return p.with_suffix(".py"), False
    return None, False


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool) -> None:
        self.module, self.is_pkg = module, is_pkg
        self.found: list[tuple[str, str, int]] = []  # (kind, name, line)
        self._fn = 0
        self._guard: list[bool] = []

    def _add(self, name: str, node: ast.AST) -> None:
        if self._fn:
            kind = "lazy"
        elif self._guard and self._guard[-1]:
            kind = "soft"
        else:
            kind = "hard"
        self.found.append((kind, name, node.lineno))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._fn += 1
        self.generic_visit(node)
        self._fn -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                self.visit(n)
            return
        self._guard.append(True)
        for n in node.body + node.orelse:
            self.visit(n)
        self._guard.pop()

    def visit_Try(self, node: ast.Try) -> None:
        self._guard.append(bool(node.handlers))
        for n in node.body:
            self.visit(n)
        self._guard.pop()
        for n in node.handlers + node.orelse + node.finalbody:
            self.visit(n)

    def visit_With(self, node: ast.With) -> None:
        soft = any("suppress" in ast.unparse(i.context_expr) for i in node.items)
        self._guard.append(soft or (self._guard[-1] if self._guard else False))
        self.generic_visit(node)
        self._guard.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_pkg:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        self._add(mod, node)
        for a in node.names:
            if a.name != "*":
                self._add(f"{mod}.{a.name}", node)


def closure(root: Path, roots: tuple[str, ...]) -> dict[str, dict[str, list[str]]]:
    """{kind: {external top-level module: ["vllm.module:line", ...]}}."""
    seen: set[str] = set()
    out: dict[str, dict[str, list[str]]] = {"hard": {}, "soft": {}, "lazy": {}}
    stack = list(roots)
    while stack:
        name = stack.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b, a.b.c
            mod = ".".join(parts[:i])
            if mod in seen:
                continue
            seen.add(mod)
            path, is_pkg = _module_file(root, mod)
            if path is None:
                continue
            v = _Imports(mod, is_pkg)
            v.visit(ast.parse(path.read_text(), str(path)))
            for kind, imp, line in v.found:
                top = imp.split(".")[0]
                if top == "vllm":
                    if kind == "hard":
                        stack.append(imp)
                elif top and top not in sys.stdlib_module_names and not top.startswith("_"):
                    out[kind].setdefault(top, []).append(f"{mod}:{line}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="directory holding the unpacked vllm/ package")
    p.add_argument("--device-packages", help="one distribution name a line (# comments)")
    p.add_argument("--lazy", action="store_true", help="also list imports inside functions")
    args = p.parse_args(argv)
    found = closure(Path(args.source), ROOTS)
    device: set[str] = set()
    if args.device_packages:
        device = {
            line.strip().lower().replace("_", "-")
            for line in Path(args.device_packages).read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
    kinds = ("hard", "soft", "lazy") if args.lazy else ("hard", "soft")
    shown: set[str] = set()
    for kind in kinds:
        print(f"== {kind}")
        for top in sorted(found[kind]):
            if top in shown:
                continue
            shown.add(top)
            dist = IMPORT_TO_DIST.get(top, top).lower().replace("_", "-")
            where = "device" if dist in device else "NOT ON DEVICE" if device else ""
            locs = found[kind][top]
            print(f"  {top:24s} {where:14s} {len(locs):4d}  {', '.join(locs[:2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
