"""The ``orpheus-serve`` command: the top of the import layers.

``cli`` dispatches its ``orpheus-serve serve`` and ``orpheus-serve say`` to the orchestrator
(``say --file``, a long-form job with its progress, is ``say_file``),
``orpheus-serve tiny-model`` and ``orpheus-serve bench`` to the benchmark package; ``demo``
is ``make demo``, ``console`` the few lines it prints. Nothing imports this package.
"""
