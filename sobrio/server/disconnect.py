"""Awaiting work while watching for the client to hang up, shared by every non-streamed route.

The disconnect is ASGI's `http.disconnect`, awaited as it comes (no polling), so an abort reaches the
engine before its next step. (Polling `request.is_disconnected()` under Starlette's BaseHTTPMiddleware
never saw it: that middleware's receive wrapper loses the message in a cancelled scope.)
"""

import asyncio

from fastapi import Request


async def unless_disconnected(work, request: Request):
    """The result of `work`, or None if the client hangs up first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
