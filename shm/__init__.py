"""The wire contract between the processes (the contract with clients is ``orpheus_wire``;
what outlives them, on disk, is ``store``).

- ``ring``: single-producer single-consumer rings in POSIX shared memory, ZeroMQ doorbells
- ``records``: the rings' record kinds and payloads, and the constants both ends agree on
- ``messages``: the control Structs sent over ZeroMQ, and who sends which on which socket
- ``layout``: where an instance's segments and sockets live (from its name alone)
- ``segments``: their lifecycle (created, unlinked, a dead instance's removed)
- ``admission``: node-wide admission counters of several gateway processes
- ``config``: the ``[shm]`` table (ring sizes, the socket directory, the consumers' wait)
"""
