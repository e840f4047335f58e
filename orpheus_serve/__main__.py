"""``python -m orpheus_serve ...`` is ``orpheus-serve ...``."""

import sys

from orpheus_serve.cli import main

sys.exit(main())
