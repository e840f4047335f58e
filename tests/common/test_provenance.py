"""C2PA provenance (common/provenance/, issue 58 part 4): a WAV and an MP3 signed with a
throwaway certificate chain made at test time (tests/harness/c2pa_certs.py) carry a manifest
that c2pa-python's own ``Reader`` verifies (trusted against the test root, the
``c2pa.created`` action with IPTC's ``trainedAlgorithmicMedia``, the generator and the
model); ``read_provenance`` says the same, and sees an unsigned file, an edited one and a
signer it is not told to trust; credentials that cannot sign fail the start in one line."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
from pathlib import Path

import av
import c2pa
import numpy as np
import pytest
from c2pa_certs import ORGANISATION, SIGNER_NAME, Chain, make_chain, other_key
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448

from common.config.jobs import JobsConfig
from common.provenance.manifest import DIGITAL_SOURCE_TYPE, generator_version
from common.provenance.reading import read_provenance
from common.provenance.signing import FileSigner, ProvenanceConfigError, load_signer
from orchestrator.failures import EXIT_PERMANENT, preflight
from orchestrator.settings import load_config
from testkit.local_server import free_port

pytestmark = pytest.mark.timeout(60)

MODEL = "canopylabs/orpheus-3b-0.1-ft"
RATE = 24000


def tone(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2")


def wav_file(samples: np.ndarray) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, RATE, RATE * 2, 2, 16)
    data = samples.tobytes()
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(data)) + data
    )  # fmt: skip


def mp3_file(samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as c:
        stream = c.add_stream("libmp3lame", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            c.mux(packet)
    return out.getvalue()


def decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.concatenate([f.to_ndarray()[0] for f in c.decode(audio=0)])


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    return make_chain(tmp_path_factory.mktemp("c2pa"))


@pytest.fixture(scope="module")
def signer(chain: Chain) -> FileSigner:
    got = load_signer(JobsConfig(c2pa_cert=str(chain.cert), c2pa_key=str(chain.key)), MODEL)
    assert got is not None
    return got


def sign(signer: FileSigner, data: bytes, codec: str, path: Path) -> Path:
    with path.open("wb") as out:
        signer.sign(io.BytesIO(data), out, codec, path.name)
    return path


@pytest.mark.parametrize(("codec", "make"), [("wav", wav_file), ("mp3", mp3_file)])
def test_a_signed_file_declares_itself_ai_generated(
    signer: FileSigner, chain: Chain, tmp_path: Path, codec: str, make: object
) -> None:
    unsigned = tmp_path / f"plain.{codec}"
    unsigned.write_bytes(make(tone()))  # type: ignore[operator]
    path = sign(signer, unsigned.read_bytes(), codec, tmp_path / f"job.{codec}")
    # The oracle: c2pa-python's own Reader, trusting the test root.
    ctx = c2pa.Context.from_dict(
        {"verify": {"verify_trust": True}, "trust": {"trust_anchors": chain.root_pem}}
    )
    with open(path, "rb") as f, c2pa.Reader(f"audio/{codec}", f, context=ctx) as r:
        assert r.get_validation_state() == "Trusted"
        manifest = r.get_active_manifest()
    actions = [a for x in manifest["assertions"] if x["label"].startswith("c2pa.actions")
               for a in x["data"]["actions"]]  # fmt: skip
    assert actions == [
        {
            "action": "c2pa.created",
            "digitalSourceType": "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia",
            "softwareAgent": {"name": "orpheus-serve", "version": generator_version()},
            "parameters": {"model": MODEL},
        }
    ]
    assert manifest["claim_generator_info"][0]["name"] == "orpheus-serve"
    assert manifest["signature_info"]["common_name"] == SIGNER_NAME
    assert manifest["title"] == path.name
    # The audio is the same audio.
    assert np.array_equal(decoded(path), decoded(unsigned))
    # read_provenance says the same.
    got = read_provenance(path, trust_anchors=chain.root_pem)
    assert got.present and got.valid and got.trusted and got.errors == ()
    assert got.digital_source_type == DIGITAL_SOURCE_TYPE
    assert got.signer == f"{SIGNER_NAME} ({ORGANISATION})"
    assert got.generator == f"orpheus-serve {generator_version()}"
    # Without anchors: valid, not trusted (anyone can sign with a certificate of their own).
    got = read_provenance(path)
    assert got.present and got.valid and not got.trusted and got.errors == ()


def test_an_edited_an_unsigned_and_an_untrusted_file(
    signer: FileSigner, chain: Chain, tmp_path: Path
) -> None:
    path = sign(signer, wav_file(tone()), "wav", tmp_path / "job.wav")
    data = bytearray(path.read_bytes())
    data[2000] ^= 0xFF  # one sample changed
    edited = tmp_path / "edited.wav"
    edited.write_bytes(bytes(data))
    got = read_provenance(edited, trust_anchors=chain.root_pem)
    assert got.present and not got.valid and not got.trusted
    assert any(e.startswith("assertion.dataHash.mismatch") for e in got.errors), got.errors

    plain = tmp_path / "plain.wav"
    plain.write_bytes(wav_file(tone()))
    assert read_provenance(plain) == read_provenance(plain, trust_anchors=chain.root_pem)
    assert not read_provenance(plain).present and read_provenance(plain).errors == ()

    other = make_chain(tmp_path, name="other")
    got = read_provenance(path, trust_anchors=other.root_pem)
    assert got.present and not got.trusted
    assert any(e.startswith("signingCredential.untrusted") for e in got.errors), got.errors

    opus = tmp_path / "x.ogg"
    opus.write_bytes(b"OggS" + bytes(100))
    got = read_provenance(opus)
    assert not got.present and got.errors and got.errors[0].startswith("unreadable")


def _refusal(cert: object, key: object) -> str:
    cfg = JobsConfig(c2pa_cert=str(cert or ""), c2pa_key=str(key or ""))
    with pytest.raises(ProvenanceConfigError) as e:
        load_signer(cfg, MODEL)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_credentials_that_cannot_sign_are_refused_in_one_line(chain: Chain, tmp_path: Path) -> None:
    assert load_signer(JobsConfig(), MODEL) is None
    assert "jobs.c2pa_key is not set" in _refusal(chain.cert, None)
    assert "jobs.c2pa_cert is not set" in _refusal(None, chain.key)
    missing = tmp_path / "missing.pem"
    assert f"jobs.c2pa_cert {str(missing)!r} cannot be read" in _refusal(missing, chain.key)
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    assert "jobs.c2pa_key" in _refusal(chain.cert, not_pem) and "not a PEM" in _refusal(
        chain.cert, not_pem
    )
    assert "cannot sign" in _refusal(chain.cert, other_key(tmp_path))  # not the cert's key
    p384 = tmp_path / "p384.pem"  # a key of another algorithm than the certificate's
    p384.write_bytes(
        ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    assert "cannot sign (es384)" in _refusal(chain.cert, p384)
    other_kind = tmp_path / "ed448.pem"
    other_kind.write_bytes(
        ed448.Ed448PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    assert "C2PA signs with ECDSA" in _refusal(chain.cert, other_kind)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert "not an unencrypted private key" in _refusal(chain.cert, encrypted)
    no_eku = make_chain(tmp_path, eku=False, name="noeku")  # C2PA's profile wants an EKU
    assert "the certificate is invalid" in _refusal(no_eku.cert, no_eku.key)
    expired = make_chain(tmp_path, valid_days=-1, name="expired")
    assert "not valid at time of signing" in _refusal(expired.cert, expired.key)


def _fake_model(tmp_path: Path) -> Path:
    """Directories that pass the preflight's path checks (the C2PA check comes after them)."""
    model = tmp_path / "model"
    (model / "snac").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    for name in ("config.json", "pytorch_model.bin"):
        (model / "snac" / name).write_text("{}")
    return model


