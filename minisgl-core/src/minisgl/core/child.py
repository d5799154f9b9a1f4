"""What a child process of minisgl sets up first, and the address its ranks meet at.

Torch-free, like ``minisgl.core.tokenizer`` and ``minisgl.core.config``: the server's launcher,
tokenizer and detokenizer processes import only such modules and never load torch.
"""

from __future__ import annotations

import os
import socket


def die_with_parent() -> None:
    """For a child process: ignore Ctrl-C (the parent handles it) and, on Linux, have the kernel
    SIGTERM this process when its parent dies, even by SIGKILL."""
    import ctypes
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's (or the launcher's) job
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
        except OSError:
            pass
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_addr(host: str = "127.0.0.1") -> str:
    """host:port with a port free now: the rendezvous of tensor-parallel ranks."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"
