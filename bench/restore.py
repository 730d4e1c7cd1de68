"""Restore benchmark (same as `hcache bench restore`)."""

import sys

from hcache.benchmarks.restore import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
