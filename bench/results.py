"""Writes bench/RESULTS.md (tables, plots) from bench/results/*.json."""

import sys

from hcache.benchmarks.results import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
