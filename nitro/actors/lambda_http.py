"""How the Lambda backend puts one Invoke call on the wire: two transports, one answer type.

``LambdaActorBackend`` (nitro/actors/lambda_.py) owns the retries, the semaphore, the duplicate
handling and the summaries; a transport only sends one synchronous ``Invoke`` request and returns
what came back (``InvokeResponse``) or raises ``TransportError`` when nothing did.

* ``SignedHttpTransport`` (the default, ``backend.lambda.invoker: aiohttp``): one aiohttp session on
  the backend's event loop. Each request is signed with SigV4 (``InvokeSigner``: botocore's
  algorithm with what does not change between calls computed once) using the credentials boto3
  would find (environment, shared config, SSO, instance or task role; temporary ones are refreshed
  by botocore). The endpoint comes from botocore's endpoint resolution; the CA bundle and proxies
  are botocore's defaults (``AWS_CA_BUNDLE`` or certifi; ``HTTPS_PROXY``/``NO_PROXY``, read once).
  What it leaves out is the rest of botocore's per-call pipeline: parameter validation,
  serialisation through the service model, about twenty event hooks, and parsing the answer
  through the model. Measured (bench/invoker_cpu.py), that pipeline plus a thread per call costs
  1 to 2.5 ms of client CPU per invoke under one GIL, which keeps a 1000-actor fan-out from being
  flat; the Invoke API's answer is simple enough to read directly (status, three headers, the
  body).
* ``Boto3Transport`` (``invoker: boto3``): ``boto3.client("lambda").invoke`` run in a thread pool:
  the SDK's own path: the fallback should the signed path ever disagree with AWS (the signed path
  is checked against the local Invoke server, which verifies SigV4 signatures with botocore's code,
  not against real AWS), and the benchmark's reference.

Both keep the Lambda rules of docs/decisions.md: no SDK retries (a slow actor is never re-sent), a
read timeout above the function's timeout, as many connections as calls in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from nitro.config import LambdaConfig

READ_TIMEOUT_MARGIN_S = 30.0
CONNECT_TIMEOUT_S = 5.0
USER_AGENT = "nitro-actor-backend"


@dataclass(frozen=True)
class InvokeResponse:
    """What one Invoke call returned: a 2xx answer from the function, or the service's error."""

    status: int
    body: bytes = b""
    function_error: str | None = None  # X-Amz-Function-Error: the function ran and failed
    log_result: str | None = None  # X-Amz-Log-Result: base64 tail of the log (LogType=Tail)
    error_code: str | None = None  # the service refused the call, e.g. TooManyRequestsException
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error_code is None


class TransportError(Exception):
    """No answer came back (refused, reset, read timeout): the function may or may not have run."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


OnSent = Callable[[str], None]


def invoke_path(function_name: str, qualifier: str | None) -> str:
    """The Invoke API's request target, quoted as botocore quotes it (an ARN's colons too)."""
    path = f"/2015-03-31/functions/{quote(function_name, safe='')}/invocations"
    return f"{path}?Qualifier={quote(qualifier, safe='')}" if qualifier else path


def error_fields(headers: Any, body: bytes) -> tuple[str | None, str]:
    """Error code and message of a rest-json error answer, read the way botocore reads them: the
    ``x-amzn-ErrorType`` header first (anything after ':' dropped), else the body's ``__type`` or
    ``code`` (anything before '#' dropped); the message is the body's ``message`` or ``Message``."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    code = headers.get("x-amzn-ErrorType") or doc.get("__type") or doc.get("code")
    if code:
        code = str(code).split(":")[0].rsplit("#", 1)[-1]
    message = doc.get("message") or doc.get("Message") or (body[:300].decode(errors="replace") if not doc else "")
    return code or None, str(message)


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``/``HTTP_PROXY``, minus
    ``NO_PROXY``), as botocore and urllib read them; None for a direct connection."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    proxy = getproxies().get(parts.scheme)
    if not proxy or proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def make_lambda_client(cfg: LambdaConfig, max_in_flight: int | None = None, session: Any = None):
    """A boto3 Lambda client as docs/decisions.md says: pool >= calls in flight, read timeout above
    the function's timeout, SDK retries off (throttles are retried by the backend)."""
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=cfg.region,
        max_pool_connections=max(int(cfg.concurrency), int(max_in_flight or 0), 10),
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=float(cfg.function_timeout_s) + READ_TIMEOUT_MARGIN_S,
        retries={"mode": "standard", "total_max_attempts": 1},
        tcp_keepalive=True,
        # Our parameters are built here with fixed types; skipping botocore's shape validation
        # cuts the client's CPU per invoke by about a third.
        parameter_validation=False,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra=USER_AGENT,
    )
    return (session or boto3.session.Session()).client("lambda", endpoint_url=cfg.endpoint_url, config=config)


