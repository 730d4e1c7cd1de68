"""Peers benchmark (same as `hcache bench peers`): hcache vs llama.cpp and transformers on the default model."""

import sys

from hcache.benchmarks.peers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
