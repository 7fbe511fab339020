"""Suite-wide setup: the test process stands where a terminal would put it.

A shell without job control starts a background job with SIGINT ignored, and every program
it starts inherits that (Python too: it keeps an inherited SIG_IGN). The tests that press
Ctrl-C on meshrun would then find it deaf. Python's own handler restored here is reset to
the default action in every child at exec, as under a terminal.
"""

from __future__ import annotations

import signal

__all__: list[str] = []

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