class InvokeSigner:
    """AWS Signature Version 4 for one request shape: ``POST`` of an Invoke call to one URL.

    botocore's ``SigV4Auth`` builds an ``AWSRequest`` and re-derives everything per call (about
    100 us here); for a fixed URL and header set, the canonical URI, query, host and signed-header
    list are computed once, and the signing key once per day. The algorithm is botocore's, step by
    step (tests check that both produce the same ``Authorization`` for the same request and time,
    and the local Invoke server verifies every signature with botocore's code)."""

    ALGORITHM = "AWS4-HMAC-SHA256"

    def __init__(self, url: str, region: str, credentials: Any, service: str = "lambda"):
        parts = urlsplit(url)
        self.region, self.service, self._credentials = region, service, credentials
        # canonical URI as botocore computes it for non-S3 services: the (already quoted) path, quoted again
        self.canonical_uri = quote(parts.path or "/", safe="/~")
        self.canonical_query = "&".join(sorted(parts.query.split("&"))) if parts.query else ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
            host = f"{host}:{parts.port}"
        self.host = host
        self._key: tuple[str, str, bytes] | None = None  # (secret, day, signing key)

    def _signing_key(self, secret: str, day: str) -> bytes:
        if self._key is None or self._key[:2] != (secret, day):
            key = ("AWS4" + secret).encode()
            for part in (day, self.region, self.service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._key = (secret, day, key)
        return self._key[2]

    def headers(self, payload: bytes, amz_date: str | None = None) -> dict[str, str]:
        """The request's headers (``Host`` included, since it is signed), signed for ``payload``."""
        creds = self._credentials.get_frozen_credentials()
        amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        day = amz_date[:8]
        signed = {"host": self.host, "x-amz-date": amz_date, "x-amz-invocation-type": "RequestResponse",
                  "x-amz-log-type": "Tail"}
        if creds.token:
            signed["x-amz-security-token"] = creds.token
        names = ";".join(signed)  # already in sorted order
        canonical = "\n".join(("POST", self.canonical_uri, self.canonical_query,
                               "".join(f"{k}:{v}\n" for k, v in signed.items()), names,
                               hashlib.sha256(payload).hexdigest()))
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = f"{self.ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers = {"Host": self.host, "X-Amz-Date": amz_date, "X-Amz-Invocation-Type": "RequestResponse",
                   "X-Amz-Log-Type": "Tail",
                   "Authorization": f"{self.ALGORITHM} Credential={creds.access_key}/{scope}, SignedHeaders={names}, "
                                    f"Signature={signature}"}
        if creds.token:
            headers["X-Amz-Security-Token"] = creds.token
        return headers


