"""Calling reward functions, plain or `async def` (TRL's convention for rewards that wait on a server, such as
a judge or a remote verifier).

An asynchronous reward is called like a plain one, once for the whole batch (`prompts`, `completions`, the
example fields), and returns its values when awaited; it may fan its completions out concurrently itself (the
`judge` reward does). `call_all` starts every asynchronous function of a batch at once, on one event loop that
lives for the process in a daemon thread, then runs the plain ones in the calling thread meanwhile, in order,
and returns every function's values in the order given. A function counts as asynchronous when it is a
coroutine function, when its `__call__` is one (a callable object), or when calling it returns an awaitable.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def is_async(fn: Callable) -> bool:
    """Whether `fn` is an `async def` function, or a callable object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for asynchronous rewards, started on first use in a daemon thread."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="grpo-rewards", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def run(awaitable) -> object:
    """Await `awaitable` on the rewards' event loop from any other thread, and return its result (or raise)."""
    return _submit(awaitable).result()


def call(fn: Callable, **kwargs) -> object:
    """`fn(**kwargs)`, awaited on the rewards' event loop when it is asynchronous."""
    out = fn(**kwargs)
    return run(out) if inspect.isawaitable(out) else out


def call_all(fns: Sequence[Callable], kwargs: dict | Sequence[dict]) -> list[tuple[object, BaseException | None]]:
    """Every function's (values, exception) for the keyword arguments `kwargs` (the same for all, or one dict per
    function): the asynchronous ones concurrently on the event loop while the plain ones run here, in order."""
    each = [kwargs] * len(fns) if isinstance(kwargs, dict) else list(kwargs)
    own = [_own(k) for k in each]  # each its own lists: one that edits them in place changes no other's
    started: dict[int, Future] = {i: _submit(_awaited(fn, own[i])) for i, fn in enumerate(fns) if is_async(fn)}
    out: list[tuple[object, BaseException | None]] = []
    for i, fn in enumerate(fns):
        if i in started:
            out.append((None, None))
            continue
        try:
            got = fn(**own[i])
            if inspect.isawaitable(got):  # a plain function that hands back an awaitable
                got = run(got)
            out.append((got, None))
        except Exception as e:  # noqa: BLE001 - the caller says which function and where
            out.append((None, e))
    for i, future in started.items():
        try:
            out[i] = (future.result(), None)
        except Exception as e:  # noqa: BLE001
            out[i] = (None, e)
    return out


def _own(kwargs: dict) -> dict:
    return {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}


async def _awaited(fn: Callable, kwargs: dict):
    return await fn(**kwargs)


def _submit(awaitable) -> Future:
    loop = event_loop()
    if _on_loop(loop):
        raise RuntimeError("a reward was awaited from the rewards' own event loop")
    coro = awaitable if inspect.iscoroutine(awaitable) else _wrap(awaitable)
    return asyncio.run_coroutine_threadsafe(coro, loop)


async def _wrap(awaitable):
    return await awaitable


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
