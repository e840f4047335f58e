"""What the C2PA manifest of a file this server wrote declares, stated once.

One ``c2pa.actions`` assertion: the file was ``c2pa.created`` by a trained model (IPTC's
``trainedAlgorithmicMedia``, what the EU AI Act's article 50(2) marking asks a reader to be
told), with ``orpheus-serve`` and its version as the software agent and the served model as
a parameter. The claim generator is ``orpheus-serve`` too.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

DIGITAL_SOURCE_TYPE: Final = (
    "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
)
"""IPTC's digital source type of media made by a trained model."""
CREATED: Final = "c2pa.created"
GENERATOR: Final = "orpheus-serve"
SIGNED_MIME: Final[dict[str, str]] = {"wav": "audio/wav", "mp3": "audio/mpeg"}
"""The formats whose files carry a manifest (the audio formats c2pa-rs embeds one in), by the
server's codec name."""


@functools.cache
def generator_version() -> str:
    """This installation's ``orpheus-serve`` version."""
    try:
        return version(GENERATOR)
    except PackageNotFoundError:
        return "unknown"


def manifest_definition(title: str, model: str) -> dict[str, Any]:
    """The manifest of one file: ``title`` (its name), spoken by ``model``."""
    agent = {"name": GENERATOR, "version": generator_version()}
    return {
        "claim_generator_info": [agent],
        "title": title,
        "assertions": [
            {
                "label": "c2pa.actions",
                "data": {
                    "actions": [
                        {
                            "action": CREATED,
                            "digitalSourceType": DIGITAL_SOURCE_TYPE,
                            "softwareAgent": agent,
                            "parameters": {"model": model},
                        }
                    ]
                },
            }
        ],
    }
