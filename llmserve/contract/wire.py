"""Conversions between the internal protobuf messages and plain dataclasses.

Protobuf stays at the edge: services call these at the gRPC boundary, and nothing
behind it (scheduling, model code) sees a generated *_pb2 type.
"""

from __future__ import annotations

import ctypes

from llmserve.internal.v1 import sampling_pb2, scheduler_pb2, worker_pb2
from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput, TokenLogprobs
from llmserve.contract.plan import (
    CachedRequestData,
    NewRequestData,
    PromptLogprobs,
    SampledToken,
    StepPlan,
    StepResult,
)
from llmserve.contract.sampling import SamplingParams, StructuredOutput
from llmserve.v1 import generation_pb2
from llmserve.contract.worker_info import WorkerInfo

# The Execute stream's message revision (worker.proto's WorkerInfo.wire_revision):
# 2 = cached rows and sampled tokens as packed columns. A worker registers with it and
# the scheduler refuses another revision.
WIRE_REVISION = 2


def _optional(msg, name: str, default=None):
    return getattr(msg, name) if msg.HasField(name) else default


# --- logprobs -------------------------------------------------------------------


def logprobs_to_pb(lp: TokenLogprobs) -> generation_pb2.TokenLogprobs:
    return generation_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=lp.top_token_ids,
        top_logprobs=lp.top_logprobs,
        rank=lp.rank,
    )


def logprobs_from_pb(msg: generation_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        top_token_ids=tuple(msg.top_token_ids),
        top_logprobs=tuple(msg.top_logprobs),
        rank=msg.rank,
    )


# --- router <-> scheduler -------------------------------------------------------


# --- sampling: the public API -> SamplingParams <-> the internal wire -------------
# NOTE: one line per SamplingParams field in each function of this section (stop strings
# aside on the internal wire); tests/test_sampling_fields.py fails while a field misses one.


def sampling_from_public_pb(msg: generation_pb2.SamplingParams) -> tuple[SamplingParams, int]:
    """A gRPC client's settings as SamplingParams, and n (its number of samples). Unset
    fields take the API's defaults, but max_tokens stays None (the router fills in what
    the prompt leaves); nothing is checked here (the router's validation is)."""
    sampling = SamplingParams(
        max_tokens=_optional(msg, "max_tokens"),
        temperature=_optional(msg, "temperature", 1.0),
        top_p=_optional(msg, "top_p", 1.0),
        top_k=msg.top_k,
        seed=_optional(msg, "seed"),
        ignore_eos=msg.ignore_eos,
        logprobs=_optional(msg, "logprobs"),
        prompt_logprobs=_optional(msg, "prompt_logprobs"),
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        repetition_penalty=_optional(msg, "repetition_penalty", 1.0),
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        min_p=msg.min_p,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        structured_output=(structured_from_public_pb(msg.structured_output)
                           if msg.HasField("structured_output") else None),
        bad_words=tuple(msg.bad_words),
        bad_words_token_ids=(),  # (router-resolved: the router tokenizes bad_words)
    )
    return sampling, _optional(msg, "n", 1)


def sampling_to_pb(p: SamplingParams) -> sampling_pb2.SamplingParams:
    """For AddRequest (router -> scheduler) and NewRequest (scheduler -> worker)."""
    return sampling_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        stop_token_ids=p.stop_token_ids,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        min_p=p.min_p,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        structured_output=structured_to_pb(p.structured_output),
        bad_words_token_ids=[sampling_pb2.TokenSequence(token_ids=seq) for seq in p.bad_words_token_ids],
    )


def sampling_from_pb(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=_optional(msg, "seed"),
        ignore_eos=msg.ignore_eos,
        logprobs=_optional(msg, "logprobs"),
        prompt_logprobs=_optional(msg, "prompt_logprobs"),
        stop_token_ids=tuple(msg.stop_token_ids),
        repetition_penalty=msg.repetition_penalty or 1.0,  # 0 (unset by an older sender): off.
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        min_p=msg.min_p,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        structured_output=StructuredOutput(msg.structured_output.kind, msg.structured_output.spec)
        if msg.HasField("structured_output") else None,
        bad_words_token_ids=tuple(tuple(seq.token_ids) for seq in msg.bad_words_token_ids),
    )


