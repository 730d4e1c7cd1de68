"""No request pays for compiling or fresh memory: after start-up's warm-up, serving
(prefills, H, KV and recompute restores at new lengths, decode) compiles nothing more and
allocates no read buffer. Run in a fresh process, since other tests leave compiled kernels
behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hcache.kernels import fused

SCRIPT = r"""
import json, random, sys
from pathlib import Path
import torch
import torch._dynamo.utils as du
from engine_helpers import make_engine, turn, word_tokenizer
from hcache.engine.sampler import SamplingParams
from hcache.model.loader import load
from hcache.restore.plan import Method
from hcache.restore.projection import warm_up
from hcache.kernels.fused import _Compiled

folder, dtype, root = sys.argv[1:4]
model = load(folder, dtype, "cpu").model
graphs = lambda: du.counters["stats"]["unique_graphs"]
warm_up(model)
eng, store = make_engine(model, word_tokenizer(model.cfg.vocab_size), [Path(root, "a"), Path(root, "b")])
after_warm_up = graphs()  # the engine's start compiles too (its decode attention)
rng = random.Random(0)
s = eng.create_session()
for n in (70, 110, 37):
    turn(eng, s.id, token_ids=[rng.randrange(300) for _ in range(n)], params=SamplingParams(max_new_tokens=3))
    for m in (Method.HIDDEN, Method.KV, Method.RECOMPUTE):
        eng.evict(s.id)
        eng.restore(s.id, m)
eng.close(); store.close()
print(json.dumps({
    "after_warm_up": after_warm_up, "after_serving": graphs(), "failed": bool(_Compiled.failed),
    "buffers_allocated": store.stats.read_buffers_allocated,
}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serving_compiles_nothing_after_warm_up(tiny_folder, tmp_path, dtype):
    if not fused.compiled():
        pytest.skip("HCACHE_COMPILE=0 or no compiler here")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    args = [sys.executable, "-c", SCRIPT]
    out = subprocess.run(
        [*args, str(tiny_folder("llama_gqa")), dtype, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["failed"]
    assert got["after_warm_up"] > 0  # the kernels compiled at start-up
    assert got["after_serving"] == got["after_warm_up"], got
    # and restores read into buffers the engine made at start-up, not fresh memory
    assert got["buffers_allocated"] == 0, got
