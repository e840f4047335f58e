"""Configuration loading: precedence (defaults < CPU profile < file < environment < flags), the
CPU profile, error messages that name the key, and docs/configuration.md being up to date."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import FOLDED_KEYS, ServeConfig
from common.config.gateway import GATEWAY_GROUPS, GatewayConfig
from orchestrator.settings import (
    CPU_PROFILE,
    ConfigError,
    env_overrides,
    load_config,
    set_overrides,
)
from orpheus_serve.cli import _serve_flags, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _gen_docs() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", ROOT / "scripts" / "gen_config_docs.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_docs", module)
    spec.loader.exec_module(module)
    return module


gen_docs = _gen_docs()


def write(tmp_path: Path, text: str, name: str = "c.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def load(
    tmp_path: Path,
    toml: str | None = None,
    env: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
) -> ServeConfig:
    path = write(tmp_path, toml) if toml is not None else None
    return load_config(path, flags, env or {})


def config_error(tmp_path: Path, **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, **kw)
    return str(info.value)


def get(cfg: ServeConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


# -- defaults and the CPU profile ------------------------------------------------------------
def test_defaults_are_the_struct_defaults_and_gpu(tmp_path: Path) -> None:
    cfg = load(tmp_path)
    assert cfg == ServeConfig()
    assert cfg.device == "cuda"


def test_process_environment_is_read_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORPHEUS_GATEWAY__PORT", "8123")
    assert load_config(None, None, None).gateway.port == 8123


def _profile_items(node: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in node.items():
        if isinstance(v, dict):
            out += _profile_items(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


PROFILE = _profile_items(CPU_PROFILE)


def test_cpu_profile_keys_exist_and_validate(tmp_path: Path) -> None:
    cfg = load(tmp_path, env={"ORPHEUS_DEVICE": "cpu"})
    for key, value in PROFILE:
        assert get(cfg, key) == value, key


@pytest.mark.parametrize(
    "how",
    ["file", "env", "flag", "cli"],
)
def test_cpu_profile_applies_whichever_layer_names_the_device(tmp_path: Path, how: str) -> None:
    if how == "cli":
        args = build_parser().parse_args(["serve", "--device", "cpu"])
        cfg = load_config(None, _serve_flags(args), {})
    else:
        cfg = load(
            tmp_path,
            toml='device = "cpu"\n' if how == "file" else None,
            env={"ORPHEUS_DEVICE": "cpu"} if how == "env" else None,
            flags={"device": "cpu"} if how == "flag" else None,
        )
    assert cfg.device == "cpu"
    assert cfg.llm.enforce_eager is True
    assert cfg.llm.max_num_seqs == CPU_PROFILE["llm"]["max_num_seqs"]


def test_cpu_profile_not_applied_on_cuda(tmp_path: Path) -> None:
    cfg = load(tmp_path, toml='device = "cuda"\n')
    assert cfg.llm.max_num_seqs == ServeConfig().llm.max_num_seqs
    assert cfg.llm.enforce_eager is False


def test_file_env_and_flags_override_the_cpu_profile(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        toml='device = "cpu"\n[llm]\nmax_num_seqs = 5\n[codec]\nmax_batch = 7\n',
        env={"ORPHEUS_CODEC__THREADS": "3"},
        flags={"llm": {"enforce_eager": False}},
    )
    assert cfg.llm.max_num_seqs == 5
    assert cfg.codec.max_batch == 7
    assert cfg.codec.threads == 3
    assert cfg.llm.enforce_eager is False
    # ... and the profile's other keys stay.
    assert cfg.llm.max_model_len == CPU_PROFILE["llm"]["max_model_len"]


def test_a_later_layer_can_leave_the_cpu_profile(tmp_path: Path) -> None:
    cfg = load(tmp_path, toml='device = "cpu"\n', flags={"device": "cuda"})
    assert cfg.device == "cuda"
    assert cfg.llm.max_num_seqs == ServeConfig().llm.max_num_seqs


# -- precedence: file < environment < flags --------------------------------------------------
def test_precedence_file_env_flags(tmp_path: Path) -> None:
    toml = "[gateway]\nport = 9001\n"
    env = {"ORPHEUS_GATEWAY__PORT": "9002"}
    flags = {"gateway": {"port": 9003}}
    assert load(tmp_path, toml=toml).gateway.port == 9001
    assert load(tmp_path, toml=toml, env=env).gateway.port == 9002
    assert load(tmp_path, toml=toml, env=env, flags=flags).gateway.port == 9003
    assert load(tmp_path, toml=toml, flags=flags).gateway.port == 9003


@settings(max_examples=40, deadline=None)
@given(
    layers=st.fixed_dictionaries(
        {},
        optional={
            "file": st.integers(1, 4096),
            "env": st.integers(1, 4096),
            "flag": st.integers(1, 4096),
            "set": st.integers(1, 4096),
        },
    )
)
def test_precedence_property(tmp_path_factory: pytest.TempPathFactory, layers: dict) -> None:
    """Whatever subset of layers sets a key, the highest one wins; unset layers change nothing.
    (--set and the named flags are one layer: the named flags are applied after --set.)"""
    tmp = tmp_path_factory.mktemp("prec")
    toml = f"[llm]\nmax_num_seqs = {layers['file']}\n" if "file" in layers else None
    env = {"ORPHEUS_LLM__MAX_NUM_SEQS": str(layers["env"])} if "env" in layers else {}
    flags = set_overrides([f"llm.max_num_seqs={layers['set']}"]) if "set" in layers else {}
    if "flag" in layers:
        flags = {**flags, "llm": {"max_num_seqs": layers["flag"]}}
    cfg = load(tmp, toml=toml, env=env, flags=flags)
    expected = ServeConfig().llm.max_num_seqs
    for layer in ("file", "env", "set", "flag"):
        expected = layers.get(layer, expected)
    assert cfg.llm.max_num_seqs == expected


def test_layers_merge_key_by_key(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        toml="[llm]\nmax_num_seqs = 11\n[llm.sampling]\ntemperature = 0.4\n",
        env={"ORPHEUS_LLM__MODEL": "/models/orpheus", "ORPHEUS_LLM__SAMPLING__TOP_P": "0.7"},
        flags={"llm": {"seed": 5}},
    )
    assert (cfg.llm.max_num_seqs, cfg.llm.model, cfg.llm.seed) == (11, "/models/orpheus", 5)
    assert (cfg.llm.sampling.temperature, cfg.llm.sampling.top_p) == (0.4, 0.7)
    assert cfg.llm.sampling.repetition_penalty == ServeConfig().llm.sampling.repetition_penalty
    assert cfg.gateway == ServeConfig().gateway


def test_cli_flags_beat_env_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[gateway]\nport = 9001\nhost = "0.0.0.0"\n[codec]\nmax_batch = 8\n')
    args = build_parser().parse_args(
        ["serve", "--config", path, "--port", "9100", "--set", "codec.max_batch=16",
         "--model", "/m", "--log-format", "json"]
    )  # fmt: skip
    env = {"ORPHEUS_GATEWAY__PORT": "9002", "ORPHEUS_CODEC__MAX_BATCH": "12"}
    cfg = load_config(args.config, _serve_flags(args), env)
    assert cfg.gateway.port == 9100
    assert cfg.gateway.host == "0.0.0.0"
    assert cfg.codec.max_batch == 16
    assert cfg.llm.model == "/m"
    assert cfg.log_format == "json"


def test_named_flag_beats_set_for_the_same_key() -> None:
    args = build_parser().parse_args(["serve", "--set", "gateway.port=1", "--port", "2"])
    assert _serve_flags(args)["gateway"]["port"] == 2


# -- environment and --set value parsing -----------------------------------------------------
def test_env_values_are_json_or_text(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        env={
            "ORPHEUS_LLM__MAX_NUM_SEQS": "12",
            "ORPHEUS_LLM__GPU_MEMORY_UTILIZATION": "0.5",
            "ORPHEUS_CODEC__COMPILE": "true",
            "ORPHEUS_CODEC__BATCH_BUCKETS": "[1, 2, 4]",
            "ORPHEUS_GATEWAY__API_KEYS": '["a", "b"]',
            "ORPHEUS_LLM__TOKENIZER": "null",
            "ORPHEUS_LLM__MODEL": "canopylabs/orpheus-3b-0.1-ft",
            "ORPHEUS_LOG_LEVEL": "DEBUG",
            "ORPHEUS_LLM__VOICE_SAMPLING__LEO__TEMPERATURE": "0.5",
        },
    )
    assert cfg.llm.max_num_seqs == 12
    assert cfg.llm.gpu_memory_utilization == 0.5
    assert cfg.codec.compile is True
    assert cfg.codec.batch_buckets == [1, 2, 4]
    assert cfg.gateway.api_keys == ["a", "b"]
    assert cfg.llm.tokenizer is None
    assert cfg.log_level == "DEBUG"
    assert cfg.llm.voice_sampling["leo"].temperature == 0.5
    assert cfg.llm.voice_sampling["leo"].top_p == ServeConfig().llm.sampling.top_p


def test_env_quoted_json_string_stays_a_string(tmp_path: Path) -> None:
    assert load(tmp_path, env={"ORPHEUS_LLM__MODEL": '"2024"'}).llm.model == "2024"


def test_env_ignores_other_variables_and_the_child_spec() -> None:
    env = {
        "PATH": "/bin",
        "ORPHEUS_SERVE_CHILD_SPEC": "{not json",
        "orpheus_llm__seed": "3",  # names are case-sensitive
        "ORPHEUS_LLM__SEED": "4",
    }
    assert env_overrides(env) == {"llm": {"seed": 4}}


def test_set_overrides_parse_and_nest() -> None:
    assert set_overrides(["llm.sampling.top_p=0.5", "device=cpu", 'gateway.api_keys=["k"]']) == {
        "llm": {"sampling": {"top_p": 0.5}},
        "device": "cpu",
        "gateway": {"api_keys": ["k"]},
    }
    assert set_overrides(["gateway.host=a=b"]) == {"gateway": {"host": "a=b"}}


def test_set_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"llm\.max_num_seqs"):
        set_overrides(["llm.max_num_seqs"])


def test_voice_aliases_replace_the_default_map_and_merge_across_layers(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        toml='[gateway.voice_aliases]\nalloy = "leo"\n',
        env={"ORPHEUS_GATEWAY__VOICE_ALIASES__ECHO": "zac"},
    )
    assert cfg.gateway.voice_aliases == {"alloy": "leo", "echo": "zac"}


def _leaf_options() -> list[Any]:
    return [o for o in gen_docs.options() if not o.is_table and not isinstance(o.default, dict)]


@pytest.mark.parametrize("option", _leaf_options(), ids=lambda o: o.key)
def test_every_option_is_settable_by_env_and_by_set(tmp_path: Path, option: Any) -> None:
    """The naming rule works for every key: set each to its own default both ways."""
    value = msgspec.to_builtins(option.default)
    raw = json.dumps(value)
    by_env = load(tmp_path, env={option.env: raw})
    by_set = load(tmp_path, flags=set_overrides([f"{option.key}={raw}"]))
    assert get(by_env, option.key) == option.default
    assert get(by_set, option.key) == option.default


# -- errors name the key ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "names"),
    [
        # wrong type
        ({"toml": '[llm]\nmax_num_seqs = "many"\n'}, ["llm.max_num_seqs", "int"]),
        ({"env": {"ORPHEUS_LLM__MAX_NUM_SEQS": "many"}}, ["llm.max_num_seqs", "int"]),
        ({"flags": {"codec": {"compile": "yes"}}}, ["codec.compile", "bool"]),
        ({"toml": '[gateway]\napi_keys = "k"\n'}, ["gateway.api_keys"]),
        ({"toml": "[llm]\nsampling = 3\n"}, ["llm.sampling"]),
        ({"toml": 'device = "tpu"\n'}, ["device", "tpu"]),
        ({"toml": 'log_format = "xml"\n'}, ["log_format", "xml"]),
        # unknown key or section
        ({"toml": "[llm]\nmax_num_seq = 3\n"}, ["max_num_seq", "llm"]),
        ({"toml": "[llmm]\nmax_num_seqs = 3\n"}, ["llmm"]),
        ({"toml": "[llm.sampling]\ntemprature = 0.3\n"}, ["temprature", "llm.sampling"]),
        ({"env": {"ORPHEUS_LLM_MAX_NUM_SEQS": "3"}}, ["llm_max_num_seqs"]),
        ({"env": {"ORPHEUS_GATEWAY__PROT": "80"}}, ["prot", "gateway"]),
        # bad value
        ({"toml": "[gateway]\nport = 70000\n"}, ["gateway.port", "70000"]),
        ({"env": {"ORPHEUS_LLM__GPU_MEMORY_UTILIZATION": "1.5"}}, ["llm.gpu_memory_utilization"]),
        ({"toml": '[llm]\nkv_cache_dtype = "int4"\n'}, ["llm.kv_cache_dtype", "int4"]),
        ({"toml": "[llm]\nmax_model_len = 100\n"}, ["llm.max_model_len"]),
        ({"toml": "[llm]\nmax_num_seqs = 0\n"}, ["llm.max_num_seqs"]),
        ({"toml": "[gateway]\nprocesses = 0\n"}, ["gateway.processes"]),
        ({"toml": "[codec]\nhop_frames = 0\n"}, ["codec.hop_frames"]),
        ({"toml": "[codec]\nmax_hop_frames = 1\nhop_frames = 2\n"}, ["codec.max_hop_frames"]),
        ({"toml": "[codec]\nmax_batch = 0\n"}, ["codec.max_batch"]),
        ({"toml": "[shm]\npcm_ring_bytes = 1024\n"}, ["shm.pcm_ring_bytes"]),
    ],
)
def test_errors_name_the_key(tmp_path: Path, kw: dict[str, Any], names: list[str]) -> None:
    message = config_error(tmp_path, **kw)
    for name in names:
        assert name in message, (name, message)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    message = config_error(tmp_path, toml="[gateway]\nport = 0\nprocesses = 0\n")
    assert "gateway.port" in message and "gateway.processes" in message


def test_bad_log_level_names_the_key(tmp_path: Path) -> None:
    assert "log_level" in config_error(tmp_path, env={"ORPHEUS_LOG_LEVEL": "VERBOSE"})


def test_unreadable_and_malformed_files_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(str(missing), None, {})
    bad = write(tmp_path, "[llm\nmax_num_seqs = 3\n", "bad.toml")
    with pytest.raises(ConfigError, match=r"bad\.toml.*line 1"):
        load_config(bad, None, {})


def test_serve_exits_2_with_the_message_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.supervisor as supervisor

    def never(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a Supervisor was started with an invalid configuration")

    monkeypatch.setattr(supervisor, "Supervisor", never)
    monkeypatch.delenv("ORPHEUS_DEVICE", raising=False)
    path = write(tmp_path, "[llm]\nmax_num_seq = 3\n")
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orpheus-serve: ") and "max_num_seq" in err
    assert main(["serve", "--set", "gateway.port=70000"]) == 2
    assert "gateway.port" in capsys.readouterr().err


# -- docs/configuration.md -------------------------------------------------------------------
def test_every_option_has_a_description() -> None:
    assert gen_docs.undocumented() == [], (
        "add a docstring under the field in its Struct (or an entry in DESCRIPTIONS of "
        "scripts/gen_config_docs.py), then run python scripts/gen_config_docs.py"
    )


def test_no_description_for_an_option_that_does_not_exist() -> None:
    assert gen_docs.stale_descriptions() == []


def test_operators_meet_at_most_100_keys_and_every_internal_key_exists() -> None:
    """Issue 44: an operator sees at most 100 keys; the rest are named as internal, each with
    a reason, and still load (the tests set several through ``--set``)."""
    assert gen_docs.unknown_internal_keys() == []
    assert len(gen_docs.operator_keys()) <= 100, gen_docs.operator_keys()
    assert all(reason.strip() for reason in gen_docs.INTERNAL_KEYS.values())
    cfg = load_config(None, {"codec": {"late_lookahead_ms": -1}, "llm": {"seed": 7}})
    assert cfg.codec.late_lookahead_ms == -1 and cfg.llm.seed == 7


@pytest.mark.parametrize("key", sorted(FOLDED_KEYS))
def test_a_folded_key_is_refused_with_what_replaced_it(tmp_path: Path, key: str) -> None:
    section, name = key.split(".")
    env = {f"ORPHEUS_{section.upper()}__{name.upper()}": "1"}
    for layer in (
        {"toml": f"[{section}]\n{name} = 1\n"},
        {"env": env},
        {"flags": {section: {name: 1}}},
    ):
        assert (
            config_error(tmp_path, **layer) == f"{key} is no longer a setting: {FOLDED_KEYS[key]}"
        )
    assert not hasattr(getattr(ServeConfig(), section), name), (
        "a folded key is gone from its Struct"
    )


def test_the_gateway_keys_are_grouped_by_job_in_the_struct_s_order() -> None:
    """Issue 61: ``[gateway]``'s keys sit in groups by the job they configure, the Struct in
    the groups' order, each key in one group; the reference shows a table per group."""
    grouped = [name for _, names in GATEWAY_GROUPS for name in names]
    assert grouped == list(GatewayConfig.__struct_fields__)
    text = gen_docs.DOC.read_text()
    for title, _ in GATEWAY_GROUPS:
        assert f"#### {title}\n" in text, title


