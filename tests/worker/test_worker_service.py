"""The worker service runs all of its torch work on one thread."""

import asyncio
import threading

from llmserve.contract import wire
from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker import service
from llmserve.worker.config import RunnerConfig


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
        real_execute = servicer.runner.execute

        def recording_execute(plan):
            threads["step"].add(threading.get_ident())
            return real_execute(plan)

        servicer.runner.execute = recording_execute
        greedy = SamplingParams(temperature=0.0)
        prefill = StepPlan(0, new_requests=[NewRequestData(1, [5, 9, 2, 7, 3], 5, greedy, [3], 0, 5)])
        decode = StepPlan(1, cached_requests=[CachedRequestData(1, [], 5, 1)])
        return [await servicer._execute(wire.step_plan_to_pb(p)) for p in (prefill, decode)]

    results = asyncio.run(run())
    assert [r.error for r in results] == ["", ""]
    assert [len(r.sampled) for r in results] == [1, 1]
    assert len(threads["load"]) == 1 and threads["step"] == threads["load"]
    assert threading.get_ident() not in threads["step"]  # not the event loop's thread
