"""The worker service runs all of its torch work on one thread, and overlaps a step's
launch with the step before's finish (or, where the step's ids are on the host already,
replies first)."""

import asyncio
import json
import threading

from llmserve.contract import wire
from llmserve.contract.peers import PeerCheck
from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker import service
from llmserve.worker.config import RunnerConfig
from llmserve.worker.simulated_runner import SimulatedRunner, simulated_token


async def run_stream(servicer, plans: list[StepPlan], calls: list | None = None) -> list:
    """Every plan queued at once (a pipelined scheduler's), then the stream's end: the
    results the Execute loop yields, in order (each appended to `calls` as ("reply",
    step id) when it is yielded, if given)."""
    queue: asyncio.Queue = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(wire.step_plan_to_pb(plan))
    queue.put_nowait(None)
    results = []
    async for result in servicer._overlapped(queue):
        if calls is not None:
            calls.append(("reply", result.step_id))
        results.append(result)
    return results


def test_steps_run_on_the_thread_that_loaded_the_model(tiny_llama_dir, monkeypatch):
    """OpenMP keeps one thread team per calling thread: loading (with its profiling
    forward) on one thread and stepping on another leaves two teams, and libgomp then
    stops spin-waiting and the worker no longer fills its cores."""
    threads = {"load": set(), "step": set()}
    real_load = service.load_runner

    def recording_load(config):
        threads["load"].add(threading.get_ident())
        return real_load(config)

    monkeypatch.setattr(service, "load_runner", recording_load)

    async def run():
        config = service.WorkerConfig(model=str(tiny_llama_dir), served_model_name="tiny", runner=RunnerConfig(num_kv_blocks=16,
                                      max_num_batched_tokens=64, swap_space=0))
        servicer = await service.load_servicer(config)
        runner = servicer.runner
        for name in ("launch", "finish"):
            def recording(arg, real=getattr(runner, name)):
                threads["step"].add(threading.get_ident())
                return real(arg)

            setattr(runner, name, recording)
        greedy = SamplingParams(temperature=0.0)
        prefill = StepPlan(0, new_requests=[NewRequestData(1, [5, 9, 2, 7, 3], 5, greedy, [3], 0, 5)])
        decode = StepPlan(1, cached_requests=[CachedRequestData(1, [], 5, 1)])
        return await run_stream(servicer, [prefill, decode])

    results = asyncio.run(run())
    assert [r.error for r in results] == ["", ""]
    assert [len(r.sampled) for r in results] == [1, 1]
    assert len(threads["load"]) == 1 and threads["step"] == threads["load"]
    assert threading.get_ident() not in threads["step"]  # not the event loop's thread


PROMPT = [5, 9, 4]


def recorded(runner, calls: list) -> None:
    """Appends ("launch" | "finish", step id) to `calls` as the runner is called."""
    for name in ("launch", "finish"):
        def recording(arg, name=name, real=getattr(runner, name)):
            calls.append((name, arg.step_id if name == "launch" else arg.plan.step_id))
            return real(arg)

        setattr(runner, name, recording)


def simulated_servicer(tmp_path) -> service.WorkerServicer:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "eos_token_id": 2,
                                                      "max_position_embeddings": 256}))
    runner = SimulatedRunner(tmp_path, RunnerConfig(num_kv_blocks=32, block_size=4), 4.0)
    return service.WorkerServicer(runner, PeerCheck(enforce=False))


def decode_plans(count: int) -> list[StepPlan]:
    greedy = SamplingParams(temperature=0.0)
    return [StepPlan(0, new_requests=[NewRequestData(1, PROMPT, 3, greedy, list(range(6)), 0, 3)])] + [
        StepPlan(step, cached_requests=[CachedRequestData(1, [], 2 + step, 1)]) for step in range(1, count)]


