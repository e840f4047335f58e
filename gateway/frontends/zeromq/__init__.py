"""The ZeroMQ front end for internal clients: the wire types (``protocol``) and the ROUTER
that serves them (``server``, started by ``gateway.main`` when ``gateway.zmq_endpoint`` is
set). Its client library is ``orpheus_client.zmq_client``, outside the server."""
