"""A writer process for the kill -9 test: saves turns forever, printing each durable count."""

from __future__ import annotations

import random
import sys

import torch
from storage_helpers import GEOM, KINDS, save

from hcache.config import StorageConfig
from hcache.storage.store import ChunkStore

if __name__ == "__main__":
    dirs = sys.argv[1:]
    with ChunkStore(StorageConfig(dirs), GEOM, torch.float32) as st:
        if not st.owners():
            st.create_owner("s", KINDS, "fp")
        n = st.owner_row("s").num_tokens
        print(f"START {n}", flush=True)
        rng = random.Random(n)
        while True:
            for size in [rng.randrange(30, 300)] + [1] * 10:
                save(st, "s", n, size)
                n += size
            st.mark_durable("s", list(range(n)))
            print(f"DURABLE {n}", flush=True)
