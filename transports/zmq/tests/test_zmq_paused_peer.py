"""A receiver paused for a couple of seconds (SIGSTOP, then SIGCONT: a GC pause, a descheduled VM) is alive: the
sends to it wait within their deadline. Small payloads (under pyzmq's 64 KiB zero-copy threshold) were copied and
their sends done at once, SNDHWM of them queued on a DEALER, and a full queue read as a lost connection after one
second: PeerFailure with the peer alive (found 2026-12-07 by review)."""

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from openprime.core.distributed import host_store
from openprime.core.streams import StreamTransportConfig
from openprime.core.transport import Rendezvous
from openprime.transports.zmq import ZmqTransport

NUM_MESSAGES, SIZE, PAUSE_S = 3000, 32 << 10, 2.0  # 98 MB: more than the sockets and queues hold
CONFIG = StreamTransportConfig(connect_timeout_s=20)

# Rank 1: says it is ready, receives every message (each within 30 s), says how many it got.
RECEIVER = f"""
import sys, time, torch
from openprime.core.transport import Rendezvous
from openprime.core.streams import StreamTransportConfig
from openprime.transports.zmq import ZmqTransport
torch.set_num_threads(1)
t = ZmqTransport(Rendezvous(host="127.0.0.1", port=int(sys.argv[1]), group="paused"), 1, 2,
                 StreamTransportConfig(connect_timeout_s=20))
t.send(0, 9, [torch.ones(1)], deadline=time.monotonic() + 20)
buf, got = torch.empty({SIZE}, dtype=torch.uint8), 0
for _ in range({NUM_MESSAGES}):
    t.recv(0, 5, [buf], deadline=time.monotonic() + 30)
    got += 1
t.send(0, 9, [torch.tensor([float(got)])], deadline=time.monotonic() + 20)
t.close()
"""


def test_sends_to_a_paused_receiver_wait_for_it_within_their_deadline():
    store = host_store(timeout_s=20)
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(store.port)])
    sender = None
    try:
        sender = ZmqTransport(Rendezvous(host="127.0.0.1", port=store.port, group="paused"), 0, 2, CONFIG)
        sender.recv(1, 9, [torch.empty(1)], deadline=time.monotonic() + 30)  # it is ready
        os.kill(child.pid, signal.SIGSTOP)
        resume = threading.Timer(PAUSE_S, os.kill, (child.pid, signal.SIGCONT))
        resume.start()
        start, data = time.monotonic(), torch.zeros(SIZE, dtype=torch.uint8)
        for handle in [sender.isend(1, 5, [data], deadline=start + 30) for _ in range(NUM_MESSAGES)]:
            handle.wait()  # raised PeerFailure ("connection lost") about a second into the pause
        assert time.monotonic() - start >= PAUSE_S - 0.5  # they did wait for the receiver
        got = torch.empty(1)
        sender.recv(1, 9, [got], deadline=time.monotonic() + 30)
        assert got.item() == NUM_MESSAGES
        resume.join()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        if sender is not None:
            sender.close()
        child.kill()
        child.wait(timeout=10)
