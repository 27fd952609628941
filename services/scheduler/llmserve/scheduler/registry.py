"""The unfinished requests, reachable by public id (from clients) and their live samples
by sequence id (from workers' results): two indexes onto the same records.

This is the scheduler process's one request table: the service keeps no other (a
request's owner and stream state live on its record, request.StreamState). A request
that just ended is out of the table but still handed over (take_ended), so whoever
delivers its end output can reach its record, even one step later (a pipelined engine
loop delivers a step's outputs once it has planned and sent the next):

    add ──▶ _requests[id] ── last sample ends ──▶ _ended ──┬─ take_ended() ──▶ gone
                                                          └─ schedule() ──▶ _ended_before
    _ended_before ── take_ended() / the next schedule() ──▶ gone
"""

from __future__ import annotations

from llmserve.scheduler.request import Request, Sample


class LiveRequests:
    """Every unfinished Request and its live Samples; a request leaves with its last sample."""

    def __init__(self) -> None:
        """No requests yet."""
        self._requests: dict[str, Request] = {}  # By public id.
        self._samples: dict[int, Sample] = {}  # By sequence id.
        self._ended: list[Request] = []  # Out of _requests since the last take_ended() or age_ended().
        self._ended_before: list[Request] = []  # _ended at the last age_ended(), not taken since.
        self.num_roots = 0  # Live samples that are roots (of n > 1 requests, not forked yet).

    def __bool__(self) -> bool:
        return bool(self._requests)

    def request(self, request_id: str) -> Request | None:
        """The unfinished request with this public id, or None."""
        return self._requests.get(request_id)

    def sample(self, seq_id: int) -> Sample | None:
        """The live sample with this sequence id, or None."""
        return self._samples.get(seq_id)

    def samples(self) -> list[Sample]:
        """Every live sample."""
        return list(self._samples.values())

    def requests(self) -> list[Request]:
        """Every unfinished request, oldest first."""
        return list(self._requests.values())

    def take_ended(self) -> list[Request]:
        """The requests whose last sample ended since the last call, in end order."""
        ended = self._ended_before + self._ended if self._ended_before else self._ended
        self._ended, self._ended_before = [], []
        return ended

    def age_ended(self) -> None:
        """Once per step: the ended records nobody took for a whole step are dropped (a
        caller that never takes them, such as the in-process engine, keeps none for long);
        those that ended since the last step stay one more."""
        self._ended_before, self._ended = self._ended, []

    def add(self, request: Request, samples: list[Sample]) -> None:
        """Register a new request with its first samples (its public id is free)."""
        request.samples = samples
        self._requests[request.request_id] = request
        self._add_samples(samples)

    def replace(self, root: Sample, samples: list[Sample]) -> None:
        """A forked root's samples take its place."""
        self._add_samples(samples)
        root.request.samples = samples
        del self._samples[root.seq_id]
        self.num_roots -= 1

    def remove(self, sample: Sample) -> None:
        """Forget a finished sample, and its request once no sample is left."""
        del self._samples[sample.seq_id]
        self.num_roots -= sample.is_root
        request = sample.request
        request.samples.remove(sample)
        if not request.samples:
            del self._requests[request.request_id]
            self._ended.append(request)

    def _add_samples(self, samples: list[Sample]) -> None:
        for sample in samples:
            self._samples[sample.seq_id] = sample
            self.num_roots += sample.is_root
