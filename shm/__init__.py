"""Shared-memory transport: SPSC rings, ZeroMQ doorbells, message schemas, segment lifecycle."""
