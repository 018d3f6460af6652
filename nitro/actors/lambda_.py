"""The AWS Lambda actor backend: the same interface as ``LocalActorPool``, over one event loop.

Why an event loop: a round boosted to 1000 actors must leave the client at once. With one boto3
call per thread, each invoke costs 1 to 2.5 ms of Python CPU (botocore's pipeline, plus a thousand
threads contending for one GIL), so the 1000th request leaves about 2.5 s after the first
(bench/fanout.py). Here every invocation is a coroutine on ONE loop in a background thread, and the
request goes through a transport (nitro/actors/lambda_http.py): by default aiohttp with botocore's
SigV4 signer, about 0.2 ms per request; ``cfg.invoker = "boto3"`` runs the SDK's ``invoke`` in a
thread pool instead.

How it talks to Lambda (docs/decisions.md, "AWS Lambda"):

* One HTTP connection pool shared by every call, as large as the concurrency; a read timeout above
  the function's timeout (a slow actor is reported by Lambda as a timeout, never cut off and
  re-sent); no SDK retries.
* Throttles (HTTP 429 ``TooManyRequestsException``: reserved or account concurrency exhausted)
  are retried here with full-jitter exponential backoff, at most ``max_throttle_retries`` times
  and never past ``timeout_s`` from the first attempt. A throttled request was never executed, so
  retrying it is safe. Nothing else is retried: after a read timeout or a reset the function may
  have run, and the round goes on with what arrived.
* A semaphore bounds the requests in flight at ``cfg.concurrency``; it is released while a
  throttled call backs off.
* Function errors (``X-Amz-Function-Error``), Lambda timeouts (``Task timed out``), oversize
  payloads (413 ``RequestEntityTooLargeException``), unknown functions and transport failures all
  come back as ``ActorSummary.failed`` with a one-line reason.
* Duplicates: an invocation id that already succeeded is answered from memory without invoking
  again, and concurrent calls for an id in flight share one invocation, so a summary is never
  counted twice (the cache's SET NX keeps the stored batch unique on the Redis side).
  ``invoke_many`` returns one summary per *distinct* invocation id, in first-seen order.
* ``launch(events)`` starts a round's invocations at once and returns when every request has left
  the client (or waits for a slot); the round's mapped Prefect tasks then ``invoke`` the same ids
  and receive those invocations' summaries. So the fan-out never waits for Prefect to start a
  thousand task runs one by one, and each actor still has its task run.
* ``billed_ms`` and the summary of an answer: nitro/actors/lambda_answer.py.
* ``endpoint_url`` (``cfg.endpoint_url``) points the client at another Invoke API, e.g.
  ``tests/support/lambda_invoke_server.py`` in tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterable
from concurrent.futures import CancelledError as FutureCancelledError
from dataclasses import dataclass
from typing import Any, TypeVar

from nitro.actors.events import ActorEvent, ActorSummary, event_payload
from nitro.actors.lambda_answer import UNKNOWN, answer_summary, one_line, parse_report
from nitro.actors.lambda_http import TRANSPORTS, Transport, TransportError
from nitro.config import LambdaConfig

__all__ = ["LAUNCH_WAIT_S", "InvocationTiming", "LambdaActorBackend", "parse_report"]

log = logging.getLogger(__name__)

_THROTTLE_CODES = {"TooManyRequestsException"}
LAUNCH_WAIT_S = 30.0
T = TypeVar("T")


@dataclass
class InvocationTiming:
    """When one invocation started, when its (last) request left the client, when it was answered
    (``time.monotonic()`` seconds, comparable across processes on one machine)."""

    started: float
    sent: float | None = None
    answered: float | None = None


class LambdaActorBackend:
    """Invoke actors as Lambda functions. Thread-safe; one instance per training run."""

    def __init__(
        self,
        cfg: LambdaConfig | None = None,
        memory_mb: int = 1024,
        timeout_s: float | None = None,
        *,
        invoker: str | None = None,
        throttle_base_s: float = 0.1,
        throttle_cap_s: float = 5.0,
        max_in_flight: int | None = None,
        remember: int = 100_000,
    ):
        self.cfg = cfg if cfg is not None else LambdaConfig()
        self.memory_mb = int(memory_mb)
        # The client-side deadline for one invocation *including throttle back-off*. A running
        # function is never cut off: the read timeout is above the function's own timeout.
        self.timeout_s = float(timeout_s) if timeout_s is not None else float(self.cfg.function_timeout_s)
        self.concurrency = int(self.cfg.concurrency)
        self.invoker = invoker or self.cfg.invoker
        if self.invoker not in TRANSPORTS:
            raise ValueError(f"unknown Lambda invoker {self.invoker!r}; one of {sorted(TRANSPORTS)}")
        self.throttle_base_s = float(throttle_base_s)
        self.throttle_cap_s = float(throttle_cap_s)
        self._remember = int(remember)
        self._rng = random.Random()
        self.stats = {"invocations": 0, "throttled": 0, "failures": 0, "duplicates": 0, "function_errors": 0}
        # Everything below is touched on the loop thread only.
        self._done: OrderedDict[str, ActorSummary] = OrderedDict()  # succeeded ids -> summary
        self._inflight: dict[str, asyncio.Future] = {}
        self._launched: OrderedDict[str, asyncio.Future] = OrderedDict()  # launched, not yet claimed
        self._left: dict[str, asyncio.Event] = {}  # set once the invocation's request left the client
        self.timings: OrderedDict[str, InvocationTiming] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._sem = asyncio.Semaphore(self.concurrency)
        self._closed = False
        self._closing = threading.Lock()  # a call is either submitted before close() or refused
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nitro-lambda-loop", daemon=True)
        self._thread.start()
        pool = max(self.concurrency, int(max_in_flight or 0), 10)
        try:
            opening: Coroutine[Any, Any, Transport] = TRANSPORTS[self.invoker].create(
                self.cfg, pool_size=pool, on_sent=self._on_sent)
            self.transport = self._call(opening)
        except BaseException:
            self._stop_loop()
            raise

    # -- the loop ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the backend's loop and wait for it (from any other thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LambdaActorBackend's blocking API was called from its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _call_unless_closed(self, coro: Coroutine[Any, Any, T], closed: T) -> T:
        """``_call``, or ``closed`` when the backend is (or gets) closed before ``coro`` finishes."""
        with self._closing:
            if self._closed:
                coro.close()
                return closed
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except (asyncio.CancelledError, FutureCancelledError):
            return closed

    def _on_sent(self, inv: str) -> None:
        """The transport wrote ``inv``'s request (called on the loop; from a pool thread for boto3)."""
        if threading.current_thread() is not self._thread:
            self._loop.call_soon_threadsafe(self._on_sent, inv)
            return
        timing = self.timings.get(inv)
        if timing is not None:
            timing.sent = time.monotonic()
        self._mark_left(inv)

    def _mark_left(self, inv: str) -> None:
        left = self._left.pop(inv, None)
        if left is not None:
            left.set()

    # -- one invocation ----------------------------------------------------------------------

    def _payload(self, event: ActorEvent | dict[str, Any]) -> tuple[str, bytes | ActorSummary]:
        return event_payload(event, self.memory_mb)

    def invoke(self, event: ActorEvent | dict[str, Any]) -> ActorSummary:
        """Invoke the function once for ``event`` (a duplicate id is answered without invoking;
        a launched id gets its launched invocation's summary)."""
        inv, payload = self._payload(event)
        if isinstance(payload, ActorSummary):
            return payload
        return self._call_unless_closed(self._claim(inv, payload), self._closed_summary(inv))

    def _closed_summary(self, inv: str) -> ActorSummary:
        return ActorSummary.failed(inv, "the Lambda backend is closed", memory_mb=self.memory_mb)

    async def _claim(self, inv: str, payload: bytes) -> ActorSummary:
        launched = self._launched.pop(inv, None)
        if launched is not None:
            return await asyncio.shield(launched)
        return await self._shared(inv, payload)

    async def _shared(self, inv: str, payload: bytes) -> ActorSummary:
        """One invocation per id: a succeeded id is answered from memory, an id in flight is
        joined, anything else is invoked."""
        mine: asyncio.Future | None = None
        if inv != UNKNOWN:
            if inv in self._done:
                self.stats["duplicates"] += 1
                return self._done[inv]
            shared = self._inflight.get(inv)
            if shared is not None:
                self.stats["duplicates"] += 1
                return await asyncio.shield(shared)
            mine = self._inflight[inv] = self._loop.create_future()
        try:
            summary = await self._invoke_once(inv, payload)
        except BaseException as exc:  # cancelled at close, or a bug: never leave a waiter hanging
            reason = "the Lambda backend was closed" if isinstance(exc, asyncio.CancelledError) else \
                f"invoker error: {type(exc).__name__}: {exc}"
            summary = ActorSummary.failed(inv, reason, memory_mb=self.memory_mb)
        self._mark_left(inv)
        if summary.ok and inv != UNKNOWN:
            self._done[inv] = summary
            while len(self._done) > self._remember:
                self._done.popitem(last=False)
        if not summary.ok:
            self.stats["failures"] += 1
        self._inflight.pop(inv, None)
        if mine is not None:
            mine.set_result(summary)
        return summary

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
        return self._rng.uniform(0.0, min(self.throttle_cap_s, self.throttle_base_s * (2 ** attempt)))

    async def _invoke_once(self, inv: str, payload: bytes) -> ActorSummary:
        start = time.monotonic()
        deadline = start + self.timeout_s
        timing = self.timings[inv] = InvocationTiming(started=start)
        while len(self.timings) > self._remember:
            self.timings.popitem(last=False)
        attempt = 0

        def failed(reason: str, billed_ms: int | None = None) -> ActorSummary:
            return ActorSummary.failed(inv, reason, duration_s=time.monotonic() - start,
                                       billed_ms=billed_ms if billed_ms is not None else 0, memory_mb=self.memory_mb)

        while True:
            if self._sem.locked():
                self._mark_left(inv)  # queued behind the semaphore: launch() need not wait for it
            async with self._sem:
                call_start = time.monotonic()
                try:
                    response = await self.transport.send(payload, inv)
                except TransportError as exc:  # no answer: refused, reset, read timeout
                    return failed(f"no response from Lambda ({exc.kind}): {one_line(exc.message)}")
            timing.answered = time.monotonic()
            if response.ok:
                break
            code, status, message = response.error_code, response.status, one_line(response.error_message)
            if code in _THROTTLE_CODES or status == 429:
                self.stats["throttled"] += 1
                if attempt < self.cfg.max_throttle_retries:
                    delay = self._backoff(attempt)
                    if time.monotonic() + delay < deadline:
                        attempt += 1
                        self._mark_left(inv)
                        await asyncio.sleep(delay)
                        continue
                return failed(f"throttled by Lambda ({code}: {message}) after {attempt + 1} attempts")
            if code == "RequestEntityTooLargeException" or status == 413:
                return failed(f"payload too large for a synchronous invoke ({len(payload)} bytes; limit 6 MB): "
                              f"{message}")
            return failed(f"Lambda rejected the invocation ({code}, HTTP {status}): {message}")
        self.stats["invocations"] += 1
        if response.function_error:
            self.stats["function_errors"] += 1
        return answer_summary(inv, response, time.monotonic() - call_start, self.memory_mb, failed)

    # -- many ---------------------------------------------------------------------------------

    def _distinct(self, events: Iterable[ActorEvent | dict[str, Any]]
                  ) -> tuple[list[tuple[str, bytes]], list[ActorSummary], int]:
        """(id, payload) of the distinct events in first-seen order, the summaries of events that
        cannot be sent at all, and how many repeats were dropped. Events without an id are all kept."""
        seen: set[str] = set()
        todo: list[tuple[str, bytes]] = []
        unsendable: list[ActorSummary] = []
        repeats = 0
        for ev in events:
            inv, payload = self._payload(ev)
            if isinstance(payload, ActorSummary):
                unsendable.append(payload)
            elif inv == UNKNOWN or inv not in seen:
                seen.add(inv)
                todo.append((inv, payload))
            else:
                repeats += 1
        return todo, unsendable, repeats

    def invoke_many(self, events: Iterable[ActorEvent | dict[str, Any]]) -> list[ActorSummary]:
        """Invoke all ``events`` at once; one summary per distinct invocation id, in order."""
        todo, unsendable, repeats = self._distinct(events)

        async def all_of() -> list[ActorSummary]:
            self.stats["duplicates"] += repeats
            return list(await asyncio.gather(*(self._claim(inv, payload) for inv, payload in todo)))

        closed = [self._closed_summary(inv) for inv, _ in todo]
        return (self._call_unless_closed(all_of(), closed) if todo else []) + unsendable

    def launch(self, events: Iterable[ActorEvent | dict[str, Any]], wait_s: float = LAUNCH_WAIT_S) -> int:
        """Start ``events``' invocations now, without waiting for their answers; return once each
        request has left the client (or waits for a free slot), at most ``wait_s``. ``invoke`` on a
        launched id returns that invocation's summary. Returns how many were started."""
        todo, _unsendable, repeats = self._distinct(events)  # unsendable ones fail again, in their invoke
        todo = [(inv, payload) for inv, payload in todo if inv != UNKNOWN]
        if not todo:
            return 0

        async def start() -> list[asyncio.Event]:
            self.stats["duplicates"] += repeats
            lefts = []
            for inv, payload in todo:
                if inv in self._launched or inv in self._inflight or inv in self._done:
                    continue
                lefts.append(self._left.setdefault(inv, asyncio.Event()))
                task = self._loop.create_task(self._shared(inv, payload))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                self._launched[inv] = self._loop.create_future()
                task.add_done_callback(self._forward(self._launched[inv], self._closed_summary(inv)))
            while len(self._launched) > self._remember:
                self._launched.popitem(last=False)
            return lefts

        async def started() -> int:
            lefts = await start()
            if lefts:
                await asyncio.wait([asyncio.ensure_future(left.wait()) for left in lefts], timeout=wait_s)
            return len(lefts)

        return self._call_unless_closed(started(), 0)

    @staticmethod
    def _forward(target: asyncio.Future, if_cancelled: ActorSummary):
        """Copy a launched task's summary to the future its claimer awaits."""
        def done(task: asyncio.Task) -> None:
            if not target.done():
                target.set_result(if_cancelled if task.cancelled() else task.result())
        return done

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what is in flight (its waiters get failed summaries), close the connections and
        stop the loop. Idempotent. A function already running on Lambda still finishes there."""
        with self._closing:
            if self._closed:
                return
            self._closed = True

        async def shutdown() -> None:
            for task in list(self._tasks):
                task.cancel()
            pending = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
            await self.transport.aclose()

        try:
            self._call(shutdown(), timeout=30)
        except Exception:
            log.debug("closing the Lambda backend", exc_info=True)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> LambdaActorBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LambdaActorBackend(function={self.cfg.function_name!r}, qualifier={self.cfg.qualifier!r}, "
                f"invoker={self.invoker!r}, concurrency={self.concurrency}, endpoint_url={self.cfg.endpoint_url!r})")