def test_queued_plans_are_launched_before_the_step_before_is_finished(tmp_path):
    servicer = simulated_servicer(tmp_path)
    runner, calls = servicer.runner, []
    recorded(runner, calls)
    results = asyncio.run(run_stream(servicer, decode_plans(12)))
    assert [r.step_id for r in results] == list(range(12)) and all(not r.error for r in results)
    expected, prev = [], PROMPT[-1]
    for pos in range(3, 15):
        prev = simulated_token(pos, prev, 100, frozenset({2}))
        expected.append(prev)
    assert [r.sampled[0].token_id for r in results] == expected
    assert calls[:4] == [("launch", 0), ("launch", 1), ("finish", 0), ("launch", 2)]
    assert runner.device.idle_starts <= 3  # The device found each next step queued (slack for load).


def test_a_step_launched_behind_a_failed_one_fails_too(tmp_path):
    servicer = simulated_servicer(tmp_path)
    runner = servicer.runner
    real_finish = runner.finish

    def failing_finish(launched):
        result = real_finish(launched)
        if launched.plan.step_id == 1:
            raise RuntimeError("device fault")
        return result

    runner.finish = failing_finish
    results = asyncio.run(run_stream(servicer, decode_plans(4)))
    assert [r.step_id for r in results] == [0, 1, 2, 3]
    assert [bool(r.error) for r in results] == [False, True, True, False]
    assert "device fault" in results[1].error and "step 1 before it failed" in results[2].error


def test_a_queued_plans_launch_and_the_finish_before_it_take_one_hop_to_the_compute_thread(tmp_path):
    """The pipelined steady state: launch N+1 and finish N are one call on the compute
    thread (each hop there and back is an executor round trip on the step's critical path)."""
    servicer = simulated_servicer(tmp_path)
    hops = []
    real_on_compute = servicer._on_compute

    async def counting(fn, *args):
        hops.append(fn.__name__)
        return await real_on_compute(fn, *args)

    servicer._on_compute = counting
    results = asyncio.run(run_stream(servicer, decode_plans(12)))
    assert [r.step_id for r in results] == list(range(12)) and all(not r.error for r in results)
    # 12 launches (11 of them finishing the step before), and the last step's own finish.
    assert hops == ["_launch_then_finish"] * 12 + ["_finish_outcome"]


def test_a_step_whose_ids_are_on_the_host_at_launch_is_replied_before_the_next_launch(tiny_llama_dir):
    """On the CPU the launch computes the forward: N's result goes out before N+1 is
    launched, not a whole forward later (the scheduler then plans N+2 while N+1 runs)."""
    async def run():
        config = service.WorkerConfig(model=str(tiny_llama_dir), served_model_name="tiny", runner=RunnerConfig(
            num_kv_blocks=16, max_num_batched_tokens=64, swap_space=0))
        servicer = await service.load_servicer(config)
        calls = []
        recorded(servicer.runner, calls)
        greedy = SamplingParams(temperature=0.0)
        plans = [StepPlan(0, new_requests=[NewRequestData(1, [5, 9, 2, 7, 3], 5, greedy, [3, 4], 0, 5)])]
        plans += [StepPlan(step, cached_requests=[CachedRequestData(1, [], 4 + step, 1)]) for step in range(1, 4)]
        return await run_stream(servicer, plans, calls), calls

    results, calls = asyncio.run(run())
    assert [r.error for r in results] == [""] * 4 and [len(r.sampled) for r in results] == [1] * 4
    assert calls == [(what, step) for step in range(4) for what in ("launch", "finish", "reply")]


def test_a_step_behind_a_failed_one_replied_first_fails_too(tmp_path):
    servicer = simulated_servicer(tmp_path)
    runner = servicer.runner
    real_launch, real_finish = runner.launch, runner.finish

    def done_at_launch(plan):  # as on the CPU: the ids are on the host when launch returns
        launched = real_launch(plan)
        launched.wait()
        return launched

    def failing_finish(launched):
        result = real_finish(launched)
        if launched.plan.step_id == 1:
            raise RuntimeError("device fault")
        return result

    runner.launch, runner.finish = done_at_launch, failing_finish
    calls = []
    results = asyncio.run(run_stream(servicer, decode_plans(4), calls))
    assert calls == [("reply", step) for step in range(4)]
    assert [bool(r.error) for r in results] == [False, True, True, False]
    assert "device fault" in results[1].error and "step 1 before it failed" in results[2].error
