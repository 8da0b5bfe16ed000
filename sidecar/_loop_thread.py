"""A private event loop on a daemon thread, for sync callers of async work (the rollout hook's
fleet), and a hook run when the main thread ends. Closing cancels what still runs and lets it
unwind, as ``asyncio.run`` does."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from sidecar.errors import FleetClosed

T = TypeVar("T")


UNWIND_S = 5.0  # how long the tasks a close cancels get to unwind (one that will not is left)


async def _cancel_the_rest(wait_s: float) -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)


class LoopThread:
    """A private event loop on a daemon thread: lets sync callers (a plain trainer loop, or a
    thread that already runs its own loop) drive the async fleet without touching their loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._pending: set[concurrent.futures.Future[Any]] = set()  # calls submitted and not answered yet
        self.thread = threading.Thread(target=self._main, name="omni-sidecar-rollout", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("RolloutProfiler's own loop cannot wait on itself; use `async with prof.astep(n)`")
        return self._submit_open(coro).result()

    def _submit_open(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self.loop.is_closed() or not self.thread.is_alive():
            coro.close()
            raise FleetClosed("this RolloutProfiler is closed (prof.close() ran): nothing more is sent; "
                              "its closing sweep stopped what its windows had started")
        return self.submit(coro)

    @property
    def here(self) -> bool:
        """True on the loop's own thread (an ``on_result`` callback): it cannot block on itself."""
        return threading.current_thread() is self.thread

    async def arun(self, coro: Coroutine[Any, Any, T], *, shield: bool = False) -> T:
        fut = asyncio.wrap_future(self._submit_open(coro))
        # A cancelled caller must not cancel a stop: the profiler would be left running.
        return await (asyncio.shield(fut) if shield else fut)

    def close(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        if self.thread.is_alive() and not self.here:
            # What still runs (a fleet close that was given up on, a stop the server holds) is
            # cancelled and let unwind, as asyncio.run does: its connections are closed, not
            # destroyed pending with the loop. A stop already sent is not undone by it.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(UNWIND_S), self.loop).result(UNWIND_S + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()
        # A call still waited on (a block's stop, sent as close() began on another thread) is never
        # answered once the loop is stopped: said to its caller instead of leaving it waiting forever.
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(FleetClosed("this RolloutProfiler was closed (prof.close()) while this call "
                                              "waited; its closing sweep stopped what its windows had started"))


def at_exit(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` when the main thread ends, before the interpreter shuts down its thread pools
    (``threading._register_atexit``: a check still running then needs ``asyncio.to_thread``,
    which an ``atexit`` handler is too late for). Falls back to ``atexit``.

    Those hooks run newest first, and each thread / process pool module registers its own
    shutdown hook when it is first imported. Both are imported here, before ``fn`` is registered,
    so ``fn`` runs while the pools still take work, whatever the import order elsewhere (the
    packages' exports are lazy: the pools may otherwise be imported after this call)."""
    import concurrent.futures.process  # noqa: F401
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(fn, *args)
        return
    try:
        register(fn, *args)
    except RuntimeError:  # already shutting down
        atexit.register(fn, *args)


__all__ = ["UNWIND_S", "LoopThread", "at_exit"]
