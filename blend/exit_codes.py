"""Every exit status a ``kvblend`` command returns, in one place (README: "Every `kvblend` command")."""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the command ran and found something wrong: a file with an issue, a failed gate, a corrupt entry
    USER_ERROR = 2  # bad input or usage: one line on stderr
    UNREACHABLE = 3  # a store tier could not be read: the check is incomplete
    INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C
    BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader of our output left (`| head`)
    TERMINATED = 128 + signal.SIGTERM  # SIGTERM: unwound as on Ctrl-C
