"""Soak: tests/integration/test_fuzz.py for 10 minutes, with a fresh seed unless
TIERCKPT_FUZZ_SEED is set (it is printed first, so a failure reproduces).

    python bench/fuzz_soak.py [SECONDS]
"""

import os
import random
import subprocess
import sys
from pathlib import Path

seed = os.environ.get("TIERCKPT_FUZZ_SEED") or str(random.randrange(2**31))
seconds = sys.argv[1] if len(sys.argv) > 1 else "600"
print(f"fuzz soak: TIERCKPT_FUZZ_SEED={seed} TIERCKPT_FUZZ_SECONDS={seconds}", flush=True)
env = {**os.environ, "TIERCKPT_FUZZ_SEED": seed, "TIERCKPT_FUZZ_SECONDS": seconds}
test = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "tests/integration/test_fuzz.py"]
sys.exit(subprocess.call([sys.executable, *test], env=env, cwd=Path(__file__).parent.parent))
