"""The sentence audio cache's measurements (``gateway/cache/``): the admission and eviction
policy on a voice-agent trace (``policy.py``)."""
