"""``python -m tokenyard.compat.deep_ep.benchmark``: DeepEP's ``python -m deep_ep.benchmark`` command line,
which is ``python -m tokenyard.tools.bench`` (the same options)."""

import sys

from ...tools.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tokenyard.compat.deep_ep.benchmark"))
