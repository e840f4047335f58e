"""Starts, watches and restarts the worker processes of one instance.

Order: codec_worker and the llm workers first (they bind the consumer doorbells and the
control sockets), gateways once all are warm. With ``llm.engines`` K > 1 there are K llm
workers, one per vLLM engine, each supervised on its own; on CUDA they start one after
another (each once the one before is ready: vLLM sizes its KV cache from the device's free
memory, which a neighbour's start-up would make wrong), on CPU all at once. The orchestrator
publishes ClusterStatus so gateways know whether and where to admit and learn when a worker
restarted (its generation is bumped, and the gateways fail the streams it held: an engine's
only, or every stream for the codec). Shutdown (SIGINT/SIGTERM): gateways drain first, then
the workers stop, then the segments are unlinked.

Each worker is a process group (its own session); when a worker dies or is stopped, what is
left of its group (vLLM's EngineCore and Worker processes, resource trackers) is killed and
the shared-memory segments only they had mapped are unlinked before it is restarted
(``orchestrator.proctree``). The orchestrator is a child subreaper, so orphans stay in reach.

A worker that reports a permanent failure (``WorkerFailed``, or exit code
``EXIT_PERMANENT``) before it was ever ready stops the server with that exit code and one line
naming the cause and the fix; so do ``MAX_START_FAILURES`` failed starts in a row.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from common.config import ServeConfig
from common.cpu_plan import cpu_plan
from llm_worker.engine.env import RPC_DIR_ENV, RPC_SOCKET_NAME_CHARS
from orchestrator import proctree
from orchestrator.child import SPEC_ENV, ChildSpec
from orchestrator.failures import EXIT_PERMANENT, Failure
from orchestrator.launcher import Launcher, Process, launch_in_own_session
from orchestrator.logs import library_env
from orchestrator.mps import log_mps
from orchestrator.reclaim import Recorder, reclaim
from shm.layout import InstanceLayout
from shm.messages import (
    ClusterStatus,
    EngineStatus,
    Heartbeat,
    OrchestratorMessage,
    WorkerFailed,
    WorkerReady,
    control_encoder,
    orchestrator_decoder,
)
from shm.segments import create_instance, describe_segments, destroy_instance

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.5
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 15.0
GIVE_UP_GRACE_S = 3.0
MAX_START_FAILURES = 5
"""Starts in a row that end before the worker is ready: then the server gives up (exit 1)."""
TREE_SNAPSHOT_S = 10.0
"""How often the shared-memory segments mapped by each worker's process tree are noted (a
tree killed by the kernel in a cascade may be gone before the orchestrator looks), and the
instance's manifest of them rewritten if they changed (``orchestrator.reclaim``: a start
after the whole instance was killed takes them back)."""
ORPHAN_REAP_S = 2.0
LOOP_STALL_WARN_S = 5.0
"""One pass of the supervision loop longer than this is logged (deaths are noticed late)."""


ENGINE_ENV = "ORPHEUS_SERVE_ENGINE"
"""The environment variable that tells an llm worker its engine index (its metrics' label)."""
MAX_SOCKET_PATH = 107
"""The longest path an AF_UNIX socket takes on Linux (``sun_path`` is 108 bytes with its NUL)."""


@dataclass
class Child:
    role: str
    index: int = 0
    numbered: bool = False
    """Named ``role-index`` (the gateways; the llm workers when there are several)."""
    proc: Process | None = None
    ready: bool = False
    generation: int = 0
    restarts: int = 0
    started_at: float = 0.0
    last_seen: float = 0.0
    restart_at: float | None = None
    ready_since: float | None = None
    ever_ready: bool = False
    failed_starts: int = 0
    failure: Failure | None = None
    segments: set[str] = field(default_factory=set)
    """/dev/shm segments its process tree has been seen to map (not the instance's rings)."""
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}" if self.numbered else self.role

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Supervises one instance. ``run`` is the whole life (segments, sockets, signals, the
    loop, shutdown); the loop is ``receive`` for each worker message and one ``step`` a
    pass, and both are public, so that a test can drive the supervision pass by pass with a
    ``launcher`` and a ``clock`` of its own."""

    def __init__(
        self,
        config: ServeConfig,
        layout: InstanceLayout | None = None,
        *,
        launcher: Launcher = launch_in_own_session,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.clock = clock
        self.layout = layout or InstanceLayout.for_pid(
            os.getpid(), config.shm.run_dir, config.gateway.processes, config.llm.engines
        )
        engines = self.layout.engines
        self.codec = Child("codec")
        self.llms = [Child("llm", e, numbered=engines > 1) for e in range(engines)]
        """One llm worker per vLLM engine."""
        self.workers = [self.codec, *self.llms]
        """Started in this order: the codec compiles while vLLM loads (docs/performance.md)."""
        self.gateways = [
            Child("gateway", i, numbered=True) for i in range(config.gateway.processes)
        ]
        self.sequential_engines = config.device == "cuda"
        """Engines start one after another (vLLM's CUDA memory profiling reads the device's
        free memory); on CPU the KV cache is sized explicitly and they start at once."""
        self.stopping = False
        self.draining = False
        self._ctx = zmq.Context.instance()
        self._orch: zmq.Socket | None = None
        self._status: zmq.Socket | None = None
        self._last_status: ClusterStatus | None = None
        self._last_status_at = 0.0
        self.metrics_dir = os.path.join(self.layout.socket_dir, "metrics")
        self.exit_failure: Failure | None = None
        self._give_up_code = EXIT_PERMANENT
        self._next_snapshot = 0.0
        self._next_reap = 0.0
        self._started_at: float | None = None
        """When the workers were started (or the first pass ran): the ready timeout and the
        "ready in" line count from it."""
        self._announced = False
        self._recorder: Recorder | None = None
        """The record of what the instance's processes hold in /dev/shm, for a start after a
        crash of the whole instance (``orchestrator.reclaim``); set by ``run``."""

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGINT/SIGTERM. Returns the process exit code."""
        if not proctree.become_subreaper():
            log.warning("cannot become a child subreaper: orphans of a dead worker go to init")
        reclaimed = reclaim(self.config.shm.run_dir, starting=self.layout.instance)
        if reclaimed.instances:
            log.warning("%s", reclaimed.describe())
        create_instance(self.layout, self.config.shm)
        log.info("%s", describe_segments(self.layout))
        self._recorder = Recorder(self.layout)
        self._recorder.write()
        plan = cpu_plan(
            self.config.device,
            self.config.cpu_affinity,
            os.sched_getaffinity(0),
            engines=self.layout.engines,
        )
        if plan is not None:
            log.info("cores: %s", plan.describe())
        log_mps(self.config, log)
        os.makedirs(self.metrics_dir, exist_ok=True)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._orch = self._ctx.socket(zmq.PULL)
            self._orch.setsockopt(zmq.LINGER, 0)
            self._orch.bind(self.layout.orch)
            self._status = self._ctx.socket(zmq.PUB)
            self._status.setsockopt(zmq.LINGER, 0)
            self._status.bind(self.layout.status)
            self.start_workers()
            code = self._loop()
        finally:
            self._shutdown()
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop(signal.Signals(signum))

    def stop(self, sig: signal.Signals) -> None:
        """Stop on ``sig`` (SIGTERM, SIGINT): the pass under way starts and announces nothing
        more, the loop ends, and ``run`` drains the gateways and stops the workers. A second
        stop skips the drain."""
        if self.stopping:
            log.warning("second signal: stopping now")
            self.draining = True
        log.info("received %s: draining and stopping", sig.name)
        self.stopping = True

    def start_workers(self) -> None:
        """Start the codec and the llm workers (on CUDA the first engine only: the others
        follow, from ``step``, each once the one before is ready)."""
        self._start(self.codec)
        self._start_engines()
        self._started_at = self.clock()

    def _loop(self) -> int:
        assert self._orch is not None
        poller = zmq.Poller()
        poller.register(self._orch, zmq.POLLIN)
        while not self.stopping:
            for sock, _ in poller.poll(100):
                self._drain_orch(sock)
            code = self.step()
            if code is not None:
                return code
        return 0

    def step(self) -> int | None:
        """One pass of supervision: notice deaths and silences (and restart), housekeeping,
        start what is due (the next engine, the gateways once the workers are warm),
        announce readiness, publish the status. Returns the exit code when the server must
        stop (0 once stopping), None to go on."""
        now = self.clock()
        if self._started_at is None:
            self._started_at = now
        t0 = self._started_at
        self._watch(now)
        if self.exit_failure is not None:
            log.error("giving up: %s", self.exit_failure.line())
            return self._give_up_code
        watched = self.clock()
        self._housekeeping(now)
        self._note_stall(now, watched)
        if self.stopping:  # a signal during this pass: start and announce nothing more
            return 0
        self._start_engines()
        warm = all(c.ready for c in self.workers)
        if warm and not any(g.proc for g in self.gateways):
            for g in self.gateways:
                self._start(g)
        if warm and all(g.ready for g in self.gateways) and not self._announced:
            self._announced = True
            g = self.config.gateway
            log.info(
                "ready in %.1fs: http://%s:%d (instance %s, %d llm engine%s)",
                now - t0, g.host, g.port, self.layout.instance, len(self.llms),
                "s" if len(self.llms) > 1 else "",
            )  # fmt: skip
        if not warm and now - t0 > self.config.ready_timeout_s and not self._announced:
            log.error("workers not ready after %.0fs: giving up", self.config.ready_timeout_s)
            return 1
        self._publish_status(now)
        return None

    def _note_stall(self, start: float, watched: float) -> None:
        """Warn when one pass of the loop took long: every death is noticed that much later
        (``_watch`` includes killing a dead worker's tree; housekeeping reads /proc)."""
        end = self.clock()
        if end - start > LOOP_STALL_WARN_S:
            log.warning(
                "supervision loop stalled %.1fs (children and trees %.1fs, housekeeping %.1fs)",
                end - start, watched - start, end - watched,
            )  # fmt: skip

    def _drain_orch(self, sock: zmq.Socket) -> None:
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = orchestrator_decoder.decode(raw)
            except msgspec.DecodeError:
                log.warning("undecodable message on the orchestrator socket")
                continue
            self.receive(msg)

    def receive(self, msg: OrchestratorMessage) -> None:
        """A worker's message (ready, failed, heartbeat); one from no current child's pid
        (a worker already replaced) is dropped."""
        child = self._by_pid(msg.pid)
        if child is None:
            return
        child.last_seen = self.clock()
        if isinstance(msg, WorkerReady) and not child.ready:
            child.ready = True
            child.ever_ready = True
            child.failed_starts = 0
            child.ready_since = child.last_seen
            self._snapshot(child)
            self._record()
            log.info(
                "%s ready (pid %d, %.1fs)%s", child.name, msg.pid,
                child.last_seen - child.started_at, f": {msg.detail}" if msg.detail else "",
            )  # fmt: skip
        elif isinstance(msg, WorkerFailed):
            child.failure = Failure(msg.cause, msg.fix)
        elif isinstance(msg, Heartbeat):
            pass

    def _by_pid(self, pid: int) -> Child | None:
        for c in (*self.workers, *self.gateways):
            if c.pid == pid:
                return c
        return None

    # -- children --------------------------------------------------------------------------
    def _start_engines(self) -> None:
        """First starts of the llm workers: all at once, or on CUDA each once the engine
        before it is ready (or has been: a later restart does not hold the others back)."""
        for prev, child in zip([None, *self.llms], self.llms, strict=False):
            if child.proc is not None:
                continue
            if self.sequential_engines and prev is not None and not prev.ever_ready:
                return
            self._start(child)

    def _spec_env(self) -> dict[str, str]:
        spec = ChildSpec(config=self.config, layout=self.layout, parent_pid=os.getpid())
        env = dict(os.environ)
        # The libraries' own output switches for log_level (the operator's values win).
        env.update(library_env(self.config.log_level, env))
        env[SPEC_ENV] = msgspec.json.encode(spec).decode()
        env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _vllm_socket_dir(self, env: dict[str, str]) -> None:
        """vLLM's own ipc sockets (``VLLM_RPC_BASE_PATH``: ``<dir>/<uuid4>``, never removed
        by vLLM) in the instance's socket directory, which goes with the instance and is
        reclaimed after a crash. An operator's value wins; a directory too long for a socket
        path (107 bytes) leaves vLLM's default, and says so."""
        if env.get(RPC_DIR_ENV):
            return
        socket_dir = self.layout.socket_dir
        if len(os.fsencode(socket_dir)) + 1 + RPC_SOCKET_NAME_CHARS > MAX_SOCKET_PATH:
            log.warning(
                "vLLM's ipc sockets stay in the system's temporary directory: %s is too long "
                "for a socket path under it (shm.run_dir)", socket_dir,
            )  # fmt: skip
            return
        env[RPC_DIR_ENV] = socket_dir

    def _start(self, child: Child) -> None:
        args = [sys.executable, "-m", "orchestrator.child", child.role, str(child.index)]
        env = self._spec_env()
        if child.role == "llm":
            env[ENGINE_ENV] = str(child.index)
            self._vllm_socket_dir(env)
        child.proc = self.launcher(args, env)
        child.ready = False
        child.failure = None
        child.started_at = child.last_seen = self.clock()
        child.restart_at = None
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def _watch(self, now: float) -> None:
        for child in (*self.workers, *self.gateways):
            if child.proc is None:
                continue
            code = child.proc.poll()
            silent = now - child.last_seen
            if code is None and child.ready and silent > self.config.heartbeat_timeout_s:
                log.error("%s sent no heartbeat for %.0fs: killing it", child.name, silent)
                child.proc.kill()
                code = child.proc.wait()
            if code is not None and child.restart_at is None:
                self._mark_dead(child)
                # Gateways learn at once (they fail the worker's streams and stop admitting);
                # killing what the worker left can take a few seconds.
                self._publish_status(now, force=True)
                self._kill_tree(child)
                if not child.ever_ready and self._start_failed(child, code):
                    return
                healthy_for = now - (child.ready_since or now)
                if healthy_for > 60:
                    child.restarts = 0  # it ran well for a while: restart promptly
                delay = min(MAX_BACKOFF_S, 0.5 * (2**child.restarts))
                child.restarts += 1
                child.restart_at = now + delay
                log.error("%s exited with %s; restarting in %.1fs", child.name, code, delay)
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child)

    def _start_failed(self, child: Child, code: int) -> bool:
        """A child died before it was ever ready: True if the server must give up."""
        child.failed_starts += 1
        if child.failure is None and code == EXIT_PERMANENT:
            child.failure = Failure(f"the {child.name} worker cannot start", "see its error above")
        if child.failure is not None:
            self.exit_failure, self._give_up_code = child.failure, EXIT_PERMANENT
            return True
        if child.failed_starts >= MAX_START_FAILURES:
            self.exit_failure = Failure(
                f"the {child.name} worker failed {child.failed_starts} starts in a row "
                f"(last exit code {code})",
                "see its errors above",
            )
            self._give_up_code = 1
            return True
        return False

    def _tracked_pids(self) -> set[int]:
        return {c.pid for c in (*self.workers, *self.gateways) if c.alive() and c.pid is not None}

    def _snapshot(self, child: Child) -> None:
        """Note the segments the child's tree maps now (its vLLM queues, created at start)."""
        if child.alive() and child.pid is not None:
            tree = {child.pid} | proctree.descendants([child.pid])
            mapped = proctree.shm_mappings(tree)
            child.segments |= {s for s in mapped if not s.startswith(self.layout.instance)}

    def _record(self) -> None:
        if self._recorder is not None:
            self._recorder.record()

    def _kill_tree(self, child: Child) -> None:
        """Kill what is left of a dead (or stopped) child's process group and unlink the
        segments only its tree had mapped."""
        if child.pid is None:
            return
        result = proctree.kill_tree(
            child.pid, keep_prefix=self.layout.instance, exclude=self._tracked_pids()
        )
        unlinked = list(result.unlinked)
        # Segments noted earlier whose processes were already gone when we looked now.
        earlier = child.segments - set(unlinked)
        if earlier:
            still_used = proctree.shm_mappings(proctree.processes())
            for name in sorted(earlier - still_used):
                try:
                    os.unlink(os.path.join(proctree.SHM_DIR, name))
                    unlinked.append(name)
                except OSError:
                    pass
        child.segments = set()
        others = [p for p in result.killed if p != child.pid]
        if others or unlinked or result.survivors:
            log.warning(
                "%s (pid %d) left processes %s and segments %s: killed and unlinked%s",
                child.name, child.pid, others or "none", unlinked or "none",
                f"; still alive: {result.survivors}" if result.survivors else "",
            )  # fmt: skip

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_snapshot:
            self._next_snapshot = now + TREE_SNAPSHOT_S
            for child in self.workers:
                if child.ready:
                    self._snapshot(child)
            self._record()
        if now >= self._next_reap:
            self._next_reap = now + ORPHAN_REAP_S
            # Every pid we started, dead or alive: Popen must reap its own children itself.
            proctree.reap_orphans({c.pid for c in (*self.workers, *self.gateways) if c.pid})

    def _mark_dead(self, child: Child) -> None:
        child.ready = False
        child.ready_since = None
        child.generation += 1
        if child.pid is not None:
            try:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(child.pid, self.metrics_dir)
            except Exception:  # metrics of a dead process are best-effort
                pass

    def _publish_status(self, now: float, force: bool = False) -> None:
        if self._status is None:  # driven without ``run``: no socket, nobody to tell
            return
        codec = self.codec
        status = ClusterStatus(
            engines=tuple(EngineStatus(c.ready, c.generation) for c in self.llms),
            codec_ready=codec.ready,
            draining=self.draining or self.stopping,
            codec_generation=codec.generation,
        )
        if force or status != self._last_status or now - self._last_status_at > STATUS_PERIOD_S:
            self._status.send(control_encoder.encode(status))
            self._last_status = status
            self._last_status_at = now

    # -- shutdown --------------------------------------------------------------------------
    def _signal_all(self, children: list[Child], sig: int) -> None:
        for c in children:
            if c.alive():
                assert c.proc is not None
                try:
                    c.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _wait_all(self, children: list[Child], timeout_s: float) -> None:
        deadline = self.clock() + timeout_s
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.0, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time: killing it", c.name)
                c.proc.kill()
                c.proc.wait()

    def _shutdown(self) -> None:
        if self._status is not None:
            self.draining = True
            self._publish_status(self.clock(), force=True)
        # Gateways drain (stop admitting, finish active streams) on SIGTERM.
        self._signal_all(self.gateways, signal.SIGTERM)
        self._wait_all(self.gateways, self.config.drain_timeout_s + STOP_GRACE_S)
        self._signal_all(self.workers, signal.SIGTERM)
        # Giving up on a permanent failure: the other worker may be deep in start-up (vLLM's
        # engine start does not look at signals), and nothing it holds is worth waiting for.
        grace = GIVE_UP_GRACE_S if self.exit_failure is not None else STOP_GRACE_S
        self._wait_all(self.workers, grace)
        # Whatever a child left behind (it was killed, or stopped without stopping its own
        # children), and any orphan re-parented to us.
        for child in (*self.gateways, *self.workers):
            self._kill_tree(child)
        stray = proctree.orphans(())
        if stray:
            result = proctree.kill_tree(-1, keep_prefix=self.layout.instance, extra=stray)
            log.warning("killed orphaned processes %s", result.killed)
        for sock in (self._orch, self._status):
            if sock is not None:
                sock.close(linger=0)
        destroy_instance(self.layout)
        log.info("stopped; instance %s removed", self.layout.instance)
