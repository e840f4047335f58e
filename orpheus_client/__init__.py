"""Clients of orpheus-serve for internal services: ``zmq_client`` speaks the gateway's ZeroMQ
protocol (``gateway.frontends.zeromq.protocol``). Outside the server package: a service that
only calls the server imports this, not the server."""
