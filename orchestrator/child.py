"""Entry point of every worker process: ``python -m orchestrator.child ROLE [INDEX]``.

The orchestrator passes the configuration and instance layout as JSON in the environment
variable ORPHEUS_SERVE_CHILD_SPEC. A child dies with its parent (PR_SET_PDEATHSIG), and if
it finds its orchestrator gone when it exits, it removes the instance's segments itself so
that nothing is left in /dev/shm even after a kill -9 of the orchestrator.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec

from orchestrator.config import ServeConfig
from orchestrator.logs import setup_logging
from shm.layout import InstanceLayout

SPEC_ENV = "ORPHEUS_SERVE_CHILD_SPEC"
ROLES = ("llm", "codec", "gateway")


class ChildSpec(msgspec.Struct, frozen=True):
    config: ServeConfig
    layout: InstanceLayout
    parent_pid: int


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
    spec = msgspec.json.decode(os.environ[SPEC_ENV].encode(), type=ChildSpec)
    os.environ["ORPHEUS_SERVE_ROLE"] = role if role != "gateway" else f"gateway-{index}"
    _die_with_parent()
    if os.getppid() != spec.parent_pid:
        return 1  # the orchestrator died before we got here
    setup_logging(spec.config.log_format, spec.config.log_level)
    try:
        from setproctitle import setproctitle

        setproctitle(f"orpheus-serve {os.environ['ORPHEUS_SERVE_ROLE']}")
    except ImportError:
        pass
    log = logging.getLogger("orchestrator.child")
    try:
        if role == "llm":
            from llm_worker.main import run as run_llm

            run_llm(spec.config, spec.layout)
        elif role == "codec":
            from codec_worker.main import run as run_codec

            run_codec(spec.config, spec.layout)
        else:
            from gateway.main import run as run_gateway

            run_gateway(spec.config, spec.layout, index)
    except KeyboardInterrupt:
        pass
    except Exception:
        log.exception("%s worker failed", role)
        return 1
    finally:
        _cleanup_if_orphaned(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
