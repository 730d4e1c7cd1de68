"""hcache: a stateful LLM serving engine that restores KV caches from hidden states, KV and tokens."""

import os

# Process settings read by native libraries when they load, so set before torch is imported.
# Only those the user left unset are set; `OWN_ENV` names them, so that a peer benchmarked in a
# child process runs with the user's environment, not ours.
_SETTINGS = {
    # MKL's conditional numerical reproducibility, read at its first call: without it a
    # float32 GEMM rounds by its buffers' alignment, so torch's float32 attention gave a
    # sequence other bits on the other thread (a batch moves it).
    "MKL_CBWR": "AUTO,STRICT",
    # libgomp's idle workers spin 300,000 pauses (milliseconds) before they sleep. A restore
    # waits on reads between layers, and the spinning worker took a core from the threads
    # that verify and place them; decode's back-to-back ops still meet a spinning worker.
    "GOMP_SPINCOUNT": "3000",
}
_ALSO_DECIDES = {"GOMP_SPINCOUNT": "OMP_WAIT_POLICY"}  # a user's wait policy decides the spin too
OWN_ENV = {k: v for k, v in _SETTINGS.items() if not {k, _ALSO_DECIDES.get(k, k)} & os.environ.keys()}
os.environ.update(OWN_ENV)

__version__ = "0.1.0"
