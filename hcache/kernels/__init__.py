"""Hot ops of the restore paths."""

import os

# HCACHE_COMPILE=0: no kernel is compiled (inductor's or ours); every op runs its eager or library form
COMPILE = os.environ.get("HCACHE_COMPILE", "1") != "0"
