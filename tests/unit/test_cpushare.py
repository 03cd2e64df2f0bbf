"""A CPU share holds a busy process to its quota (the benchmarks' "machine of its own")."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from swarm.ops.cpushare import CpuShare

BUSY = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\nimport os; print(sum(os.times()[:2]))"


def test_a_busy_process_in_a_share_gets_no_more_than_its_quota() -> None:
    try:
        share = CpuShare(f"swarm-test-{time.monotonic_ns()}", 0.2)
    except OSError as e:
        pytest.skip(f"no cgroup CPU controller here: {e}")
    try:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", BUSY], capture_output=True, text=True, check=True,
                             preexec_fn=share.enter).stdout
        wall = time.monotonic() - start
        used = float(out)
        assert 0 < used <= 0.2 * wall + 0.1, (used, wall)  # a ceiling: a loaded host only lowers it
    finally:
        share.close()
    assert not share.path.exists()
