"""The codec worker process: SNAC decoding of every stream's code frames, batched across streams.

Process entry point: ``main`` (``codec_worker.main.run``: the rings, sockets and loop).
Modules, each with one job:

- ``service``: ``CodecService``, the streams' state machine (frames in, PCM out)
- ``output``: ``RingSink``, the only writer of the gateways' PCM rings
- ``engine``: ``DecodeEngine``, one batched SNAC call for many windows (own CUDA stream)
- ``policy``, ``scheduler``: a stream's next window; when to dispatch a batch and which
  windows go in it; ``decoder``, ``levels``, ``noise``: the windowed decode, frames to SNAC
  levels, position-keyed noise
- ``watermark``: the mark every chunk carries (PerTh by default), applied by the engine
  after decoding and before the int16 conversion; its reading for the detector
- ``encoder``: SNAC's encoder for custom-voice clips (a thread; the ROUTER socket of ``EncodeRequest``)
- ``snac_model``, ``host_memory``: loading checkpoints; keeping freed host blocks for CPU
  decoding, up to a bound
- ``metrics``, ``profiling``: Prometheus metrics; the profiler hook
"""
