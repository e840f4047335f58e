"""The GPU recipe's parts that need no GPU (scripts/gpu/, docs/gpu.md).

- the Orpheus-3B random-weight generator, at a reduced shape on the CPU: transformers loads
  what it writes, and unscaled its config is the published checkpoint's (parameter count
  computed from the config, nothing allocated);
- the wheel carrier: parts, chunks and checksums survive a round trip, and a broken
  transfer is caught;
- the carried-wheel list covers what the server imports on a machine without network;
- the trace summary's arithmetic, and the shell scripts parse.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from bench.engine.results import Level
from bench.load.criteria import Capacity

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "scripts" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load("make_random_orpheus")
wheels = _load("wheels")
tools = _load("gpu_tools")


# ----------------------------------------------------------------------------- generator


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("orpheus-small")
    # Two shards at this size, so the index and the shard layout are exercised too.
    gen.write_random_orpheus(out, device="cpu", seed=1, shard_gib=0.05, snac=False, **gen.SMALL)
    return out


def test_unscaled_config_is_orpheus_3b() -> None:
    base = {"orpheus": {"voices": ["tara"]}, "vocab_size": 1, "bos_token_id": 128000}
    cfg = gen.orpheus_config(base)
    for key, value in gen.ORPHEUS_3B.items():
        assert cfg[key] == value, key
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (
        3072,
        28,
        24,
    )
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (8, 128, 8192)
    assert cfg["vocab_size"] == 156_940 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["bos_token_id"] == 128000  # the base's token ids are kept
    assert (
        cfg["orpheus"]["voices"] == ["tara"] and "random weights" in cfg["orpheus"]["description"]
    )
    # ~3.3 B parameters, 6.6 GB in bf16, 112 KiB of KV cache per token (docs/orpheus.md).
    n = gen.param_count(cfg)
    assert n == 3_300_867_072
    assert 2 * n == pytest.approx(6.6e9, rel=0.01)
    assert gen.kv_bytes_per_token(cfg) == 112 * 1024
    assert "lm_head.weight" not in gen.weight_shapes(cfg)  # tied embeddings


@pytest.mark.slow
def test_param_count_matches_transformers_without_allocating() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # Full width, two layers (the count is linear in the layers; 28 would only be slower).
    cfg = gen.orpheus_config({"orpheus": {}}, num_hidden_layers=2)
    hf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "orpheus"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == gen.param_count(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert expected == gen.weight_shapes(cfg)
    per_layer = gen.param_count(cfg) - gen.param_count(gen.orpheus_config({}, num_hidden_layers=1))
    assert gen.param_count(gen.orpheus_config({})) == gen.param_count(cfg) + 26 * per_layer


def test_shape_overrides_are_checked() -> None:
    with pytest.raises(ValueError):
        gen.orpheus_config({}, vocab_size=10)
    small = gen.orpheus_config({}, **gen.SMALL)
    assert "reduced shape" in small["orpheus"]["description"]
    assert gen.param_count(small) < gen.param_count(gen.orpheus_config({}))


@pytest.mark.slow
def test_small_model_loads_in_transformers(small_model: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    cfg = transformers.LlamaConfig.from_pretrained(small_model)
    assert cfg.num_hidden_layers == gen.SMALL["num_hidden_layers"]
    assert cfg.hidden_size == gen.SMALL["hidden_size"] and cfg.head_dim == 64
    assert cfg.vocab_size == 156_940 and cfg.tie_word_embeddings

    index = json.loads((small_model / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2 and all((small_model / s).exists() for s in shards)
    raw = json.loads((small_model / "config.json").read_text())
    shapes = gen.weight_shapes(raw)
    seen = {}
    for s in shards:
        with safe_open(str(small_model / s), "pt") as f:
            for name in f.keys():  # safe_open has no __iter__
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16
                seen[name] = tuple(t.shape)
                if name.endswith("proj.weight"):
                    assert 0.015 < t.float().std().item() < 0.025  # normal(0, 0.02)
    assert seen == shapes
    assert index["metadata"]["total_size"] == 2 * gen.param_count(raw)

    model, info = transformers.LlamaForCausalLM.from_pretrained(
        small_model, output_loading_info=True, dtype=torch.bfloat16
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == gen.param_count(raw)

    tok = transformers.AutoTokenizer.from_pretrained(small_model)
    assert tok("tara: hello").input_ids[0] == 128000
    assert tok.convert_tokens_to_ids("<custom_token_2>") == 128258
    assert raw["orpheus"]["voices"][0] == "tara"  # voices stored like the tiny model's


def test_generator_dry_run_prints_the_3b_numbers() -> None:
    out = subprocess.run(
        [sys.executable, str(GPU / "make_random_orpheus.py"), "--dry-run"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    numbers = json.loads(out.stdout)
    assert numbers["params"] == 3_300_867_072
    assert numbers["kv_bytes_per_token_bf16"] == 114_688


# ----------------------------------------------------------------------------- wheels


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_parts_round_trip(tmp_path: Path) -> None:
    staging, out, stage, dest = (tmp_path / d for d in ("staging", "out", "stage", "dest"))
    staging.mkdir()
    big = os.urandom(5 * 1024 * 1024 + 123)
    (tmp_path / "big-1.0-py3-none-any.whl").write_bytes(big)
    # What prepare_wheels.sh does: split -b into .chunk-NN and record the whole file's hash.
    piece = 2 * 1024 * 1024
    for i in range(0, len(big), piece):
        (staging / f"big-1.0-py3-none-any.whl.chunk-{i // piece:02d}").write_bytes(
            big[i : i + piece]
        )
    digest = _sha(tmp_path / "big-1.0-py3-none-any.whl")
    (staging / "big-1.0-py3-none-any.whl.full-sha256").write_text(f"{digest} {len(big)}\n")
    for name in ("small_a-1.0-py3-none-any.whl", "small_b-2.0-py3-none-any.whl"):
        (staging / name).write_bytes(os.urandom(300_000))
    listing = tmp_path / "wheels.txt"
    listing.write_text("small-b==2.0 small-b>=1\nsmall_a==1.0 always\nbig==1.0 always\n")

    assert wheels.main(["layout", str(staging), str(out), "--part-mib", "2.5",
                        "--when-file", str(listing)]) == 0  # fmt: skip
    manifest = json.loads((out / "MANIFEST.json").read_text())
    parts = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert parts == [p["name"] for p in manifest["parts"]]
    for p in manifest["parts"]:
        assert p["bytes"] <= 2.5 * 1024 * 1024
        assert (out / p["name"] / "MANIFEST.json").exists()
    # Listed order decides the packing: small-b, then small_a, lead part-1.
    assert manifest["parts"][0]["files"][:2] == [
        "small_b-2.0-py3-none-any.whl", "small_a-1.0-py3-none-any.whl"
    ]  # fmt: skip
    whens = {w["name"]: w["when"] for w in manifest["wheels"]}
    assert whens == {"big": "always", "small-a": "always", "small-b": "small-b>=1"}

    # The device: parts arrive one call at a time; the big wheel is whole only at the end.
    for p in parts[:-1]:
        assert wheels.main(["receive", str(out / p), str(stage)]) == 0
    assert wheels.main(["status", str(stage)]) == 3
    assert wheels.main(["assemble", str(stage), str(dest)]) == 3
    assert wheels.main(["assemble", str(stage), str(dest), "--only-complete"]) == 0
    assert wheels.main(["receive", str(out / parts[-1]), str(stage)]) == 0
    assert wheels.main(["status", str(stage)]) == 0
    assert wheels.main(["assemble", str(stage), str(dest)]) == 0
    assert (dest / "big-1.0-py3-none-any.whl").read_bytes() == big
    for name in ("small_a-1.0-py3-none-any.whl", "small_b-2.0-py3-none-any.whl"):
        assert _sha(dest / name) == _sha(staging / name)


def test_broken_transfer_is_caught(tmp_path: Path) -> None:
    staging, out, stage = tmp_path / "staging", tmp_path / "out", tmp_path / "stage"
    staging.mkdir()
    (staging / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(1000))
    wheels.main(["layout", str(staging), str(out), "--part-mib", "1"])
    victim = out / "part-1" / "a-1.0-py3-none-any.whl"
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        wheels.main(["receive", str(out / "part-1"), str(stage)])


def test_wheel_list_is_well_formed() -> None:
    from packaging.requirements import Requirement

    entries = wheels.read_list(GPU / "wheels.txt")
    names = [wheels.norm(Requirement(r).name) for r, _ in entries]
    assert len(names) == len(set(names)), "one version of each: two stop the install"
    pins = {wheels.norm(Requirement(r).name): str(Requirement(r).specifier) for r, _ in entries}
    assert pins["vllm"] == "==0.25.1"  # pins torch==2.11.0, the device's torch
    assert all(spec.startswith("==") for spec in pins.values()), "pin every carried wheel"
    device = _device_packages()
    for req, when in entries:
        name = wheels.norm(Requirement(req).name)
        if when == "always":
            assert name not in device, f"{name} is on the device: carry it as a fallback"
        else:
            assert wheels.norm(Requirement(when).name) == name
            assert name in device, f"{name} is not on the device: install it always"


def _device_packages() -> set[str]:
    lines = (GPU / "device_packages.txt").read_text().splitlines()
    return {wheels.norm(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


IMPORT_TO_DIST = {
    "zmq": "pyzmq",
    "c2pa": "c2pa-python",
    "perth": "resemble-perth",
    "indic_numtowords": "indic-numtowords",
    "pynvml": "nvidia-ml-py",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "cv2": "opencv-python-headless",
    "sklearn": "scikit-learn",
    "google": "protobuf",
    "cpuinfo": "py-cpuinfo",
    "dateutil": "python-dateutil",
    "opentelemetry": "opentelemetry-api",  # one namespace over several dists, all carried
}
RUNTIME_PACKAGES = (
    "orpheus_serve", "bench", "testkit", "orchestrator", "orpheus_client", "llm_worker", "codec_worker",
    "gateway", "common", "store", "shm", "orpheus_wire",
)  # fmt: skip


def test_server_imports_are_on_the_device_or_carried() -> None:
    """Every third-party module the server and the load generator import exists on the GPU
    machine (KINDS.md's list) or travels as a wheel (scripts/gpu/wheels.txt). A new
    dependency fails here until it is added to wheels.txt (docs/gpu.md)."""
    available = _device_packages() | {
        wheels.norm(re.split(r"[=<>!~ ]", r, maxsplit=1)[0])
        for r, _ in wheels.read_list(GPU / "wheels.txt")
    }
    missing = {}
    for pkg in RUNTIME_PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    top = m.split(".")[0]
                    if top in sys.stdlib_module_names or top in RUNTIME_PACKAGES:
                        continue
                    dist = wheels.norm(IMPORT_TO_DIST.get(top, top))
                    if dist not in available:
                        missing.setdefault(dist, str(f.relative_to(REPO)))
    assert not missing, f"neither on the GPU machine nor in scripts/gpu/wheels.txt: {missing}"


# ----------------------------------------------------------------------------- tools


def test_trace_summary_arithmetic(tmp_path: Path) -> None:
    events = [
        # kernels: [0,10) [5,20) [30,40) [1040,1050) -> busy 20+10+10 = 40 us over 1050 us
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 5, "dur": 15},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 30, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1040, "dur": 10},
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0, "dur": 45},
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 1000, "dur": 55},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 3},
    ]
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = tools.summarize_trace(path, step_re="execute_model")
    g = s["gpu"]
    assert g["span_ms"] == pytest.approx(1.05)
    assert g["busy_ms"] == pytest.approx(0.04)
    assert g["idle_gaps"]["count_over_20us"] == 1  # 1000 us; the 10 us gap is under 20
    assert g["idle_gaps"]["ms_in_gaps_over_20us"] == pytest.approx(1.0)
    assert g["idle_gaps"]["count_over_1ms"] == 0
    assert s["top_kernels"][0] == {"name": "gemm", "count": 2, "total_ms": 0.03, "mean_us": 12.5}
    assert s["steps"]["count"] == 2 and s["steps"]["mean_period_ms"] == pytest.approx(1.0)


def test_capacity_is_read_with_the_bench_result_classes() -> None:
    """gpu_tools reads a load report's ``capacities`` as bench.load.criteria.Capacity: one
    owner of the format."""
    capacities = [
        Capacity(criterion=c, definition=c, concurrency=n, at_least=False, first_failure=None,
                 bounded_by=[])
        for c, n in (("published", 96), ("real-time", 78), ("interactive", 64))
    ]  # fmt: skip
    new = {"capacities": msgspec.to_builtins(capacities)}
    assert tools.capacity_of(new) == 78  # real-time, the default
    assert tools.capacity_of(new, criterion="published") == 96
    assert tools.capacity_of(new, criterion="interactive") == 64
    assert tools.capacity_of({}) is None
    # the budget form from before the criteria is no Capacity: bench load --recompute it
    old = {"capacities": [{"ttfb_budget_s": 1.0, "concurrency": 320}]}
    assert tools.capacity_of(old) is None
    committed = json.loads((REPO / "docs/results/h100_capacity_v2.json").read_text())
    assert tools.capacity_of(committed, criterion="published") == 96
    assert tools.capacity_of(committed) == 78


def _engine(variant: str, steps: dict[int, tuple[float, float]]) -> list[dict]:
    return [
        msgspec.to_builtins(
            Level(variant=variant, streams=n, step_ms_p50=p50, step_ms_p99=p99,
                  engine_cpu_ms_per_step=None, gpu_busy_fraction=None, tokens_per_s=0.0)
        )
        for n, (p50, p99) in steps.items()
    ]  # fmt: skip


def test_the_sweep_predicts_the_confirmation_levels(tmp_path: Path) -> None:
    """Published where t(N)'s p50 reaches 11.5 ms, real-time where its p99 does, linear
    between the levels, rounded down to a multiple of 8; the audio head is what the server
    runs (llm.output_head auto on a GPU)."""
    levels = _engine("full-head", {64: (9.0, 10.0), 128: (14.0, 16.0)}) + _engine(
        "audio-head", {128: (8.0, 9.0), 256: (10.0, 11.0), 384: (13.0, 15.0)}
    )
    p = tools.predict({"levels": levels})
    # p50 crosses 11.5 between 256 (10) and 384 (13): 256 + 128 * 1.5 / 3 = 320
    # p99 crosses between 256 (11) and 384 (15): 256 + 128 * 0.5 / 4 = 272
    assert (p["variant"], p["published"], p["real-time"]) == ("audio-head", 320, 272)
    full = tools.predict({"levels": levels}, variant="full-head")
    # p50: 64 + 64 * 2.5 / 5 = 96; p99: 64 + 64 * 1.5 / 6 = 80
    assert (full["published"], full["real-time"]) == (96, 80)
    # already over the line at the smallest level: proportional below it
    slow = tools.predict({"levels": _engine("audio-head", {64: (23.0, 23.0)})})
    assert slow["published"] == 32
    # under the line everywhere: the last slope, at most twice the largest level
    fast = tools.predict({"levels": _engine("audio-head", {64: (2.0, 2.0), 128: (3.0, 3.0)})})
    assert fast["published"] == 256
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"levels": levels}))
    out = subprocess.run([sys.executable, str(GPU / "gpu_tools.py"), "predict", str(f)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split() == ["320", "272"]
    with pytest.raises(ValueError, match="no levels of variant"):
        tools.predict({"levels": levels}, variant="kv-fp8")


def test_check_out_names_what_the_device_would_not_return(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    good = {"benchmark": "engine", "machine": {"gpu": "H100"}, "versions": {"git_commit": "a"},
            "variants": [{"variant": "audio-head", "status": "ok"}],
            "levels": [{"variant": "audio-head", "streams": 64, "step_ms_p50": 8.0}]}  # fmt: skip
    (out / "h100_engine_a.json").write_text(json.dumps(good))
    assert tools.check_out(out, ["h100_engine_a.json"]) == []
    skipped = dict(good, variants=[{"variant": "kv-fp8", "status": "skipped"}], levels=[])
    (out / "h100_engine_b.json").write_text(json.dumps(skipped))
    assert tools.check_out(out, []) == ["h100_engine_b.json: no variant measured"]
    (out / "h100_engine_b.json").unlink()
    empty = {"schema": "orpheus-serve/bench-load/1", "machine": {}, "versions": {},
             "levels": [{"requests": 0}]}  # fmt: skip
    (out / "h100_confirm_bf16.json").write_text(json.dumps(empty))
    (out / "bad name.txt").write_text("x")
    for i in range(7):
        (out / f"x{i}.txt").write_text("x")
    problems = tools.check_out(out, ["h100_engine_a.json", "h100_missing.json"])
    assert "10 files under $OUT; 8 come back" in problems
    assert "h100_confirm_bf16.json: no commit" in problems
    assert "h100_confirm_bf16.json: no level measured a request" in problems
    assert "bad name.txt: a name outside [A-Za-z0-9._-]" in problems
    assert "h100_missing.json: missing" in problems


def test_stamp_fills_machine_versions_and_commit_from_the_facts() -> None:
    facts = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "versions": {"vllm": "0.25.1"}}
    bare: dict = {"levels": []}
    assert tools.stamp(bare, "abc123", facts)
    assert bare["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert bare["versions"]["vllm"] == "0.25.1" and bare["versions"]["git_commit"] == "abc123"
    own = {"machine": {"gpu": "x"}, "versions": {"git_commit": "def"}}
    assert not tools.stamp(own, "abc123", facts)  # its own machine and commit stay
    assert own["machine"] == {"gpu": "x"} and own["versions"]["git_commit"] == "def"


# ----------------------------------------------------------------------------- the plan


def _plan() -> list[dict]:
    rows = []
    for line in (GPU / "plan.tsv").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        call, carry, args, minutes, go, expect, need = line.split("\t")
        rows.append({"call": int(call), "carry": carry, "args": args, "minutes": float(minutes),
                     "go": int(go), "expect": expect.split(), "need": need})  # fmt: skip
    return rows


def test_the_plan_fits_fifteen_minutes_and_docs_state_it() -> None:
    plan = _plan()
    assert [r["call"] for r in plan] == list(range(1, len(plan) + 1))
    assert {r["need"] for r in plan} <= {"essential", "optional"}
    needs = [r["need"] for r in plan]
    assert needs == sorted(needs), "optional calls come last"
    essential = [r for r in plan if r["need"] == "essential"]
    setup = [r for r in plan if r["args"].split()[0] in ("first", "part", "last")]
    assert sum(r["minutes"] for r in setup) < 3.0  # setup under 3 minutes
    # The essential calls, machine start included, leave at least 1.5 of the 15 minutes for
    # the gaps between calls (each reply read, the next call sent) and estimates that run over.
    assert sum(r["minutes"] for r in essential) <= 13.5
    # every go/no-go threshold covers at least the call itself
    for r in plan:
        assert r["go"] >= r["minutes"] * 60, r
    # the engines calls and the confirmation (which needs the sweeps) are in the plan
    args = [r["args"] for r in essential]
    assert args.index("engines audio-head 2 on") < args.index("confirm")
    assert any(r["args"].startswith("engine ") and "audio-head" in r["args"] for r in essential)
    assert plan[-1]["args"] == "soak" and plan[-1]["need"] == "optional"
    # the carries are the parts prepare_wheels.sh lays out, one a call, each carried once
    carries = [r["carry"] for r in plan if r["carry"] != "-"]
    assert carries == [f".whl/part-{i}" for i in range(1, len(carries) + 1)]
    doc = (REPO / "docs/gpu.md").read_text()
    table = doc[doc.index("## The 15-minute plan") :]
    for r in plan:
        row = next(line for line in table.splitlines() if line.startswith(f"| {r['call']} |"))
        assert f"`{r['args']}`" in row and f"{r['minutes']:g}" in row and str(r["go"]) in row
        assert r["need"] in row
    recipe = (GPU / "run_capacity.sh").read_text()
    for r in plan:  # each call is a case of the recipe
        assert re.search(rf"^  {r['args'].split()[0]}\)", recipe, re.M), r["args"]
    assert "scripts/gpu/plan.tsv" in (GPU / "rehearse.sh").read_text()


def _bash_function(name: str) -> str:
    """The text of a function of run_capacity.sh, from its name to its closing brace."""
    recipe = (GPU / "run_capacity.sh").read_text()
    start = recipe.index(f"{name}() {{")
    return recipe[start : recipe.index("\n}\n", start) + 3]


def test_engine_stage_calls_bench_engine_with_the_plan_interface() -> None:
    stage = _bash_function("stage_engine")
    for flag in ("bench engine", "--model", "--device", "--streams", "--steps", "--variants",
                 "--json", "--png"):  # fmt: skip
        assert flag in stage
    assert "64,96,128,160,192,224,256,320,384" in stage and "ENGINE_STEPS:-300" in stage


def _run_recipe(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "GPU_HOME": str(tmp_path / "gpu"), "OUT": str(tmp_path / "out"),
            "MODEL": str(tmp_path / "model"), "PYTHON": sys.executable, **env}  # fmt: skip
    return subprocess.run(["bash", str(GPU / "run_capacity.sh"), *args], capture_output=True,
                          text=True, env=full, timeout=120)  # fmt: skip


def test_codec_benchmark_is_opt_in(tmp_path: Path) -> None:
    """CODEC_STREAMS="" skips the codec benchmark (it used to run the default levels), and
    call 1 runs it only when CODEC_STREAMS names levels."""
    p = _run_recipe(tmp_path, "codec", CODEC_STREAMS="")
    assert "codec benchmark skipped (CODEC_STREAMS is empty)" in p.stdout
    assert "bench codec" not in p.stdout + p.stderr
    recipe = (GPU / "run_capacity.sh").read_text()
    first = recipe[recipe.index("  first)") : recipe.index(";;", recipe.index("  first)"))]
    assert "[[ -n ${CODEC_STREAMS:-} ]] && stage_codec" in first
    assert "MODEL_CHECK" in _bash_function("stage_model")


def test_confirm_levels_come_from_the_sweep(tmp_path: Path) -> None:
    state = tmp_path / "gpu" / "state"
    state.mkdir(parents=True)
    levels = _engine("audio-head", {128: (8.0, 9.0), 256: (10.0, 11.0), 384: (13.0, 15.0)})
    (state / "engine_full-head_audio-head.json").write_text(json.dumps({"levels": levels}))
    fn = _bash_function("confirm_levels")
    script = f"PY={sys.executable}; TOOLS={GPU / 'gpu_tools.py'}; STATE={state}\n{fn}confirm_levels"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["320", "272"]
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "CONFIRM_LEVELS": "200,180"})  # fmt: skip
    assert out.stdout.split() == ["200", "180"]


def _k(engines: int, mps: bool | None, steps: dict[int, tuple[float, float]]) -> list[dict]:
    return [dict(lv, engines=engines, mps=mps) for lv in _engine("audio-head", steps)]


def test_the_sweeps_choose_the_engine_count() -> None:
    """K engines' levels are read apart (a level without ``engines`` is one engine), with
    or without MPS, and the best predicts the most published-criterion streams."""
    one = [
        {k: v for k, v in lv.items() if k not in ("engines", "mps", "per_engine")}
        for lv in _engine("audio-head", {128: (8.0, 9.0), 256: (10.0, 11.0), 384: (13.0, 15.0)})
    ]  # levels from before the engines dimension
    two_mps = _k(2, True, {128: (6.0, 7.0), 256: (8.0, 9.0), 384: (10.0, 12.0)})
    two_slice = _k(2, False, {256: (12.0, 14.0), 384: (16.0, 20.0)})
    doc = {"levels": one + two_mps + two_slice}
    assert tools.predict(doc)["published"] == 320  # K = 1, as before the engines dimension
    k2 = tools.predict(doc, engines=2, mps=True)
    # p50 under the line at 384 (10 ms): the last slope (2 ms per 128) reaches 11.5 at 480
    assert (k2["published"], k2["engines"], k2["mps"]) == (480, 2, True)
    assert tools.predict(doc, engines=2, mps=False)["published"] == 240  # 12 ms at 256
    best = tools.best_engines(doc)
    assert (best["engines"], best["mps"], best["published"]) == (2, True, 480)
    assert len(best["candidates"]) == 3
    with pytest.raises(ValueError, match="with 3 engine"):
        tools.predict(doc, engines=3)
    # equal predictions: fewer engines win
    tie = {"levels": one + _k(2, True, {128: (8.0, 9.0), 256: (10.0, 11.0), 384: (13.0, 15.0)})}
    assert tools.best_engines(tie)["engines"] == 1


def test_confirm_uses_the_best_engines_and_passes_llm_engines(tmp_path: Path) -> None:
    state = tmp_path / "gpu" / "state"
    state.mkdir(parents=True)
    one = _engine("audio-head", {128: (8.0, 9.0), 256: (10.0, 11.0), 384: (13.0, 15.0)})
    two = _k(2, True, {128: (6.0, 7.0), 256: (8.0, 9.0), 384: (10.0, 12.0)})
    (state / "engine_a.json").write_text(json.dumps({"levels": one}))
    (state / "engine_b.json").write_text(json.dumps({"levels": two}))
    fns = _bash_function("confirm_engines") + _bash_function("confirm_levels")
    head = f"PY={sys.executable}; TOOLS={GPU / 'gpu_tools.py'}; STATE={state}\n{fns}"
    out = subprocess.run(["bash", "-c", head + 'read -r k m <<<"$(confirm_engines)"; '
                          'echo $k $m $(confirm_levels $k $m)'],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split() == ["2", "on", "480", "360"]
    out = subprocess.run(["bash", "-c", head + "confirm_engines"], capture_output=True,
                         text=True, check=True, env={**os.environ, "CONFIRM_ENGINES": "3 off"})  # fmt: skip
    assert out.stdout.split() == ["3", "off"]
    serve = _bash_function("stage_serve")
    assert "--set llm.engines=$engines" in serve and "${ENGINES:-1}" in serve
    confirm = _bash_function("stage_confirm")
    assert "ENGINES=$k stage_serve" in confirm and "mps_start" in confirm


FAKE_MPS = """#!/usr/bin/env bash
# A stand-in for nvidia-cuda-mps-control: -d makes the control pipe (the daemon), "quit" on
# stdin removes it; every call is logged.
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >>"$FAKE_MPS_LOG"
if [[ ${1:-} == -d ]]; then mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read -r cmd; [[ $cmd == quit ]] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


def _mps_script(tmp_path: Path, body: str, with_binary: bool = True) -> tuple[int, str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if with_binary:
        fake = bindir / "nvidia-cuda-mps-control"
        fake.write_text(FAKE_MPS)
        fake.chmod(0o755)
    state, work = tmp_path / "state", tmp_path / "work"
    state.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    fns = "".join(_bash_function(f) for f in ("mps_start", "mps_stop"))
    script = (f'log() {{ echo "$*"; }}; note() {{ echo "NOTE $*"; }}; STATE={state}; '
              f"WORK={work}\n{fns}{body}")  # fmt: skip
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "FAKE_MPS_LOG": str(tmp_path / "calls")}
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    return p.returncode, p.stdout, calls


def test_the_recipe_starts_its_own_mps_daemon_and_always_stops_it(tmp_path: Path) -> None:
    # started with its own pipe and log directories, visible to the children it starts
    rc, out, calls = _mps_script(tmp_path, textwrap.dedent("""\
        mps_start || exit 9
        [[ -p $CUDA_MPS_PIPE_DIRECTORY/control ]] || exit 8
        python3 -c 'import os; print("child sees", os.environ["CUDA_MPS_PIPE_DIRECTORY"])'
        exit 3   # a failing stage: the EXIT trap still stops the daemon
        """))  # fmt: skip
    assert rc == 3, out
    assert "child sees /tmp/orpheus-mps." in out
    started, stopped = calls.splitlines()
    assert (
        started.startswith("-d pipe=/tmp/orpheus-mps.") and "/pipe log=/tmp/orpheus-mps." in started
    )
    assert stopped.startswith(" pipe=/tmp/orpheus-mps.")  # echo quit | nvidia-cuda-mps-control
    assert "MPS control daemon stopped" in out
    pipe = started.split("pipe=")[1].split()[0]
    assert not Path(pipe).parent.exists()  # its temp dir is removed
    assert not (tmp_path / "state" / "mps_dir").exists()


def test_a_daemon_left_by_a_killed_call_is_stopped_by_the_next(tmp_path: Path) -> None:
    rc, _, _ = _mps_script(tmp_path, "mps_start; trap - EXIT; exit 0")  # killed: no trap ran
    assert rc == 0 and (tmp_path / "state" / "mps_dir").exists()
    rc, _, calls = _mps_script(tmp_path, "mps_stop")
    assert rc == 0 and calls.count("-d") == 1 and len(calls.splitlines()) == 2
    assert not (tmp_path / "state" / "mps_dir").exists()
    recipe = (GPU / "run_capacity.sh").read_text()
    assert "[[ $cmd != status && -f $STATE/mps_dir ]] && mps_stop" in recipe


def test_without_the_mps_binary_the_recipe_says_so_and_goes_on(tmp_path: Path) -> None:
    _, out, calls = _mps_script(tmp_path, "mps_start; echo rc=$?", with_binary=False)
    assert "NOTE MPS: nvidia-cuda-mps-control is not on this machine" in out
    assert "rc=1" in out and calls == ""
    stage = _bash_function("stage_engines")
    assert "--engines" in stage and "--mps" in stage and "mps_stop" in stage


def test_fixed_length_is_ten_seconds_of_audio() -> None:
    text = (GPU / "run_capacity.sh").read_text()
    expr = re.search(r"TOKENS=\$\{TOKENS:-\$\(\((.+?)\)\)\}", text).group(1)
    value = int(subprocess.run(["bash", "-c", f"echo $(({expr}))"], capture_output=True,
                               text=True, check=True).stdout)  # fmt: skip
    assert value == 7 * math.ceil(10 * 24000 / 2048) == 826


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_shell_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(GPU / script)], check=True, timeout=30)


