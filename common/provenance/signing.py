"""The operator's C2PA signing credentials, loaded and tried once at start, and the signing of
a finished file.

``jobs.c2pa_cert`` (the PEM certificate chain: the signing certificate first, then its
intermediates) and ``jobs.c2pa_key`` (its PEM private key) name files; the signature
algorithm follows from the key (``algorithm_of``). ``load_signer`` reads them and signs a tenth of a second of silence in
memory, then verifies it, so that a missing file, a key that is not the certificate's, a
certificate C2PA refuses (self-signed, no ``emailProtection``/``documentSigning`` extended key
usage, expired) fails the start in one line (``ProvenanceConfigError``) instead of the first
job. Neither key set: None, no manifest.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from common.config.jobs import JobsConfig
from common.provenance.manifest import SIGNED_MIME, manifest_definition

if TYPE_CHECKING:
    import c2pa


class ProvenanceConfigError(ValueError):
    """The signing credentials cannot sign: the message names the key and why, in one line."""


class SigningFailed(RuntimeError):
    """A file could not be signed (c2pa-rs's reason, in one line)."""


class FileSigner:
    """Signs whole files with one operator's credentials (thread-safe: c2pa guards its
    signer; a ``Builder`` is made per file)."""

    def __init__(self, signer: c2pa.Signer, model: str) -> None:
        self._signer = signer
        self.model = model

    def sign(self, source: BinaryIO, dest: BinaryIO, codec: str, title: str) -> None:
        """``source`` (a whole ``codec`` file, one of ``SIGNED_MIME``) written to ``dest`` with
        its manifest embedded; ``SigningFailed`` if c2pa-rs cannot."""
        import c2pa

        try:
            with c2pa.Builder(manifest_definition(title, self.model)) as builder:
                builder.sign(self._signer, SIGNED_MIME[codec], source, dest)
        except c2pa.C2paError as e:
            raise SigningFailed(_one_line(e)) from None

    def close(self) -> None:
        self._signer.close()


def _read(key: str, path: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ProvenanceConfigError(f"{key} {path!r} cannot be read: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ProvenanceConfigError(f"{key} {path!r} is not a PEM file")
    return data


_CURVES = {"secp256r1": "es256", "secp384r1": "es384", "secp521r1": "es512"}


def algorithm_of(key_pem: bytes) -> str:
    """The C2PA signature algorithm of a PEM private key: ES256/384/512 by its curve, PS256
    for RSA, Ed25519; ``ProvenanceConfigError`` for another key or one that cannot be read."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ProvenanceConfigError(
            f"jobs.c2pa_key is not an unencrypted private key: {_one_line(e)}"
        ) from None
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name in _CURVES:
        return _CURVES[key.curve.name]
    if isinstance(key, rsa.RSAPrivateKey):
        return "ps256"
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "ed25519"
    raise ProvenanceConfigError(
        f"jobs.c2pa_key is a {type(key).__name__}: C2PA signs with ECDSA P-256/P-384/P-521, "
        "RSA or Ed25519"
    )


def _silence_wav(samples: int = 2400, rate: int = 24000) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    data = bytes(2 * samples)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(data))
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )


def load_signer(config: JobsConfig, model: str) -> FileSigner | None:
    """The signer of ``config``'s credentials for files spoken by ``model``, tried once; None
    when neither ``c2pa_cert`` nor ``c2pa_key`` is set. ``ProvenanceConfigError`` if they
    cannot sign."""
    if not config.c2pa_cert and not config.c2pa_key:
        return None
    # Imported here: a gateway that signs nothing never loads c2pa-rs (3.5 MB resident).
    import c2pa

    from common.provenance.reading import read_provenance_stream

    for key, value in (("jobs.c2pa_cert", config.c2pa_cert), ("jobs.c2pa_key", config.c2pa_key)):
        if not value:
            raise ProvenanceConfigError(
                f"{key} is not set but the other C2PA key is (both or neither)"
            )
    cert = _read("jobs.c2pa_cert", config.c2pa_cert)
    key = _read("jobs.c2pa_key", config.c2pa_key)
    alg_name = algorithm_of(key)
    alg = c2pa.C2paSigningAlg[alg_name.upper()]
    try:
        signer = c2pa.Signer.from_info(c2pa.C2paSignerInfo(alg, cert, key, None))
    except (c2pa.C2paError, ValueError) as e:
        raise ProvenanceConfigError(
            f"jobs.c2pa_cert/jobs.c2pa_key cannot sign ({alg_name}): {_one_line(e)}"
        ) from None
    file_signer = FileSigner(signer, model)
    out = io.BytesIO()
    try:
        file_signer.sign(io.BytesIO(_silence_wav()), out, "wav", "check.wav")
    except SigningFailed as e:
        file_signer.close()
        raise ProvenanceConfigError(
            f"jobs.c2pa_cert/jobs.c2pa_key cannot sign ({alg_name}): {e}"
        ) from None
    out.seek(0)
    got = read_provenance_stream(out, "audio/wav")
    if not got.valid:
        file_signer.close()
        raise ProvenanceConfigError(
            "jobs.c2pa_cert/jobs.c2pa_key sign manifests that do not verify: "
            + "; ".join(got.errors)
        )
    return file_signer


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
