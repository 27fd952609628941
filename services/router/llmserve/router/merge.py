"""Several async streams as one, tagged with their position (a completions request with a
batch of prompts runs one generation per prompt, side by side)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(i, item) as each stream yields; the first error ends it all. Closing this closes
    every stream (a generation closed early aborts its request)."""
    if len(streams) == 1:  # The common case, without tasks in between.
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item, None))
            await queue.put((i, _END, None))
        except Exception as err:  # Handed to the consumer, which raises it.
            await queue.put((i, None, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is _END:
                left -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
