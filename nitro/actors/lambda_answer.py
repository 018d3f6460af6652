"""What a Lambda answer means for Nitro: the billing fields of its log tail, and the actor's summary.

``billed_ms`` comes from the ``REPORT ... Billed Duration: N ms`` line of the log tail
(``LogType=Tail``) when Lambda returns it, since that is what AWS bills; otherwise it is the
duration measured inside the actor, and failing that the client's round trip. A function error
(``X-Amz-Function-Error``, a ``Task timed out``) or an answer that is not a valid summary becomes
``ActorSummary.failed`` with a one-line reason.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable
from typing import Any

from nitro.actors.events import UNKNOWN_INVOCATION, ActorSummary
from nitro.actors.lambda_http import InvokeResponse

_BILLED_RE = re.compile(r"Billed Duration:\s*(\d+)\s*ms")
_MEMORY_RE = re.compile(r"Memory Size:\s*(\d+)\s*MB")
_INIT_RE = re.compile(r"Init Duration:\s*([\d.]+)\s*ms")
_MAX_USED_RE = re.compile(r"Max Memory Used:\s*(\d+)\s*MB")
UNKNOWN = UNKNOWN_INVOCATION  # the id of an event that names none

Failed = Callable[..., ActorSummary]  # failed(reason, billed_ms=None) -> a failed summary


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


def one_line(text: Any, limit: int = 400) -> str:
    return " ".join(str(text).split())[:limit]


def answer_summary(inv: str, response: InvokeResponse, wall: float, memory_mb: int, failed: Failed) -> ActorSummary:
    """The actor's summary from a 2xx answer, with ``billed_ms`` from the REPORT line."""
    report = parse_report(response.log_result)
    billed = int(report["billed_ms"]) if "billed_ms" in report else None
    body = response.body
    if response.function_error:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"errorMessage": body[:300].decode(errors="replace")}
        etype = doc.get("errorType", response.function_error) if isinstance(doc, dict) else response.function_error
        emsg = doc.get("errorMessage", "") if isinstance(doc, dict) else str(doc)
        kind = "timed out" if "timed out" in str(emsg).lower() or "Timedout" in str(etype) else "function error"
        return failed(f"Lambda {kind} ({etype}): {one_line(emsg)}",
                      billed if billed is not None else math.ceil(wall * 1000))
    try:
        summary = ActorSummary.model_validate(json.loads(body))
    except ValueError as exc:
        return failed(f"Lambda returned an invalid summary: {one_line(exc, 200)}",
                      billed if billed is not None else math.ceil(wall * 1000))
    if summary.invocation_id != inv and inv != UNKNOWN:
        return failed(f"Lambda answered for invocation {summary.invocation_id!r}, expected {inv!r}", billed)
    update: dict[str, Any] = {}
    if billed is not None:
        update["billed_ms"] = billed
    elif summary.billed_ms <= 0:
        update["billed_ms"] = math.ceil(max(summary.duration_s, wall) * 1000)
    if not summary.memory_mb:
        update["memory_mb"] = int(report.get("memory_mb", memory_mb))
    return summary.model_copy(update=update) if update else summary
