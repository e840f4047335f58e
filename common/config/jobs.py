"""Long-form speech jobs (``POST /v1/audio/jobs``): text far beyond ``gateway.max_input_chars``
spoken as many units through the engines' spare capacity, kept on disk until done, resumed
after a restart (docs/api.md, Jobs)."""

from __future__ import annotations

import msgspec


class JobsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
    """Serve ``/v1/audio/jobs`` and run jobs in every gateway process."""
    dir: str = ""
    """Directory of the jobs (one subdirectory each: text, settings, state, finished units'
    audio). Empty: ``jobs/`` in ``voices.state_dir``. Every gateway process of a node must see
    the same one; exactly one of them runs a given job (a lock per job)."""
    max_text_chars: int = 1_000_000
    """Longest text of one job; a longer one is answered 413 ``text_too_long``."""
    max_body_bytes: int = 8 << 20
    """Largest ``POST /v1/audio/jobs`` body (JSON-escaped text); larger ones get 413."""
    max_jobs_per_key: int = 100
    """Jobs one API key may keep (any state, until they expire or are deleted); one more is
    answered 429 ``job_quota_exceeded``."""
    max_bytes_per_key: int = 10 << 30
    """Disk one API key's jobs may take (units' audio and final files); a job that would
    pass it fails with ``quota_exceeded``, and a new job is refused (429) while it is passed."""
    expire_after_s: float = 7 * 86400.0
    """A finished job (done, failed or cancelled) is deleted this long after it finished."""
    reserve_streams: int = 8
    """Stream slots (of ``gateway.max_active_streams``, the node's) that job units never take:
    a job's next unit starts only while fewer than ``max_active_streams - reserve_streams``
    streams are active and no interactive request waits. A running unit is not stopped."""
    streams_per_job: int = 4
    """Units of one job spoken at once (its audio is joined in order whatever order they
    finish in)."""
    max_running_jobs: int = 2
    """Jobs one gateway process runs at once; more wait, queued, in creation order."""
    unit_retries: int = 3
    """Times a unit that failed in the workers (a restart, a timeout) is tried again before
    its job fails."""
    join_fade_ms: float = 4.0
    """Each unit's audio fades in and out over this long, so that joining units clicks
    nowhere (the model's own silence at a sentence's end is the pause between them)."""
    poll_s: float = 0.5
    """How often a gateway looks for jobs to run (queued, or left running by a process that
    died) and for cancellations made through another gateway process."""
    c2pa_cert: str = ""
    """PEM file of the certificate chain that signs a C2PA manifest into every job's WAV and
    MP3 file, declaring the audio AI-generated (the signing certificate first, then its
    intermediates; C2PA wants an ``emailProtection`` or ``documentSigning`` extended key usage
    and a CA other than the certificate itself). Set with ``c2pa_key``. Empty (the default):
    job files carry no manifest, and the gateway says so at start; the audio watermark still
    marks them. docs/operations.md, "Signed provenance (C2PA)"."""
    c2pa_key: str = ""
    """PEM file of the private key of ``c2pa_cert``'s signing certificate, unencrypted (ECDSA
    P-256/P-384/P-521, RSA or Ed25519: the signature algorithm follows from it, ES256/ES384/
    ES512, PS256 or Ed25519)."""
