"""The object-store client behind ``S3Storage``: boto3, configured from the standard AWS places, with its
errors turned into the ``OSError`` the Storage contract promises and its retries counted.

Why boto3 (``benchmarks/s3_throughput.py`` measured it against obstore on the same server): it reads the
whole AWS credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` and ``~/.aws/config``/``credentials``, SSO, web identity, instance and container roles), the
endpoint of an S3-compatible server (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``endpoint_url`` in the
config file), the region (``AWS_REGION``, ``AWS_DEFAULT_REGION``), and has bounded, jittered retries of
throttling (503 SlowDown), 5xx, timeouts and dropped connections ("standard" mode). Its plain download is
slower than obstore's; ``S3Storage`` reads a file as parallel ranged GETs, which closes most of that gap.

Settings (environment, read when a storage is opened): ``EASYCKPT_S3_MAX_ATTEMPTS`` (tries per request, 6),
``EASYCKPT_S3_TIMEOUT`` (connect and read timeout in seconds, 20), ``EASYCKPT_S3_THREADS`` (parallel parts and
ranges, 8), ``EASYCKPT_S3_PART_MB`` (multipart part size, 32). No credential is ever logged or stored:
messages name the URL, the endpoint and the variables to set, never their values.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

INSTALL = "pip install 'easyckpt[s3]'"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class S3Settings:
    max_attempts: int = 6
    timeout: float = 20.0
    threads: int = 8
    part_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.timeout <= 0 or self.threads < 1:
            raise ValueError(f"S3 settings must be positive: {self}")
        if not 5 << 20 <= self.part_bytes <= 5 << 30:
            raise ValueError(f"EASYCKPT_S3_PART_MB={self.part_bytes >> 20}: S3 parts are 5 MiB to 5 GiB")

    @classmethod
    def from_env(cls) -> S3Settings:
        def number(name: str, default: float) -> float:
            text = os.environ.get(name, "").strip()
            if not text:
                return default
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a number") from None

        return cls(max_attempts=int(number("EASYCKPT_S3_MAX_ATTEMPTS", 6)), timeout=number("EASYCKPT_S3_TIMEOUT", 20.0),
                   threads=int(number("EASYCKPT_S3_THREADS", 8)),
                   part_bytes=int(number("EASYCKPT_S3_PART_MB", 32) * (1 << 20)))


class RetryTally:
    """Requests retried by the client, by reason (an error code or an exception's name), counted from botocore's
    ``needs-retry`` event: every attempt that failed and was followed by another."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reasons: collections.Counter[str] = collections.Counter()

    def hook(self, response: Any = None, caught_exception: Any = None, attempts: int = 0, **_: Any) -> None:
        reason = None
        if caught_exception is not None:
            reason = type(caught_exception).__name__
        elif response is not None:
            http, parsed = response
            if getattr(http, "status_code", 200) >= 500 or parsed.get("Error", {}).get("Code") in ("SlowDown", "Throttling"):
                reason = parsed.get("Error", {}).get("Code") or f"HTTP {http.status_code}"
        if reason is not None:
            self.count(reason)

    def count(self, reason: str) -> None:
        """One more request made again for ``reason`` (the client's retries, and the storage's own)."""
        with self.lock:
            self.reasons[reason] += 1

    def snapshot(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.reasons)


_CLIENT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION",
               "AWS_ACCESS_KEY_ID", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
_SHARED: dict[tuple[Any, ...], tuple[Any, RetryTally]] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(settings: S3Settings) -> tuple[Any, RetryTally]:
    """One client (thread-safe, with its connection pool) and its retry tally per settings and AWS environment in
    a process: making a client costs a fraction of a second (its service model is parsed)."""
    key = (settings, *(os.environ.get(name, "") for name in _CLIENT_ENV))
    with _SHARED_LOCK:
        if key not in _SHARED:
            tally = RetryTally()
            _SHARED[key] = (make_client(settings, tally), tally)
        return _SHARED[key]


def make_client(settings: S3Settings, tally: RetryTally) -> Any:
    """An S3 client from the standard AWS configuration (see the module's docstring)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImportError(f"an s3:// save_dir needs boto3: {INSTALL}") from None
    session = boto3.session.Session()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or session.region_name or "us-east-1"
    custom = bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                  or session._session.get_config_variable("endpoint_url"))   # noqa: SLF001 (a config file's)
    config = Config(region_name=region, connect_timeout=settings.timeout, read_timeout=settings.timeout,
                    retries={"max_attempts": settings.max_attempts, "mode": "standard"},
                    max_pool_connections=max(10, settings.threads * 2),
                    # S3-compatible servers (MinIO, Ceph, moto) are addressed by path; AWS picks for itself
                    s3={"addressing_style": "path" if custom else "auto"},
                    request_checksum_calculation="when_supported", response_checksum_validation="when_supported")
    client = session.client("s3", config=config)
    client.meta.events.register("needs-retry.s3", tally.hook)
    return client


_EACCES_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden",
                 "ExpiredToken", "InvalidToken", "AllAccessDisabled"}
_ENOENT_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchUpload"}
_AGAIN_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeTooSkewed", "503", "ServiceUnavailable"}


def os_error(exc: BaseException, where: str, endpoint: str, attempts: int) -> OSError:
    """The OSError (with an errno the persist-failure report and every ``except OSError`` understand) for a
    client error at ``where``; its message names the URL and the fix, never a credential."""
    from botocore import exceptions as bx

    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        text = f"{code or status}: {error.get('Message') or 'no message'}"
        if code == "NoSuchBucket":
            return FileNotFoundError(errno.ENOENT, f"{text} (the bucket is missing at {endpoint}: create it, or fix "
                                     "the URL)", where)
        if code in _ENOENT_CODES or status == 404:
            return FileNotFoundError(errno.ENOENT, text, where)
        if code in _EACCES_CODES or status == 403:
            return PermissionError(errno.EACCES, f"{text} (check the credentials: AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and ~/.aws/credentials)", where)
        if code in ("PreconditionFailed", "412") or status == 412:
            return FileExistsError(errno.EEXIST, text, where)
        if code in _AGAIN_CODES or status == 503:
            return OSError(errno.EAGAIN, f"{text}, still after {attempts} attempts (EASYCKPT_S3_MAX_ATTEMPTS)", where)
        return OSError(errno.EIO, text, where)
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return PermissionError(errno.EACCES, f"no AWS credentials found ({exc}): set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials", where)
    if isinstance(exc, bx.ConnectTimeoutError | bx.ReadTimeoutError):
        return TimeoutError(errno.ETIMEDOUT, f"no answer from {endpoint} within the timeout, still after {attempts} "
                            "attempts (EASYCKPT_S3_TIMEOUT, EASYCKPT_S3_MAX_ATTEMPTS)", where)
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectionClosedError | bx.ConnectionError):
        return ConnectionError(errno.ECONNREFUSED, f"cannot reach {endpoint} ({type(exc).__name__}), still after "
                               f"{attempts} attempts: is the server up, and AWS_ENDPOINT_URL_S3 right?", where)
    if isinstance(exc, bx.BotoCoreError):
        return OSError(errno.EIO, f"{type(exc).__name__}: {exc}", where)
    if isinstance(exc, OSError):
        return exc
    return OSError(errno.EIO, f"{type(exc).__name__}: {exc}", where)


def client_errors() -> tuple[type[BaseException], ...]:
    """The exception types ``os_error`` translates."""
    from botocore import exceptions as bx

    return (bx.ClientError, bx.BotoCoreError)
