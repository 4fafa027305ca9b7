"""A DeepSeek-V3 routed MoE layer step (issue 52): tokenyard against the expert GEMMs alone and an all-to-all
dispatcher, train and decode, checked against the reference backend before timing.

    python benchmarks/moe_step.py [--num_ranks N] [--step train|decode|both] [--micro_batches M] [--json OUT]

The work is in tokenyard/tools/bench/moe_step.py; on a machine without GPUs it runs CPU-sized on gloo ranks.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

from tokenyard.tools.bench import moe_step

if __name__ == "__main__":
    sys.exit(moe_step.main())
