"""Every file under deploy/ is parsed and validated: TOML through the real config loader,
systemd units with systemd-analyze, supervisord with supervisor's own parser, nginx and HAProxy
with their own checkers, Prometheus files with promtool (including the alert unit tests), and
every metric a dashboard or alert queries must be defined in the code (or by vLLM).

The external checkers are used when installed (Debian: systemd, nginx-light, haproxy,
prometheus) and skipped with the reason otherwise; the structural checks always run. Nothing
here starts a service.
"""

from __future__ import annotations

import ast
import configparser
import getpass
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from front_limits import body_limits, longest_node_silence_s, nginx_size

from common.mps import control_path
from orchestrator.failures import EXIT_PERMANENT
from orchestrator.settings import load_config
from orchestrator.supervisor import STOP_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
PROM = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
MULTINODE = DEPLOY / "multinode"
PROD_TOML = DEPLOY / "config" / "orpheus-serve.toml"
CPU_TOML = DEPLOY / "config" / "cpu.toml"
EXEC = "/opt/orpheus-serve/.venv/bin/orpheus-serve serve --config /etc/orpheus-serve/config.toml"
CODE_DIRS = ("gateway", "codec_worker", "llm_worker", "orchestrator", "shm")
# Series that come from Prometheus itself or from standard exporters, not from our code.
EXTERNAL_METRICS = {"up", "probe_success"}
CHECK_TIMEOUT_S = 60


def tool(name: str) -> str | None:
    """An installed program, also from the sbin directories that a user's PATH may lack."""
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False, **kw
    )


def prod_config() -> Any:
    return load_config(str(PROD_TOML), None, {})


def min_stop_timeout_s() -> float:
    """What a service manager must wait after SIGTERM: the drain, then two grace periods
    (gateways, then workers) of the orchestrator's shutdown."""
    return prod_config().drain_timeout_s + 2 * STOP_GRACE_S


# -- TOML configuration examples -------------------------------------------------------------
def test_production_config_loads_and_targets_one_gpu() -> None:
    cfg = prod_config()
    assert cfg.device == "cuda"
    assert cfg.log_format == "json"
    assert cfg.gateway.host == "0.0.0.0"
    assert cfg.codec.compile is True
    assert cfg.llm.enforce_eager is False
    assert cfg.llm.max_num_seqs >= cfg.gateway.max_active_streams  # no queue inside vLLM


def test_cpu_config_loads_with_the_cpu_profile() -> None:
    cfg = load_config(str(CPU_TOML), None, {})
    assert cfg.device == "cpu"
    assert cfg.codec.compile is False and cfg.llm.enforce_eager is True  # from the profile
    assert cfg.gateway.host == "127.0.0.1"
    assert cfg.llm.max_num_seqs >= cfg.gateway.max_active_streams


@pytest.mark.parametrize("path", [PROD_TOML, CPU_TOML], ids=lambda p: p.name)
def test_config_examples_take_environment_overrides(path: Path) -> None:
    cfg = load_config(str(path), None, {"ORPHEUS_GATEWAY__PORT": "9009"})
    assert cfg.gateway.port == 9009


# -- systemd -----------------------------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate; comments start with # or ;."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}:{n}: key outside a section"
        assert "=" in line, f"{path.name}:{n}: not key=value: {raw!r}"
        assert not line.endswith("\\"), f"{path.name}:{n}: continuation lines are not used here"
        key, value = (s.strip() for s in line.split("=", 1))
        current.setdefault(key, []).append(value)
    return sections


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "": 1}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


UNITS = sorted(SYSTEMD.glob("orpheus-serve*.service"))
"""The server's units (the whole server as one service, and one instance per GPU)."""
MPS_UNIT = SYSTEMD / "nvidia-mps.service"
MPS_DROP_IN = SYSTEMD / "orpheus-serve-mps.conf"


