"""The wire types orpheus-serve shares with its clients, msgspec Structs and nothing else:
``sampling`` (the sampling fields of a speech request, HTTP and ZeroMQ), ``text`` (the
pronunciation dictionaries a request names) and ``zeromq`` (the gateway's ZeroMQ protocol). The server (``gateway``) and the client library
(``orpheus_client``) both import them, so a client does not import the server; this package
imports nothing but msgspec (.importlinter).

Its own package, below every other, rather than a module of ``shm``: ``shm`` is the contract
between the server's own processes (it changes with them, and its rings bring numpy), while
these types are the contract with clients deployed elsewhere, which must stay byte-stable
(tests/gateway/frontends/zeromq/test_orpheus_wire.py) and light to import."""
