"""Int8 kernel rates on a model's int8 matrices (same as `hcache bench int8`)."""

import sys

from hcache.benchmarks.int8 import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
