"""Pin one version of an upstream CustomResourceDefinition's schema for the manifest tests.

``python scripts/dev/pin_crd_schema.py CRD.yaml VERSION SOURCE OUT.yaml`` reads a CRD file
(as released upstream), keeps the ``openAPIV3Schema`` of its served version ``VERSION`` (e.g.
``v1``) without the ``description`` texts, and writes it to ``OUT.yaml`` under a header that
names the group, kind, version and ``SOURCE`` (the repository, tag and path it came from).
tests/deploy/test_kubernetes_inference_gateway.py validates the rendered objects against these files
(strictly: an object schema with properties takes no other field). Run it again with the new
upstream file when the pinned release changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    """The schema without its prose: ``description`` keys removed at every level, except a
    property that is itself named ``description``."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and not isinstance(value, dict):
                continue
            if key == "properties" and isinstance(value, dict):
                out[key] = {k: strip_descriptions(v) for k, v in value.items()}
            else:
                out[key] = strip_descriptions(value)
        return out
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def pinned(crd: dict[str, Any], version: str, source: str) -> str:
    spec = crd["spec"]
    (served,) = [v for v in spec["versions"] if v["name"] == version and v.get("served", True)]
    schema = strip_descriptions(served["schema"]["openAPIV3Schema"])
    header = (
        f"# {spec['names']['kind']} {spec['group']}/{version}: the openAPIV3Schema of its CRD,\n"
        f"# descriptions removed (scripts/dev/pin_crd_schema.py).\n"
        f"# Source: {source}\n"
    )
    return header + yaml.safe_dump(
        {
            "group": spec["group"],
            "kind": spec["names"]["kind"],
            "version": version,
            "schema": schema,
        },
        sort_keys=False,
        width=100,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("version")
    parser.add_argument("source", help="where the CRD file came from: repository, tag, path")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    args.out.write_text(pinned(crd, args.version, args.source))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
