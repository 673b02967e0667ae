"""benchmarks/perplexity.py on the default model: every mode's row, over the same tokens, and a quantized
mode's perplexity near float32's (a broken kernel is off by far more than 8-bit rounding)."""
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.model import cpu_kernels

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "perplexity.py"


@pytest.mark.slow
def test_modes_side_by_side(default_model_path):
    modes = ["float32", "w8a8" if cpu_kernels.linear_int8_supported() else "int8"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--modes", ",".join(modes), "--chunks", "2", "--chunk-len",
                           "48"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert list(rows) == modes
    ppl = {mode: float(row[1]) for mode, row in rows.items()}
    assert all(row[3] == str(2 * 47) for row in rows.values())  # every token after each window's first
    assert rows["float32"][2] == "+0.0%"
    assert 1 < ppl["float32"] < 1000 and abs(ppl[modes[1]] / ppl["float32"] - 1) < 0.1
