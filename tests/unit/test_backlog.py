"""The compute gate's backlog: what a request arriving now would wait, from the work ahead of it."""

from __future__ import annotations

import pytest

from swarm.server.backlog import Backlog


def test_the_wait_is_the_queued_work_priced_by_pass_plus_the_rest_of_the_job_in_progress():
    backlog = Backlog()
    backlog.finished("forward", 4, 2.0)  # 0.5 s per sample
    backlog.finished("backward", 2, 2.0)  # 1 s per sample
    backlog.started("backward", 3, now=100.0)  # about 3 s
    forward = backlog.enqueue("forward", 4)
    backlog.enqueue("backward", 1)
    assert backlog.queued == 2
    assert backlog.wait(now=101.0) == pytest.approx(2.0 + 2.0 + 1.0)
    backlog.leave(forward)
    backlog.leave(forward)  # leaving twice (given up, then taken) counts once
    assert backlog.queued == 1 and backlog.wait(now=101.0) == pytest.approx(3.0)
    assert backlog.wait(now=110.0) == pytest.approx(1.0)  # a job past its estimate is taken as ending now


def test_work_never_timed_costs_nothing_so_a_fresh_server_takes_everything():
    backlog = Backlog()
    backlog.enqueue("forward", 8)
    backlog.enqueue(None, 0)  # a step: untimed
    backlog.started("forward", 8, now=0.0)
    assert backlog.wait(now=0.0) == 0.0


def test_a_pass_slowing_down_shows_in_the_next_estimates_at_once():
    backlog = Backlog()
    backlog.finished("forward", 1, 1.0)
    backlog.finished("forward", 1, 3.0)  # the machine got three times slower
    assert backlog.cost("forward", 1) == pytest.approx(2.0)
    backlog.finished("forward", 2, 6.0)
    assert backlog.cost("forward", 1) == pytest.approx(2.5)
    backlog.finished(None, 0, 5.0)  # untimed work leaves the estimates as they are
    assert backlog.cost("forward", 1) == pytest.approx(2.5) and backlog.cost("backward", 1) == 0.0
