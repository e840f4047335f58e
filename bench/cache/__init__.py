"""The sentence audio cache's measurements (``gateway/cache/``): the admission and eviction
policy on a voice-agent trace (``policy``: LRU, second sight, TinyLFU, no server), and the
real server on a voice-agent trace with the cache used and bypassed side by side
(``trace``: time to first byte of hits and misses, hit ratio, audio delivered)."""
