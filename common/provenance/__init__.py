"""C2PA provenance of the whole files the server writes (issue 58, part 4): a signed manifest
that declares the audio AI-generated, and its reading.

- ``manifest``: what a file's manifest declares (the action "c2pa.created" by orpheus-serve,
  the IPTC digital source type ``trainedAlgorithmicMedia``, the model) and which formats
  carry one (``manifest.SIGNED_MIME``: WAV and MP3)
- ``signing``: the operator's certificate chain and private key loaded and tried once
  (``signing.load_signer``, ``signing.ProvenanceConfigError`` in one line), a finished file
  signed (``signing.FileSigner``)
- ``reading``: a file's manifest read and verified (``reading.read_provenance``,
  ``reading.Provenance``), for the gateway and the orpheus-serve command alike

c2pa-python (c2pa-rs) does the work; it loads no model runtime, so every process may import it.
"""
