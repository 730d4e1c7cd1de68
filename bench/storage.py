"""Storage benchmark (same as `hcache bench storage`)."""

import sys

from hcache.benchmarks.storage import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
