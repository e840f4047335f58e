"""The codec worker measured alone (no server).

- ``cli``: ``orpheus-serve bench codec``: batched SNAC decode against the reference decoder
  (``testkit.reference_decoder``), per variant and batch; its ``--watermark-ab`` runs
  ``watermark``: the codec worker with the watermark off and on.
- ``quality``: the decoded audio's error against a reference, in dB (this bench and the codec
  tests).
"""
