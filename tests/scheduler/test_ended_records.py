"""A request's record after its end: handed over by take_ended, kept through one more
step for a pipelined loop that delivers a step's outputs after planning the next, and
then dropped when nobody takes it (the in-process engine never does)."""

from __future__ import annotations

from tests.scheduler.scheduler_testkit import FakeWorker, Run, make_scheduler, params, step


def test_an_ended_record_outlives_one_schedule_and_not_two():
    core = make_scheduler()
    worker, run = FakeWorker(core.cache.block_size), Run()
    core.add_request("short", [1, 2, 3], params(1))
    core.add_request("long", [4, 5, 6], params(8))
    step(core, worker, run)  # Prefills both: "short" ends with its only token.
    assert run.finish["short"] is not None and core.get_request("short") is None
    core.schedule()  # The plan after next, built before the step's outputs are delivered.
    [ended] = core.take_ended()
    assert ended.request_id == "short" and ended.is_finished
    assert core.take_ended() == []  # Taken once.

    core = make_scheduler()
    worker, run = FakeWorker(core.cache.block_size), Run()
    core.add_request("short", [1, 2, 3], params(1))
    core.add_request("long", [4, 5, 6], params(8))
    step(core, worker, run)
    step(core, worker, run)
    core.schedule()  # Nobody took it for two schedules: gone.
    assert core.take_ended() == []
