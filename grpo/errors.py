"""Errors a user can fix: the CLI prints them as one line and exits non-zero, without a traceback."""
import errno
import os


class GRPOError(Exception):
    """Base class of the errors caused by a config, a data file or a user-supplied function."""


class ConfigError(GRPOError):
    """A config key, type, value or combination of values is not allowed."""


class DataError(GRPOError):
    """A model, data set or reward function cannot be used as given."""


class WriteError(GRPOError):
    """A run's output could not be written (a full disk, a quota, a file-size limit, permissions)."""


# errnos of a write that failed for want of room: a full disk, a quota, a file-size limit
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_failure(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: `e` itself, or the one a Rust library (safetensors, tokenizers) reports in
    the message of its own exception ("I/O error: No space left on device (os error 28)"); None if `e` is not a
    failed write."""
    import re

    if isinstance(e, OSError):
        return e
    code = re.search(r"\(os error (\d+)\)", str(e))
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else None


def os_reason(e: OSError) -> str:
    """An OSError as its reason and the file it concerns: "No space left on device (writing model.safetensors)"."""
    reason = e.strerror or " ".join(str(e).split()) or type(e).__name__
    return f"{reason} (writing {os.path.basename(e.filename)})" if e.filename else reason
