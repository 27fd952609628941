"""The worker's half of the pipelined loop: a step launched on the device and read back
later (ModelRunner.launch / finish), and when a plan may not be launched ahead.

    compute stream:  forward N ─ sample N ─┬─ forward N+1 (placeholders <- ids N) ─ sample N+1
    copy stream:                           └─ (logprobs N,) ids N -> pinned host ─ event N
    host:            launch N | launch N+1 | finish N (wait event N, fill placeholders) | ...

Step N's sampled ids stay a device tensor [S]; each sampled row gets a PLACEHOLDER in its
token ids, which step N+1's inputs take from that tensor on the device
(InputBatch.build_inputs), and which finish(N) overwrites with the id read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.contract.plan import PromptLogprobs, SampledToken, StepPlan, StepResult
from llmserve.worker.input_batch import Placeholder, RequestState
from llmserve.worker.sampler import PendingLogprobs, as_token_logprobs


class HostIds:
    """Where sampled ids are read back. On CUDA: two pinned host buffers used in turn
    (at most two steps are in flight, and the older is read back before a third is
    launched), filled by a non-blocking copy on a side stream that waits for the
    compute stream, each copy's completion marked by an event. On the CPU the ids are
    already on the host: no copy."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._buffers = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)] \
            if self.on_cuda else []
        self._stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._turn = 0

    def copy(self, ids: torch.Tensor, along: tuple[torch.Tensor, ...] = ()
             ) -> tuple[torch.Tensor, torch.cuda.Event | None, tuple[torch.Tensor, ...]]:
        """ids: [S] long on the device -> ([S] on the host once the event has fired, the
        event, and `along`'s tensors on the host, copied before the ids on the same stream:
        valid once the event has fired too; pinned, from the caching host allocator)."""
        if not self.on_cuda:
            return ids, None, along
        if ids.shape[0] > self._buffers[0].shape[0]:
            self._buffers = [torch.empty(ids.shape[0], dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._buffers[self._turn][: ids.shape[0]]
        self._turn ^= 1
        event, host_along = self._copy_out(along, (host, ids))
        return host, event, host_along

    def copy_tensors(self, tensors: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.cuda.Event | None, tuple[torch.Tensor, ...]]:
        """`tensors` on the device -> (the event, their copies on the host once it has
        fired), as copy() does without ids (the ids' two buffers keep their turns)."""
        if not self.on_cuda:
            return None, tensors
        return self._copy_out(tensors)

    def _copy_out(self, tensors: tuple[torch.Tensor, ...], ids: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]:
        """Copies `tensors` (and ids: (host buffer, device ids)) to the host on the copy
        stream, once the compute stream's work so far is done; the event marks the end."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            host = tuple(t.to("cpu", non_blocking=True) for t in tensors)  # (pinned: non_blocking)
            if ids is not None:
                ids[0].copy_(ids[1], non_blocking=True)
            event.record()
        for t in (*tensors, ids[1]) if ids is not None else tensors:
            t.record_stream(self._stream)  # NOTE: allocated on the compute stream, read on this one.
        return event, host


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """One forward's prompt logprobs on their way to the host (HostIds.copy_tensors): read
    back by finish, never inside the launch."""

    rows: tuple[tuple[int, int, int, int], ...]  # (seq id, start, count, k) per row asking, in the tensors' order
    tensors: tuple[torch.Tensor, ...]  # sampler.prompt_logprob_tensors', on the host once `copied` has fired
    copied: torch.cuda.Event | None  # None: on the host already (CPU)

    def read(self) -> list[PromptLogprobs]:
        if self.copied is not None:
            self.copied.synchronize()
        got = as_token_logprobs(self.tensors, [k for _, _, count, k in self.rows for _ in range(count)])
        out, at = [], 0
        for seq_id, start, count, _ in self.rows:
            out.append(PromptLogprobs(seq_id, start, got[at : at + count]))
            at += count
        return out


@dataclass
class DeviceStep:
    """One forward's samples, launched: the ids on the device and (once `copied` has
    fired) on the host, and what each sample is."""

    states: list[RequestState]  # [S]
    offsets: list[int]  # [S]: 0, or the draft position of a row verifying drafts
    logprobs: PendingLogprobs  # [S] rows', copied to the host beside the ids (read with them)
    ids: torch.Tensor  # [S] long on the device: the next step's placeholders read it
    host_ids: torch.Tensor  # [S] long on the host (pinned on CUDA), valid once `copied` has fired
    copied: torch.cuda.Event | None  # None: host_ids is already valid (CPU)
    placeholders: list[Placeholder | None]  # [S]; None: a row verifying drafts appends its tokens at read back


@dataclass
class LaunchedStep:
    """A plan launched by ModelRunner.launch: the tokens its steps read back already (a
    multi-step plan's), and its last forward's samples, still on the device."""

    plan: StepPlan
    rows: list[tuple[RequestState, int]]
    sampled: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PendingPromptLogprobs] = field(default_factory=list)  # Read back by finish
    num_steps: int = 1
    pending: DeviceStep | None = None  # None: nothing sampled, or already read back
    result: StepResult | None = None  # Set by finish (which may run inside a later launch)
    error: BaseException | None = None  # finish's failure, raised again by every finish

    @property
    def verifies_drafts(self) -> bool:
        return any(st.draft_token_ids for st, _ in self.rows)

    def device_done(self) -> bool:
        """Whether the sampled ids are on the host already (finish would not wait), asked
        without blocking: always on the CPU, where the launch computed them."""
        pending = self.pending
        if pending is None or pending.copied is None:
            return True
        with torch.cuda.device(pending.ids.device):  # (as wait: no context opened on GPU 0 by this thread)
            return pending.copied.query()

    def wait(self) -> None:
        """Blocks until the device has copied the sampled ids to the host. Any thread may
        call it (the worker service waits on a thread of its own)."""
        pending = self.pending  # (finish may clear it meanwhile, on the compute thread)
        if pending is not None and pending.copied is not None:
            # NOTE: this rank's device made current on the calling thread (else a new thread's
            # first CUDA call opens a context on GPU 0).
            with torch.cuda.device(pending.ids.device):
                pending.copied.synchronize()


def must_finish_first(in_flight: LaunchedStep, plan: StepPlan, states: dict[int, RequestState]) -> bool:
    """Whether `plan` must wait for `in_flight`'s tokens on the host before its launch
    (correctness over overlap). Every rank of a TP x PP group decides alike: the plan and
    the states are the same on all. Why each reason is one:

      in_flight verified drafts    how many it accepts moves its rows' num_computed_tokens,
                                   which the next plan's inputs start from
      plan runs several steps      its steps read each step's ids back before the next
                                   (ModelRunner._launch_steps)
      a row carries drafts         a draft row's input is built from token_ids on the host
                                   and its acceptance compares host ids
      a constrained row            its grammar's bitmask needs the matcher advanced by the
                                   token in flight

    Logprobs are no reason: they are of this step's own logits and ids (copied to the host
    beside the ids, read with them); nor are
    prompt logprobs (this step's logits at prompt tokens, never placeholders), seeds and
    min_tokens (which read counts of tokens, placeholders counted, only), nor penalties
    and multi-token bad words (a placeholder in such a row's history is read on the device:
    sampler.InFlightIds; a bad word's ban then holds where the id in flight is the word's).
    """
    if in_flight.result is not None:
        return False  # Read back already.
    if in_flight.verifies_drafts or plan.num_steps > 1:
        return True
    for r in plan.new_requests:
        if r.draft_token_ids or r.sampling.structured_output is not None:
            return True
    for c in plan.cached_requests:
        st = states.get(c.seq_id)
        if c.draft_token_ids or (st is not None and st.needs_last_id_on_host):
            return True
    return False
