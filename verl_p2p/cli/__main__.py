"""`python -m verl_p2p.cli ...` runs the same commands as the `verl-p2p` script."""

import sys

from verl_p2p.cli import main

sys.exit(main())
