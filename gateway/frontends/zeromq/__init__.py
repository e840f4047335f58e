"""The ZeroMQ front end for internal clients: the ROUTER (``server``, started by
``gateway.main`` when ``[gateway] zmq_endpoint`` is set) that serves the wire types of
``orpheus_wire.zeromq``. Its client library is ``orpheus_client.zmq_client``, outside the
server: both import the wire types, neither the other."""
