"""The sentence audio cache's measurements (``gateway/cache/``): the admission and eviction
policy on a voice-agent trace (``policy``: LRU, second sight, TinyLFU, no server), the real
server on a voice-agent trace with the cache used and bypassed side by side (``trace``: time
to first byte of hits and misses, hit ratio, audio delivered), and a cached greeting opening
a sentence never said before (``seam``: the cached part's first byte, and the gap and
playback margin where the synthesised rest begins)."""
