"""Long-form speech as durable jobs (``/v1/audio/jobs``, docs/api.md, Jobs).

A job is a text cut into units (``gateway.frontends.text_units``) that are spoken one
request each through the same path as interactive requests (``Gateway.requests``), in the
engines' spare capacity, and kept on disk so that a restart resumes them:

- ``store``: the on-disk layout and its atomic writes; the one owner of a job's files.
- ``runner``: runs the jobs of this gateway process (claimed with a lock per job), unit by
  unit, at the priority ``JobsConfig.reserve_streams`` sets.
- ``routes``: the HTTP API, answered from disk by any gateway process.
"""

from gateway.jobs.routes import setup

__all__ = ["setup"]
