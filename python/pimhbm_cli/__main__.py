"""``python -m pimhbm_cli``: the ``pimhbm`` command."""

import sys

from pimhbm_cli import main

sys.exit(main())
