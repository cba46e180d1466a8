"""`python -m orchestrator.host.hostjobs`: the host side run from these sources (on this machine)."""

import sys

from .main import main

sys.exit(main(sys.argv[1:]))
