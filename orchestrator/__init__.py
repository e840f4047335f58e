"""The ``orpheus-serve`` command: configuration, process supervision, shared-memory ownership."""
