"""Entry point of every worker process: ``python -m orchestrator.child ROLE [INDEX]``.

The orchestrator passes the configuration and instance layout as JSON in the environment
variable ORPHEUS_SERVE_CHILD_SPEC. A child dies with its parent (PR_SET_PDEATHSIG), and if
it finds its orchestrator gone when it exits, it removes the instance's segments itself so
that nothing is left in /dev/shm even after a kill -9 of the orchestrator.

Every process a child forks or spawns with multiprocessing (vLLM's EngineCore, which starts
its Workers) gets PR_SET_PDEATHSIG too (an at-fork hook inherited down the tree; spawned
processes import this module as ``__mp_main__`` first), so the engine dies with the llm
worker even when nobody is left to clean up; and a child that exits kills whatever is left
of its own process group (it leads one: the orchestrator starts it in a new session).

Whatever a worker does on that SIGTERM, it is gone ``ORPHAN_GRACE_S`` after its orchestrator
died: a watchdog thread waits on the orchestrator's pidfd, and at the deadline kills the
worker's group, removes the segments and ends the process (one ERROR line says so). The
orchestrator's supervision is what bounds a stuck worker while it lives; nothing else
would once it is dead.

A failure that restarting cannot fix (``orchestrator.failures.classify``) is logged as one
line, reported to the orchestrator as ``WorkerFailed`` and ends the process with
``EXIT_PERMANENT``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import msgspec

from common import heap
from common.config import ServeConfig
from common.cpu_plan import apply_cpu_plan, cpu_plan
from orchestrator import proctree
from orchestrator.failures import EXIT_PERMANENT, Failure, classify
from orchestrator.logs import protect_stdio, quiet_teardown, setup_logging
from shm.layout import InstanceLayout
from shm.messages import UNDECODABLE

SPEC_ENV = "ORPHEUS_SERVE_CHILD_SPEC"
EXIT_ORPHANED = 1
ORPHAN_GRACE_S = 15.0
"""How long a worker may take to stop once its orchestrator died (the gateway stops at once,
the llm worker's vLLM shutdown takes about 2 s, its own force-kill 5) before it is ended."""
ROLES = ("llm", "codec", "gateway")
MEMORY_PROBE_ENV = "ORPHEUS_PROFILE_MEMORY"
"""Mirrors :data:`common.memory_probe.ENV` (not imported: nothing of the probe loads when unset)."""


class ChildSpec(msgspec.Struct, frozen=True):
    config: ServeConfig
    layout: InstanceLayout
    parent_pid: int


def _die_with_parent() -> None:
    proctree.set_pdeathsig(signal.SIGTERM)
    # Children forked from here on (multiprocessing "fork": vLLM's EngineCore and, from it,
    # its Workers) get SIGTERM when the process that forked them dies: a kill -9 of the llm
    # worker then ends its engine (vLLM shuts down cleanly on SIGTERM). Processes started
    # with multiprocessing "spawn" run _prepare_spawned (below); other fork+exec children
    # (subprocess) are covered by the group kill.
    os.register_at_fork(after_in_child=_die_with_parent_in_fork)


def _die_with_parent_in_fork() -> None:
    proctree.set_pdeathsig(signal.SIGTERM)


def _kill_own_group(spec: ChildSpec) -> None:
    """Kill what is left of this process's group (never the caller: it leads the group only
    when the orchestrator started it, so a test calling main() cannot kill its runner)."""
    if os.getpgrp() != os.getpid():
        return
    result = proctree.kill_tree(
        os.getpid(),
        keep_prefix=spec.layout.instance,
        exclude=[os.getpid()],
        timeout_s=5.0,
        tracker_grace_s=None,  # they exit after us, once they have cleaned up what we left
    )
    if result.killed:
        logging.getLogger("orchestrator.child").warning(
            "killed processes left in this worker's group: %s", result.describe()
        )


def _end_when_orphaned_too_long(spec: ChildSpec, role: str, grace_s: float) -> None:
    """Start the watchdog: ``grace_s`` after the orchestrator's exit, if this process still
    lives, clean up as ``main``'s ``finally`` would and end it (``os._exit``: a thread cannot
    raise into the one that is stuck)."""

    def watch() -> None:
        proctree.wait_exit(spec.parent_pid)
        time.sleep(grace_s)
        logging.getLogger("orchestrator.child").error(
            "%s worker still running %.0f s after its orchestrator (pid %d) died: ending it",
            role,
            grace_s,
            spec.parent_pid,
        )
        try:
            _kill_own_group(spec)
            _cleanup_if_orphaned(spec)
        finally:
            logging.shutdown()
            os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def _report_failure(spec: ChildSpec, role: str, failure: Failure) -> None:
    """Tell the orchestrator (best-effort: it may be gone; the exit code says it too)."""
    import zmq

    from shm.messages import WorkerFailed, control_encoder

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(spec.layout.orch)
        msg = WorkerFailed(role, os.getpid(), failure.cause, failure.fix)
        try:
            sock.send(control_encoder.encode(msg))
        except zmq.ZMQError:
            pass
        sock.close()
    finally:
        ctx.term()


def _cleanup_if_orphaned(spec: ChildSpec) -> None:
    if os.getppid() != spec.parent_pid:
        from shm.segments import destroy_instance

        destroy_instance(spec.layout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ROLES:
        print(f"usage: python -m orchestrator.child {{{'|'.join(ROLES)}}} [INDEX]", file=sys.stderr)
        return 2
    role = argv[0]
    index = int(argv[1]) if len(argv) > 1 else 0
    heap.collect_older_rarely()  # before the role imports torch or vLLM (common/heap.py)
    spec = msgspec.json.decode(os.environ[SPEC_ENV].encode(), type=ChildSpec)
    numbered = role == "gateway" or (role == "llm" and spec.layout.engines > 1)
    os.environ["ORPHEUS_SERVE_ROLE"] = f"{role}-{index}" if numbered else role
    _die_with_parent()
    if os.getppid() != spec.parent_pid:
        return 1  # the orchestrator died before we got here
    _end_when_orphaned_too_long(spec, role, ORPHAN_GRACE_S)
    protect_stdio()  # a full log disk must not kill the worker (tqdm, print)
    setup_logging(spec.config.log_format, spec.config.log_level)
    quiet_teardown(spec.config.log_level)  # first atexit handler: runs after the others
    plan = cpu_plan(
        spec.config.device,
        spec.config.cpu_affinity,
        os.sched_getaffinity(0),
        engines=spec.layout.engines,
    )
    if plan is not None:
        apply_cpu_plan(plan, role, index)  # before the role imports torch or vLLM
    try:
        from setproctitle import setproctitle

        setproctitle(f"orpheus-serve {os.environ['ORPHEUS_SERVE_ROLE']}")
    except ImportError:
        pass
    if os.environ.get(MEMORY_PROBE_ENV, "").strip():  # after the title, which its samples carry
        from common import memory_probe

        memory_probe.install_from_environment()
    log = logging.getLogger("orchestrator.child")
    try:
        if role == "llm":
            from llm_worker.main import run as run_llm

            run_llm(spec.config, spec.layout, index)
        elif role == "codec":
            from codec_worker.main import run as run_codec

            run_codec(spec.config, spec.layout)
        else:
            from gateway.main import run as run_gateway

            run_gateway(spec.config, spec.layout, index)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failure = classify(role, exc, spec.config)
        if failure is None:
            log.exception("%s worker failed", role)
            return 1
        log.debug("%s worker failed", role, exc_info=True)
        log.error("%s worker failed permanently: %s", role, failure.line())
        _report_failure(spec, role, failure)
        return EXIT_PERMANENT
    finally:
        _kill_own_group(spec)
        _cleanup_if_orphaned(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _prepare_spawned() -> None:
    """In a process a worker started with multiprocessing's "spawn" method (vLLM's EngineCore
    and Workers when vLLM spawns, e.g. once CUDA is initialised): the same protections as the
    worker's own, since nothing is inherited but the environment and the open files, and the
    worker's collector thresholds (before vLLM is imported here: common/heap.py)."""
    heap.collect_older_rarely()
    protect_stdio()  # a full log disk must not fail vLLM's weight loading (tqdm on stderr)
    _die_with_parent()
    # The worker's log format and levels: what vLLM logs before it configures its own
    # logging (import-time notes, on the root logger) is then labelled and filtered too.
    try:
        config = msgspec.json.decode(os.environ[SPEC_ENV].encode(), type=ChildSpec).config
    except (KeyError, *UNDECODABLE):
        return
    setup_logging(config.log_format, config.log_level)
    quiet_teardown(config.log_level)


if __name__ == "__mp_main__":
    # multiprocessing's spawn imports the parent's main module (this one, run with -m) under
    # this name in every process it starts, before anything else runs there.
    _prepare_spawned()
