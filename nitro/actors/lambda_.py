"""The AWS Lambda actor backend: the same interface as ``LocalActorPool``, over boto3.

``LambdaActorBackend(cfg: LambdaConfig, memory_mb, timeout_s)`` gives ``invoke(event) ->
ActorSummary`` (thread-safe, blocking, never raises for a failed actor), ``invoke_many(events)``,
``close()`` and the context-manager protocol.

How it talks to Lambda (see ../shared/NOTES.md, "AWS Lambda"):

* ONE boto3 client, shared by every thread, with an explicit botocore ``Config``:
  ``max_pool_connections`` at least the configured concurrency (so no thread waits for a socket),
  ``read_timeout`` above the function's timeout (a slow actor is reported by Lambda as a timeout,
  never cut off and re-sent by the SDK), and SDK retries OFF (``total_max_attempts=1``): the
  SDK's own retries re-invoke a slow actor, running the handler several times.
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
* ``billed_ms`` comes from the ``REPORT ... Billed Duration: N ms`` line of the log tail
  (``LogType=Tail``) when Lambda returns it; otherwise it is the duration measured inside the
  actor, and failing that the client's round trip.
* ``endpoint_url`` (``cfg.endpoint_url``) points the client at another Invoke API, e.g.
  ``nitro.actors.invoke_server`` in tests and benchmarks.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nitro.actors.events import ActorEvent, ActorSummary
from nitro.config import LambdaConfig

log = logging.getLogger(__name__)

_BILLED_RE = re.compile(r"Billed Duration:\s*(\d+)\s*ms")
_MEMORY_RE = re.compile(r"Memory Size:\s*(\d+)\s*MB")
_INIT_RE = re.compile(r"Init Duration:\s*([\d.]+)\s*ms")
_MAX_USED_RE = re.compile(r"Max Memory Used:\s*(\d+)\s*MB")
_THROTTLE_CODES = {"TooManyRequestsException"}
READ_TIMEOUT_MARGIN_S = 30.0


def parse_report(log_result: str | None) -> dict[str, float]:
    """Fields of the ``REPORT`` line of a base64 ``LogResult`` (tail of the invocation's log).

    Returns any of ``billed_ms``, ``memory_mb``, ``init_ms``, ``max_memory_used_mb``; empty if
    there is no log or no REPORT line.
    """
    if not log_result:
        return {}
    try:
        text = base64.b64decode(log_result).decode("utf-8", errors="replace")
    except (ValueError, TypeError):
        return {}
    report = next((line for line in reversed(text.splitlines()) if line.startswith("REPORT")), None)
    if report is None:
        return {}
    out: dict[str, float] = {}
    for key, rx, cast in (("billed_ms", _BILLED_RE, int), ("memory_mb", _MEMORY_RE, int),
                          ("init_ms", _INIT_RE, float), ("max_memory_used_mb", _MAX_USED_RE, int)):
        m = rx.search(report)
        if m:
            out[key] = cast(m.group(1))
    return out


def _one_line(text: Any, limit: int = 400) -> str:
    return " ".join(str(text).split())[:limit]


def make_lambda_client(cfg: LambdaConfig, timeout_s: float | None = None, max_in_flight: int | None = None):
    """The one boto3 Lambda client a backend shares across its threads."""
    import boto3
    from botocore.config import Config

    pool = max(int(cfg.concurrency), int(max_in_flight or 0), 10)
    read_timeout = float(cfg.function_timeout_s) + READ_TIMEOUT_MARGIN_S
    config = Config(
        region_name=cfg.region,
        max_pool_connections=pool,
        connect_timeout=5,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": 1},  # throttles are retried by us
        tcp_keepalive=True,
        # Our parameters are built here with fixed types; skipping botocore's shape validation
        # cuts the client's CPU per invoke by about a third, which is what bounds a large fan-out.
        parameter_validation=False,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="nitro-actor-backend",
    )
    session = boto3.session.Session()
    return session.client("lambda", endpoint_url=cfg.endpoint_url, config=config)


class LambdaActorBackend:
    """Invoke actors as Lambda functions. Thread-safe; one instance per training run."""

    def __init__(
        self,
        cfg: LambdaConfig | None = None,
        memory_mb: int = 1024,
        timeout_s: float | None = None,
        *,
        client: Any = None,
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
        self.throttle_base_s = float(throttle_base_s)
        self.throttle_cap_s = float(throttle_cap_s)
        self.client = client if client is not None else make_lambda_client(self.cfg, self.timeout_s, max_in_flight)
        self._sem = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self._done: OrderedDict[str, ActorSummary] = OrderedDict()  # succeeded ids -> summary
        self._inflight: dict[str, Future] = {}
        self._remember = int(remember)
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._rng = random.Random()
        self.stats = {"invocations": 0, "throttled": 0, "failures": 0, "duplicates": 0, "function_errors": 0}

    # -- one invocation ----------------------------------------------------------------------

    def invoke(self, event: ActorEvent | dict[str, Any]) -> ActorSummary:
        """Invoke the function once for ``event`` (a duplicate id is answered without invoking)."""
        if isinstance(event, ActorEvent):
            payload = event.model_dump_json().encode()
            inv = event.invocation_id
        else:
            try:
                payload = json.dumps(event).encode()
            except (TypeError, ValueError) as exc:
                inv = str(event.get("invocation_id") or "unknown") if isinstance(event, dict) else "unknown"
                return ActorSummary.failed(inv, f"event is not JSON-serialisable: {exc}", memory_mb=self.memory_mb)
            raw = event.get("invocation_id") if isinstance(event, dict) else None
            inv = raw if isinstance(raw, str) and raw else "unknown"
        if self._closed:
            return ActorSummary.failed(inv, "the Lambda backend is closed", memory_mb=self.memory_mb)

        mine: Future | None = None
        with self._lock:
            if inv != "unknown":
                if inv in self._done:
                    self.stats["duplicates"] += 1
                    return self._done[inv]
                shared = self._inflight.get(inv)
                if shared is None:
                    mine = Future()
                    self._inflight[inv] = mine
            else:
                shared = None
        if shared is not None:
            with self._lock:
                self.stats["duplicates"] += 1
            summary = shared.result()
            return summary
        try:
            summary = self._invoke_once(inv, payload)
        except BaseException as exc:  # never leave a waiter hanging
            summary = ActorSummary.failed(inv, f"invoker error: {type(exc).__name__}: {exc}", memory_mb=self.memory_mb)
        with self._lock:
            if summary.ok and inv != "unknown":
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

    def _invoke_once(self, inv: str, payload: bytes) -> ActorSummary:
        from botocore.exceptions import BotoCoreError, ClientError

        kwargs: dict[str, Any] = dict(FunctionName=self.cfg.function_name, InvocationType="RequestResponse",
                                      LogType="Tail", Payload=payload)
        if self.cfg.qualifier:
            kwargs["Qualifier"] = self.cfg.qualifier
        start = time.perf_counter()
        deadline = start + self.timeout_s
        attempt = 0

        def failed(reason: str, billed_ms: int | None = None) -> ActorSummary:
            wall = time.perf_counter() - start
            return ActorSummary.failed(inv, reason, duration_s=wall,
                                       billed_ms=billed_ms if billed_ms is not None else 0, memory_mb=self.memory_mb)

        while True:
            with self._sem:
                call_start = time.perf_counter()
                try:
                    response = self.client.invoke(**kwargs)
                    body = response["Payload"].read()
                except ClientError as exc:
                    err = exc.response.get("Error", {})
                    code = err.get("Code") or "ClientError"
                    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                    message = _one_line(err.get("Message") or exc)
                    response = None
                except BotoCoreError as exc:  # no answer: connection refused/reset, read timeout
                    return failed(f"no response from Lambda ({type(exc).__name__}): {_one_line(exc)}")
            if response is None:
                if code in _THROTTLE_CODES or status == 429:
                    with self._lock:
                        self.stats["throttled"] += 1
                    if attempt < self.cfg.max_throttle_retries:
                        delay = self._backoff(attempt)
                        if time.perf_counter() + delay < deadline:
                            attempt += 1
                            time.sleep(delay)
                            continue
                    return failed(f"throttled by Lambda ({code}: {message}) after {attempt + 1} attempts")
                if code == "RequestEntityTooLargeException" or status == 413:
                    return failed(f"payload too large for a synchronous invoke ({len(payload)} bytes; limit 6 MB): {message}")
                return failed(f"Lambda rejected the invocation ({code}, HTTP {status}): {message}")
            break

        with self._lock:
            self.stats["invocations"] += 1
        wall = time.perf_counter() - call_start
        report = parse_report(response.get("LogResult"))
        billed = int(report["billed_ms"]) if "billed_ms" in report else None
        fn_error = response.get("FunctionError")
        if fn_error:
            with self._lock:
                self.stats["function_errors"] += 1
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {"errorMessage": body[:300].decode(errors="replace")}
            etype = doc.get("errorType", fn_error) if isinstance(doc, dict) else fn_error
            emsg = doc.get("errorMessage", "") if isinstance(doc, dict) else str(doc)
            kind = "timed out" if "timed out" in str(emsg).lower() or "Timedout" in str(etype) else "function error"
            return failed(f"Lambda {kind} ({etype}): {_one_line(emsg)}",
                          billed if billed is not None else math.ceil(wall * 1000))
        try:
            summary = ActorSummary.model_validate(json.loads(body))
        except ValueError as exc:
            return failed(f"Lambda returned an invalid summary: {_one_line(exc, 200)}",
                          billed if billed is not None else math.ceil(wall * 1000))
        if summary.invocation_id != inv and inv != "unknown":
            return failed(f"Lambda answered for invocation {summary.invocation_id!r}, expected {inv!r}", billed)
        update: dict[str, Any] = {}
        if billed is not None:
            update["billed_ms"] = billed
        elif summary.billed_ms <= 0:
            update["billed_ms"] = math.ceil(max(summary.duration_s, wall) * 1000)
        if not summary.memory_mb:
            update["memory_mb"] = int(report.get("memory_mb", self.memory_mb))
        return summary.model_copy(update=update) if update else summary

    # -- many ---------------------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="nitro-lambda")
            return self._executor

    def invoke_many(self, events: Iterable[ActorEvent | dict[str, Any]]) -> list[ActorSummary]:
        """Invoke all ``events`` concurrently; one summary per distinct invocation id, in order."""
        unique: OrderedDict[str, ActorEvent | dict[str, Any]] = OrderedDict()
        anonymous: list[ActorEvent | dict[str, Any]] = []
        for ev in events:
            inv = ev.invocation_id if isinstance(ev, ActorEvent) else (ev.get("invocation_id") if isinstance(ev, dict) else None)
            if not isinstance(inv, str) or not inv:
                anonymous.append(ev)
            elif inv in unique:
                with self._lock:
                    self.stats["duplicates"] += 1
            else:
                unique[inv] = ev
        todo = list(unique.values()) + anonymous
        if not todo:
            return []
        pool = self._pool()
        futures = [pool.submit(self.invoke, ev) for ev in todo]
        return [f.result() for f in futures]

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the invoker threads and close the client's connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        try:
            self.client.close()
        except Exception:
            pass

    def __enter__(self) -> "LambdaActorBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LambdaActorBackend(function={self.cfg.function_name!r}, qualifier={self.cfg.qualifier!r}, "
                f"concurrency={self.concurrency}, endpoint_url={self.cfg.endpoint_url!r})")
