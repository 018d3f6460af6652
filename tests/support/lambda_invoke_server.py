"""A local implementation of AWS Lambda's synchronous Invoke API that runs the real handler.

There is no AWS Lambda emulator on PyPI and moto does not execute handlers without Docker, so the
Lambda backend's real boto3 code path is tested against this server (``endpoint_url``)::

    POST /2015-03-31/functions/{FunctionName}/invocations[?Qualifier=...]
         X-Amz-Invocation-Type: RequestResponse | DryRun     X-Amz-Log-Type: None | Tail

What it reproduces of the service (so that the client-side behaviour can be tested):

* the handler (``actor_lambda.handler.handler`` by default) runs in *worker processes*, one
  execution environment per process (``threads_per_worker=1``): a cold start imports the handler
  (INIT), warm invocations reuse the process and its module-level state;
* reserved concurrency: more requests in flight than ``concurrency`` get ``429
  TooManyRequestsException`` with Lambda's JSON body (no queueing, like the service);
* ``413 RequestEntityTooLargeException`` for a request payload over 6 MB; a response over 6 MB is
  a ``Function.ResponseSizeTooLarge`` function error; a body that is not JSON is ``400
  InvalidRequestContentException``; an unknown function or qualifier is ``404``;
* function errors: ``200`` with ``X-Amz-Function-Error: Unhandled`` and the runtime's error
  document (``errorMessage``, ``errorType``, ``requestId``, ``stackTrace``); an import failure is
  ``Runtime.ImportModuleError``; a worker that dies is ``Runtime.ExitError``;
* timeouts: after ``timeout_s`` the caller gets ``{"errorType": "Sandbox.Timedout",
  "errorMessage": "RequestId: ... Error: Task timed out after N.00 seconds"}`` with Function-Error
  ``Unhandled``, and the execution environment (the worker process) is destroyed;
* ``X-Amz-Executed-Version``, ``x-amzn-RequestId`` and, for ``LogType=Tail``, ``X-Amz-Log-Result``:
  the base64 of the log tail with the ``REPORT RequestId: ... Duration: ... Billed Duration: N ms``
  line (billed = duration rounded up to the ms, plus the INIT duration on a cold start, as Lambda
  bills container-image functions).

For the fan-out benchmark a function can run with ``threads_per_worker > 1``: then many execution
environments share a worker process as threads (the handler's simulated duration is a sleep), so
a thousand concurrent invocations need a handful of processes on a 2-core machine. The HTTP side
is a single asyncio (aiohttp) loop.

* SigV4, when the server is given credentials (``InvokeServer(..., credentials=(key id, secret))``):
  a request must carry an ``Authorization`` header whose signature, recomputed from the request as
  received (method, path, query, the signed headers, the body's SHA-256) with botocore's own
  signer, matches; otherwise ``403 InvalidSignatureException`` (or
  ``MissingAuthenticationTokenException`` without one, ``UnrecognizedClientException`` for another
  key id, "Signature expired" past 15 minutes of skew), as the service answers. Without credentials,
  any signature is accepted.

Not reproduced: asynchronous (``Event``) invocation, the 15-minute ceiling of real environments,
memory limits and CPU scaling with memory.

Run standalone: ``python -m tests.support.lambda_invoke_server --port 9001 --function nitro-actor``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import calendar
import hmac
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("nitro.invoke_server")

MAX_REQUEST_BYTES = 6 * 1024 * 1024  # 6,291,456: synchronous invoke request payload limit
MAX_RESPONSE_BYTES = 6 * 1024 * 1024
ACCOUNT_ID = "123456789012"
_INVOKE_PREFIX = "/2015-03-31/functions/"


@dataclass
class FunctionSpec:
    """One function the server serves, as the Lambda service would know it."""

    name: str
    handler: str = "actor_lambda.handler.handler"
    memory_mb: int = 1024
    timeout_s: float = 300.0
    concurrency: int = 2  # reserved concurrency: execution environments in flight at once
    environment: dict[str, str] = field(default_factory=dict)
    threads_per_worker: int = 1  # >1: environments are threads (simulate mode / fan-out bench)
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> version
    region: str = "us-east-1"

    @property
    def arn(self) -> str:
        return f"arn:aws:lambda:{self.region}:{ACCOUNT_ID}:function:{self.name}"


# ------------------------------------------------------------------------------------------------
# The worker process (one or more execution environments)
# ------------------------------------------------------------------------------------------------


class _Context:
    """The subset of Lambda's context object that handlers use."""

    def __init__(self, spec: dict[str, Any], request_id: str, deadline: float, qualifier: str | None):
        self.aws_request_id = request_id
        self.function_name = spec["name"]
        self.function_version = spec.get("version", "$LATEST")
        self.memory_limit_in_mb = str(spec["memory_mb"])
        arn = f"arn:aws:lambda:{spec['region']}:{ACCOUNT_ID}:function:{spec['name']}"
        self.invoked_function_arn = f"{arn}:{qualifier}" if qualifier else arn
        self.log_group_name = f"/aws/lambda/{spec['name']}"
        self.log_stream_name = f"local/{os.getpid()}"
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.time()) * 1000))


