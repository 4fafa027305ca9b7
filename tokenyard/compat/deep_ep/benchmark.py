"""``python -m tokenyard.compat.deep_ep.benchmark``: the seed README's ``python -m deep_ep.benchmark``,
which is ``python -m tokenyard.bench`` (the same options)."""

import sys

from ...bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
