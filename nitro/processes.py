"""Child processes that never outlive the process that started them, even on ``kill -9``.

``die_with_parent`` is a ``preexec_fn`` for ``subprocess.Popen``: Linux's PR_SET_PDEATHSIG makes
the kernel send the child a signal when its parent dies, however it dies (atexit handlers and
context managers do not run on SIGKILL). The signal goes when the *thread* that forked the
child exits, so call ``Popen`` with it from a thread that lives as long as the process: the main
thread. Elsewhere (macOS) it does nothing, and the owner's own clean-up is all there is.
"""

from __future__ import annotations

import ctypes
import signal
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Runs in the child between fork and exec: ask the kernel for ``sig`` when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except Exception:
        pass


def on_main_thread() -> bool:
    """Whether a child forked now may use ``die_with_parent`` (see the module docstring)."""
    return threading.current_thread() is threading.main_thread()
