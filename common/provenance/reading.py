"""A file's C2PA manifest read and verified: ``read_provenance(path)`` answers a small
``Provenance`` (present, valid, trusted, the signer, the digital source type, the errors).

Valid means c2pa-rs checked the claim's signature and every hash (the audio unchanged since it
was signed); trusted, that the signer's certificate chains to one of ``trust_anchors`` (PEM
text, the operator's or C2PA's trust list). Without anchors a manifest can be valid but is
never trusted: anyone can sign with a certificate of their own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import c2pa
import msgspec

from common.provenance.manifest import CREATED

_MIME_BY_SUFFIX = {
    ".wav": "audio/wav",
    ".wave": "audio/wav",
    ".mp3": "audio/mpeg",
    ".flac": "audio/flac",
    ".m4a": "audio/mp4",
}
UNTRUSTED = "signingCredential.untrusted"


class Provenance(msgspec.Struct, frozen=True, kw_only=True):
    """What a file's C2PA manifest says, and whether it holds."""

    present: bool
    """The file carries a C2PA manifest."""
    valid: bool = False
    """Its signature and hashes check: signed as it is now."""
    trusted: bool = False
    """Its signer chains to one of the trust anchors given."""
    signer: str | None = None
    """The signing certificate's common name (and its issuer's organisation)."""
    digital_source_type: str | None = None
    """The ``c2pa.created`` action's digital source type (IPTC's URI)."""
    generator: str | None = None
    """The claim generator: name and version."""
    errors: tuple[str, ...] = ()
    """Each failed check (code: explanation), or why the file could not be read."""


def _settings(trust_anchors: str | None) -> dict[str, Any]:
    if trust_anchors is None:
        return {"verify": {"verify_trust": False}}
    return {"verify": {"verify_trust": True}, "trust": {"trust_anchors": trust_anchors}}


def _source_type(manifest: dict[str, Any]) -> str | None:
    for assertion in manifest.get("assertions", []):
        if assertion.get("label", "").startswith("c2pa.actions"):
            for action in assertion.get("data", {}).get("actions", []):
                if action.get("action") == CREATED and action.get("digitalSourceType"):
                    return str(action["digitalSourceType"])
    return None


def _signer(manifest: dict[str, Any]) -> str | None:
    info = manifest.get("signature_info") or {}
    name, issuer = info.get("common_name"), info.get("issuer")
    if name and issuer:
        return f"{name} ({issuer})"
    return name or issuer


def _generator(manifest: dict[str, Any]) -> str | None:
    for g in manifest.get("claim_generator_info", []):
        if g.get("name"):
            return f"{g['name']} {g.get('version', '')}".strip()
    return manifest.get("claim_generator")


def read_provenance_stream(
    stream: BinaryIO, mime: str | None, *, trust_anchors: str | None = None
) -> Provenance:
    """``read_provenance`` of an open binary stream of type ``mime`` (None: detected)."""
    context = c2pa.Context.from_dict(_settings(trust_anchors))
    try:
        reader = (
            c2pa.Reader(mime, stream, context=context)
            if mime
            else c2pa.Reader(stream, context=context)
        )
    except c2pa.C2paError.ManifestNotFound:
        return Provenance(present=False)
    except c2pa.C2paError as e:
        return Provenance(present=False, errors=(f"unreadable: {e}",))
    with reader:
        state = reader.get_validation_state()
        manifest = reader.get_active_manifest() or {}
        results = reader.get_validation_results() or {}
    failures = (results.get("activeManifest") or {}).get("failure") or []
    errors = tuple(f"{f.get('code')}: {f.get('explanation', '')}" for f in failures)
    return Provenance(
        present=True,
        valid=state in ("Valid", "Trusted"),
        trusted=state == "Trusted",
        signer=_signer(manifest),
        digital_source_type=_source_type(manifest),
        generator=_generator(manifest),
        errors=errors,
    )


def read_provenance(
    path: str | os.PathLike[str], *, trust_anchors: str | None = None
) -> Provenance:
    """The C2PA manifest of the file at ``path``, verified (its type from its suffix, or
    detected); ``trust_anchors``: PEM certificates whose chains are trusted. Never raises for
    a file it can open: an unreadable or unsupported one is ``present=False`` with the reason
    in ``errors``."""
    p = Path(path)
    with open(p, "rb") as f:
        return read_provenance_stream(
            f, _MIME_BY_SUFFIX.get(p.suffix.lower()), trust_anchors=trust_anchors
        )