def test_systemd_units_exist() -> None:
    assert [p.name for p in UNITS] == ["orpheus-serve.service", "orpheus-serve@.service"]
    assert sorted(p.name for p in SYSTEMD.iterdir()) == sorted(
        [*(p.name for p in UNITS), MPS_UNIT.name, MPS_DROP_IN.name]
    )


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_unit_structure(path: Path) -> None:
    unit = parse_unit(path)
    assert set(unit) == {"Unit", "Service", "Install"}
    s = {k: v[-1] for k, v in unit["Service"].items()}
    assert s["Type"] == "simple"  # the orchestrator does not speak sd_notify
    assert s["ExecStart"] == EXEC
    assert s["KillSignal"] == "SIGTERM"
    # SIGTERM to the orchestrator only: it drains and stops its workers in order.
    assert s["KillMode"] == "mixed"
    assert seconds(s["TimeoutStopSec"]) > min_stop_timeout_s()
    assert s["Restart"] == "on-failure"
    # Configuration error (2) and permanent start-up failure (78): no restart loop.
    assert {"2", str(EXIT_PERMANENT)} <= set(s["RestartPreventExitStatus"].split())
    assert unit["Service"]["EnvironmentFile"]
    assert s["User"] and s["User"] != "root"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # Hardening that would break CUDA or /dev/shm.
    assert s.get("PrivateDevices", "no") == "no"
    assert s.get("MemoryDenyWriteExecute", "no") == "no"
    assert s.get("ProcSubset", "all") == "all"
    assert s.get("DevicePolicy", "auto") == "auto"
    assert "DeviceAllow" not in s  # any allow list (also the one ProtectClock implies) ...
    assert s.get("ProtectClock", "no") == "no"  # ... would shut out /dev/nvidia*
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_unit_environment_names_real_options(path: Path) -> None:
    env = {}
    for assignment in parse_unit(path)["Service"].get("Environment", []):
        name, _, value = assignment.partition("=")
        env[name] = value.replace("%i", "0")
    orpheus = {k: v for k, v in env.items() if k.startswith("ORPHEUS_")}
    assert orpheus, "the units set shm.run_dir through the environment"
    cfg = load_config(str(PROD_TOML), None, orpheus)
    assert cfg.shm.run_dir.startswith("/run/orpheus-serve")
    runtime = parse_unit(path)["Service"]["RuntimeDirectory"][-1].replace("%i", "0")
    assert cfg.shm.run_dir == f"/run/{runtime}"


def test_template_unit_does_not_remove_other_instances_ipc() -> None:
    s = parse_unit(SYSTEMD / "orpheus-serve@.service")["Service"]
    assert s["RemoveIPC"] == ["no"]  # RemoveIPC is per user: it would unlink the others' rings
    assert "%i" in s["RuntimeDirectory"][-1]


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_units_free_what_a_crashed_instance_left(path: Path) -> None:
    """After any stop, a crash included, `orpheus-serve cleanup` with the server's own
    configuration (its shm.run_dir); a failure there does not fail the unit (issue 47)."""
    from orpheus_serve.cli import build_parser

    post = parse_unit(path)["Service"]["ExecStopPost"]
    assert post == ["-" + EXEC.replace(" serve ", " cleanup ")]
    args = build_parser().parse_args(post[0][1:].split()[1:])
    assert args.command == "cleanup" and args.config == "/etc/orpheus-serve/config.toml"


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(path: Path, tmp_path: Path) -> None:
    exe = tool("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # verify checks that ExecStart exists: point it at a real program in a copy.
    name = path.name.replace("@.", "@0.")
    copy = tmp_path / name
    copy.write_text(path.read_text().replace(EXEC.split()[0], "/bin/true"))
    r = run([exe, "verify", "--man=no", str(copy)])
    ours = [line for line in (r.stdout + r.stderr).splitlines() if name in line]
    assert not ours, "\n".join(ours)
    if r.returncode != 0:
        pytest.skip(f"systemd-analyze verify cannot run here: {(r.stderr or r.stdout)[:300]}")


# -- CUDA MPS under systemd ---------------------------------------------------------------------
def environment(section: dict[str, list[str]]) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in section.get("Environment", []))


