#!/usr/bin/env python3
"""Carrying wheels to a machine without network, in parts that fit one device call each.

Used by scripts/gpu/prepare_wheels.sh (here) and scripts/gpu/device_install.sh (there).
Standard library only, plus ``packaging`` for the version checks on the device.

    wheels.py read-list wheels.txt                  # "requirement<TAB>when" lines
    wheels.py layout STAGING OUT --part-mib 60 --tree-mib 1.5 [--when-file F]
        bin-packs STAGING's files (whole wheels and ``*.whl.chunk-NN`` pieces) into
        OUT/part-1, OUT/part-2 ... and writes OUT/part-*/MANIFEST.json (the same in each)
    wheels.py deps OUT [--device-packages F]       # Requires-Dist not carried nor on the device
    wheels.py receive PARTDIR STAGE                 # verify sha256 of one part, copy into STAGE
    wheels.py status STAGE                          # which parts arrived, which are missing
    wheels.py assemble STAGE WHEELDIR [--only-complete]
        joins chunks (in order), verifies every wheel's sha256, writes WHEELDIR/*.whl
    wheels.py select WHEELDIR                       # the wheels this machine needs (one a line)
    wheels.py slim WHEEL --drop GLOB [--drop GLOB]  # rewrite WHEEL without the files matching
        any GLOB (and their RECORD lines): optional native modules the device never loads

A part is a folder of at most part-mib MiB; together with the working tree that travels with
every call it must stay under the device's 64 MiB per call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

MIB = 1 << 20
CARRY_LIMIT_MIB = 64.0
CHUNK_RE = re.compile(r"^(?P<wheel>.+\.whl)\.chunk-(?P<index>\d+)$")
MANIFEST = "MANIFEST.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """Distribution name of a wheel file, normalized (``pydantic_core-2...whl`` -> pydantic-core)."""
    return norm(filename.split("-", 1)[0])


def read_list(path: Path) -> list[tuple[str, str]]:
    """(requirement, when) pairs of wheels.txt, comments and blank lines skipped."""
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SystemExit(f"{path}: expected 'requirement when', got {raw!r}")
        out.append((parts[0], parts[1]))
    return out


# ----------------------------------------------------------------------------- here


def cmd_read_list(args: argparse.Namespace) -> int:
    for req, when in read_list(Path(args.file)):
        print(f"{req}\t{when}")
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    staging, out = Path(args.staging), Path(args.out)
    when: dict[str, str] = {}
    order: dict[str, int] = {}
    if args.when_file:
        for i, (req, w) in enumerate(read_list(Path(args.when_file))):
            name = norm(re.split(r"[=<>!~;\[ ]", req, maxsplit=1)[0])
            when[name] = w
            order[name] = i
    budget = int(args.part_mib * MIB)
    if args.part_mib + args.tree_mib > CARRY_LIMIT_MIB:
        print(
            f"WARNING: part budget {args.part_mib} MiB + working tree {args.tree_mib:.1f} MiB "
            f"exceeds the {CARRY_LIMIT_MIB:.0f} MiB a call carries; lower --part-mib",
            file=sys.stderr,
        )

    wheels: dict[str, dict] = {}
    items: list[tuple[str, int, str]] = []  # (file, bytes, kind) kind: whole|chunk
    for f in sorted(staging.iterdir()):
        m = CHUNK_RE.match(f.name)
        if m:
            w = wheels.setdefault(m["wheel"], {"file": m["wheel"], "chunks": []})
            w["chunks"].append({"file": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)})
            items.append((f.name, f.stat().st_size, "chunk"))
        elif f.name.endswith(".whl"):
            w = wheels.setdefault(f.name, {"file": f.name, "chunks": []})
            items.append((f.name, f.stat().st_size, "whole"))
    for name, w in wheels.items():
        whole = staging / name
        full = staging / (name + ".full-sha256")
        if whole.exists():
            w["sha256"], w["bytes"] = sha256(whole), whole.stat().st_size
        elif full.exists():  # split wheels: prepare_wheels.sh records the whole file's hash
            digest, size = full.read_text().split()
            w["sha256"], w["bytes"] = digest, int(size)
        else:
            raise SystemExit(f"{name}: chunks without the whole file's hash ({full.name})")
        w["chunks"].sort(key=lambda c: int(CHUNK_RE.match(c["file"])["index"]))
        w["name"] = wheel_name(name)
        w["when"] = when.get(w["name"], "always")
    for _, size, _ in items:
        if size > budget:
            raise SystemExit(
                f"a file of {size / MIB:.1f} MiB exceeds the part budget; split smaller"
            )

    # Whole wheels first, in the list's order (first fit): the project's own needs come first
    # in wheels.txt, so part-1 holds what the first device call needs to generate the model
    # and run the codec benchmark before vLLM has arrived. This project's wheel (not in the
    # list) leads. Chunks follow in order, each into the first part with room.
    parts: list[list[tuple[str, int]]] = []

    def place(name: str, size: int, start: int = 0) -> int:
        for i in range(start, len(parts)):
            if sum(s for _, s in parts[i]) + size <= budget:
                parts[i].append((name, size))
                return i
        parts.append([(name, size)])
        return len(parts) - 1

    def rank(item: tuple[str, int, str]) -> tuple[int, int]:
        name = wheel_name(item[0])
        return (-1 if name == "orpheus-serve" else order.get(name, len(order)), -item[1])

    wholes = sorted((i for i in items if i[2] == "whole"), key=rank)
    for name, size, _ in wholes:
        place(name, size)
    for name, size, _ in (i for i in items if i[2] == "chunk"):
        place(name, size)
    part_of = {n: i + 1 for i, p in enumerate(parts) for n, _ in p}
    for w in wheels.values():
        w["part"] = part_of.get(w["file"])
        for c in w["chunks"]:
            c["part"] = part_of[c["file"]]
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "part_mib": args.part_mib,
        "tree_mib": round(args.tree_mib, 2),
        "parts": [
            {
                "name": f"part-{i + 1}",
                "bytes": sum(s for _, s in p),
                "files": [n for n, _ in p],
            }
            for i, p in enumerate(parts)
        ],
        "wheels": sorted(wheels.values(), key=lambda w: w["file"]),
    }
    if out.exists():
        shutil.rmtree(out)
    for i, p in enumerate(parts):
        d = out / f"part-{i + 1}"
        d.mkdir(parents=True)
        for n, _ in p:
            os.link(staging / n, d / n) if _same_fs(staging, out) else shutil.copy2(
                staging / n, d / n
            )
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{'part':8s} {'MiB':>7s}  {'+tree':>6s}  files")
    for p in manifest["parts"]:
        mib = p["bytes"] / MIB
        print(f"{p['name']:8s} {mib:7.1f}  {mib + args.tree_mib:6.1f}  {', '.join(p['files'])}")
    total = sum(p["bytes"] for p in manifest["parts"]) / MIB
    print(f"{len(parts)} parts, {total:.1f} MiB of wheels, {len(wheels)} wheels")
    return 0


def _same_fs(a: Path, b: Path) -> bool:
    b.mkdir(parents=True, exist_ok=True)
    return os.stat(a).st_dev == os.stat(b).st_dev


def _metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def cmd_deps(args: argparse.Namespace) -> int:
    """Every carried wheel's unconditional Requires-Dist must be carried or on the device."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    env.update(
        python_version="3.12",
        python_full_version="3.12.3",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        os_name="posix",
        extra="",
    )
    device = {
        norm(line.strip())
        for line in Path(args.device_packages).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    wheels = sorted(Path(args.dir).glob("*.whl"))
    carried = {wheel_name(w.name) for w in wheels}
    skip = {norm(x) for x in (args.ignore or "").split(",") if x}
    bad = 0
    device_floor: dict[str, set[str]] = {}
    for w in wheels:
        if wheel_name(w.name) in skip:
            continue
        for line in _metadata(w).splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker and not req.marker.evaluate(env):
                continue
            n = norm(req.name)
            if n in carried:
                continue
            if n in device:
                if str(req.specifier):
                    device_floor.setdefault(n, set()).add(f"{req.specifier} ({wheel_name(w.name)})")
                continue
            bad += 1
            print(f"NOT CARRIED, NOT ON DEVICE: {req} (needed by {w.name})")
    for n, specs in sorted(device_floor.items()):
        print(f"device must provide {n}: {'; '.join(sorted(specs))}")
    print(f"{len(wheels)} wheels checked; {bad} requirement(s) neither carried nor on the device")
    return 1 if bad and args.strict else 0


# ----------------------------------------------------------------------------- there


def _manifest_of(d: Path) -> dict:
    f = d / MANIFEST
    if not f.exists():
        raise SystemExit(f"{d}: no {MANIFEST} (was the part carried?)")
    return json.loads(f.read_text())


def cmd_receive(args: argparse.Namespace) -> int:
    part, stage = Path(args.part), Path(args.stage)
    stage.mkdir(parents=True, exist_ok=True)
    manifest = _manifest_of(part)
    old = stage / MANIFEST
    if old.exists() and json.loads(old.read_text())["created"] != manifest["created"]:
        print(f"a different wheel set was staged before: clearing {stage}")
        shutil.rmtree(stage)
        stage.mkdir(parents=True)
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    expected = {c["file"]: c["sha256"] for w in manifest["wheels"] for c in w["chunks"]}
    expected.update({w["file"]: w["sha256"] for w in manifest["wheels"] if not w["chunks"]})
    entry = next(p for p in manifest["parts"] if p["name"] == part.name)
    for name in entry["files"]:
        src = part / name
        if not src.exists():
            raise SystemExit(f"{part.name}: {name} missing")
        digest = sha256(src)
        if digest != expected[name]:
            raise SystemExit(f"{part.name}: {name} sha256 mismatch (transfer broke?)")
        shutil.copyfile(src, stage / name)
    (stage / f"{part.name}.ok").write_text(time.strftime("%H:%M:%S") + "\n")
    print(f"received {part.name}: {len(entry['files'])} files, {entry['bytes'] / MIB:.1f} MiB")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    stage = Path(args.stage)
    if not (stage / MANIFEST).exists():
        print("no parts received yet")
        return 1
    manifest = json.loads((stage / MANIFEST).read_text())
    names = [p["name"] for p in manifest["parts"]]
    got = [n for n in names if (stage / f"{n}.ok").exists()]
    missing = [n for n in names if n not in got]
    print(f"parts received: {', '.join(got) or 'none'}; missing: {', '.join(missing) or 'none'}")
    return 0 if not missing else 3


def cmd_assemble(args: argparse.Namespace) -> int:
    stage, outdir = Path(args.stage), Path(args.wheeldir)
    outdir.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((stage / MANIFEST).read_text())
    incomplete = []
    for w in manifest["wheels"]:
        target = outdir / w["file"]
        if (
            target.exists()
            and target.stat().st_size == w["bytes"]
            and sha256(target) == w["sha256"]
        ):
            continue
        pieces = [stage / c["file"] for c in w["chunks"]] or [stage / w["file"]]
        if not all(p.exists() for p in pieces):
            incomplete.append(w["file"])
            continue
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as out:  # cat chunk-00 chunk-01 ... > wheel
            for p in pieces:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 16 * MIB)
        if sha256(tmp) != w["sha256"]:
            tmp.unlink()
            raise SystemExit(f"{w['file']}: sha256 of the reassembled wheel does not match")
        tmp.rename(target)
    ready = len(manifest["wheels"]) - len(incomplete)
    print(f"wheels ready: {ready}/{len(manifest['wheels'])} in {outdir}")
    if incomplete:
        print(f"waiting for parts of: {', '.join(incomplete)}")
        return 0 if args.only_complete else 3
    return 0


