"""A process for the kill -9 test of releases: keeps creating owners, making their turns
durable and giving up older owners' layers, printing each acknowledged turn and release."""

from __future__ import annotations

import sys

import torch
from storage_helpers import GEOM, KINDS, save

from hcache.config import StorageConfig
from hcache.storage.store import ChunkStore

if __name__ == "__main__":
    dirs = sys.argv[1:]
    with ChunkStore(StorageConfig(dirs), GEOM, torch.float32) as st:
        first = len(st.owners())
        print("START", flush=True)
        for i in range(first, first + 10_000):
            owner = f"o{i}"
            st.create_owner(owner, KINDS, "fp")
            n = 0
            for size in (150, 40, 7):
                save(st, owner, n, size)
                n += size
                st.mark_durable(owner, list(range(n)))
                print(f"DURABLE {owner} {n}", flush=True)
            if i >= 2:  # give up two owners back a layer at a time (H first, then KV, bottom up)
                freed = st.release(f"o{i - 2}", 1)
                print(f"RELEASED o{i - 2} {freed}", flush=True)
