"""`python -m verl_p2p.cli ...` runs the same commands as the `verl-p2p` script."""

import sys

from verl_p2p.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports it in a child
    sys.exit(main())
