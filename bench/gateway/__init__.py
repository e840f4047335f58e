"""The gateway measured in front of the synthetic backend (``testkit.synthetic_backend``: no
model), and its text front end alone.

- ``cpu``: ``orpheus-serve bench gateway``: the gateway's CPU per stream and its chunks' lag;
- ``protocols``: ``orpheus-serve bench protocols``: flush to first byte per streaming
  protocol;
- ``jobs``: ``orpheus-serve bench jobs``: interactive TTFB with long-form jobs running and
  without;
- ``textnorm``: ``orpheus-serve bench textnorm``: the cost of text normalisation and
  pronunciation dictionaries per sentence;
- ``synthetic``: a gateway process as served, in front of the synthetic backend (what
  ``cpu``, ``jobs`` and ``protocols`` measure).
"""