def test_the_start_fails_fast_on_credentials_that_cannot_sign(chain: Chain, tmp_path: Path) -> None:
    model = _fake_model(tmp_path)
    flags: dict[str, object] = {
        "device": "cpu",
        "llm": {"model": str(model)},
        "codec": {"model": str(model / "snac")},
        "gateway": {"port": free_port()},
    }
    ok = {"c2pa_cert": str(chain.cert), "c2pa_key": str(chain.key)}
    assert preflight(load_config(None, {**flags, "jobs": ok}, {}), probe_hub=False) is None
    bad = {"c2pa_cert": str(chain.cert), "c2pa_key": str(tmp_path / "nokey.pem")}
    failure = preflight(load_config(None, {**flags, "jobs": bad}, {}), probe_hub=False)
    assert failure is not None and failure.cause.startswith("C2PA signing: jobs.c2pa_key")
    assert "docs/operations.md" in failure.fix
    # Jobs off: nothing is signed, nothing is checked.
    off = {**bad, "enabled": False}
    assert preflight(load_config(None, {**flags, "jobs": off}, {}), probe_hub=False) is None
    # The command: exit 78, one line.
    cmd = [
        sys.executable, "-m", "orpheus_serve.cli", "serve", "--device", "cpu",
        "--model", str(model), "--codec-model", str(model / "snac"),
        "--port", str(free_port()), "--set", f"jobs.c2pa_cert={chain.cert}",
        "--set", f"jobs.c2pa_key={tmp_path / 'nokey.pem'}",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == EXIT_PERMANENT, run.stderr
    lines = [x for x in run.stderr.splitlines() if x.startswith("orpheus-serve:")]
    assert len(lines) == 1 and "C2PA signing: jobs.c2pa_key" in lines[0], run.stderr


def test_a_gateway_that_signs_nothing_does_not_load_c2pa() -> None:
    """c2pa-rs (3.5 MB resident) is loaded by the signing and reading, not by an import of
    the gateway (a fresh interpreter: this one has loaded it)."""
    code = "import sys, gateway.app; print('c2pa' in sys.modules, 'cryptography' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "False"]
