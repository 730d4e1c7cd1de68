"""Serving benchmark (same as `hcache bench serve`): a multi-turn trace over gRPC, auto vs forced KV vs forced RE."""

import sys

from hcache.benchmarks.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