def test_mps_unit_runs_the_control_daemon() -> None:
    unit = parse_unit(MPS_UNIT)
    s = {k: v[-1] for k, v in unit["Service"].items()}
    # -d forks the daemon and returns; quit on the control pipe is its documented shutdown.
    assert s["Type"] == "forking"
    assert s["ExecStart"].split() == ["/usr/bin/nvidia-cuda-mps-control", "-d"]
    assert re.fullmatch(
        r"/bin/sh -c 'echo quit \| /usr/bin/nvidia-cuda-mps-control'", s["ExecStop"]
    )
    # Its directories are systemd's: made before the start, the pipe's removed after the stop.
    env = environment(unit["Service"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"/run/{s['RuntimeDirectory']}"
    assert env["CUDA_MPS_LOG_DIRECTORY"] == f"/var/log/{s['LogsDirectory']}"
    assert "CUDA_VISIBLE_DEVICES" not in env, "one daemon serves every GPU"
    assert "User" not in s, "root: compute mode, and one MPS server per client user"
    assert "EXCLUSIVE_PROCESS" in s["ExecStartPre"] and "DEFAULT" in s["ExecStopPost"]
    assert "orpheus-serve.service" in unit["Unit"]["Before"][-1].split()
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_mps_drop_in_puts_every_server_unit_behind_the_daemon() -> None:
    drop_in = parse_unit(MPS_DROP_IN)
    assert set(drop_in) == {"Unit", "Service"}
    assert drop_in["Unit"]["Wants"] == drop_in["Unit"]["After"] == [MPS_UNIT.name]
    pipe = environment(drop_in["Service"])["CUDA_MPS_PIPE_DIRECTORY"]
    daemon_env = environment(parse_unit(MPS_UNIT)["Service"])
    # The server looks where the daemon listens: what common.mps.mps_active checks at start.
    assert control_path({"CUDA_MPS_PIPE_DIRECTORY": pipe}) == control_path(daemon_env)
    # The MPS server's shared memory is the service user's, outside its cgroup.
    assert drop_in["Service"]["RemoveIPC"] == ["no"]
    for path in UNITS:
        s = {k: v[-1] for k, v in parse_unit(path)["Service"].items()}
        if s.get("PrivateTmp") == "yes":
            assert not Path(pipe).is_relative_to("/tmp"), f"{path.name} has its own /tmp"
        assert "CUDA_MPS_PIPE_DIRECTORY" not in environment(parse_unit(path)["Service"])
        assert not set(s.get("InaccessiblePaths", "").split()) & {"/run", pipe}


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_with_mps(path: Path, tmp_path: Path) -> None:
    """The daemon's unit, and each server unit with the drop-in installed as README says."""
    exe = tool("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    name = path.name.replace("@.", "@0.")
    (tmp_path / name).write_text(path.read_text().replace(EXEC.split()[0], "/bin/true"))
    (tmp_path / f"{path.name}.d").mkdir()
    (tmp_path / f"{path.name}.d" / "mps.conf").write_text(MPS_DROP_IN.read_text())
    mps = MPS_UNIT.read_text()
    for program in ("/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-smi"):
        mps = mps.replace(program, "/bin/true")
    (tmp_path / MPS_UNIT.name).write_text(mps)
    r = run([exe, "verify", "--man=no", str(tmp_path / name), str(tmp_path / MPS_UNIT.name)])
    ours = [
        line
        for line in (r.stdout + r.stderr).splitlines()
        if any(n in line for n in (name, "mps.conf", MPS_UNIT.name))
    ]
    assert not ours, "\n".join(ours)
    if r.returncode != 0:
        pytest.skip(f"systemd-analyze verify cannot run here: {(r.stderr or r.stdout)[:300]}")


# -- supervisord -------------------------------------------------------------------------------
SUPERVISORD = DEPLOY / "supervisord" / "orpheus-serve.conf"
SUPERVISORD_MPS = DEPLOY / "supervisord" / "nvidia-mps.conf"


def test_supervisord_structure() -> None:
    cp = configparser.RawConfigParser(inline_comment_prefixes=(";",))
    cp.read(SUPERVISORD)
    assert cp.sections() == ["program:orpheus-serve"]
    p = cp["program:orpheus-serve"]
    assert p["command"] == EXEC
    assert p["stopsignal"] == "TERM"
    assert int(p["stopwaitsecs"]) > min_stop_timeout_s()
    assert p["stopasgroup"] == "false" and p["killasgroup"] == "false"
    assert {"0", "2", str(EXIT_PERMANENT)} <= set(p["exitcodes"].split(","))
    assert p["autorestart"] == "unexpected"


def supervisor_groups(tmp_path: Path, *programs: Path) -> list[Any]:
    """supervisord's process groups of ``programs`` (deploy/supervisord/'s files), included
    from one main file as deploy/README.md installs them; parsed without a critical or a
    warning. The parser checks that the user and the log directory exist: this machine's
    user, ``tmp_path`` for the logs."""
    from supervisor.options import ServerOptions

    files = []
    for path in programs:
        text = path.read_text().replace("user=orpheus", f"user={getpass.getuser()}")
        files.append(tmp_path / path.name)
        files[-1].write_text(text.replace("/var/log/orpheus-serve/", f"{tmp_path}/"))
    main = tmp_path / "supervisord.conf"
    main.write_text(
        f"[supervisord]\nlogfile={tmp_path}/supervisord.log\npidfile={tmp_path}/s.pid\n"
        f"[include]\nfiles={' '.join(map(str, files))}\n"
    )
    opts = ServerOptions()
    opts.configfile = str(main)
    opts.process_config(do_usage=False)
    assert not opts.parse_criticals and not opts.parse_warnings
    return opts.process_group_configs


def test_supervisord_parsed_by_supervisor(tmp_path: Path) -> None:
    pytest.importorskip("supervisor.options", reason="pip install supervisor")
    from supervisor.datatypes import RestartWhenExitUnexpected, signal_number

    [group] = supervisor_groups(tmp_path, SUPERVISORD)
    [proc] = group.process_configs
    assert proc.name == "orpheus-serve"
    assert proc.command == EXEC
    assert proc.stopsignal == signal_number("TERM")
    assert proc.stopwaitsecs > min_stop_timeout_s()
    assert proc.killasgroup is False and proc.stopasgroup is False
    assert proc.autorestart is RestartWhenExitUnexpected
    assert {0, 2, EXIT_PERMANENT} <= set(proc.exitcodes)
    orpheus_env = {k: v for k, v in proc.environment.items() if k.startswith("ORPHEUS_")}
    assert load_config(str(PROD_TOML), None, orpheus_env).shm.run_dir == "/tmp"


def test_supervisord_mps_program_parsed_by_supervisor(tmp_path: Path) -> None:
    """nvidia-mps.conf next to orpheus-serve.conf, as deploy/README.md installs them: the
    daemon in the foreground, started before the server and stopped after it, listening
    where the server's engines look."""
    pytest.importorskip("supervisor.options", reason="pip install supervisor")
    from supervisor.datatypes import RestartUnconditionally, signal_number

    groups = {g.name: g for g in supervisor_groups(tmp_path, SUPERVISORD, SUPERVISORD_MPS)}
    [mps] = groups["nvidia-mps"].process_configs
    [server] = groups["orpheus-serve"].process_configs
    assert groups["nvidia-mps"].priority < groups["orpheus-serve"].priority
    assert mps.uid == 0 and mps.autorestart is RestartUnconditionally
    assert mps.stopsignal == signal_number("INT")
    # The shell makes the directories, then becomes the daemon, in the foreground.
    argv = mps.command.split(None, 2)
    assert argv[:2] == ["/bin/sh", "-c"]
    script = argv[2].strip("'")
    assert script.endswith("exec nvidia-cuda-mps-control -f")
    pipe = mps.environment["CUDA_MPS_PIPE_DIRECTORY"]
    assert f"mkdir -p {pipe} {mps.environment['CUDA_MPS_LOG_DIRECTORY']}" in script
    assert server.environment["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    systemd_pipe = environment(parse_unit(MPS_UNIT)["Service"])["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe == systemd_pipe, "one pipe directory for both service managers"


# -- multi-node load balancers ----------------------------------------------------------------
NGINX = MULTINODE / "nginx.conf"
HAPROXY = MULTINODE / "haproxy.cfg"


def nginx_directives(text: str) -> list[list[str]]:
    body = re.sub(r"#[^\n]*", "", text)
    body = re.sub(r"'[^']*'", "''", body)  # quoted bodies of `return`
    return [d.split() for d in re.split(r"[;{}]", body) if d.strip()]


def test_nginx_structure() -> None:
    ds = nginx_directives(NGINX.read_text())
    first = {d[0]: d[1:] for d in ds}
    servers = [d for d in ds if d[0] == "server" and len(d) > 1]
    assert len(servers) >= 2
    assert first["least_conn"] == []
    assert first["proxy_buffering"] == ["off"]
    assert first["proxy_http_version"] == ["1.1"]
    assert seconds(first["proxy_read_timeout"][0]) >= 60
    nxt = first["proxy_next_upstream"]
    assert {"http_503", "http_429", "non_idempotent"} <= set(nxt) and "timeout" not in nxt
    assert ["location", "=", "/metrics"] in ds
    assert ["gzip", "off"] in ds


def test_nginx_config_test(tmp_path: Path) -> None:
    exe = tool("nginx")
    if exe is None:
        pytest.skip("nginx is not installed (Debian: apt-get install nginx-light)")
    # nginx -t opens the log files: keep them in tmp_path.
    text = NGINX.read_text().replace("/var/log/nginx/", f"{tmp_path}/")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text.replace("/run/nginx.pid", f"{tmp_path}/nginx.pid"))
    r = run([exe, "-t", "-q", "-p", str(tmp_path), "-c", str(conf)])
    assert r.returncode == 0, r.stderr
    assert "[emerg]" not in r.stderr


def test_haproxy_structure() -> None:
    lines = [ln.split("#")[0].strip() for ln in HAPROXY.read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    assert "balance leastconn" in lines
    assert "option httpchk" in lines
    check = next(ln for ln in lines if ln.startswith("http-check send"))
    assert "meth GET" in check and "uri /ready" in check
    assert "http-check expect status 200" in lines
    assert not any("shutdown-sessions" in ln for ln in lines)  # DOWN must not cut streams
    timeouts = {ln.split()[1]: ln.split()[2] for ln in lines if ln.startswith("timeout ")}
    assert seconds(timeouts["server"]) >= 60 and seconds(timeouts["client"]) >= 60
    assert len([ln for ln in lines if ln.startswith("server ")]) >= 2
    # maxconn per node = what one node admits plus what it queues (the comment says so); the
    # limits are the node's whatever gateway.processes is (shared admission counter).
    maxconn = int(re.search(r"default-server .*maxconn (\d+)", HAPROXY.read_text()).group(1))
    g = prod_config().gateway
    assert maxconn == g.max_active_streams + g.max_queued_streams


def test_haproxy_config_check() -> None:
    exe = tool("haproxy")
    if exe is None:
        pytest.skip("haproxy is not installed (Debian: apt-get install haproxy)")
    r = run([exe, "-c", "-f", str(HAPROXY)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "[WARNING]" not in out and "[ALERT]" not in out, out


# -- the fronts against the server's own limits -------------------------------------------------
Block = tuple[list[list[str]], list[tuple[list[str], Any]]]


def nginx_tree(text: str) -> Block:
    """(directives, [(block header, block)]) of an nginx file, nested."""
    body = re.sub(r"#[^\n]*", "", text)
    body = re.sub(r"'[^']*'", "''", body)
    stack: list[Block] = [([], [])]
    word = ""
    for ch in body:
        if ch in ";{}":
            head = word.split()
            word = ""
            if ch == ";":
                stack[-1][0].append(head)
            elif ch == "{":
                block: Block = ([], [])
                stack[-1][1].append((head, block))
                stack.append(block)
            else:
                stack.pop()
        else:
            word += ch
    assert len(stack) == 1 and not word.strip(), "unbalanced braces"
    return stack[0]


def nginx_server() -> Block:
    http = next(b for h, b in nginx_tree(NGINX.read_text())[1] if h == ["http"])
    return next(b for h, b in http[1] if h == ["server"])


def nginx_setting(block: Block, name: str) -> list[str] | None:
    found = [d[1:] for d in block[0] if d[0] == name]
    return found[-1] if found else None


def nginx_location(server: Block, path: str) -> Block:
    """The location nginx picks for ``path`` (exact match, else the longest prefix)."""
    locations = [(h[1:], b) for h, b in server[1] if h[0] == "location"]
    for args, block in locations:
        if args == ["=", path]:
            return block
    prefixes = [(args[0], b) for args, b in locations if len(args) == 1]
    return max((p for p in prefixes if path.startswith(p[0])), key=lambda p: len(p[0]))[1]


@pytest.mark.parametrize("path", body_limits())
def test_nginx_takes_every_body_the_gateway_takes(path: str) -> None:
    """Each POST route's location lets through the largest body the gateway takes there (so the
    gateway's own 413, which names its limit, is what a client sees), and not unboundedly
    more (0, no limit, would let anything reach the node)."""
    server = nginx_server()
    location = nginx_location(server, path)
    assert nginx_setting(location, "proxy_pass") == ["http://orpheus"]
    limit = nginx_setting(location, "client_max_body_size") or nginx_setting(
        server, "client_max_body_size"
    )
    assert limit is not None
    size = nginx_size(limit[0])
    gateway = body_limits()[path]
    assert gateway < size <= 2 * gateway, (path, limit, gateway)


NGINX_LOCATION_OWN = {"proxy_pass", "client_max_body_size", "return", "default_type", "add_header"}
"""What a location of nginx.conf may set itself; everything else is the server's."""


def test_nginx_streams_every_location() -> None:
    """Streaming and timeouts are set once for the server and no location overrides them."""
    server = nginx_server()
    assert nginx_setting(server, "proxy_buffering") == ["off"]
    assert nginx_setting(server, "proxy_request_buffering") == ["on"]  # resent on 429/503
    silence = longest_node_silence_s()
    for name in ("proxy_read_timeout", "proxy_send_timeout"):
        assert seconds(nginx_setting(server, name)[0]) > silence, name
    # The node drops a client that reads nothing first.
    assert seconds(nginx_setting(server, "send_timeout")[0]) > (
        prod_config().gateway.client_stall_timeout_s
    )
    assert nginx_setting(server, "proxy_set_header") is not None
    for head, location in server[1]:
        overridden = {d[0] for d in location[0]} - NGINX_LOCATION_OWN
        assert not overridden, f"location {head}: set these for the server: {overridden}"


def haproxy_lines() -> list[str]:
    lines = [ln.split("#")[0].strip() for ln in HAPROXY.read_text().splitlines()]
    return [ln for ln in lines if ln]


def test_haproxy_timeouts_outlast_the_nodes_silences() -> None:
    timeouts = {ln.split()[1]: ln.split()[2] for ln in haproxy_lines() if ln.startswith("timeout ")}
    silence = longest_node_silence_s()
    for name in ("client", "server", "tunnel"):
        assert seconds(timeouts[name]) > silence, name
    assert not any("http-buffer-request" in ln or "compression" in ln for ln in haproxy_lines())


def test_haproxy_body_limits_per_path() -> None:
    """The Content-Length limits: above the gateway's on each POST route, at most twice it."""
    lines = haproxy_lines()
    acl = next(ln.split() for ln in lines if ln.startswith("acl voice_upload "))
    assert acl[2:] == ["path", "/v1/audio/voices", "/v1/watermark/detect"]
    rules = {}
    for ln in lines:
        m = re.match(r"http-request return status 413 .* if (!?voice_upload) \{ "
                     r"req\.hdr_val\(content-length\) gt (\d+) \}$", ln)  # fmt: skip
        if m:
            rules[m.group(1)] = int(m.group(2))
    assert set(rules) == {"voice_upload", "!voice_upload"}
    for path, gateway in body_limits().items():
        upload = path in ("/v1/audio/voices", "/v1/watermark/detect")
        size = rules["voice_upload" if upload else "!voice_upload"]
        assert gateway < size <= 2 * gateway, (path, size, gateway)


# -- metrics: what the code defines ------------------------------------------------------------
KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary"}
VLLM_KINDS = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}


def _metric_calls(path: Path, kinds: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(name, kind) of every metric constructor call with a literal name in a Python file."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if fname not in kinds:
            continue
        arg = next((k.value for k in node.keywords if k.arg == "name"), None)
        if arg is None and node.args:
            arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield arg.value, kinds[fname]


def exposed_names(name: str, kind: str) -> set[str]:
    """The sample names prometheus_client exposes for a metric (counters lose and regain
    ``_total``)."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count", f"{name}_created"}
    return {name}


@cache
def code_metrics() -> dict[str, str]:
    """Exposed sample name -> defining metric, for every metric defined in our Python."""
    out: dict[str, str] = {}
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            for name, kind in _metric_calls(path, KINDS):
                for sample in exposed_names(name, kind):
                    out[sample] = f"{kind} {name} ({path.relative_to(ROOT)})"
    return out


@cache
def vllm_metrics() -> dict[str, str] | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    out: dict[str, str] = {}
    metrics_dir = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    for path in sorted(metrics_dir.glob("*.py")):
        for name, kind in _metric_calls(path, {**VLLM_KINDS, **KINDS}):
            if name.startswith("vllm:"):
                for sample in exposed_names(name, kind):
                    out[sample] = f"{kind} {name}"
    return out


_KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan", "group_left", "group_right"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers (and Grafana's {{legend}})
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_promql_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (node, le) (rate(a_bucket{job="x", le=~"1|2"}[5m])))'
        " / on (node) group_left sum without (api) (b_total offset 5m) > bool 1e3"
        ' and vllm:c{instance=~"$instance"} unless resets(sum(d)[15m:1m]) > 0'
    )
    assert promql_metric_names(expr) == {"a_bucket", "b_total", "vllm:c", "d"}


def unknown_metrics(exprs: list[str]) -> dict[str, set[str]]:
    known = {**code_metrics()}
    vllm = vllm_metrics()
    missing: dict[str, set[str]] = {}
    for expr in exprs:
        for name in promql_metric_names(expr):
            if name in known or name in EXTERNAL_METRICS:
                continue
            if name.startswith("vllm:") and (vllm is None or name in vllm):
                continue
            missing.setdefault(name, set()).add(expr.strip().splitlines()[0][:80])
    return missing


def label_values_used(exprs: list[str], label: str) -> set[str]:
    values: set[str] = set()
    for expr in exprs:
        for m in re.finditer(rf'\b{label}\s*(=~|=)\s*"([^"]*)"', expr):
            values |= set(m.group(2).split("|")) if m.group(1) == "=~" else {m.group(2)}
    return values


def test_code_defines_the_metrics_the_deploy_files_rely_on() -> None:
    exposed = code_metrics()
    for sample in (
        "orpheus_gateway_ttfb_seconds_bucket",
        "orpheus_gateway_rtf_bucket",
        "orpheus_gateway_active_streams",
        "orpheus_gateway_requests_total",
        "orpheus_codec_batch_windows_bucket",
        "orpheus_codec_decode_seconds_bucket",
        "orpheus_codec_late_windows_total",
    ):
        assert sample in exposed, sample


# -- Prometheus ---------------------------------------------------------------------------------
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_prometheus_scrape_config() -> None:
    doc = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    serve = jobs["orpheus-serve"]
    assert serve.get("metrics_path", "/metrics") == "/metrics"
    assert all(":" in t for sc in serve["static_configs"] for t in sc["targets"])
    ready = jobs["orpheus-ready"]
    assert all(t.endswith("/ready") for sc in ready["static_configs"] for t in sc["targets"])
    for rule_file in doc["rule_files"]:
        assert (PROM / rule_file).is_file(), rule_file


def test_alert_rules_structure() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
    # What the issue asks alerts for: TTFB, RTF, underruns, readiness, restarts.
    exprs = " ".join(r["expr"] for r in rules)
    for sample in (
        "orpheus_gateway_ttfb_seconds_bucket",
        "orpheus_gateway_rtf_bucket",
        "orpheus_codec_late_windows_total",
        "probe_success",
        "up",
    ):
        assert sample in promql_metric_names(exprs), sample
    assert "worker_restarted" in label_values_used([exprs], "outcome")
    assert any(r["expr"].lstrip().startswith("resets(") for r in rules)


def test_alert_rules_query_metrics_that_exist() -> None:
    assert unknown_metrics([r["expr"] for r in alert_rules()]) == {}


def test_outcome_labels_are_ones_the_gateway_counts() -> None:
    from gateway.metrics import OUTCOMES

    exprs = [r["expr"] for r in alert_rules()] + [e for _, e in dashboard_exprs()]
    assert label_values_used(exprs, "outcome") <= set(OUTCOMES)


def promtool() -> str:
    exe = tool("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return exe


def test_promtool_check_config() -> None:
    r = run([promtool(), "check", "config", "prometheus.yml"], cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules() -> None:
    r = run([promtool(), "check", "rules", "alerts.yml"], cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_alert_unit_tests() -> None:
    r = run([promtool(), "test", "rules", "alerts.test.yml"], cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr


# -- Grafana ----------------------------------------------------------------------------------
def dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "orpheus-serve.json").read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def grafana_to_promql(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$instance", ".*")
    )


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]


def test_dashboard_covers_the_issue() -> None:
    """TTFB, RTF, streams, codec batches, vLLM step metrics and KV cache use."""
    names = set().union(*(promql_metric_names(e) for _, e in dashboard_exprs()))
    for sample in (
        "orpheus_gateway_ttfb_seconds_bucket",
        "orpheus_gateway_rtf_bucket",
        "orpheus_gateway_active_streams",
        "orpheus_codec_batch_windows_bucket",
        "orpheus_codec_decode_seconds_bucket",
        "vllm:iteration_tokens_total_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert sample in names, sample


def test_dashboard_queries_metrics_that_exist() -> None:
    assert unknown_metrics([e for _, e in dashboard_exprs()]) == {}


def test_vllm_metric_names_are_checked() -> None:
    if vllm_metrics() is None:
        pytest.skip("vllm is not installed: vllm:* names in deploy/ are not checked")
    assert "vllm:kv_cache_usage_perc" in vllm_metrics()


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """promtool parses every dashboard query (as recording rules in a scratch file)."""
    exe = promtool()
    rules = [
        {"record": f"dashboard:q{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run([exe, "check", "rules", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning() -> None:
    prov = GRAFANA / "provisioning"
    dashboards = yaml.safe_load((prov / "dashboards" / "orpheus-serve.yml").read_text())
    assert dashboards["apiVersion"] == 1
    [provider] = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    sources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert sources["apiVersion"] == 1
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]


# -- every file is covered -------------------------------------------------------------------
def test_every_deploy_file_is_checked_here() -> None:
    checked = {
        "README.md",
        "config/cpu.toml",
        "config/orpheus-serve.toml",
        "grafana/orpheus-serve.json",
        "grafana/provisioning/dashboards/orpheus-serve.yml",
        "grafana/provisioning/datasources/prometheus.yml",
        "multinode/haproxy.cfg",
        "multinode/nginx.conf",
        "prometheus/alerts.test.yml",
        "prometheus/alerts.yml",
        "prometheus/prometheus.yml",
        "supervisord/nvidia-mps.conf",
        "supervisord/orpheus-serve.conf",
        "systemd/nvidia-mps.service",
        "systemd/orpheus-serve-mps.conf",
        "systemd/orpheus-serve.service",
        "systemd/orpheus-serve@.service",
    }
    # docker/ and kubernetes/ have tests of their own, each with its own every-file test
    # (tests/deploy/test_docker.py, tests/deploy/test_kubernetes.py).
    elsewhere = ("docker", "kubernetes")
    present = {
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.relative_to(DEPLOY).parts[0] not in elsewhere
    }
    assert present == checked, "add a check for new deploy files (and list them here)"
