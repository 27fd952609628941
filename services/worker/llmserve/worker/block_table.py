"""The worker's block tables, kept across steps in one host tensor: a request's table is
written once when it arrives and then only its new blocks, so a step's padded table is
one row gather, not a Python list of lists turned into a tensor.

    table [capacity, max_blocks] int32          row r: the block ids of the request in row r
      row 0: [ 7  2  5  0  0 ...]                (entries past a table's length are 0: the
      row 1: [ 3  9  0  0  0 ...]                 kernels mask keys past each row's length)
    step with rows [1, 0], widest 3 blocks  ->  [[3 9 0], [7 2 5]]   (table[:, :3].index_select)

With `staged` (the CUDA worker's) a step's gather lands in one of two persistent
host buffers, pinned on CUDA, used in turn: its non-blocking copy to the device may still
be running while the next step's gather writes the other buffer, and a buffer is written
again only two steps later, when its step has been read back (at most two steps are in
flight, the older read back before a third is launched: ModelRunner.launch).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.contract.arith import cdiv


class BlockTables:
    def __init__(self, max_model_len: int, block_size: int, capacity: int = 64, staged: bool = False):
        # NOTE: widened if a multi-step run's lookahead or a step's drafts reach past max_model_len's blocks.
        self.max_blocks = cdiv(max_model_len, block_size) + 1
        self.block_size = block_size
        self.staged = staged
        self._staging: list[torch.Tensor] = []  # two flat int32 buffers (staged only), grown on demand
        self._turn = 0
        self._set_table(self._zeros(capacity, self.max_blocks))
        self.lengths: list[int] = [0] * capacity  # blocks written per row
        self._free = list(range(capacity - 1, -1, -1))  # rows not in use (popped from the end: lowest first)

    @staticmethod
    def _zeros(rows: int, max_blocks: int) -> torch.Tensor:
        # NOTE: a table grows inside a step (ModelRunner.launch runs in inference mode) and is
        # zeroed outside one (reset_requests): an inference tensor would refuse the in-place
        # update there, so the tables are always normal tensors.
        with torch.inference_mode(False):
            return torch.zeros(rows, max_blocks, dtype=torch.int32)

    def _set_table(self, table: torch.Tensor) -> None:
        self.table = table  # [capacity, max_blocks] int32
        # The same memory as numpy: a row's few new ids are written, and a step's slots read,
        # without a tensor made per call.
        self._np = table.numpy()

    def add(self, block_ids: list[int]) -> int:
        """A row holding `block_ids` (a request's whole table); returns the row."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.lengths[row] = 0
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        """Append `block_ids` to the row's table."""
        if not block_ids:
            return
        start = self.lengths[row]
        end = start + len(block_ids)
        if end > self.max_blocks:  # (a table the plan's validation let through: never refuse it here)
            self._widen(end)
        self._np[row, start:end] = block_ids
        self.lengths[row] = end

    def drop(self, row: int) -> None:
        """The row is free again; its entries are zeroed (a later request's table is shorter)."""
        self._np[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free.append(row)

    def clear(self) -> None:
        self.table.zero_()
        capacity = self.table.shape[0]
        self.lengths = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[n] int64: the cache slot of each row's token at its position (rows, positions:
        [n] int64): table[row, p // block_size] * block_size + p % block_size."""
        bs = self.block_size
        return self._np[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def padded(self, rows: list[int] | np.ndarray, width: int) -> torch.Tensor:
        """[len(rows), width] int32: the rows' tables in this order, cut or zero-padded to
        width (staged: a view of the next staging buffer, valid until padded's next call but one)."""
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        if not self.staged:
            return self.table[:, :width].index_select(0, index)
        return torch.index_select(self.table[:, :width], 0, index, out=self._next_staging(len(rows) * width)
                                  .view(len(rows), width))

    def _next_staging(self, numel: int) -> torch.Tensor:
        """[numel] int32 of the buffer whose turn it is."""
        if not self._staging or numel > self._staging[0].numel():
            size = max(numel, 2 * self._staging[0].numel() if self._staging else 4096)
            self._staging = [torch.empty(size, dtype=torch.int32, pin_memory=torch.cuda.is_available())
                             for _ in range(2)]
        self._turn ^= 1
        return self._staging[self._turn][:numel]

    def _widen(self, max_blocks: int) -> None:
        table = self._zeros(self.table.shape[0], max_blocks)
        table[:, : self.max_blocks] = self.table
        self._set_table(table)
        self.max_blocks = max_blocks

    def _grow(self) -> None:
        old = self.table.shape[0]
        table = self._zeros(2 * old, self.max_blocks)
        table[:old] = self.table
        self._set_table(table)
        self.lengths += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
