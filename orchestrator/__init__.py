"""The top of the serving processes: configuration loading, supervision of the workers,
shared-memory ownership, fail-fast checks. The `orpheus-serve` command is `orpheus_serve`."""
