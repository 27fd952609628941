"""A fake worker and a driver loop for the scheduler tests.

The fake worker keeps its own copy of each request the way a real one does (token list,
block table, num_computed_tokens), checks every plan against that copy, and samples one
token for each request whose known tokens are all computed after the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from llmserve.contract.outputs import FinishReason, RequestOutput, TokenLogprobs
from llmserve.contract.plan import SampledToken, StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.request import Request, Sample
from llmserve.scheduler.scheduler import KVCacheShape, Scheduler, SchedulerConfig
from llmserve.scheduler.step_budget import on_cpu

NO_EOS = (10_000,)  # An eos id the fake workers never produce.


@dataclass
class WorkerRequest:
    label: str  # The sample's label ("a", "r#0"): token functions key on it.
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None = None
    seq_id: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


TokenFn = Callable[[WorkerRequest, int], int]  # (request, step_id) -> token


def hash_token(request: WorkerRequest, step_id: int) -> int:
    """Depends only on the token list (and seed), so any schedule gives the same outputs."""
    return (sum(request.token_ids) * 31 + len(request.token_ids) + 13 * (request.seed or 0)) % 97


PROPERTY_MAX_MODEL_LEN = 24  # Context limit of the property tests' random workloads.


def lone_run_tokens(prompt: list[int], max_tokens: int, eos: int, seed: int | None = None) -> list[int]:
    """The tokens hash_token gives a request running alone with unlimited blocks."""
    tokens, out = list(prompt), []
    while True:
        token = hash_token(WorkerRequest("x", tokens, len(prompt), [], len(tokens), seed), 0)
        tokens.append(token)
        out.append(token)
        if token == eos or len(out) >= max_tokens or len(tokens) >= PROPERTY_MAX_MODEL_LEN:
            return out


def draw_batching_config(draw, max_seqs: int) -> dict:
    """The batching half of a random SchedulerConfig (hypothesis draws, in this order)."""
    chunked = draw(st.booleans())
    return dict(
        max_model_len=PROPERTY_MAX_MODEL_LEN,
        block_size=draw(st.sampled_from([1, 2, 4])),
        max_num_seqs=draw(st.integers(1, max_seqs)),
        max_num_batched_tokens=draw(st.integers(1, 16) if chunked else st.integers(24, 40)),
        enable_chunked_prefill=chunked,
        num_scheduler_steps=draw(st.sampled_from([1, 1, 2, 3, 5])),
        # Speculative decoding: hash_token's outputs rarely repeat, so drafts are mostly
        # rejected here (1-grams make some); test_speculative.py has accepting workers.
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        speculative_ngram_min=1,
    )


def interrupt_some_runs(plan: StepPlan) -> int:
    """Steps a fake worker runs of a multi-step plan before an "interrupt": 1..num_steps,
    varying from plan to plan."""
    return 1 + (plan.step_id * 7 + 3) % plan.num_steps


def table_fits(table_len: int, num_computed: int, block_size: int, num_scheduler_steps: int,
               num_speculative_tokens: int = 0) -> bool:
    """A sequence's block table holds its computed tokens' slots, and no more than a
    multi-step run's lookahead beyond them (an interrupted run leaves those slots), or
    its rejected drafts' slots."""
    lookahead = max(num_scheduler_steps, 1 + num_speculative_tokens)
    return -(-num_computed // block_size) <= table_len <= -(-(num_computed + lookahead - 1) // block_size)


def sequence_tokens(sequences: dict[str, list[int]]) -> TokenFn:
    """The n-th output of request r is sequences[r][n]."""
    return lambda request, step_id: sequences[request.label][len(request.output_token_ids)]


@dataclass
class FakeWorker:
    """Also simulates the KV content: each block slot remembers the token written there,
    so a wrong share, copy-on-write, swap or prefix hit shows up as a wrong token read."""

    block_size: int
    token_fn: TokenFn = hash_token
    logprobs: bool = False
    # Of a multi-step plan, how many steps to run (None: all): an interrupt's effect.
    steps_to_run: Callable[[StepPlan], int] | None = None
    # Every layer's sliding window (0: none): a query at p reads only positions p-W+1..p,
    # so KV before them may be gone (its block released and reused).
    window: int = 0
    requests: dict[int, WorkerRequest] = field(default_factory=dict)  # By sequence id.
    gpu: dict[int, list] = field(default_factory=dict)  # block -> token per slot
    cpu: dict[int, list] = field(default_factory=dict)
    num_computed_tokens: int = 0  # Tokens run through the "model", lifetime.

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.requests.pop(seq_id, None)
        empty = [None] * self.block_size
        for gpu_block, cpu_block in plan.swap_out:
            self.cpu[cpu_block] = list(self.gpu.get(gpu_block, empty))
        for cpu_block, gpu_block in plan.swap_in:
            self.gpu[gpu_block] = list(self.cpu[cpu_block])
        for src, dst in plan.copies:
            self.gpu[dst] = list(self.gpu.get(src, empty))
        sampled, rows = [], []
        for new in plan.new_requests:
            assert new.seq_id not in self.requests
            state = WorkerRequest(
                LABELS.get(new.seq_id, str(new.seq_id)),
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling.seed,
            )
            state.seq_id = new.seq_id
            self.requests[new.seq_id] = state
            rows.append(state)
            sampled += self._run(state, new.num_scheduled_tokens, plan, new.draft_token_ids)
        for cached in plan.cached_requests:
            state = self.requests[cached.seq_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
            rows.append(state)
            sampled += self._run(state, cached.num_scheduled_tokens, plan, cached.draft_token_ids)
        num_steps = plan.num_steps if self.steps_to_run is None or plan.num_steps == 1 else self.steps_to_run(plan)
        if plan.num_steps > 1:
            assert len(sampled) == len(rows), "a multi-step plan schedules decodes only"
            for state in rows:  # The run's lookahead: slots for all of its steps up front.
                computed_before = state.num_computed_tokens - 1
                assert len(state.block_ids) >= -(-(computed_before + plan.num_steps) // self.block_size)
        for _ in range(1, num_steps):  # A multi-step plan's further decode steps.
            for state in rows:
                sampled += self._run(state, 1, plan)
        return StepResult(step_id=plan.step_id, sampled=sampled, num_steps=num_steps)

    def _run(self, state: WorkerRequest, num_tokens: int, plan: StepPlan,
             drafts: list[int] = ()) -> list[SampledToken]:
        if drafts:
            return self._verify(state, num_tokens, plan, list(drafts))
        assert num_tokens > 0
        step_id = plan.step_id
        bs, start = self.block_size, state.num_computed_tokens
        for pos in range(self._first_key(start), start):  # The KV this step reads.
            got = self.gpu.get(state.block_ids[pos // bs], [None] * bs)[pos % bs]
            assert got == state.token_ids[pos], f"{state.label}: KV of position {pos} is wrong"
        for pos in range(start, min(start + num_tokens, len(state.token_ids))):  # The KV it writes.
            self.gpu.setdefault(state.block_ids[pos // bs], [None] * bs)[pos % bs] = state.token_ids[pos]
        self.num_computed_tokens += num_tokens
        state.num_computed_tokens += num_tokens
        assert state.num_computed_tokens <= len(state.token_ids)
        assert len(state.block_ids) >= -(-state.num_computed_tokens // self.block_size)
        if state.num_computed_tokens < len(state.token_ids):
            return []  # Mid-prompt chunk: nothing to sample.
        token = self.token_fn(state, step_id)
        state.token_ids.append(token)
        logprobs = TokenLogprobs(token, -0.5) if self.logprobs else None
        return [SampledToken(state.seq_id, token, logprobs)]

    def _first_key(self, first_query: int) -> int:
        """The first position the step's queries read (from first_query on)."""
        return max(0, first_query - self.window + 1) if self.window else 0

    def _verify(self, state: WorkerRequest, num_tokens: int, plan: StepPlan, drafts: list[int]) -> list[SampledToken]:
        """A row verifying drafts, as the real worker does: the last token and the
        drafts are written, a token is sampled after each accepted prefix, and the
        drafts are kept up to the first that differs from its sample, plus that sample."""
        assert plan.num_steps == 1 and num_tokens == 1 + len(drafts)
        assert state.num_computed_tokens + 1 == len(state.token_ids), "drafts follow the last sampled token"
        bs, start = self.block_size, state.num_computed_tokens
        assert len(state.block_ids) >= -(-(start + num_tokens) // bs), "no slots for the drafts"
        for pos in range(self._first_key(start), start):
            assert self.gpu.get(state.block_ids[pos // bs], [None] * bs)[pos % bs] == state.token_ids[pos]
        for pos, token in zip(range(start, start + num_tokens), state.token_ids[start:] + drafts):
            self.gpu.setdefault(state.block_ids[pos // bs], [None] * bs)[pos % bs] = token
        self.num_computed_tokens += num_tokens
        state.num_computed_tokens += 1
        out = []
        for draft in drafts + [None]:
            token = self.token_fn(state, plan.step_id)
            state.token_ids.append(token)
            out.append(SampledToken(state.seq_id, token, TokenLogprobs(token, -0.5) if self.logprobs else None))
            if token != draft:
                break
            state.num_computed_tokens += 1  # The accepted draft's KV was written above.
        return out


@dataclass
class Run:
    """What a driver loop saw: every plan and each request's tokens and end."""

    plans: list[StepPlan] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    by_sample: bool = False  # Key tokens and finish by (request id, sample index).

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            key = (out.request_id, out.index) if self.by_sample else out.request_id
            assert key not in self.finish, f"output after finish: {out}"
            self.tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                self.finish[key] = out.finish_reason
        self.outputs += outputs


# Sequence id -> label ("a", "r#0", "r#p") of every sequence a LabelledScheduler planned.
# Sequence ids are unique in the process, so one table serves every test's scheduler.
LABELS: dict[int, str] = {}


def names(rows) -> list[str]:
    """Labels of plan rows, sampled tokens or sequence ids."""
    return [LABELS[row if isinstance(row, int) else row.seq_id] for row in rows]


def named(rows) -> list:
    """Plan rows with their sequence ids replaced by labels, to compare with expected rows."""
    return [replace(row, seq_id=LABELS[row.seq_id]) for row in rows]


class LabelledScheduler(Scheduler):
    """A Scheduler that remembers each planned sequence's label, so tests can name plan
    rows and dropped ids long after the sample is gone."""

    def add_request(self, *args, **kwargs) -> Request:
        request = super().add_request(*args, **kwargs)
        LABELS.update((s.seq_id, s.label) for s in request.samples)
        return request

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        for row in plan.new_requests + plan.cached_requests:
            LABELS[row.seq_id] = self.get_sample(row.seq_id).label
        return plan

    def sample(self, label: str) -> Sample:
        """The live sample labelled `label`."""
        request = self.get_request(label.partition("#")[0])
        found = [s for s in (request.samples if request else []) if s.label == label]
        assert found, f"no live sample {label!r}"
        return found[0]


def build_scheduler(config: dict, num_blocks: int, eos, num_cpu_blocks: int = 0) -> "LabelledScheduler":
    """A scheduler from one dict of settings and cache facts (block_size, max_model_len;
    `clock`: the scheduler's clock, time.monotonic unless given)."""
    config = dict(config)
    cache = KVCacheShape(num_blocks=num_blocks, block_size=config.pop("block_size", 16),
                         max_model_len=config.pop("max_model_len"), num_cpu_blocks=num_cpu_blocks,
                         sliding_window=config.pop("sliding_window", 0))
    clock = config.pop("clock", time.monotonic)
    # NOTE: these tests were written against a 2048-token default step budget; the rest
    # of the budget is a CPU worker's (a core is built for a registered worker's device).
    config.setdefault("max_num_batched_tokens", 2048)
    return LabelledScheduler(on_cpu(SchedulerConfig(**config)), cache, eos, clock=clock)


def make_scheduler(num_blocks: int = 64, eos=NO_EOS, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 64)
    # NOTE: the older tests assert exact block ids without prefix caching.
    config.setdefault("enable_prefix_caching", False)
    return build_scheduler(config, num_blocks, eos)


def params(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kwargs)


def step(scheduler: Scheduler, worker: FakeWorker, run: Run) -> StepPlan:
    plan = scheduler.schedule()
    result = worker.execute(plan) if not plan.is_empty else StepResult(plan.step_id)
    run.plans.append(plan)
    run.record(scheduler.update_from_output(plan, result))
    return plan


def run_until_done(
    scheduler: Scheduler,
    worker: FakeWorker,
    run: Run | None = None,
    max_steps: int = 10_000,
    check: Callable[[Scheduler], None] | None = None,
) -> Run:
    run = run or Run()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return run
        step(scheduler, worker, run)
        if check:
            check(scheduler)
    raise AssertionError(f"not done after {max_steps} steps")
