"""SIGINT/SIGTERM during training: finish the step, checkpoint, stop."""
from __future__ import annotations

import os
import signal
import sys
import threading


class GracefulStop:
    """SIGINT/SIGTERM: let the current step finish, checkpoint, and stop. A second signal exits at once."""

    def __init__(self):
        self.signal: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None:
            sys.stderr.write(f"\ngrpo: second {name}: exiting now without a checkpoint\n")
            os._exit(128 + signum)
        self.signal = name
        sys.stderr.write(f"\ngrpo: {name} received: finishing this step, then writing a checkpoint "
                         "(send it again to exit at once)\n")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
