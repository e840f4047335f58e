"""SNAC's encoder for custom voices: reference audio (24 kHz mono) to Orpheus code frames.

Why here: the codec worker already loads the SNAC checkpoint (encoder included) and owns the
codec's device; the gateway never touches torch; the llm_worker's event loop drives the
engine, and an encode there (hundreds of ms on a CPU for a 30 s clip) would stall every
stream's steps; a process of its own would be one more model copy, CUDA context and
supervised child for a call made once per voice. So the codec worker serves encodes on a
thread of its own (:class:`EncodeServer`, ROUTER ``layout.encode``): torch releases the GIL
in its kernels, the decode loop keeps running, and on CUDA the encoder has its own stream.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch
import zmq
from snac import SNAC

from codec_worker.levels import levels_to_frames
from codec_worker.watermark.detect import ClipDetector
from shm.messages import (
    UNDECODABLE,
    DetectReply,
    DetectRequest,
    EncodeReply,
    codec_request_decoder,
    control_encoder,
)
from shm.records import CODE_DTYPE

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
MAX_SAMPLES = 120 * SAMPLE_RATE
"""Nothing longer is encoded, whatever a client of the socket sends (the gateway's own
limit, ``voices.max_seconds``, is far lower)."""


class VoiceEncoder:
    """Encodes a clip with SNAC's encoder and quantizer; frames in Orpheus slot order."""

    def __init__(self, snac: SNAC, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.encoder = snac.encoder
        self.quantizer = snac.quantizer
        self._snac = snac
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @torch.inference_mode()
    def encode(self, pcm: np.ndarray) -> np.ndarray:
        """``pcm`` float32 mono 24 kHz -> ``(frames, 7)`` int16 codes. The clip is padded at
        the end to a whole frame (2048 samples), as SNAC's own ``encode`` pads."""
        if pcm.ndim != 1 or not len(pcm):
            raise ValueError("expected a non-empty mono clip")
        if len(pcm) > MAX_SAMPLES:
            raise ValueError(f"clip of {len(pcm)} samples: at most {MAX_SAMPLES}")
        x = torch.from_numpy(np.array(pcm, dtype=np.float32))  # a writable copy
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                codes = self._encode(x.to(self.device, non_blocking=True))
                self._stream.synchronize()
        else:
            codes = self._encode(x)
        l0, l1, l2 = (c.cpu() for c in codes)
        frames = levels_to_frames(l0, l1, l2)[0]
        return frames.numpy().astype(CODE_DTYPE)

    def _encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        audio = self._snac.preprocess(x.reshape(1, 1, -1))
        z = self.encoder(audio)
        _, codes = self.quantizer(z)
        return codes


class EncodeServer:
    """A thread serving ``EncodeRequest``s, and ``DetectRequest``s (a clip's watermark, with
    ``detector``), on a ROUTER socket, one at a time."""

    def __init__(
        self, encoder: VoiceEncoder, endpoint: str, detector: ClipDetector | None = None
    ) -> None:
        self._encoder = encoder
        self._detector = detector
        self._endpoint = endpoint
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="snac-encode", daemon=True)
        self._bound = threading.Event()
        self.served = 0

    def start(self) -> None:
        self._thread.start()
        self._bound.wait(10.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(self._endpoint)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    continue
                ident, raw = frames
                reply = self._handle(raw)
                if reply is None:
                    continue
                try:
                    sock.send_multipart([ident, control_encoder.encode(reply)])
                except zmq.ZMQError as e:  # the gateway went away meanwhile
                    log.info("encode reply not delivered: %s", e)
        finally:
            sock.close(linger=0)

    def _handle(self, raw: bytes) -> EncodeReply | DetectReply | None:
        try:
            req = codec_request_decoder.decode(raw)
        except UNDECODABLE as e:
            log.warning("undecodable encode request dropped: %s", e)
            return None
        if isinstance(req, DetectRequest):
            return self._detect(req)
        try:
            frames = self._encoder.encode(_pcm(req.pcm))
        except Exception as e:
            log.warning("encode %d failed: %s", req.request_id, e)
            return EncodeReply(req.request_id, error=f"{type(e).__name__}: {e}")
        self.served += 1
        return EncodeReply(req.request_id, codes=frames.tobytes())

    def _detect(self, req: DetectRequest) -> DetectReply:
        try:
            if self._detector is None:
                raise RuntimeError("this codec worker has no watermark detector")
            score, name = self._detector.detect(_pcm(req.pcm))
        except Exception as e:
            log.warning("detect %d failed: %s", req.request_id, e)
            return DetectReply(req.request_id, error=f"{type(e).__name__}: {e}")
        self.served += 1
        return DetectReply(req.request_id, score=score, watermark=name)


def _pcm(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise ValueError("pcm is not whole float32 samples")
    pcm = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(pcm).all():
        raise ValueError("pcm holds NaN or infinite samples")
    return pcm
