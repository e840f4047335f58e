"""Saying the audio is synthetic: ``headers`` (every audio answer says it is AI-generated and
how it is marked; the protocols' metadata messages take ``headers.watermark_of``) and
``detect`` (``POST /v1/watermark/detect``)."""
