"""The ``orpheus-serve`` command: the top of the import layers.

``cli`` dispatches its ``orpheus-serve serve`` to the orchestrator; ``orpheus-serve say`` is
``say``, a client of a running server over HTTP or ZeroMQ (``say --file``, a long-form job with
its progress, is ``say_file``),
``orpheus-serve watermark detect`` is ``watermark_detect``,
``orpheus-serve tiny-model`` and ``orpheus-serve bench`` to the benchmark package; ``demo``
is ``make demo``, ``console`` the few lines it prints. Nothing imports this package.
"""
