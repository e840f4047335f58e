"""The sentence audio cache: the PCM of each synthesis unit, kept on the node and served
again to a repeat (``[cache]``, ``common.config.cache``; docs/api.md).

- ``keys``: what decides a unit's audio, digested into its key (``UnitKey``), and the
  identities of the model and codec checkpoints;
- ``entry``: an entry's bytes on disk (a header with a checksum: a torn entry is never
  served);
- ``node``: the node's entries, files in one directory that every gateway process of the
  node shares (atomic writes, a byte bound, a TTL, admission on second sight, LRU);
- ``units``: a whole text's sentences as keyed (an HTTP text whose start is cached);
- ``control``: what a request lets the cache do (``Cache-Control``, a protocol's field);
- ``fleet``: the entries a fleet of nodes shares in Valkey (``[cache] fleet_url``), asked when
  the node misses, never failing a request;
- ``flight``: a unit's synthesis as the node's gateway processes share it (single flight):
  the leader's audio in a file beside the entries, read as it grows, its lock the leader's
  liveness;
- ``relay``: the loop's side of it: the leader's audio to its file in order, off the loop,
  and another process's flight as a stream its twins here follow;
- ``service``: the gateway's cache (``Gateway.cache``): lookups and stores off the event
  loop, never failing a request;
- ``routes``: ``DELETE /v1/cache`` (a key's purge) and ``DELETE /v1/admin/cache`` (the
  node's);
- ``metrics``: its Prometheus metrics (lookups by result, stores, evictions, errors,
  entries, bytes).
"""