def test_configuration_doc_is_up_to_date() -> None:
    current = gen_docs.DOC.read_text()
    assert gen_docs.BEGIN in current and gen_docs.END in current
    assert gen_docs.render_document(current) == current, (
        "docs/configuration.md is out of date: run python scripts/gen_config_docs.py"
    )


def test_doc_lists_every_option_and_cpu_default() -> None:
    text = gen_docs.DOC.read_text().partition(gen_docs.BEGIN)[2]
    for option in gen_docs.options():
        if "." in option.key or not option.is_table:  # sections are headings, not rows
            assert f"| `{option.key}` |" in text, option.key
    for key, value in PROFILE:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        cells = re.split(r"(?<!\\)\|", row)
        if get(ServeConfig(), key) != value:
            assert f"`{gen_docs.toml_value(value)}`" in cells[4], (key, cells)


def test_doc_check_mode_detects_a_stale_doc(tmp_path: Path) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# x\n\n{gen_docs.BEGIN}\nold\n{gen_docs.END}\n")
    assert gen_docs.main(["--check", "--doc", str(doc)]) == 1
    assert gen_docs.main(["--doc", str(doc)]) == 0
    assert gen_docs.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text().startswith("# x\n\n")


def test_key_weights_are_read_from_toml_and_must_be_positive(tmp_path: Path) -> None:
    ok = write(tmp_path, '[gateway]\nkey_weights = { "gold" = 3, "silver" = 1.5 }\n', "ok.toml")
    assert load_config(ok, None, {}).gateway.key_weights == {"gold": 3.0, "silver": 1.5}
    message = config_error(tmp_path, toml='[gateway]\nkey_weights = { "gold" = 0 }\n')
    assert "gateway.key_weights" in message