def _error_doc(exc: BaseException, request_id: str, error_type: str | None = None) -> dict[str, Any]:
    tb = traceback.extract_tb(exc.__traceback__)
    return {
        "errorMessage": str(exc),
        "errorType": error_type or type(exc).__name__,
        "requestId": request_id,
        "stackTrace": [f'  File "{f.filename}" Line {f.lineno}, in {f.name}\n    {f.line or ""}\n' for f in tb],
    }


def _max_rss_mb() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    except Exception:
        return 0


def _worker_main(conn, spec: dict[str, Any]) -> None:  # runs in the child process
    """INIT (import the handler), then serve invocations from the pipe until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us; Ctrl-C must not race it
    os.environ.update(spec.get("environment") or {})
    os.environ.setdefault("MUJOCO_GL", "disable")
    os.environ["AWS_LAMBDA_FUNCTION_NAME"] = spec["name"]
    os.environ["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"] = str(spec["memory_mb"])
    os.environ["AWS_LAMBDA_FUNCTION_VERSION"] = "$LATEST"
    os.environ.setdefault("AWS_REGION", spec["region"])
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except (OSError, EOFError):
                pass

    t0 = time.perf_counter()
    handler = None
    init_error: dict[str, Any] | None = None
    module_name, _, func_name = spec["handler"].rpartition(".")
    try:
        import importlib

        module = importlib.import_module(module_name)
        handler = getattr(module, func_name)
    except Exception as exc:  # what the runtime reports when the handler cannot be loaded
        kind = "Runtime.HandlerNotFound" if isinstance(exc, AttributeError) else "Runtime.ImportModuleError"
        init_error = _error_doc(exc, "", kind)
        init_error["errorMessage"] = (
            f"Unable to import module '{module_name}': {exc}"
            if kind.endswith("ImportModuleError")
            else f"Handler '{func_name}' missing on module '{module_name}'"
        )
        init_error.pop("stackTrace", None)
    init_ms = (time.perf_counter() - t0) * 1000.0
    send(("ready", init_ms))
    first = [True]
    first_lock = threading.Lock()

    def run_one(req_id: int, payload: bytes, timeout_s: float, request_id: str, qualifier: str | None) -> None:
        with first_lock:
            cold, first[0] = first[0], False
        start = time.perf_counter()
        func_error = False
        if init_error is not None:
            doc = dict(init_error, requestId=request_id)
            body, func_error = json.dumps(doc).encode(), True
        else:
            ctx = _Context(spec, request_id, time.time() + timeout_s, qualifier)
            try:
                event = json.loads(payload) if payload else {}
                result = handler(event, ctx)
                try:
                    body = json.dumps(result).encode()
                except (TypeError, ValueError) as exc:
                    body = json.dumps(_error_doc(exc, request_id, "Runtime.MarshalError") | {
                        "errorMessage": f"Unable to marshal response: {exc}"}).encode()
                    func_error = True
            except Exception as exc:
                body, func_error = json.dumps(_error_doc(exc, request_id)).encode(), True
            if not func_error and len(body) > MAX_RESPONSE_BYTES:
                body = json.dumps(
                    {
                        "errorMessage": f"Response payload size ({len(body)} bytes) exceeded maximum allowed "
                        f"payload size ({MAX_RESPONSE_BYTES} bytes).",
                        "errorType": "Function.ResponseSizeTooLarge",
                    }
                ).encode()
                func_error = True
        duration_ms = (time.perf_counter() - start) * 1000.0
        send(("result", req_id, func_error, body, duration_ms, init_ms if cold else None, _max_rss_mb()))

    slots = max(1, int(spec.get("threads_per_worker", 1)))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=slots, thread_name_prefix="lambda-env") as pool:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "invoke":
                _, req_id, payload, timeout_s, request_id, qualifier = msg
                pool.submit(run_one, req_id, payload, timeout_s, request_id, qualifier)
            elif msg[0] == "stop":
                break
    os._exit(0)  # do not wait on stray handler threads (a timed-out simulated sleep)


# ------------------------------------------------------------------------------------------------
# The server side
# ------------------------------------------------------------------------------------------------


@dataclass
class _Result:
    func_error: bool
    body: bytes
    duration_ms: float
    init_ms: float | None
    max_rss_mb: int


class _Worker:
    """A worker process and the invocations it has in flight."""

    _ids = itertools.count(1)

    def __init__(self, pool: _FunctionPool):
        self.pool = pool
        self.id = next(self._ids)
        ctx = _mp_context()
        self.conn, child = ctx.Pipe(duplex=True)
        spec = dict(pool.spec.__dict__)
        self.process = ctx.Process(
            target=_worker_main, args=(child, spec), daemon=True, name=f"lambda-{pool.spec.name}-{self.id}"
        )
        self.process.start()
        child.close()
        self.in_flight: dict[int, asyncio.Future] = {}
        self.dead = False
        self.ready = asyncio.get_running_loop().create_future()
        self._reader = threading.Thread(target=self._read_loop, args=(asyncio.get_running_loop(),), daemon=True)
        self._reader.start()

    def _read_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                loop.call_soon_threadsafe(self._on_message, msg)
            loop.call_soon_threadsafe(self._on_exit)
        except RuntimeError:  # the server's loop has closed (it stopped first): nobody is left to tell
            pass

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "ready":
            if not self.ready.done():
                self.ready.set_result(msg[1])
            return
        _, req_id, func_error, body, duration_ms, init_ms, rss = msg
        fut = self.in_flight.pop(req_id, None)
        self.pool.release(self)
        if fut is not None and not fut.done():
            fut.set_result(_Result(func_error, body, duration_ms, init_ms, rss))

    def _on_exit(self) -> None:
        self.dead = True
        self.process.join(0.5)  # so that exitcode is known
        if not self.ready.done():
            self.ready.set_result(None)
        code = self.process.exitcode
        for fut in list(self.in_flight.values()):
            if not fut.done():
                fut.set_exception(_WorkerDied(code))
            self.pool.release(self)
        self.in_flight.clear()
        self.pool.forget(self)

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)

    def kill(self) -> None:
        self.dead = True
        try:
            self.process.kill()
        except Exception:
            pass
        self.pool.forget(self)

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except Exception:
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=2)
        try:
            self.conn.close()
        except Exception:
            pass


_PRELOAD: list[str] = []


def _mp_context():
    """``forkserver`` with the handler modules preloaded: an execution environment's process is
    forked from a server that imported torch/gymnasium once, so a cold start costs milliseconds
    here instead of seconds (the handler is still imported - INIT - in every worker). ``spawn``
    when nothing is preloaded."""
    if not _PRELOAD:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


class _WorkerDied(RuntimeError):
    def __init__(self, exitcode: int | None):
        super().__init__(exitcode)
        self.exitcode = exitcode


class _FunctionPool:
    """Execution environments of one function: workers x threads_per_worker slots."""

    def __init__(self, spec: FunctionSpec):
        self.spec = spec
        self.workers: list[_Worker] = []
        self.busy: dict[int, int] = {}  # worker id -> slots in use
        self.in_flight = 0
        self.stats = {
            "invocations": 0,
            "throttles": 0,
            "timeouts": 0,
            "function_errors": 0,
            "cold_starts": 0,
            "too_large": 0,
        }
        self.request_ids: deque[str] = deque(maxlen=100_000)

    def acquire(self) -> _Worker | None:
        """A worker with a free slot, spawning one (cold start) if allowed; None = throttle."""
        if self.in_flight >= self.spec.concurrency:
            return None
        slots = max(1, self.spec.threads_per_worker)
        best = None
        for w in self.workers:
            free = not w.dead and self.busy.get(w.id, 0) < slots
            if free and (best is None or self.busy.get(w.id, 0) < self.busy.get(best.id, 0)):
                best = w
        # Spread threaded environments over a few processes before stacking them.
        max_procs = max(1, math.ceil(self.spec.concurrency / slots))
        spread = best is not None and (
            self.busy.get(best.id, 0) > 0 and len(self.workers) < min(max_procs, os.cpu_count() or 1) and slots > 1
        )
        if (best is None or spread) and len([w for w in self.workers if not w.dead]) < max_procs:
            best = _Worker(self)
            self.workers.append(best)
            self.stats["cold_starts"] += 1
        if best is None:
            return None
        self.busy[best.id] = self.busy.get(best.id, 0) + 1
        self.in_flight += 1
        return best

    def release(self, worker: _Worker) -> None:
        if self.busy.get(worker.id, 0) > 0:
            self.busy[worker.id] -= 1
            self.in_flight -= 1

    def forget(self, worker: _Worker) -> None:
        n = self.busy.pop(worker.id, 0)
        self.in_flight -= n
        if worker in self.workers:
            self.workers.remove(worker)
        threading.Thread(target=worker.stop, daemon=True).start()

    def stop(self) -> None:
        for w in list(self.workers):
            w.stop()
        self.workers.clear()


def _json_error(status: int, error_type: str, message: str, extra: dict | None = None, headers: dict | None = None):
    from aiohttp import web

    body = {"Type": "User", "message": message}
    body.update(extra or {})
    hdrs = {"x-amzn-ErrorType": error_type, "x-amzn-RequestId": str(uuid.uuid4()), "Content-Type": "application/json"}
    hdrs.update(headers or {})
    return web.Response(status=status, body=json.dumps(body).encode(), headers=hdrs)


_AUTH_RE = re.compile(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
                      r"SignedHeaders=([a-z0-9;\-]+), Signature=([0-9a-f]{64})$")
MAX_SKEW_S = 15 * 60


def sigv4_problem(method: str, raw_path_qs: str, headers: Any, body: bytes,
                  credentials: tuple[str, str]) -> tuple[int, str, str] | None:
    """Why the request's SigV4 signature is not valid for ``credentials`` ((status, error type,
    message), as Lambda answers), or None when it is. The canonical request is rebuilt from what
    was received, so a client that signed one thing and sent another fails here as it would on AWS."""
    from botocore.auth import SIGV4_TIMESTAMP, SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = headers.get("Authorization")
    if not auth:
        return 403, "MissingAuthenticationTokenException", "Missing Authentication Token"
    m = _AUTH_RE.match(auth)
    amz_date = headers.get("X-Amz-Date", "")
    if m is None or not amz_date:
        return (
            403,
            "IncompleteSignatureException",
            f"Authorization header requires a valid Credential, SignedHeaders and Signature: {auth[:80]}",
        )
    key_id, day, region, service, signed, signature = m.groups()
    if key_id != credentials[0]:
        return 403, "UnrecognizedClientException", "The security token included in the request is invalid."
    try:
        when = calendar.timegm(time.strptime(amz_date, SIGV4_TIMESTAMP))
    except ValueError:
        return 403, "IncompleteSignatureException", f"invalid X-Amz-Date {amz_date!r}"
    if abs(time.time() - when) > MAX_SKEW_S:
        return (
            403,
            "InvalidSignatureException",
            f"Signature expired: {amz_date} is now earlier or later than 15 min of the server time",
        )
    names = signed.split(";")
    if "host" not in names or any(name not in headers for name in names):
        return 403, "InvalidSignatureException", f"signed headers missing from the request: {signed}"
    request = AWSRequest(method=method, url=f"http://{headers['Host']}{raw_path_qs}", data=body,
                         headers={name: headers[name] for name in names})
    request.context["timestamp"] = amz_date
    signer = SigV4Auth(
        Credentials(credentials[0], credentials[1], headers.get("X-Amz-Security-Token")), service, region
    )
    expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    if not hmac.compare_digest(expected, signature) or day != amz_date[:8]:
        return (
            403,
            "InvalidSignatureException",
            (
                "The request signature we calculated does not match the signature you "
                "provided. Check your AWS Secret Access Key and signing method."
            ),
        )
    return None


def _log_tail(request_id: str, lines: list[str]) -> str:
    text = "\n".join(lines) + "\n"
    raw = text.encode()[-4096:]  # Lambda returns the last 4 KB of the log
    return base64.b64encode(raw).decode()


class InvokeServer:
    """``with InvokeServer([FunctionSpec("nitro-actor")]) as srv: ... endpoint_url=srv.url``.

    The HTTP side runs on an asyncio loop in a background thread; handlers run in worker
    processes started on demand (cold starts) and kept warm until ``stop()``.
    """

    def __init__(self, functions: list[FunctionSpec], host: str = "127.0.0.1", port: int = 0,
                 preload: tuple[str, ...] | None = ("actor_lambda.handler",),
                 credentials: tuple[str, str] | None = None):
        self.functions = {f.name: f for f in functions}
        self.credentials = credentials  # (access key id, secret): verify SigV4 signatures; None: accept any
        for module in preload or ():
            if module not in _PRELOAD:
                _PRELOAD.append(module)
        self.host = host
        self.port = port
        self._pools: dict[str, _FunctionPool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.auth_failures = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> InvokeServer:
        self._thread = threading.Thread(target=self._run, name="invoke-server", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            raise RuntimeError(f"invoke server did not start: {self._start_error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # pragma: no cover - reported to start()
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(self._shutdown())
        loop.close()

    async def _serve(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/2015-03-31/functions/{name}/invocations", self._invoke)
        app.router.add_get("/_nitro/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        for name, spec in self.functions.items():
            self._pools[name] = _FunctionPool(spec)

    async def _shutdown(self) -> None:
        for pool in self._pools.values():
            await asyncio.get_running_loop().run_in_executor(None, pool.stop)
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=15)
        self._loop = None

    def __enter__(self) -> InvokeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self, name: str | None = None) -> dict[str, Any]:
        pools = self._pools if name is None else {name: self._pools[name]}
        return {n: dict(p.stats, in_flight=p.in_flight, workers=len(p.workers)) for n, p in pools.items()}

    def prewarm(self, name: str | dict[str, int], n: int = 1) -> None:
        """Start ``n`` execution environments of function ``name`` (or of each function in a
        ``{name: n}`` dict) now and wait for their INIT: like provisioned concurrency."""
        wanted = name if isinstance(name, dict) else {name: n}

        async def go() -> None:
            ws = []
            for fname, count in wanted.items():
                pool = self._pools[fname]
                for _ in range(count):
                    w = pool.acquire()
                    if w is None:
                        break
                    ws.append((pool, w))
            for _, w in ws:
                await w.ready
            for pool, w in ws:
                pool.release(w)

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(go(), self._loop).result(120)

    # -- HTTP handlers -----------------------------------------------------------------------

    async def _stats(self, request):
        from aiohttp import web

        return web.json_response(self.stats())

    async def _invoke(self, request):
        from aiohttp import web

        name = request.match_info["name"]
        if name.startswith("arn:"):
            name = name.split(":")[6] if len(name.split(":")) > 6 else name
        payload = await request.read()  # read it all first, as the service does, then judge it
        if self.credentials is not None:
            problem = sigv4_problem(request.method, request.raw_path, request.headers, payload, self.credentials)
            if problem is not None:
                self.auth_failures += 1
                return _json_error(problem[0], problem[1], problem[2])
        spec = self.functions.get(name)
        if spec is None:
            return _json_error(
                404,
                "ResourceNotFoundException",
                f"Function not found: arn:aws:lambda:us-east-1:{ACCOUNT_ID}:function:{name}",
            )
        pool = self._pools[name]
        qualifier = request.query.get("Qualifier")
        version = "$LATEST"
        if qualifier and qualifier != "$LATEST":
            if qualifier in spec.aliases:
                version = spec.aliases[qualifier]
            elif qualifier.isdigit():
                version = qualifier
            else:
                return _json_error(404, "ResourceNotFoundException", f"Function not found: {spec.arn}:{qualifier}")
        if len(payload) > MAX_REQUEST_BYTES:
            pool.stats["too_large"] += 1
            return _json_error(
                413,
                "RequestEntityTooLargeException",
                f"Request must be smaller than {MAX_REQUEST_BYTES} bytes for the InvokeFunction operation",
            )
        try:
            if payload:
                json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _json_error(400, "InvalidRequestContentException", f"Could not parse request body into json: {exc}")
        inv_type = request.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if inv_type == "DryRun":
            return web.Response(status=204, headers={"x-amzn-RequestId": str(uuid.uuid4())})
        if inv_type != "RequestResponse":
            return _json_error(
                400,
                "InvalidParameterValueException",
                f"this local server supports RequestResponse and DryRun, not {inv_type}",
            )

        worker = pool.acquire()
        if worker is None:
            pool.stats["throttles"] += 1
            return _json_error(429, "TooManyRequestsException", "Rate Exceeded.",
                               {"Reason": "ReservedFunctionConcurrentInvocationLimitExceeded"}, {"Retry-After": "1"})
        pool.stats["invocations"] += 1
        request_id = str(uuid.uuid4())
        pool.request_ids.append(request_id)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req_id = next(_REQ_IDS)
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), timeout=spec.timeout_s + 60)
        except TimeoutError:
            pass  # the invoke below fails or times out on its own
        worker.in_flight[req_id] = fut
        try:
            worker.send(("invoke", req_id, payload, spec.timeout_s, request_id, qualifier))
        except (OSError, ValueError):
            worker.in_flight.pop(req_id, None)
            pool.release(worker)
            return self._function_error(
                request_id,
                version,
                {
                    "errorType": "Runtime.ExitError",
                    "errorMessage": f"RequestId: {request_id} Error: Runtime exited without providing a reason",
                },
                None,
                spec,
                request,
            )
        tail = request.headers.get("X-Amz-Log-Type") == "Tail"
        try:
            res: _Result = await asyncio.wait_for(asyncio.shield(fut), timeout=spec.timeout_s)
        except TimeoutError:
            pool.stats["timeouts"] += 1
            if spec.threads_per_worker <= 1:
                worker.in_flight.pop(req_id, None)
                worker.kill()  # Lambda destroys the execution environment after a timeout
            else:
                fut.cancel()  # the slot frees itself when the (simulated) handler returns
            billed = math.ceil(spec.timeout_s * 1000)
            doc = {
                "errorType": "Sandbox.Timedout",
                "errorMessage": f"RequestId: {request_id} Error: Task timed out after {spec.timeout_s:.2f} seconds",
            }
            report = (
                f"REPORT RequestId: {request_id}\tDuration: {spec.timeout_s * 1000:.2f} ms\t"
                f"Billed Duration: {billed} ms\t"
                f"Memory Size: {spec.memory_mb} MB\tMax Memory Used: 0 MB\tStatus: timeout"
            )
            lines = [
                f"START RequestId: {request_id} Version: {version}",
                f"{time.strftime('%Y-%m-%dT%H:%M:%S')}Z {request_id} Task timed out after {spec.timeout_s:.2f} seconds",
                f"END RequestId: {request_id}",
                report,
            ]
            return self._function_error(request_id, version, doc, lines if tail else None, spec, request)
        except _WorkerDied as died:
            pool.stats["function_errors"] += 1
            sig = (
                f"signal: {-died.exitcode}"
                if died.exitcode is not None and died.exitcode < 0
                else f"exit status {died.exitcode}"
            )
            doc = {
                "errorType": "Runtime.ExitError",
                "errorMessage": f"RequestId: {request_id} Error: Runtime exited with error: {sig}",
            }
            return self._function_error(request_id, version, doc, None, spec, request)
        billed = math.ceil(res.duration_ms) + (math.ceil(res.init_ms) if res.init_ms is not None else 0)
        report = (f"REPORT RequestId: {request_id}\tDuration: {res.duration_ms:.2f} ms\tBilled Duration: {billed} ms\t"
                  f"Memory Size: {spec.memory_mb} MB\tMax Memory Used: {res.max_rss_mb} MB")
        if res.init_ms is not None:
            report += f"\tInit Duration: {res.init_ms:.2f} ms"
        lines = [f"START RequestId: {request_id} Version: {version}", f"END RequestId: {request_id}", report]
        headers = {
            "x-amzn-RequestId": request_id,
            "X-Amz-Executed-Version": version,
            "Content-Type": "application/json",
        }
        if tail:
            headers["X-Amz-Log-Result"] = _log_tail(request_id, lines)
        if res.func_error:
            pool.stats["function_errors"] += 1
            headers["X-Amz-Function-Error"] = "Unhandled"
        return web.Response(status=200, body=res.body, headers=headers)

    def _function_error(self, request_id, version, doc, lines, spec, request):
        from aiohttp import web

        headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": version,
                   "X-Amz-Function-Error": "Unhandled", "Content-Type": "application/json"}
        if lines:
            headers["X-Amz-Log-Result"] = _log_tail(request_id, lines)
        return web.Response(status=200, body=json.dumps(doc).encode(), headers=headers)


_REQ_IDS = itertools.count(1)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.support.lambda_invoke_server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--function", default="nitro-actor", help="function name")
    p.add_argument("--handler", default="actor_lambda.handler.handler")
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--concurrency", type=int, default=2, help="reserved concurrency (more in flight: 429)")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--simulate-duration-s", type=float, default=None,
                   help="the handler sleeps this long and writes a small dummy batch instead of a rollout")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="function environment variable")
    p.add_argument("--ready-file", default=None, help="write the bound port here once listening")
    args = p.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    if args.simulate_duration_s is not None:
        env["NITRO_SIMULATE_DURATION_S"] = str(args.simulate_duration_s)
    spec = FunctionSpec(args.function, handler=args.handler, memory_mb=args.memory_mb, timeout_s=args.timeout_s,
                        concurrency=args.concurrency, environment=env, threads_per_worker=args.threads_per_worker)
    server = InvokeServer([spec], host=args.host, port=args.port).start()
    print(f"Lambda Invoke API for {spec.name!r} on {server.url} (concurrency {spec.concurrency})", flush=True)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(args.ready_file + ".tmp", args.ready_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
