"""Scale-out benchmark (same as `hcache bench cluster`): two replicas on a Redis Cluster, a trace
routed by affinity then at random, and one long session restored across replicas."""

import sys

from hcache.benchmarks.cluster import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
