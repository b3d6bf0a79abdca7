"""The tensor memory of a piece of work, as the bench and the Trainer measure it."""

import subprocess
import sys

import torch

from mixprec.memory import measured


def test_cpu_peak_memory_is_the_peak_of_live_tensor_bytes():
    def work():
        a = torch.empty(3_000_000, dtype=torch.uint8)
        b = torch.empty(1_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(2_500_000, dtype=torch.uint8)
        return b, c

    (b, c), peak = measured(torch.device("cpu"), work)
    assert peak == 4_000_000  # a + b; after a is freed, b + c is only 3.5 MB


def test_measuring_keeps_the_profilers_log_lines_off_stderr_and_passes_the_rest_on():
    """torch's profiler logs a line at each start and stop from C++; a measurement prints
    neither, while what the work itself writes to stderr still arrives, in order."""
    code = (
        "import os, sys, torch\n"
        "from mixprec.memory import measured\n"
        "def work():\n"
        "    os.write(2, b'from the work, by its descriptor\\n')\n"
        "    print('from the work, by sys.stderr', file=sys.stderr)\n"
        "    return torch.ones(4) @ torch.ones(4)\n"
        "out, peak = measured(torch.device('cpu'), work)\n"
        "print(float(out), peak > 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split() == ["4.0", "True"]
    assert "USDT" not in done.stderr and "profiler_st" not in done.stderr
    assert done.stderr.splitlines() == [
        "from the work, by its descriptor",
        "from the work, by sys.stderr",
    ]
