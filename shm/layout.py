"""Where an instance's rings and sockets live. Derived from the instance name alone, so
every process (and a split-process deployment) computes the same names."""

from __future__ import annotations

import os

import msgspec

SEGMENT_PREFIX = "orpheus-"
MAX_ENGINES = 8
"""Most vLLM engines one instance runs (``llm.engines``): the admission segment keeps a
count per engine for each gateway (``shm.admission``)."""


class RingEndpoints(msgspec.Struct, frozen=True):
    segment: str
    """POSIX shared-memory name (no leading slash): the file /dev/shm/<segment>."""
    data_bell: str
    """ZeroMQ endpoint the consumer binds; the producer rings it when data arrives."""
    space_bell: str
    """ZeroMQ endpoint the producer binds; the consumer rings it when space frees."""


class InstanceLayout(msgspec.Struct, frozen=True):
    instance: str
    run_dir: str
    gateways: int = 1
    engines: int = 1
    """vLLM engines (llm worker processes): each has its own control and admin sockets and
    its own code ring into the codec worker (``engine_*``, numbered from 0)."""

    @classmethod
    def for_pid(cls, pid: int, run_dir: str, gateways: int, engines: int = 1) -> InstanceLayout:
        return cls(
            instance=f"{SEGMENT_PREFIX}{pid}", run_dir=run_dir, gateways=gateways, engines=engines
        )

    @property
    def socket_dir(self) -> str:
        return os.path.join(self.run_dir, self.instance)

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.socket_dir, name)}"

    def engine_control(self, engine: int) -> str:
        """The engine's llm_worker binds PULL; gateways connect PUSH (LlmSubmit, LlmAppendText,
        LlmCancel of the streams placed on that engine)."""
        return self._ipc(f"control-{engine}")

    @property
    def orch(self) -> str:
        """orchestrator binds PULL; workers connect PUSH (WorkerReady, Heartbeat)."""
        return self._ipc("orch")

    @property
    def status(self) -> str:
        """orchestrator binds PUB; gateways connect SUB (ClusterStatus)."""
        return self._ipc("status")

    @property
    def encode(self) -> str:
        """codec_worker binds ROUTER; gateways connect DEALER (EncodeRequest/EncodeReply:
        reference clips of custom voices to SNAC codes)."""
        return self._ipc("encode")

    def engine_admin(self, engine: int) -> str:
        """The engine's llm_worker binds ROUTER; gateways connect DEALER
        (LoraLoad/LoraUnload/AdminReply: a LoRA voice is loaded into every engine)."""
        return self._ipc(f"admin-{engine}")

    def _ring(self, name: str) -> RingEndpoints:
        return RingEndpoints(
            segment=f"{self.instance}-{name}",
            data_bell=self._ipc(f"{name}.data"),
            space_bell=self._ipc(f"{name}.space"),
        )

    def engine_code_ring(self, engine: int) -> RingEndpoints:
        """The engine's llm_worker produces, the codec worker consumes (one ring per engine:
        a ring has one producer)."""
        return self._ring(f"codes-{engine}")

    def pcm_ring(self, gateway_index: int) -> RingEndpoints:
        return self._ring(f"pcm-{gateway_index}")

    @property
    def admission_segment(self) -> str:
        """Node-wide admission counters of the gateways (``shm.admission``; processes > 1)."""
        return f"{self.instance}-admission"

    @property
    def shared_admission(self) -> bool:
        """Whether the gateways admit through the shared segment (more than one gateway)."""
        return self.gateways > 1

    def all_rings(self) -> list[RingEndpoints]:
        return [
            *(self.engine_code_ring(e) for e in range(self.engines)),
            *(self.pcm_ring(i) for i in range(self.gateways)),
        ]


def pid_alive(pid: int) -> bool:
    """A process with this id exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
