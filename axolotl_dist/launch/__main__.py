"""``python -m axolotl_dist.launch``: the ``axolotl-dist`` command."""

import sys

from . import main

sys.exit(main())
