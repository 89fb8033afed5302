"""Ready pyzmq's zero-copy bookkeeping in one thread, before the transport's writer threads use it.

A zero-copy send (`copy=False, track=True`) hands libzmq the caller's memory; when libzmq is done with it,
its I/O thread tells pyzmq's garbage-collector thread through an inproc PUSH socket, and that thread
completes the send's MessageTracker. pyzmq creates that PUSH socket (and the mutex around it) lazily, the
first time a zero-copy frame is built in the process, without a lock (pyzmq 27.x, `Frame.__init__` and
`GarbageCollector._push_socket`). The transport's writer threads, one per connection, make their first
zero-copy sends at the same moment; two of them can each create a socket, one replaces the other, and
the replaced one is closed when Python drops it, while a frame still names it as the socket to notify.
That frame's notification is then lost: its tracker never completes, and its writer waits until the
send's deadline although the bytes were delivered ("deadline passed while sending"). Seen on
2026-12-03 in tools/bench_transports.py, in 3 of 4 runs of a 2-process group that held a Gloo process
group, a TCP transport and a ZeroMQ transport; the peer had received everything.

`ready_zero_copy()` builds one zero-copy frame under a lock, once per process (again after a fork), so
the socket and the mutex exist before any writer thread starts; it costs one small frame.
"""

from __future__ import annotations

import os
import threading

import zmq

_lock = threading.Lock()
_ready_pid: int | None = None


def ready_zero_copy() -> None:
    """Make pyzmq create its garbage-collector thread, PUSH socket and mutex now, in this thread."""
    global _ready_pid
    with _lock:
        if _ready_pid == os.getpid():
            return
        frame = zmq.Frame(bytearray(64), copy=False, track=True)  # copy=False: the zero-copy path, always
        del frame  # never sent: libzmq frees it at once, through the same notification
        _ready_pid = os.getpid()
