"""The scheduler's three queues of samples, each kept sorted by (priority, arrival):

    waiting  [ s  s  s ]           hold no blocks (new, or preempted by recompute)
    running  [ s  s  s  s ]        hold GPU blocks; the last one is the preemption victim
    swapped  [ [s s] [s] ]         units preempted together; their blocks are on the CPU

Since each is sorted by key, the preemption victim is always the last running sample,
never one already scheduled earlier in the same step.
"""

from __future__ import annotations

import bisect

from llmserve.scheduler.request import Request, RequestStatus, Sample


def _key(sample: Sample) -> tuple[int, int]:
    return sample.key


def _unit_key(unit: list[Sample]) -> tuple[int, int]:
    return unit[0].key


class Queues:
    """The waiting, running and swapped queues; moving a sample between them sets its status."""

    def __init__(self, max_num_seqs: int) -> None:
        """Empty queues, at most `max_num_seqs` running samples."""
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Sample] = []
        self.running: list[Sample] = []
        self.swapped: list[list[Sample]] = []  # Units swapped out together.

    def wait(self, sample: Sample) -> None:
        """Queue the sample as WAITING, in key order."""
        sample.status = RequestStatus.WAITING
        bisect.insort(self.waiting, sample, key=_key)

    def run(self, sample: Sample) -> None:
        """Queue the sample as RUNNING, in key order."""
        sample.status = RequestStatus.RUNNING
        bisect.insort(self.running, sample, key=_key)

    def swap(self, unit: list[Sample]) -> None:
        """Queue samples swapped out together as one SWAPPED unit, in key order."""
        for sample in unit:
            sample.status = RequestStatus.SWAPPED
        bisect.insort(self.swapped, unit, key=_unit_key)

    def remove(self, sample: Sample) -> None:
        """Take the sample out of whichever queue its status says it is in."""
        if sample.status is RequestStatus.WAITING:
            self.waiting.remove(sample)
        elif sample.status is RequestStatus.RUNNING:
            self.running.remove(sample)
        else:
            unit = next(u for u in self.swapped if sample in u)
            unit.remove(sample)
            if not unit:
                self.swapped.remove(unit)

    def take_running(self, request: Request) -> list[Sample]:
        """Remove and return the request's running samples (for a preemption)."""
        live = [s for s in self.running if s.request is request]
        for sample in live:
            self.running.remove(sample)
        return live

    def replace_running(self, root: Sample, samples: list[Sample]) -> None:
        """Put a forked root's samples where the root was (same key: order holds)."""
        at = self.running.index(root)
        self.running[at : at + 1] = samples
        for sample in samples:
            sample.status = RequestStatus.RUNNING

    def end_of_request(self, start: int) -> int:
        """The index after the run of running samples, from `start`, of one request."""
        request, end = self.running[start].request, start
        while end < len(self.running) and self.running[end].request is request:
            end += 1
        return end

    def has_seats(self, sample: Sample, num_samples: int = 1) -> bool:
        """Room for `num_samples` more running samples; a root reserves a seat for each
        sample it forks into."""
        used = len(self.running) + sum(s.request.n - 1 for s in self.running if s.is_root)
        wanted = sample.request.n if sample.is_root else num_samples
        return used + wanted <= self.max_num_seqs

    def waiting_goes_first(self) -> bool:
        """Waiting samples are admitted only when no swapped unit comes before them."""
        return bool(self.waiting) and (not self.swapped or self.waiting[0].key < _unit_key(self.swapped[0]))

    def swapped_goes_first(self) -> bool:
        """The first swapped unit comes before every waiting sample."""
        return not (self.waiting and self.waiting[0].key < _unit_key(self.swapped[0]))
