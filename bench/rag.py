"""RAG benchmark (same as `hcache bench rag`): quality and TTFT of every context mode."""

import sys

from hcache.benchmarks.rag import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
