"""The orchestrator's start-up line about CUDA MPS, and its warning when several engines
would share the GPU without it (the engines still start: MPS is a matter of speed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from common.config import ServeConfig
from common.mps import PIPE_DIRECTORY_ENV, control_path, mps_active, pipe_directory

DOCS = 'deploy/README.md, "CUDA MPS"'


def mps_lines(
    device: str, engines: int, environ: Mapping[str, str] = os.environ
) -> list[tuple[int, str]]:
    """What to log at start, as (logging level, line): nothing off CUDA; on CUDA one line
    saying whether MPS is active, a WARNING when ``engines > 1`` runs without it."""
    if device != "cuda":
        return []
    where = pipe_directory(environ)
    source = PIPE_DIRECTORY_ENV if environ.get(PIPE_DIRECTORY_ENV) else "the default"
    if mps_active(environ):
        line = f"CUDA MPS: active (control daemon at {control_path(environ)})"
        if engines > 1:
            line += f": the {engines} engines' kernels can run on the GPU at the same time"
        return [(logging.INFO, line)]
    if engines == 1:
        return [(logging.INFO, f"CUDA MPS: not active (no control daemon in {where}, {source})")]
    return [
        (
            logging.WARNING,
            f"CUDA MPS: not active (no control daemon in {where}, {source}) with "
            f"llm.engines = {engines}: the engines' kernels will take turns on the GPU "
            f"instead of overlapping; fix: start the MPS control daemon before the server and "
            f"give the server its CUDA_MPS_PIPE_DIRECTORY ({DOCS})",
        )
    ]


def log_mps(config: ServeConfig, log: logging.Logger) -> None:
    for level, line in mps_lines(config.device, config.llm.engines):
        log.log(level, "%s", line)