# The public enum's values <-> StructuredOutput.kind (UNSPECIFIED: "", refused by validation).
_STRUCTURED_KINDS = {"json_schema": generation_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
                     "json_object": generation_pb2.STRUCTURED_OUTPUT_KIND_JSON_OBJECT,
                     "regex": generation_pb2.STRUCTURED_OUTPUT_KIND_REGEX,
                     "choice": generation_pb2.STRUCTURED_OUTPUT_KIND_CHOICE,
                     "grammar": generation_pb2.STRUCTURED_OUTPUT_KIND_GRAMMAR}
_STRUCTURED_KIND_NAMES = {number: name for name, number in _STRUCTURED_KINDS.items()}


def structured_from_public_pb(msg: generation_pb2.StructuredOutput) -> StructuredOutput:
    """An unknown or unset kind becomes "" (validation refuses it by name)."""
    return StructuredOutput(_STRUCTURED_KIND_NAMES.get(msg.kind, ""), msg.spec)


def structured_to_pb(so: StructuredOutput | None) -> sampling_pb2.StructuredOutput | None:
    return None if so is None else sampling_pb2.StructuredOutput(kind=so.kind, spec=so.spec)


def public_float(value: float) -> float:
    """`value` as a public API float field holds it (float32: rounded, inf beyond its
    range), so that an OpenAI body's numbers are checked exactly as a gRPC client's."""
    return ctypes.c_float(value).value


def public_int(value: int, bits: int = 32) -> int:
    """`value` if a public API int field of `bits` bits holds it; else the ValueError
    protobuf raises (the HTTP API answers it with a 400)."""
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise ValueError(f"Value out of range: {value}")
    return value


def public_str(value: str) -> str:
    """`value` if a public API string field holds it (UTF-8: no lone surrogate); else the
    UnicodeEncodeError (a ValueError) protobuf raises."""
    value.encode("utf-8")
    return value


def add_request_to_pb(request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      n: int = 1, priority: int = 0, trace_context: dict[str, str] | None = None,
                      deadline_ms: int = 0, cache_salt: str = "") -> scheduler_pb2.AddRequest:
    return scheduler_pb2.AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                    sampling=sampling_to_pb(sampling), n=n, priority=priority,
                                    trace_context=trace_context, deadline_ms=deadline_ms, cache_salt=cache_salt)


def request_output_to_pb(out: RequestOutput) -> scheduler_pb2.RequestOutput:
    # NOTE: one per running sample per step: a field at its proto3 default is left
    # unset (the same message on the wire) instead of passed, which costs per field.
    msg = scheduler_pb2.RequestOutput(request_id=out.request_id, new_token_ids=out.new_token_ids,
                                      stop_token_id=out.stop_token_id)
    if out.index:
        msg.index = out.index
    if out.num_cached_tokens:
        msg.num_cached_tokens = out.num_cached_tokens
    if out.logprobs:
        msg.logprobs.extend(logprobs_to_pb(lp) for lp in out.logprobs)
    if out.finish_reason:
        msg.finish_reason = int(out.finish_reason)
    if out.error:
        msg.error = out.error
    if out.error_code:
        msg.error_code = int(out.error_code)
    if out.retry_after_ms:
        msg.retry_after_ms = out.retry_after_ms
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_pb(lp) for lp in out.prompt_logprobs)
    return msg


# Enum members by value: looked up, not constructed (an enum call costs about a
# microsecond, and the router reads one output per running sample per step).
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}
_ERROR_CODES = {code.value: code for code in ErrorCode}


def request_output_from_pb(msg: scheduler_pb2.RequestOutput) -> RequestOutput:
    # NOTE: the common output is one token, nothing else: the repeated fields are
    # converted only when they hold something.
    logprobs, prompt_logprobs = msg.logprobs, msg.prompt_logprobs
    return RequestOutput(
        request_id=msg.request_id,
        index=msg.index,
        new_token_ids=list(msg.new_token_ids),
        logprobs=[logprobs_from_pb(lp) for lp in logprobs] if logprobs else [],
        finish_reason=_finish_reason(msg.finish_reason),
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error,
        stop_token_id=msg.stop_token_id,
        # An unknown code (a newer scheduler's) reads as INTERNAL, never as a crash.
        error_code=_ERROR_CODES.get(msg.error_code, ErrorCode.INTERNAL),
        retry_after_ms=msg.retry_after_ms,
        prompt_logprobs=[logprobs_from_pb(lp) for lp in prompt_logprobs] if prompt_logprobs else [],
    )


