"""``python -m conclave``: the same as the ``conclave`` command."""
import sys

from conclave.cluster.cli import main

sys.exit(main())
