"""The fairness scenario's verdict per key: its real-time streams/s beside its fair share of
what the node played under the flood, and beside its own rate alone (issue 60).

A key's fair rate is the max-min fair share (``gateway.admission.shares.fair_shares``, the weights the
server was given) of the node's real-time streams/s during the mixed phase, each light key's
demand being the rate it played alone in the same run (it cannot use more), the flooding key's
unbounded. A light key holds its share when it plays at least ``MIN_OF_FAIR`` of the lesser
of its fair rate and its solo rate, and ``MIN_SHARE_REALTIME`` of its answered streams in
real time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import msgspec

from bench.overload.classify import OverloadLevel
from gateway.admission.shares import fair_shares

MIN_OF_FAIR = 0.8
MIN_SHARE_REALTIME = 0.9
WEIGHTS_SETTING = "gateway.key_weights="


class KeyShare(msgspec.Struct, frozen=True, kw_only=True):
    case: str
    """The mixed phase (``fairness 16+1+1``)."""
    key: str
    clients: int
    weight: float
    realtime_per_s: float
    """Its real-time streams/s in the mixed phase."""
    share_realtime: float
    """Of its answered streams in the mixed phase, the share real-time."""
    solo_realtime_per_s: float
    """Its real-time streams/s alone, same run (NaN for the flooding key: not measured)."""
    fair_realtime_per_s: float
    """Its max-min fair share of the node's real-time streams/s in the mixed phase."""
    of_bound: float
    """``realtime_per_s`` over the lesser of its fair and solo rates."""
    refusal_codes: dict[str, int]
    held: bool | None
    """A light key: ``of_bound >= MIN_OF_FAIR`` and ``share_realtime >= MIN_SHARE_REALTIME``
    (None for the flooding key)."""


def weights_of(settings: Sequence[str]) -> dict[str, float]:
    """The API keys' weights among ``--set`` settings (the last ``gateway.key_weights`` wins)."""
    weights: dict[str, float] = {}
    for item in settings:
        if item.startswith(WEIGHTS_SETTING):
            weights = {k: float(v) for k, v in json.loads(item[len(WEIGHTS_SETTING) :]).items()}
    return weights


def key_shares(
    case: str,
    mixed: Sequence[OverloadLevel],
    solo: dict[str, float],
    weights: dict[str, float],
) -> list[KeyShare]:
    """Per key of the mixed phase (the flooding key first), its rate against its bounds."""
    node = sum(lv.realtime_per_s for lv in mixed if not math.isnan(lv.realtime_per_s))
    keys = [lv.key or "" for lv in mixed]
    demands = [min(node, solo[k]) if k in solo else node for k in keys]
    w = [weights.get(k, 1.0) for k in keys]
    fair = fair_shares(node, demands, w)
    out = []
    for lv, key, weight, share in zip(mixed, keys, w, fair, strict=True):
        alone = solo.get(key, math.nan)
        bound = share if math.isnan(alone) else min(share, alone)
        of_bound = lv.realtime_per_s / bound if bound > 0 else math.nan
        held = None
        if key in solo:
            held = of_bound >= MIN_OF_FAIR and lv.share_realtime >= MIN_SHARE_REALTIME
        out.append(
            KeyShare(
                case=case,
                key=key,
                clients=lv.concurrency,
                weight=weight,
                realtime_per_s=lv.realtime_per_s,
                share_realtime=lv.share_realtime,
                solo_realtime_per_s=alone,
                fair_realtime_per_s=share,
                of_bound=of_bound,
                refusal_codes=lv.refusal_codes,
                held=held,
            )
        )
    return out