def _satisfied(requirement: str) -> tuple[bool, str]:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        have = version(req.name)
    except PackageNotFoundError:
        return False, "absent"
    return req.specifier.contains(have, prereleases=True), have


def cmd_select(args: argparse.Namespace) -> int:
    """Print the wheel files to install: 'always' ones, and fallbacks the device needs."""
    wheeldir = Path(args.wheeldir)
    manifest = json.loads((Path(args.stage) / MANIFEST).read_text())
    for w in manifest["wheels"]:
        path = wheeldir / w["file"]
        if not path.exists():
            print(f"# not assembled yet: {w['file']}", file=sys.stderr)
            continue
        if args.skip and w["name"] in {norm(s) for s in args.skip.split(",")}:
            continue
        if w["when"] != "always":
            ok, have = _satisfied(w["when"])
            if ok:
                print(
                    f"# device has {w['name']} {have} ({w['when']}): not installing",
                    file=sys.stderr,
                )
                continue
            what = "lacks it" if have == "absent" else f"has {have}"
            print(f"# device {what}, needs {w['when']}: installing {w['name']}", file=sys.stderr)
        print(path)
    return 0


def slim_wheel(path: Path, drops: list[str]) -> tuple[int, int, list[str]]:
    """Rewrite the wheel at ``path`` without the members matching any of ``drops``
    (fnmatch globs on the member path) and without their RECORD lines. Returns (bytes
    before, bytes after, dropped members)."""
    import fnmatch

    before = path.stat().st_size
    tmp = path.with_suffix(".slim.tmp")
    dropped: list[str] = []
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if any(fnmatch.fnmatch(info.filename, g) for g in drops):
                dropped.append(info.filename)
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [
                    line
                    for line in data.decode().splitlines(keepends=True)
                    if line.split(",", 1)[0] not in dropped
                    and not any(fnmatch.fnmatch(line.split(",", 1)[0], g) for g in drops)
                ]
                data = "".join(keep).encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    os.replace(tmp, path)
    return before, path.stat().st_size, dropped