def _finish_reason(value: int) -> FinishReason:
    try:
        return _FINISH_REASONS[value]
    except KeyError:
        return FinishReason(value)  # ValueError, as before: not a reason this router knows


def scheduler_stats_to_pb(s, worker_ready: bool) -> scheduler_pb2.SchedulerStats:
    """From the core's SchedulerStats dataclass."""
    return scheduler_pb2.SchedulerStats(
        num_waiting=s.num_waiting,
        num_running=s.num_running,
        num_total_blocks=s.num_total_blocks,
        num_free_blocks=s.num_free_blocks,
        num_preemptions=s.num_preemptions,
        num_steps=s.num_steps,
        num_finished=s.num_finished,
        num_aborted=s.num_aborted,
        worker_ready=worker_ready,
        prompt_tokens_total=s.prompt_tokens_total,
        generation_tokens_total=s.generation_tokens_total,
        num_swapped=s.num_swapped,
        kv_cache_usage=s.kv_cache_usage,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions_recompute=s.num_preemptions_recompute,
        num_preemptions_swap=s.num_preemptions_swap,
        num_swapped_out_blocks=s.num_swapped_out_blocks,
        num_cached_blocks=s.num_cached_blocks,
        num_cpu_blocks=s.num_cpu_blocks,
        num_free_cpu_blocks=s.num_free_cpu_blocks,
        num_allocated_blocks=s.num_allocated_blocks,
        num_cow_copies=s.num_cow_copies,
        num_failed=s.num_failed,
        num_queued_requests=s.num_queued_requests,
        num_queued_tokens=s.num_queued_tokens,
        max_queued_requests=s.max_queued_requests,
        max_queued_tokens=s.max_queued_tokens,
        saturated=s.saturated,
        num_refused=s.num_refused,
        num_expired=s.num_expired,
        spec_num_drafts=s.spec_num_drafts,
        spec_num_draft_tokens=s.spec_num_draft_tokens,
        spec_num_accepted_tokens=s.spec_num_accepted_tokens,
        spec_accepted_per_position=s.spec_accepted_per_position,
    )


# --- scheduler <-> worker -------------------------------------------------------


def block_audit_to_pb(audit, num_total_blocks: int, num_free_blocks: int) -> scheduler_pb2.BlockAudit:
    """A scheduler's BlockAudit (llmserve.scheduler.block_audit) as its proto."""

    def held(owners) -> list[scheduler_pb2.HeldBlock]:
        return [scheduler_pb2.HeldBlock(block_id=block, holders=[
            scheduler_pb2.BlockHolder(request_id=h.request_id, index=h.index, is_root=h.is_root) for h in holders])
            for block, holders in owners.items()]

    return scheduler_pb2.BlockAudit(
        gpu_blocks=held(audit.gpu_owners), cpu_blocks=held(audit.cpu_owners),
        orphaned_gpu_blocks=audit.orphaned_gpu_blocks, orphaned_cpu_blocks=audit.orphaned_cpu_blocks,
        problems=audit.problems, num_total_blocks=num_total_blocks, num_free_blocks=num_free_blocks)


def worker_info_to_pb(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        model=info.model,
        model_path=info.model_path,
        num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size,
        dtype=info.dtype,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        tensor_parallel_size=info.tensor_parallel_size,
        bos_token_id=info.bos_token_id,
        num_cpu_blocks=info.num_cpu_blocks,
        device=info.device,
        cuda_graphs=info.cuda_graphs,
        quantization=info.quantization,
        dtype_reason=info.dtype_reason,
        device_memory_bytes=info.device_memory_bytes,
        sliding_window=info.sliding_window,
        wire_revision=WIRE_REVISION,
    )


