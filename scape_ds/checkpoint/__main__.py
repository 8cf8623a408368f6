"""``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]`` (:mod:`scape_ds.checkpoint.convert`)."""
import sys

from .convert import main

sys.exit(main())
