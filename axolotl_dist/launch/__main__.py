"""``python -m axolotl_dist.launch``: the ``axolotl-dist`` command."""

from . import cli

cli()
