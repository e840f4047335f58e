"""``python -m bench.engine``: the command, and how the parent starts each engine's process."""

from bench.engine.cli import main

raise SystemExit(main())