def worker_info_from_pb(msg: worker_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model=msg.model,
        model_path=msg.model_path,
        num_kv_blocks=msg.num_kv_blocks,
        block_size=msg.block_size,
        dtype=msg.dtype,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        tensor_parallel_size=msg.tensor_parallel_size,
        bos_token_id=msg.bos_token_id,
        num_cpu_blocks=msg.num_cpu_blocks,
        device=msg.device or "cpu",
        cuda_graphs=msg.cuda_graphs,
        quantization=msg.quantization or "none",
        dtype_reason=msg.dtype_reason,
        device_memory_bytes=msg.device_memory_bytes,
        sliding_window=msg.sliding_window,
    )


def step_plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                seq_id=r.seq_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_pb(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                trace_context=r.trace_context,
                draft_token_ids=r.draft_token_ids,
            )
            for r in plan.new_requests
        ],
        cached=_cached_rows_to_pb(plan.cached_requests),
        finished_seq_ids=plan.finished_seq_ids,
        swap_out=_moves_to_pb(plan.swap_out),
        swap_in=_moves_to_pb(plan.swap_in),
        copies=_moves_to_pb(plan.copies),
        num_steps=plan.num_steps,
        trace_context=plan.trace_context,
    )


def plan_command_to_pb(plan: StepPlan) -> worker_pb2.WorkerCommand:
    return worker_pb2.WorkerCommand(plan=step_plan_to_pb(plan))


def interrupt_command_to_pb(step_id: int) -> worker_pb2.WorkerCommand:
    return worker_pb2.WorkerCommand(interrupt=worker_pb2.Interrupt(step_id=step_id))


def step_plan_from_pb(msg: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestData(
                seq_id=r.seq_id,
                token_ids=list(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_from_pb(r.sampling),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                trace_context=dict(r.trace_context),
                draft_token_ids=list(r.draft_token_ids),
            )
            for r in msg.new_requests
        ],
        cached_requests=_cached_rows_from_pb(msg.cached),
        finished_seq_ids=list(msg.finished_seq_ids),
        swap_out=_moves_from_pb(msg.swap_out),
        swap_in=_moves_from_pb(msg.swap_in),
        copies=_moves_from_pb(msg.copies),
        num_steps=max(1, msg.num_steps),
        trace_context=dict(msg.trace_context),
    )


def _moves_to_pb(moves: list[tuple[int, int]]) -> list[worker_pb2.BlockMove]:
    return [worker_pb2.BlockMove(src=src, dst=dst) for src, dst in moves]


def _moves_from_pb(msgs) -> list[tuple[int, int]]:
    return [(m.src, m.dst) for m in msgs]


def _cached_rows_to_pb(rows: list[CachedRequestData]) -> worker_pb2.CachedRows:
    """One packed array per field; the ragged ones as counts + one flat array."""
    msg = worker_pb2.CachedRows(
        seq_ids=[r.seq_id for r in rows],
        num_computed_tokens=[r.num_computed_tokens for r in rows],
        num_scheduled_tokens=[r.num_scheduled_tokens for r in rows],
        num_new_blocks=[len(r.new_block_ids) for r in rows],
    )
    for r in rows:
        if r.new_block_ids:  # NOTE: most decode rows get no new block in a step
            msg.new_block_ids.extend(r.new_block_ids)
    if any(r.draft_token_ids for r in rows):
        msg.num_drafts.extend(len(r.draft_token_ids) for r in rows)
        for r in rows:
            msg.draft_token_ids.extend(r.draft_token_ids)
    return msg


def _cached_rows_from_pb(msg: worker_pb2.CachedRows) -> list[CachedRequestData]:
    """ValueError when the columns disagree in length (a malformed plan names itself)."""
    n = len(msg.seq_ids)
    columns = (msg.num_computed_tokens, msg.num_scheduled_tokens, msg.num_new_blocks)
    if any(len(c) != n for c in columns) or len(msg.num_drafts) not in (0, n):
        raise ValueError(f"cached rows: {n} seq ids but {[len(c) for c in columns]} counts "
                         f"and {len(msg.num_drafts)} draft counts")
    blocks = _split(list(msg.new_block_ids), list(msg.num_new_blocks), "new_block_ids")
    drafts = _split(list(msg.draft_token_ids), list(msg.num_drafts), "draft_token_ids") if msg.num_drafts else None
    return [
        CachedRequestData(seq_id, block_ids, computed, scheduled, drafts[i] if drafts else [])
        for i, (seq_id, computed, scheduled, block_ids) in enumerate(
            zip(msg.seq_ids, msg.num_computed_tokens, msg.num_scheduled_tokens, blocks))
    ]


