"""``python -m promptcache.cli``: the ``promptcache`` command."""

import sys

from promptcache.cli.main import main

sys.exit(main())
