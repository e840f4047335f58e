"""``bench load --recompute FILE``: a stored result's capacities under the three criteria,
from its levels, measuring nothing.

Levels are stored whole (every number a criterion reads is in them), so a result measured
before the criteria existed gets them without a new measurement. The JSON written back is
the stored one with ``capacities`` (and ``search.capacities``) recomputed; the capacities it
held before are kept under ``search_before_recompute``, and ``recomputed`` says when and how.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec

from bench.lib.environment import versions
from bench.lib.report import now_iso
from bench.load.criteria import capacities_of
from bench.load.report import SCHEMA, LoadReport
from bench.load.search import SearchResult
from bench.load.summary import LevelResult, Slo


class RecomputeError(ValueError):
    pass


def _float_fields() -> tuple[set[str], set[str], set[str]]:
    """LevelResult's float fields, its Summary fields and its dict-of-float fields: JSON
    writes NaN as null, which must come back as NaN."""
    floats, summaries, dicts = set(), set(), set()
    for f in msgspec.structs.fields(LevelResult):
        t = f.type
        if t is float:
            floats.add(f.name)
        elif t == dict[str, float]:
            dicts.add(f.name)
        elif isinstance(t, type) and issubclass(t, msgspec.Struct):
            summaries.add(f.name)
    return floats, summaries, dicts


def _nan(v: Any) -> Any:
    return math.nan if v is None else v


def decode_level(raw: dict[str, Any]) -> LevelResult:
    floats, summaries, dicts = _float_fields()
    level = dict(raw)
    for k in floats & level.keys():
        level[k] = _nan(level[k])
    for k in summaries & level.keys():
        level[k] = {s: _nan(v) for s, v in level[k].items()}
    for k in dicts & level.keys():
        level[k] = {s: _nan(v) for s, v in level[k].items()}
    return msgspec.convert(level, LevelResult)


def recompute(path: Path) -> tuple[LoadReport, dict[str, Any]]:
    """The recomputed report (for the table and the plot) and the JSON document to write."""
    try:
        data = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise RecomputeError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise RecomputeError(f"{path} is not a bench load result (schema {SCHEMA})")
    try:
        slo = msgspec.convert(data["slo"], Slo)
        levels = [decode_level(lv) for lv in data["levels"]]
        warm = data.get("warmup_level")
        warmup = decode_level(warm) if warm else None
        old_search = data.get("search")
        capacities = capacities_of(levels, slo)
        search = None
        if old_search:
            search = SearchResult(capacities=capacities, probes=list(old_search["probes"]))
        report = LoadReport(
            created=data["created"],
            target=data["target"],
            machine=data["machine"],
            versions=data["versions"],
            config=data["config"],
            corpus=data["corpus"],
            slo=slo,
            levels=levels,
            search=search,
            capacities=capacities,
            warmup_level=warmup,
        )
        report = msgspec.convert(msgspec.to_builtins(report), LoadReport)
    except (KeyError, TypeError, msgspec.ValidationError) as exc:
        raise RecomputeError(f"{path}: {type(exc).__name__}: {exc}") from exc
    out = dict(data)
    out["slo"] = msgspec.to_builtins(slo)
    out["capacities"] = msgspec.to_builtins(capacities)
    if search is not None:
        if "search_before_recompute" not in out:
            out["search_before_recompute"] = old_search
        out["search"] = msgspec.to_builtins(search)
    out["recomputed"] = {
        "created": now_iso(),
        "how": "bench load --recompute: the capacities under the published, real-time and "
        "interactive criteria, over the stored levels; nothing measured again",
        "git_commit": versions().git_commit,
        "warmup_level_in_data": warmup is not None,
    }
    return report, out
