"""Admission: who may speak now. ``queue``: the slots, the waiting queue and the per-key
limits (``queue.Admission``); ``capacity``: each engine's real-time limit, learned from the
streams' audio; ``shares``: each key's max-min fair share of a full node (the queue's turns
between keys); ``readiness``: whether the gateway can take a stream (``/ready``, the queue's
gate); ``cluster``: the ClusterStatus the orchestrator publishes."""
