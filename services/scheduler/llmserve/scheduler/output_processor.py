"""Applying a step's result: sampled tokens, stop conditions, the fork of n > 1 roots,
and the end of samples and requests (finished, aborted or failed).

A root that has prefilled prompt[:-1] forks into the request's n samples, which share
its blocks (ref counts) and each compute the last prompt token themselves, writing into
the shared partial block: copy-on-write (see kv_cache_manager.py).

    before:  running [ ... r#p ... ]        r#p: blocks [7, 2], 5 of 6 prompt tokens
    after:   running [ ... r#0 r#1 ... ]    both [7, 2] (ref count 2 each), 5 computed
"""

from __future__ import annotations

import logging

from llmserve.contract.outputs import ErrorCode, RequestOutput
from llmserve.contract.plan import PromptLogprobs, SampledToken, StepPlan, StepResult
from llmserve.scheduler.block_audit import holders_by_block
from llmserve.scheduler.kv_cache_manager import KVCacheManager
from llmserve.scheduler.ngram_drafter import NgramDrafter
from llmserve.scheduler.queues import Queues
from llmserve.scheduler.registry import LiveRequests
from llmserve.scheduler.request import Request, RequestStatus, Sample
from llmserve.scheduler.stats import Counters
from llmserve.scheduler.worker_view import WorkerView

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Turns step results into RequestOutputs and ends samples and requests."""

    def __init__(self, max_model_len: int, kv: KVCacheManager, queues: Queues, live: LiveRequests,
                 worker: WorkerView, counters: Counters) -> None:
        """Apply results to samples that may hold at most `max_model_len` tokens."""
        self.max_model_len = max_model_len
        self.kv = kv
        self.queues = queues
        self.live = live
        self.worker = worker
        self.counters = counters
        # A request's only sample fits the pool while blocks_to_hold_at_most([it]) does:
        # max(its table, its tokens' blocks) + 1 <= every block.
        self._max_table_alone = kv.num_total_blocks - 1
        self._max_tokens_alone = (kv.num_total_blocks - 1) * kv.block_size

    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens (see Scheduler.update_from_output)."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id} given with plan {plan.step_id}")
        # The real tokens replace the placeholders.
        sampling = self.worker.take_pending(plan.step_id)
        if result.error:
            return self.fail_step(plan, self.in_plan(plan), result.error)
        self._add_prompt_logprobs(result.prompt_logprobs)
        outputs = self._apply_tokens(plan, result, sampling)
        if self.live.num_roots:  # NOTE: n > 1 requests only: no walk of the plan otherwise
            for sample in self.in_plan(plan):  # (roots sample nothing: the tokens ended none)
                if sample.is_root and sample.status is RequestStatus.RUNNING and not sample.num_uncomputed_tokens:
                    self._fork(sample)
        return outputs

    def fail_step(self, plan: StepPlan, in_plan: list[Sample], error: str) -> list[RequestOutput]:
        """A step failed or was never applied: its requests end with ERROR, and so do the
        requests whose blocks it moved (their KV may not have arrived). The worker is told
        again to drop what the plan dropped."""
        self.kv.reset_prefix_cache()  # The failed step may have left blocks half written.
        self.worker.take_pending(plan.step_id)
        self.worker.redrop(plan.finished_seq_ids)
        gpu, cpu = holders_by_block(self.live.samples())
        moved = [s for _, cpu_block in plan.swap_out for s in cpu.get(cpu_block, ())]
        moved += [s for _, gpu_block in plan.swap_in + plan.copies for s in gpu.get(gpu_block, ())]
        request_ids = dict.fromkeys(s.request.request_id for s in in_plan + moved)
        return self.end_requests(request_ids, RequestStatus.FINISHED_ERROR, error, ErrorCode.INTERNAL)

    def in_plan(self, plan: StepPlan) -> list[Sample]:
        """The plan's samples still live (some may have been aborted during the step)."""
        found = (self.live.sample(r.seq_id) for r in plan.new_requests + plan.cached_requests)
        return [s for s in found if s is not None]

    def _apply_tokens(self, plan: StepPlan, result: StepResult, sampling: set[Sample]) -> list[RequestOutput]:
        """One output per sample the plan sampled for that is still running and got some."""
        num_drafts = plan.num_drafts()
        if plan.num_steps <= 1 and not num_drafts:
            return self._apply_one_token_each(result.sampled, sampling)
        # A multi-step result lists each sample once per step run, step by step; a
        # speculative row lists its accepted drafts and one sampled token, in order.
        per_sample: dict[int, list[SampledToken]] = {}
        for sampled in result.sampled:
            per_sample.setdefault(sampled.seq_id, []).append(sampled)
        outputs = []
        for seq_id, sampled in per_sample.items():
            sample = self.live.sample(seq_id)
            # NOTE: whether the plan sampled for it is what the plan recorded, not its
            # counts now: a pipelined loop has planned its next step since.
            if sample is None or sample not in sampling or sample.status is not RequestStatus.RUNNING:
                logger.debug("ignoring token for %s", seq_id)
                continue
            drafts = num_drafts.get(seq_id, 0)
            if len(sampled) > 1:  # (a multi-step or speculative row's; a stray entry beyond them is dropped)
                sampled = sampled[: max(plan.num_steps, 1 + drafts)]
            if drafts:
                self._count_drafts(sample, drafts, len(sampled) - 1)
            outputs.append(self._append_tokens(sample, sampled))
        return outputs

    def _apply_one_token_each(self, tokens: list[SampledToken], sampling: set[Sample]) -> list[RequestOutput]:
        """_apply_tokens for a one-step plan without drafts: at most one token per sample
        (the common step), without grouping the result by sample first."""
        outputs = []
        live, running = self.live, RequestStatus.RUNNING
        for token in tokens:
            sample = live.sample(token.seq_id)
            if sample is None or sample not in sampling or sample.status is not running:
                logger.debug("ignoring token for %s", token.seq_id)
                continue
            sampling.discard(sample)  # (a stray second token for it is dropped, as grouping would)
            outputs.append(self._append_token(sample, token))
        return outputs

    def _add_prompt_logprobs(self, chunks: list[PromptLogprobs]) -> None:
        """Extend each request's prompt logprobs by the step's chunks. A chunk computed
        again (a preempted sample's recompute, a sibling's) adds only what is new."""
        for chunk in chunks:
            sample = self.live.sample(chunk.seq_id)
            if sample is None:
                continue
            have = sample.request.prompt_logprobs
            offset = len(have) - (chunk.start - 1)  # Entries of the chunk already held.
            if 0 <= offset < len(chunk.logprobs):
                have += chunk.logprobs[offset:]

    def _count_drafts(self, sample: Sample, num_drafts: int, num_accepted: int) -> None:
        """Speculative decoding's acceptance: counters, and the drafter's pause."""
        counters = self.counters
        counters.spec_drafts += 1
        counters.spec_draft_tokens += num_drafts
        counters.spec_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.spec_accepted_per_position[position] += 1
        NgramDrafter.observe(sample, num_drafts, num_accepted)

    # ---- tokens and stops ----

    def _append_tokens(self, sample: Sample, sampled: list[SampledToken]) -> RequestOutput:
        """Append the sample's tokens; finish it if one of them stops it. The sample's
        first output carries the prompt logprobs where asked."""
        first = not sample.output_token_ids
        new_token_ids, logprobs, status = self._take_tokens(sample, sampled)
        return self._output(sample, new_token_ids, logprobs, status, first, len(sampled) > 1)

    def _append_token(self, sample: Sample, token: SampledToken) -> RequestOutput:
        """_append_tokens for one token (the common row), without the run's loop."""
        first = not sample.output_token_ids
        status = self._take(sample, token.token_id)
        return self._output(sample, [token.token_id], [] if token.logprobs is None else [token.logprobs], status,
                            first, False)

    def _output(self, sample: Sample, new_token_ids: list[int], logprobs: list, status: RequestStatus | None,
                first: bool, ran_several: bool) -> RequestOutput:
        """The sample's output for the tokens just appended; finishes it on `status`."""
        if ran_several or status is None:
            # Blocks the run filled (before a finish frees them), or the block a pipelined
            # plan filled ending in this token's placeholder (a no-op in a serial loop).
            self.kv.prefix.cache_full_blocks(sample)
            self.kv.release_outside_window(sample)  # a run's further steps moved its window on
        # NOTE: only the fields that differ from their defaults are passed (0.4 against 0.7 us
        # an output at batch 256, on the step's critical path); an end sets the rest.
        output = RequestOutput(request_id=sample.request.request_id, index=sample.index, new_token_ids=new_token_ids,
                               logprobs=logprobs, num_cached_tokens=sample.request.num_cached_tokens)
        if first:
            output.prompt_logprobs = list(sample.request.prompt_logprobs)
        if status is not None:
            self.queues.running.remove(sample)
            self._finish(sample, status, sample.error)
            output.finish_reason, output.stop_token_id = status.finish_reason, sample.stop_token_id
            output.error, output.error_code = sample.error, sample.error_code
        return output

    def _take_tokens(self, sample: Sample, sampled: list[SampledToken]) -> tuple[list, list, RequestStatus | None]:
        """Append a step's token, or a multi-step run's tokens in order: each token after
        the first was computed by the run's next step (or was an accepted draft, whose
        KV the verifying pass wrote). Tokens after a stop are dropped.
        Returns the kept token ids, their logprobs and the finished status (or None)."""
        new_token_ids, logprobs = [], []
        for i, token in enumerate(sampled):
            if i:
                sample.num_computed_tokens += 1
            new_token_ids.append(token.token_id)
            if token.logprobs is not None:
                logprobs.append(token.logprobs)
            status = self._take(sample, token.token_id)
            if status is not None:
                return new_token_ids, logprobs, status
        return new_token_ids, logprobs, None

    def _take(self, sample: Sample, token_id: int) -> RequestStatus | None:
        """Append one token to the sample; the finished status it causes, or None."""
        sample.output_token_ids.append(token_id)
        self.counters.generation_tokens_total += 1
        return self._stop_status(sample, token_id)

    def _stop_status(self, sample: Sample, token_id: int) -> RequestStatus | None:
        """The finished status the token just appended causes, or None.

        Sets sample.stop_token_id (STOP) or sample.error (ERROR) on the way.
        """
        sampling = sample.sampling
        is_eos = token_id in sample.request.eos_token_ids and not sampling.ignore_eos
        # NOTE: the worker masks these ids until min_tokens outputs (worker_view's
        # _worker_sampling); counting only after it keeps a runner without that mask honest.
        if (is_eos or token_id in sampling.stop_token_ids) and sample.num_output_tokens > sampling.min_tokens:
            sample.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        num_tokens = sample.num_tokens
        if sample.num_output_tokens >= sampling.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if (len(sample.request.samples) == 1 and len(sample.block_table or sample.cpu_table) <= self._max_table_alone
                and num_tokens <= self._max_tokens_alone):
            return None  # NOTE: _outgrows_cache's bound for one sample, inlined: checked once per token
        return self._outgrows_cache(sample)

    def _outgrows_cache(self, sample: Sample) -> RequestStatus | None:
        """ERROR when the whole cache cannot hold the request's live samples any more."""
        # NOTE: the next step needs KV for all num_tokens tokens of every live sample.
        # Failing here, rather than in schedule(), keeps the running loop free of
        # requests that could only preempt everyone and then themselves, forever.
        samples = sample.request.samples
        if self.kv.blocks_to_hold_at_most(samples) <= self.kv.num_total_blocks:
            return None  # NOTE: the common case, decided without walking every block table
        num_blocks = self.kv.blocks_to_run(samples)
        what = f"{sample.num_tokens} tokens" if len(samples) == 1 else f"{len(samples)} samples"
        if error := self.kv.too_small_for(num_blocks, what):
            sample.error, sample.error_code = error, ErrorCode.RESOURCE_EXHAUSTED
            return RequestStatus.FINISHED_ERROR
        return None

    # ---- fork ----

    def _fork(self, root: Sample) -> None:
        """Replace a root that prefilled prompt[:-1] by the request's n samples, which
        share its blocks and each compute the last prompt token themselves."""
        samples = root.request.new_samples()
        self.live.replace(root, samples)
        for sample in samples:
            sample.num_computed_tokens = root.num_computed_tokens
        self.kv.fork(root, samples)
        self.queues.replace_running(root, samples)
        self.worker.drop(root)

    # ---- ends ----

    def end_requests(self, request_ids, status: RequestStatus, error: str,
                     code: ErrorCode = ErrorCode.OK) -> list[RequestOutput]:
        """Finish every live sample of the given public ids (unknown ones are ignored);
        one output per sample. `code` says why an ERROR end happened."""
        outputs = []
        for request_id in request_ids:
            request = self.live.request(request_id)
            if request is not None:
                outputs += self._end_request(request, status, error, code)
        return outputs

    def _end_request(self, request: Request, status: RequestStatus, error: str,
                     code: ErrorCode) -> list[RequestOutput]:
        """Dequeue and finish every live sample of the request; their end outputs."""
        outputs = []
        for sample in list(request.samples):
            self.queues.remove(sample)
            sample.error_code = code
            self._finish(sample, status, error)
            outputs += _final_outputs(sample)
        return outputs

    def _finish(self, sample: Sample, status: RequestStatus, error: str = "") -> None:
        """Give the sample its final status, free its blocks and forget it (and its
        request once no sample is left). The caller has already dequeued it."""
        sample.status = status
        sample.error = error
        if status is not RequestStatus.FINISHED_ERROR:
            sample.error_code = ErrorCode.OK
        elif not sample.error_code:
            sample.error_code = ErrorCode.INTERNAL
        self.kv.free(sample)
        self.counters.finished[status] += 1
        self.worker.drop(sample)
        self.live.remove(sample)


def _final_outputs(sample: Sample) -> list[RequestOutput]:
    """The end outputs of a sample finished without a token (abort, failure)."""
    request, reason = sample.request, sample.status.finish_reason
    if sample.is_root:  # The samples did not exist yet: each still gets its end.
        return [RequestOutput(request.request_id, index=i, finish_reason=reason, error=sample.error,
                              error_code=sample.error_code) for i in range(request.n)]
    return [RequestOutput(request_id=request.request_id, index=sample.index, finish_reason=reason,
                          num_cached_tokens=request.num_cached_tokens, error=sample.error,
                          error_code=sample.error_code)]
