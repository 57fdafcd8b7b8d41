"""``python -m workhorse`` is the ``workhorse`` command."""
import sys

from .daemon.cli import main

sys.exit(main())
