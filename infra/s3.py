"""What `RunStore` (infra/storage.py) needs to know about S3 and no other backend.

- `s3_filesystem`: the s3fs filesystem a store talks through, configured so that readers see new
  objects at once and the store's own retry loop is the only one.
- `abort_incomplete_uploads`: the multipart uploads a killed writer left, which no listing shows.
- `rejection_reason`, `is_precondition_failure`: how an error from s3fs or botocore is read. The
  store retries what a later attempt can get past (timeouts, connection errors, throttling, 408,
  429, 5xx) and fails at once on what it cannot: any other 4xx answer, an OSError EINVAL, a
  missing or malformed configuration. A refused conditional PUT is neither: it is the answer
  "the key exists" that `put_if_absent` returns as False.

Why a module of its own: the classification is a table of S3's error codes and botocore's
exception types, which a reader of the store's commit logic never needs to hold in mind.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import fsspec
from botocore.exceptions import ClientError, NoCredentialsError, ParamValidationError, PartialCredentialsError

from configs.sections import StorageConfig
from infra.credentials import s3_credentials

PERMANENT_BOTO_ERRORS = (NoCredentialsError, PartialCredentialsError, ParamValidationError)
"""botocore errors raised before any request is sent: the configuration is wrong, no retry helps."""
TRANSIENT_ERROR_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "TooManyRequestsException",
    "RequestLimitExceeded", "RequestThrottled", "RequestTimeout", "RequestTimeoutException",
    "ServiceUnavailable", "InternalError", "OperationAborted", "PriorRequestNotComplete",
    "ConditionalRequestConflict", "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody",
})  # fmt: skip
"""S3 error codes that a later attempt can get past, whatever HTTP status carried them (the last
three: a body damaged or cut off on its way, answered with a 400)."""
TRANSIENT_4XX = (408, 429)


def abort_incomplete_uploads(call_s3: Callable[..., dict], bucket: str, prefix: str) -> list[str]:
    """Abort the multipart uploads under `prefix` of `bucket` that never completed; returns their
    object keys. `call_s3(operation, **params)` sends each request (the store's, with its retries).
    An upload that completes or goes between the listing and its abort is left."""
    aborted, markers = [], {}
    while True:
        answer = call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        for upload in answer.get("Uploads", []):
            try:
                call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
                continue
            aborted.append(upload["Key"])
        if not answer.get("IsTruncated"):
            return aborted
        markers = {"KeyMarker": answer.get("NextKeyMarker", ""), "UploadIdMarker": answer.get("NextUploadIdMarker", "")}


def _client_error_of(err: BaseException) -> ClientError | None:
    """The botocore ClientError behind `err` (s3fs raises OSErrors caused by one), if any."""
    for _ in range(8):  # explicit causes only: a __context__ may be an unrelated earlier error
        if err is None or isinstance(err, ClientError):
            return err
        err = err.__cause__
    return None


def rejection_reason(err: BaseException) -> str | None:
    """Why `err` can never succeed on retry ("InvalidBucketName (HTTP 400)"), or None if a retry
    may help: timeouts, connection errors, throttling, 408, 429 and 5xx are worth retrying; any
    other 4xx answer, an OSError EINVAL and a missing or malformed configuration are not."""
    if isinstance(err, PERMANENT_BOTO_ERRORS):
        return type(err).__name__
    client_error = _client_error_of(err)
    if client_error is not None:
        error = client_error.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = client_error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if not isinstance(status, int) and code.isdigit():
            status = int(code)
        if code in TRANSIENT_ERROR_CODES or not isinstance(status, int):
            return None
        if 400 <= status < 500 and status not in TRANSIENT_4XX:
            return f"{code or 'error'} (HTTP {status})"
        return None
    if isinstance(err, OSError) and err.errno == errno.EINVAL:
        return "invalid request (EINVAL)"
    return None


def is_missing_bucket(err: BaseException) -> bool:
    """True when S3 answered NoSuchBucket, which s3fs raises as FileNotFoundError, the error of a
    missing key: read as one, a run's bucket that a restarted server has not loaded yet (SeaweedFS
    answers so for a moment) made the run look empty, its checkpoints and snapshots absent."""
    client_error = _client_error_of(err)
    return client_error is not None and client_error.response.get("Error", {}).get("Code") == "NoSuchBucket"


def is_precondition_failure(err: BaseException) -> bool:
    """True when S3 refused a conditional PUT because the key already exists."""
    cause = err.__cause__ if isinstance(err.__cause__, ClientError) else err
    if isinstance(cause, ClientError):
        return cause.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")
    return "pre-conditions" in str(err)


def s3_filesystem(storage: StorageConfig) -> fsspec.AbstractFileSystem:
    """An s3fs filesystem with listing caches off (readers must see new shards at once) and no
    retries of its own, neither s3fs's nor botocore's, so that `RunStore._retry` owns the backoff
    and `storage.retry_seconds` is the budget: with botocore's legacy `max_attempts: 2` (three
    tries) and s3fs's five, giving up on a refused endpoint took 7.4 s under a budget of 2 s and
    8.5 s under 0; now 1.5 s and 0.3 s.

    fsspec's instance cache is kept on: a thread gets one filesystem, and so one botocore
    client, per set of credentials. Every rollout group opens the run's store, and building a
    fresh client each time (loading botocore's service model) took 84% of the rollout workers'
    time on SeaweedFS: the tiny pipeline stepped at 3.5 s on s3://, 1.4-2.1 s with the cache,
    0.6 s on file://. fsspec drops its cache in a forked child, whose copy of the client's
    connections would be unusable."""
    key, secret = s3_credentials(storage)
    endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    fs = fsspec.filesystem(
        "s3",
        key=key,
        secret=secret,
        endpoint_url=endpoint,
        use_listings_cache=False,
        config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"total_max_attempts": 1}},
    )
    fs.retries = 1  # s3fs's own retries: a class attribute, which its constructor does not take
    return fs
