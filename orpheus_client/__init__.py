"""Clients of orpheus-serve for internal services: ``zmq_client`` speaks the gateway's ZeroMQ
protocol (``orpheus_wire.zeromq``). Outside the server package: a service that only calls the
server imports this and the wire types (msgspec and pyzmq), not the server (no gateway, PyAV,
numpy or torch; tests/gateway/frontends/zeromq/test_orpheus_wire.py)."""
