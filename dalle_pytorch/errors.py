"""User errors end in one line saying what to do; --debug shows the traceback. Depends on nothing else here,
so every script and tool (generate.py, convert, plot) can use it without importing the training stack."""

from __future__ import annotations

import sys
from contextlib import contextmanager

USER_ERRORS = (
    ValueError, FileNotFoundError, ImportError, ConnectionError, FloatingPointError, NotADirectoryError,
    PermissionError, TimeoutError,
)  # fmt: skip


@contextmanager
def user_errors(debug: bool):
    try:
        yield
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        if debug or e.errno != 28:
            raise
        print(f"error: out of disk space ({e}); free space or point --output_dir elsewhere", file=sys.stderr)
        raise SystemExit(2) from None