def test_run_capacity_without_a_call_prints_its_plan(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_HOME": str(tmp_path / "gpu"), "OUT": str(tmp_path / "out")}
    p = subprocess.run(["bash", str(GPU / "run_capacity.sh")], capture_output=True, text=True,
                       env=env, timeout=60)  # fmt: skip
    assert p.returncode == 2
    for call in _plan():
        assert call["args"] in p.stdout, call["args"]


def test_speaks_codes_model_emits_valid_codes_unconstrained(tmp_path: Path) -> None:
    """The V2 runner on vLLM 0.25 runs no constraint: the benchmark model must still emit
    valid codes, or that path would produce no audio to measure."""
    mro = gen
    plain, speaks = tmp_path / "plain", tmp_path / "speaks"
    mro.write_random_orpheus(plain, device="cpu", snac=False, **mro.SMALL)
    mro.write_random_orpheus(speaks, device="cpu", snac=False, speaks_codes=True, **mro.SMALL)
    cfg = json.loads((speaks / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["orpheus"]["speaks_codes"] is True
    assert mro.check_codes(speaks, "cpu", tokens=21)["valid"] == 21
    assert mro.check_codes(plain, "cpu", tokens=21)["valid"] <= 3


def test_wheel_slimming_drops_members_and_their_record_lines(tmp_path: Path) -> None:
    import zipfile

    wheels = _load("wheels")
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/_fa2_C.abi3.so", b"\0" * 4096)
        z.writestr("pkg/_fa3_C.abi3.so", b"\1" * 4096)
        z.writestr(
            "pkg-1.0.dist-info/RECORD",
            "pkg/__init__.py,,\npkg/_fa2_C.abi3.so,sha256=x,4096\npkg/_fa3_C.abi3.so,sha256=y,4096\n",
        )
    before, after, dropped = wheels.slim_wheel(whl, ["pkg/_fa2_C*"])
    assert dropped == ["pkg/_fa2_C.abi3.so"] and after < before
    with zipfile.ZipFile(whl) as z:
        assert "pkg/_fa2_C.abi3.so" not in z.namelist() and "pkg/_fa3_C.abi3.so" in z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert "_fa2_C" not in record and "_fa3_C" in record
    assert wheels.slim_wheel(whl, ["pkg/_fa2_C*"])[2] == []  # idempotent


def test_prepare_wheels_slims_vllm_but_keeps_what_hopper_loads() -> None:
    text = (GPU / "prepare_wheels.sh").read_text()
    drops = re.findall(r"--drop '([^']+)'", text)
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in drops
    import fnmatch

    for kept in (
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/_C_stable_libtorch.abi3.so",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
    ):
        assert not any(fnmatch.fnmatch(kept, d) for d in drops), kept


def test_device_verify_runs_the_start_up_preflight() -> None:
    """verify once passed while the server could not start: it must build what start-up
    builds (scripts/gpu/preflight.py). Call 3 keeps the imports and FlashAttention 3 and
    starts no server (the rehearsal runs the rest of the preflight on a CPU)."""
    verify = (GPU / "device_install.sh").read_text()
    assert "scripts/gpu/preflight.py" in verify and "PREFLIGHT_ONLY" in verify
    assert 'bad.append("FlashAttention 3 is not available")' in verify
    recipe = (GPU / "run_capacity.sh").read_text()
    last = recipe[recipe.index("  last)") : recipe.index(";;", recipe.index("  last)"))]
    assert "verify" in last and "PREFLIGHT_ONLY=${PREFLIGHT_ONLY-imports}" in last
    assert "stage_serve" not in last and "stage_single" not in last
    pf = (GPU / "preflight.py").read_text()
    for check in ("check_sampling", "check_sampler", "check_staging", "check_codec_compile"):
        assert f"def {check}" in pf
