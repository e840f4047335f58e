"""TorchInductor's checks of the CPU's vector instruction sets, remembered per host instead of
made again in every process.

Before TorchInductor compiles C++ for a CPU (vLLM 0.25's CPU worker compiles its sampler's
random sample when it warms the model up, in every engine core), it checks each vector ISA
the CPU reports and then its extensions (AVX-512 VNNI and BF16, AMX and AMX-FP16): for each
it builds a small library and loads it in a fresh ``python -c "import torch; ..."``
(``torch._inductor.cpu_vec_isa.VecISA.check_build``). Torch keeps the built libraries on disk
but not the verdicts, so every such process pays about seven interpreters importing torch:
on the 2-core development machine an offline vLLM 0.25.1 engine spent 19 s initialising, of
which 17.5 s were these checks (docs/performance.md, the suite's thirteenth pass).

:func:`remember_isa_checks` wraps ``check_build`` so that its verdict for one ISA's compiler
flags and test code is kept in torch's own cache directory (``orpheus-vec-isa/``), under a
name made of everything that decides it (torch's version, the interpreter, the C++ compiler,
the flags, the code). The first process on a host checks as torch would and writes the
verdict; later ones read it. A verdict that cannot be read is checked again; one that cannot
be written is not kept. Torch's flag ``TORCHINDUCTOR_VEC_ISA_OK`` still decides first where an
operator sets it. The project's vLLM plugin installs it in every vLLM process
(:mod:`llm_worker.vllm_ext.plugin`); a torch without ``check_build`` (another version) is left
as it is.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DIR_NAME = "orpheus-vec-isa"
_MARK = "_orpheus_remembered"


@functools.cache
def host_identity() -> str:
    """What decides a check besides the ISA: torch, the interpreter that loads the library,
    and the compiler that builds it (its path, size and time)."""
    import torch
    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    path = os.path.realpath(shutil.which(cxx) or cxx)
    try:
        st = os.stat(path)
        compiler = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        compiler = path
    return "\n".join([torch.__version__, os.path.realpath(sys.executable), compiler])


def verdict_path(cache_dir: Path, arch_flags: str, code: str) -> Path:
    key = "\n".join([host_identity(), arch_flags, code])
    return cache_dir / DIR_NAME / hashlib.sha256(key.encode()).hexdigest()[:24]


def _read(path: Path) -> bool | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return {b"1": True, b"0": False}.get(data)


def _write(path: Path, ok: bool) -> None:
    """Whole or not at all: another process may read or write it at the same time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(b"1" if ok else b"0")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next process checks again


def remembered(
    check: Callable[[object, str], bool], cache_dir: Callable[[], str]
) -> Callable[[object, str], bool]:
    """``check`` (torch's ``VecISA.check_build``) with its verdicts kept under
    ``cache_dir()``."""

    @functools.wraps(check)
    def check_build(self: object, code: str) -> bool:
        path = verdict_path(Path(cache_dir()), str(getattr(self, "_arch_flags", "")), code)
        ok = _read(path)
        if ok is None:
            ok = bool(check(self, code))
            _write(path, ok)
        return ok

    setattr(check_build, _MARK, True)
    return check_build


def remember_isa_checks() -> bool:
    """Install :func:`remembered` on torch's ``VecISA.check_build`` in this process, once.
    False where this torch has no such method or it is installed already."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return False
    check = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if check is None or getattr(check, _MARK, False):
        return False
    cpu_vec_isa.VecISA.check_build = remembered(check, cache_dir)  # type: ignore[method-assign]
    return True