def _split(flat: list[int], counts: list[int], what: str) -> list[list[int]]:
    """flat cut into consecutive pieces of counts[i] items."""
    if any(c < 0 for c in counts) or sum(counts) != len(flat):
        raise ValueError(f"cached rows: counts of {what} sum to {sum(counts)} but it holds {len(flat)}")
    if not flat:
        return [[] for _ in counts]
    out, start = [], 0
    for c in counts:
        out.append(flat[start : start + c])
        start += c
    return out


def step_result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    sampled = result.sampled
    tokens = worker_pb2.SampledTokens(seq_ids=[s.seq_id for s in sampled], token_ids=[s.token_id for s in sampled])
    for i, s in enumerate(sampled):
        if s.logprobs is not None:
            tokens.logprobs_entry.append(i)
            tokens.logprobs.append(logprobs_to_pb(s.logprobs))
    return worker_pb2.StepResult(step_id=result.step_id, sampled_tokens=tokens, error=result.error,
                                 num_steps=result.num_steps,
                                 prompt_logprobs=[_prompt_logprobs_to_pb(p) for p in result.prompt_logprobs])


def step_result_from_pb(msg: worker_pb2.StepResult) -> StepResult:
    tokens = msg.sampled_tokens
    if len(tokens.token_ids) != len(tokens.seq_ids) or len(tokens.logprobs_entry) != len(tokens.logprobs):
        raise ValueError(f"step {msg.step_id}'s result: {len(tokens.seq_ids)} seq ids, {len(tokens.token_ids)} "
                         f"tokens, {len(tokens.logprobs)} logprobs for {len(tokens.logprobs_entry)} entries")
    sampled = [SampledToken(seq_id, token_id) for seq_id, token_id in zip(tokens.seq_ids, tokens.token_ids)]
    for i, lp in zip(tokens.logprobs_entry, tokens.logprobs):
        if not 0 <= i < len(sampled):
            raise ValueError(f"step {msg.step_id}'s result: logprobs for entry {i} of {len(sampled)}")
        sampled[i].logprobs = logprobs_from_pb(lp)
    return StepResult(step_id=msg.step_id, sampled=sampled, error=msg.error, num_steps=max(1, msg.num_steps),
                      prompt_logprobs=[_prompt_logprobs_from_pb(p) for p in msg.prompt_logprobs])


def _prompt_logprobs_to_pb(p: PromptLogprobs) -> worker_pb2.PromptLogprobs:
    """Packed: one array per field, the top entries row-major [N * k]."""
    k = len(p.logprobs[0].top_token_ids) if p.logprobs else 0
    return worker_pb2.PromptLogprobs(
        seq_id=p.seq_id, start=p.start, num_top=k,
        token_ids=[lp.token_id for lp in p.logprobs], logprobs=[lp.logprob for lp in p.logprobs],
        ranks=[lp.rank for lp in p.logprobs],
        top_token_ids=[t for lp in p.logprobs for t in lp.top_token_ids],
        top_logprobs=[v for lp in p.logprobs for v in lp.top_logprobs])


def _prompt_logprobs_from_pb(msg: worker_pb2.PromptLogprobs) -> PromptLogprobs:
    n, k = len(msg.token_ids), msg.num_top
    if len(msg.logprobs) != n or len(msg.ranks) != n or len(msg.top_token_ids) != n * k \
            or len(msg.top_logprobs) != n * k or msg.start < 1:
        raise ValueError(f"prompt logprobs of {msg.seq_id}: {n} tokens, {len(msg.logprobs)} logprobs, "
                         f"{len(msg.ranks)} ranks, {len(msg.top_token_ids)} top ids for k = {k}, start {msg.start}")
    ids, values = list(msg.top_token_ids), list(msg.top_logprobs)
    return PromptLogprobs(msg.seq_id, msg.start, [
        TokenLogprobs(t, v, tuple(ids[i * k:(i + 1) * k]), tuple(values[i * k:(i + 1) * k]), r)
        for i, (t, v, r) in enumerate(zip(msg.token_ids, msg.logprobs, msg.ranks))])
