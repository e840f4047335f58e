"""The gateway's audio output: 24 kHz int16 mono PCM in, what the client asked for out
(and, for the watermark detector, any file in).

- ``formats``: the codecs, sample rates and content types, stated once (``formats.Codec``,
  ``formats.OutputFormat``, which codec at which rate, ElevenLabs' format names)
- ``encoders``: streaming encoders, one codec each (pcm, wav, G.711, PyAV's containers, the
  atempo time-stretch)
- ``output``: the one encoder factory, ``output.make_output`` (time-stretch, resampling, the
  codec), that every front end builds its encoder with
- ``decode``: any file FFmpeg reads to 24 kHz mono float (``decode.decode_clip``), for the
  watermark detector
"""
