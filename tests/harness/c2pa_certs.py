"""A throwaway C2PA certificate chain, made at test time with ``cryptography``: a root CA and
an end-entity signing certificate under it (ECDSA P-256, ``emailProtection`` extended key
usage, as C2PA's certificate profile asks), written as the PEM files the operator's
``jobs.c2pa_cert`` and ``jobs.c2pa_key`` name."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SIGNER_NAME = "orpheus-serve test signer"
ORGANISATION = "Orpheus Test Operator"


class Chain(NamedTuple):
    cert: Path
    """The chain: the signing certificate, then the root (``jobs.c2pa_cert``)."""
    key: Path
    """The signing certificate's private key, PKCS#8 (``jobs.c2pa_key``)."""
    root_pem: str
    """The root alone: the trust anchor a verifier is given."""


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANISATION),
        ]
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _root(key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> x509.Certificate:
    name = _name("Orpheus Test Root CA")
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def make_chain(
    directory: Path, *, eku: bool = True, valid_days: float = 30, name: str = "c2pa"
) -> Chain:
    """Write ``{name}-chain.pem`` and ``{name}-key.pem`` in ``directory``. ``eku=False``: the
    signing certificate has no extended key usage (C2PA refuses it); ``valid_days`` < 0: it
    expired that long ago."""
    now = datetime.datetime.now(datetime.UTC)
    root_key = ec.generate_private_key(ec.SECP256R1())
    root = _root(root_key, now)
    key = ec.generate_private_key(ec.SECP256R1())
    end = now + datetime.timedelta(days=valid_days)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(SIGNER_NAME))
        .issuer_name(root.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(min(now, end) - datetime.timedelta(days=2))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()),
            critical=False,
        )
    )
    if eku:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False
        )
    cert = builder.sign(root_key, hashes.SHA256())
    chain_path = directory / f"{name}-chain.pem"
    key_path = directory / f"{name}-key.pem"
    chain_path.write_bytes(_pem(cert) + _pem(root))
    key_path.write_bytes(_key_pem(key))
    return Chain(chain_path, key_path, _pem(root).decode())


def other_key(directory: Path) -> Path:
    """A P-256 private key that belongs to no certificate."""
    path = directory / "other-key.pem"
    path.write_bytes(_key_pem(ec.generate_private_key(ec.SECP256R1())))
    return path
