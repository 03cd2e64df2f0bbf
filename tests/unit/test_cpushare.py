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


def test_a_process_reads_the_quota_it_is_held_to() -> None:
    try:
        share = CpuShare(f"swarm-test-{time.monotonic_ns()}", 0.3)
    except OSError as e:
        pytest.skip(f"no cgroup CPU controller here: {e}")
    read = "from swarm.ops.cpushare import quota_cores; print(quota_cores())"
    try:
        inside = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, check=True,
                                preexec_fn=share.enter).stdout
    finally:
        share.close()
    outside = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, check=True).stdout
    assert float(inside) == pytest.approx(0.3)
    assert outside.strip() == "None" or float(outside) > 0.3  # this host's own limit, if it has one


def test_quotas_are_read_from_both_cgroup_versions(tmp_path, monkeypatch) -> None:
    import swarm.ops.cpushare as cpushare

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    (v1 / "outer" / "inner").mkdir(parents=True)
    (v1 / "outer" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "outer" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "outer" / "inner" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "outer" / "inner" / "cpu.cfs_period_us").write_text("100000\n")
    (v2 / "box").mkdir(parents=True)
    (v2 / "box" / "cpu.max").write_text("max 100000\n")
    (v2 / "cpu.max").write_text("250000 100000\n")
    monkeypatch.setattr(cpushare, "V1", v1)
    monkeypatch.setattr(cpushare, "V2", v2)
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("4:memory:/x\n1:cpu,cpuacct:/outer/inner\n")
    assert cpushare.quota_cores(cgroup) == 1.5  # the ancestor's quota holds the inner group too
    cgroup.write_text("0::/box\n")
    assert cpushare.quota_cores(cgroup) == 2.5
    cgroup.write_text("1:cpu:/\n0::/\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpushare.quota_cores(cgroup) is None
