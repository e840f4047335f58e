"""The ``orpheus-serve`` command: the top of the import layers.

``cli`` dispatches ``serve`` and ``say`` to the orchestrator, ``tiny-model`` and ``bench``
to the benchmark package; ``demo`` is ``make demo``. Nothing imports this package.
"""