def cmd_slim(args: argparse.Namespace) -> int:
    path = Path(args.wheel)
    before, after, dropped = slim_wheel(path, args.drop)
    if not dropped:  # already slimmed (a kept download): nothing to do
        print(f"slim {path.name}: nothing matched (already slim)")
        return 0
    print(
        f"slim {path.name}: {before / MIB:.1f} -> {after / MIB:.1f} MiB, dropped "
        + ", ".join(dropped)
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wheels.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("read-list")
    s.add_argument("file")
    s = sub.add_parser("layout")
    s.add_argument("staging")
    s.add_argument("out")
    s.add_argument("--part-mib", type=float, default=60.0)
    s.add_argument("--tree-mib", type=float, default=0.0)
    s.add_argument("--when-file")
    s = sub.add_parser("deps")
    s.add_argument("dir")
    s.add_argument("--device-packages", required=True)
    s.add_argument("--ignore", help="wheels whose requirements are not checked (comma list)")
    s.add_argument("--strict", action="store_true")
    s = sub.add_parser("receive")
    s.add_argument("part")
    s.add_argument("stage")
    s = sub.add_parser("status")
    s.add_argument("stage")
    s = sub.add_parser("assemble")
    s.add_argument("stage")
    s.add_argument("wheeldir")
    s.add_argument("--only-complete", action="store_true")
    s = sub.add_parser("select")
    s.add_argument("stage")
    s.add_argument("wheeldir")
    s.add_argument("--skip", help="wheel names not to install (comma list)")
    s = sub.add_parser("slim")
    s.add_argument("wheel")
    s.add_argument("--drop", action="append", required=True)
    args = p.parse_args(argv)
    return {
        "slim": cmd_slim,
        "read-list": cmd_read_list,
        "layout": cmd_layout,
        "deps": cmd_deps,
        "receive": cmd_receive,
        "status": cmd_status,
        "assemble": cmd_assemble,
        "select": cmd_select,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