class SignedHttpTransport:
    """Invoke over aiohttp, each request signed with botocore's SigV4Auth. Create it on the loop
    that will use it (``await SignedHttpTransport.create(...)``): the session belongs to that loop."""

    def __init__(self, cfg: LambdaConfig, *, pool_size: int, on_sent: OnSent | None = None):
        import boto3
        from botocore.exceptions import NoCredentialsError

        session = boto3.session.Session()
        client = make_lambda_client(cfg, pool_size, session)  # botocore resolves the endpoint
        self.endpoint_url = client.meta.endpoint_url.rstrip("/")
        self.region = client.meta.region_name
        client.close()
        self._credentials = session.get_credentials()  # boto3's provider chain; refreshable ones refresh
        if self._credentials is None:
            raise NoCredentialsError()
        self.url = self.endpoint_url + invoke_path(cfg.function_name, cfg.qualifier)
        self.signer = InvokeSigner(self.url, self.region, self._credentials)
        self.pool_size = int(pool_size)
        self.read_timeout_s = float(cfg.function_timeout_s) + READ_TIMEOUT_MARGIN_S
        self._on_sent = on_sent
        self.session: Any = None
        self._yarl_url: Any = None

    @classmethod
    async def create(cls, cfg: LambdaConfig, *, pool_size: int, on_sent: OnSent | None = None) -> SignedHttpTransport:
        transport = cls(cfg, pool_size=pool_size, on_sent=on_sent)
        transport._open()
        return transport

    def _open(self) -> None:
        import aiohttp
        import yarl

        trace = aiohttp.TraceConfig()
        if self._on_sent is not None:
            on_sent = self._on_sent

            async def sent(_session, ctx, _params) -> None:
                inv = ctx.trace_request_ctx.get("inv") if ctx.trace_request_ctx else None
                if inv is not None:
                    on_sent(inv)

            trace.on_request_chunk_sent.append(sent)
        ssl_context: ssl.SSLContext | bool = False
        if self.endpoint_url.startswith("https://"):
            from botocore.httpsession import get_cert_path

            ssl_context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True))
        connector = aiohttp.TCPConnector(limit=self.pool_size, limit_per_host=0, ttl_dns_cache=300, ssl=ssl_context)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.read_timeout_s)
        # trust_env=False: with it aiohttp reads the proxy variables and ~/.netrc in a thread on EVERY
        # request (measured: more client CPU than the request itself); they are read once here.
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                              trace_configs=[trace], auto_decompress=True)
        self._proxy = env_proxy(self.endpoint_url)
        self._yarl_url = yarl.URL(self.url, encoded=True)  # sent exactly as signed

    async def send(self, payload: bytes, inv: str) -> InvokeResponse:
        import aiohttp

        headers = self.signer.headers(payload)
        headers["User-Agent"] = USER_AGENT  # not signed, as in botocore
        try:
            async with self.session.post(self._yarl_url, data=payload, headers=headers, proxy=self._proxy,
                                          trace_request_ctx={"inv": inv}) as resp:
                body = await resp.read()
                status, hdrs = resp.status, resp.headers
        except TimeoutError:
            raise TransportError("ReadTimeoutError",
                                 f"no answer within {self.read_timeout_s:.0f} s on {self.endpoint_url}") from None
        except aiohttp.ClientConnectorError as exc:
            raise TransportError("EndpointConnectionError",
                                 f'Could not connect to the endpoint URL: "{self.url}": {exc}') from None
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(type(exc).__name__, str(exc) or repr(exc)) from None
        if 200 <= status < 300:
            return InvokeResponse(status, body, hdrs.get("X-Amz-Function-Error"), hdrs.get("X-Amz-Log-Result"))
        code, message = error_fields(hdrs, body)
        return InvokeResponse(status, body, error_code=code or f"HTTP{status}", error_message=message)

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


class Boto3Transport:
    """``client.invoke`` in a thread pool: the SDK's path, for comparison and as a fallback."""

    def __init__(self, cfg: LambdaConfig, *, pool_size: int, on_sent: OnSent | None = None, client: Any = None):
        self.cfg = cfg
        self.client = client if client is not None else make_lambda_client(cfg, pool_size)
        self._pool = ThreadPoolExecutor(max_workers=int(pool_size), thread_name_prefix="nitro-lambda")
        self._on_sent = on_sent

    @classmethod
    async def create(cls, cfg: LambdaConfig, *, pool_size: int, on_sent: OnSent | None = None) -> Boto3Transport:
        return cls(cfg, pool_size=pool_size, on_sent=on_sent)

    async def send(self, payload: bytes, inv: str) -> InvokeResponse:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._invoke, payload, inv)

    def _invoke(self, payload: bytes, inv: str) -> InvokeResponse:
        from botocore.exceptions import BotoCoreError, ClientError

        kwargs: dict[str, Any] = dict(FunctionName=self.cfg.function_name, InvocationType="RequestResponse",
                                      LogType="Tail", Payload=payload)
        if self.cfg.qualifier:
            kwargs["Qualifier"] = self.cfg.qualifier
        if self._on_sent is not None:
            self._on_sent(inv)  # approximate: the SDK gives no hook once the bytes are out
        try:
            response = self.client.invoke(**kwargs)
            body = response["Payload"].read()
        except ClientError as exc:
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return InvokeResponse(int(status), error_code=err.get("Code") or "ClientError",
                                  error_message=str(err.get("Message") or exc))
        except BotoCoreError as exc:
            raise TransportError(type(exc).__name__, str(exc)) from None
        return InvokeResponse(int(response.get("StatusCode", 200)), body, response.get("FunctionError"),
                              response.get("LogResult"))

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except Exception:
            pass


Transport = SignedHttpTransport | Boto3Transport
TRANSPORTS: dict[str, type[SignedHttpTransport] | type[Boto3Transport]] = {
    "aiohttp": SignedHttpTransport,
    "boto3": Boto3Transport,
}
