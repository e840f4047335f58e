"""TorchInductor's ISA checks remembered per host (``llm_worker.vllm_ext.vec_isa``): a check
runs once and later processes read its verdict; another ISA's flags or code, another compiler,
is another verdict; a damaged verdict is checked again; a cache that cannot be written costs
nothing but the memory; the plugin installs it once on torch's own method, which the real
check then goes through (one AVX2 check: an interpreter importing torch, about 2 s)."""

from __future__ import annotations

import inspect
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
from torch._inductor import cpu_vec_isa

from llm_worker.vllm_ext import vec_isa
from llm_worker.vllm_ext.vec_isa import DIR_NAME, remember_isa_checks, remembered, verdict_path


class Isa:
    def __init__(self, flags: str) -> None:
        self._arch_flags = flags


def counted(verdict: bool, calls: list[tuple[str, str]]) -> Callable[[Isa, str], bool]:
    def check(self: Isa, code: str) -> bool:
        calls.append((self._arch_flags, code))
        return verdict

    return check


def test_a_check_runs_once_per_host_and_its_verdict_is_read_after(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    check = remembered(counted(True, calls), lambda: str(tmp_path))
    assert check(Isa("-mavx2"), "code") is True and calls == [("-mavx2", "code")]
    assert check(Isa("-mavx2"), "code") is True and len(calls) == 1  # read
    # Another process (another wrapper) reads it too.
    assert remembered(counted(False, calls), lambda: str(tmp_path))(Isa("-mavx2"), "code")
    assert len(calls) == 1
    # Another ISA, another test code: checked.
    assert check(Isa("-mavx512f"), "code") and check(Isa("-mavx2"), "other code")
    assert len(calls) == 3
    assert len(list((tmp_path / DIR_NAME).iterdir())) == 3


def test_a_failed_check_is_remembered_as_failed(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    check = remembered(counted(False, calls), lambda: str(tmp_path))
    assert check(Isa("-mamx-tile"), "amx") is False
    assert check(Isa("-mamx-tile"), "amx") is False and len(calls) == 1


def test_a_damaged_verdict_is_checked_again(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    path = verdict_path(tmp_path, "-mavx2", "code")
    path.parent.mkdir()
    path.write_bytes(b"")  # a torn write of another kind than ours
    assert remembered(counted(True, calls), lambda: str(tmp_path))(Isa("-mavx2"), "code")
    assert len(calls) == 1 and path.read_bytes() == b"1"


def test_a_cache_that_cannot_be_written_still_answers(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    check = remembered(counted(True, calls), lambda: str(blocked))
    assert check(Isa("-mavx2"), "code") and check(Isa("-mavx2"), "code")
    assert len(calls) == 2  # nothing kept: checked each time, as torch does


def test_another_compiler_is_another_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = verdict_path(tmp_path, "-mavx2", "code")
    monkeypatch.setattr(vec_isa, "host_identity", lambda: "2.13\n/usr/bin/python\n/usr/bin/g++-99")
    assert verdict_path(tmp_path, "-mavx2", "code") != here


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 ISA")
def test_the_plugin_installs_it_once_on_torchs_check_which_it_then_remembers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As torch ships it (this process may have loaded the plugin already), restored after.
    torch_check = inspect.unwrap(cpu_vec_isa.VecISA.check_build)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", torch_check)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert remember_isa_checks() and not remember_isa_checks()
    isa = cpu_vec_isa.VecAVX2()
    if "avx2" not in cpu_vec_isa.x86_isa_checker():
        pytest.skip("this CPU has no AVX2")
    assert isa.check_build(cpu_vec_isa.VecISA._avx_code)  # torch's real check, remembered
    (verdict,) = (tmp_path / DIR_NAME).iterdir()
    assert verdict.read_bytes() == b"1"
