"""Load/soak benchmark (same as `hcache bench soak`): 64 concurrent sessions for --minutes."""

import sys

from hcache.benchmarks.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
