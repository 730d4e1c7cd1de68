"""Engine benchmark (same as `hcache bench engine`): TTFT fused vs sequential, TBT during restores."""

import sys

from hcache.benchmarks.engine import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
