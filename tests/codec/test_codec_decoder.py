"""WindowDecoder against SNAC itself: same samples, exact cropping, batching, seams."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock

from bench.codec.quality import error_db
from codec_worker.decoder import WindowDecoder, WindowKey
from codec_worker.engine import DecodeEngine
from codec_worker.levels import frames_to_levels
from codec_worker.noise import block_seeds, decode_seed, positional_noise, stream_seed
from codec_worker.output import CollectingSink
from codec_worker.service import CodecService
from codec_worker.snac_model import (
    SNAC_24KHZ,
    SNAC_24KHZ_SMALL,
    SnacConfigError,
    fuse_weight_norm,
    load_snac,
)
from common.config.codec import CodecConfig
from shm.records import RecordKind, StreamEnd, record_encoder
from shm.ring import Record
from testkit.tiny_model import random_snac, write_random_snac

torch.set_num_threads(1)


def _with_positional_noise(model: SNAC, seeds: torch.Tensor) -> SNAC:
    """SNAC's own modules, its NoiseBlocks drawing positional noise from frame 0."""
    blocks = [b for b in model.decoder.model if isinstance(b, DecoderBlock)]
    for i, block in enumerate(blocks):
        for m in block.block:
            if isinstance(m, NoiseBlock):

                def forward(x: torch.Tensor, m: NoiseBlock = m, i: int = i) -> torch.Tensor:
                    pos = torch.arange(x.shape[-1]).expand(x.shape[0], -1)
                    return x + positional_noise(block_seeds(seeds, i), pos)[:, None] * m.linear(x)

                m.forward = forward  # type: ignore[method-assign]
    return model


@pytest.fixture(scope="module")
def full() -> WindowDecoder:
    return WindowDecoder(fuse_weight_norm(random_snac(0, SNAC_24KHZ))).eval()


@pytest.fixture(scope="module")
def small() -> WindowDecoder:
    return WindowDecoder(fuse_weight_norm(random_snac(0, SNAC_24KHZ_SMALL))).eval()


@torch.inference_mode()
def test_offline_decode_is_snacs_decode_with_the_same_noise(full: WindowDecoder) -> None:
    frames = torch.randint(0, 4096, (2, 5, 7), generator=torch.Generator().manual_seed(1))
    seeds = torch.tensor([stream_seed(0, 1), stream_seed(0, 2)])
    reference = _with_positional_noise(random_snac(0, SNAC_24KHZ), seeds)
    want = reference.decode(list(frames_to_levels(frames)))[:, 0]
    got = full.decode_offline(frames, seeds)
    assert got.shape == (2, 5 * 2048)
    assert (got - want).abs().max().item() < 1e-5


@torch.inference_mode()
@pytest.mark.parametrize("key", [WindowKey(1, 1, 2), WindowKey(0, 1, 1), WindowKey(1, 3, 0)])
def test_cropping_leaves_the_emitted_samples_unchanged(full: WindowDecoder, key: WindowKey) -> None:
    frames = torch.randint(0, 4096, (2, key.frames, 7), generator=torch.Generator().manual_seed(2))
    seeds, starts = torch.tensor([11, 12]), torch.tensor([0, 40])
    cropped = full.decode(frames, seeds, starts, key, crop=True)
    whole = full.decode(frames, seeds, starts, key, crop=False)
    assert cropped.shape == (2, key.hop * 2048)
    assert (cropped - whole).abs().max().item() < 1e-5
    plan = full.plan(key)
    # The point of cropping: the last stages run on little more than the emitted span.
    lo, hi = plan.crops[-1]
    assert hi - lo < (key.hop + 0.05) * full.samples_per_frame


@torch.inference_mode()
def test_batched_windows_equal_windows_decoded_one_by_one(small: WindowDecoder) -> None:
    key = WindowKey(1, 2, 2)
    g = torch.Generator().manual_seed(3)
    frames = torch.randint(0, 4096, (6, key.frames, 7), generator=g)
    seeds = torch.randint(0, 2**32, (6,), generator=g)
    starts = torch.randint(0, 500, (6,), generator=g)
    batched = small.decode(frames, seeds, starts, key)
    for i in range(6):
        alone = small.decode(frames[i : i + 1], seeds[i : i + 1], starts[i : i + 1], key)
        assert (alone[0] - batched[i]).abs().max().item() < 1e-5


@torch.inference_mode()
def test_streamed_chunks_join_without_seams(full: WindowDecoder) -> None:
    """The worker's chunks against one offline decode: far below the noise of fresh draws."""
    n = 12
    codes = np.random.default_rng(4).integers(0, 4096, (n, 7)).astype("<i2")
    cfg = CodecConfig(max_hop_frames=4)
    sink = CollectingSink()
    svc = CodecService(cfg, DecodeEngine.for_config(full, cfg, torch.device("cpu")), sink, 1)
    # Frames arrive a few at a time, so windows of several shapes meet at the seams.
    for a, b in ((0, 2), (2, 3), (3, 7), (7, 12)):
        svc.ingest([Record(RecordKind.CODES, 5, a, memoryview(codes[a:b].tobytes()))])
        while svc.pump():
            pass
    end = record_encoder.encode(StreamEnd("stop", n))
    svc.ingest([Record(RecordKind.END, 5, n, memoryview(end))])
    while svc.pump():
        pass
    pcm = [r for r in sink.records if r[1] == RecordKind.PCM]
    assert len(pcm) >= 4
    streamed = np.frombuffer(b"".join(r[4] for r in pcm), dtype="<i2")
    frames = torch.from_numpy(codes.astype(np.int64))[None]
    offline = full.decode_offline(frames, torch.tensor([decode_seed(0)]))[0]
    offline_pcm = (offline * 32767).round().numpy()
    streamed_db = error_db(streamed, offline_pcm)
    # What SNAC's fresh noise alone costs: two offline decodes of the same codes.
    model = random_snac(0, SNAC_24KHZ)
    fresh = [model.decode(list(frames_to_levels(frames)))[0, 0].numpy() for _ in range(2)]
    fresh_db = error_db(fresh[0], fresh[1])
    assert streamed_db < -30.0
    assert streamed_db < fresh_db - 20.0


def test_random_snac_checkpoint_round_trip(tmp_path: Path) -> None:
    out = write_random_snac(tmp_path / "snac", seed=3)
    assert json.loads((out / "config.json").read_text()) == SNAC_24KHZ
    fused = load_snac(str(out))
    assert not any(hasattr(m, "parametrizations") for m in fused.modules())
    shipped = SNAC.from_pretrained(str(out))  # the layout snac itself reads
    conv = shipped.decoder.model[1]
    assert torch.equal(fused.decoder.model[1].weight, conv.weight.detach())
    again = write_random_snac(tmp_path / "again", seed=3)
    a = torch.load(out / "pytorch_model.bin", weights_only=True)
    b = torch.load(again / "pytorch_model.bin", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(p.numel() for p in fused.decoder.parameters()) == pytest.approx(13.0e6, rel=0.01)


def test_load_snac_rejects_a_codec_that_cannot_decode_orpheus_frames(tmp_path: Path) -> None:
    config = {**SNAC_24KHZ_SMALL, "vq_strides": [8, 4, 2, 1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(random_snac(0, config).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(SnacConfigError, match="vq_strides"):
        load_snac(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_snac(str(tmp_path / "missing"))
