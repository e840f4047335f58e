"""The gateway's audio output: 24 kHz int16 mono PCM in, what the client asked for out.

- ``encoders``: streaming encoders (pcm, wav, PyAV's containers, the atempo time-stretch)
- ``output``: the formats (``output.OutputFormat``) and the output pipeline
  (``output.make_output``: time-stretch, resampling, the codec), G.711, content types,
  ElevenLabs' format names
"""
