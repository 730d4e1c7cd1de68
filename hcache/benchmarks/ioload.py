"""A reader in a process of its own, for benchmarks. It opens files with O_DIRECT, says
`ready`, waits for a line on stdin, reads `--bytes` of them in `--request-mb` requests on
`--threads` threads, and prints the bytes read and the milliseconds taken. Run beside a
turn, it shows what the machine's I/O path alone costs the computing threads: no GIL, no
checksums, no placing, none of hcache's reader.

    python -m hcache.benchmarks.ioload --bytes N [--threads 8] [--request-mb 4] FILE...
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time

from hcache.memory import aligned_buffer  # stdlib only: this process imports no torch

ALIGN = 4096  # storage.layout.ALIGN (that module imports torch)


def pieces(paths: list[str], nbytes: int, request: int) -> list[tuple[int, int]]:
    """(file index, offset) of each request, over the files in turn, until `nbytes` are covered."""
    out: list[tuple[int, int]] = []
    left = nbytes
    for i, p in enumerate(paths):
        size = os.path.getsize(p)
        for off in range(0, size, request):
            if left <= 0:
                return out
            out.append((i, off))
            left -= min(request, size - off)
    return out


def read_all(paths: list[str], nbytes: int, threads: int, request: int) -> int:
    fds = [os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for p in paths]
    todo: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    for item in pieces(paths, nbytes, request):
        todo.put(item)
    done = [0] * threads

    def work(k: int) -> None:
        view = memoryview(aligned_buffer(request))  # the buffers hcache's reader reads into
        while True:
            try:
                i, off = todo.get_nowait()
            except queue.Empty:
                return
            done[k] += os.preadv(fds[i], [view], off)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for fd in fds:
        os.close(fd)
    return sum(done)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcache.benchmarks.ioload", description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--request-mb", type=int, default=4)
    args = ap.parse_args(argv)
    request = max(ALIGN, (args.request_mb << 20) // ALIGN * ALIGN)
    print("ready", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    n = read_all(args.files, args.bytes, max(1, args.threads), request)
    print(n, (time.perf_counter() - t) * 1e3, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
