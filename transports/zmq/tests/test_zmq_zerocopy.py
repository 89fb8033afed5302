"""pyzmq sets up tracked zero-copy sends lazily and without a lock; the transport readies it first (zerocopy.py).

Without it, two writer threads making their first zero-copy sends at once could each create pyzmq's notification
socket, one replacing the other, and a send's tracker then never completed: 4 runs of 4 of a 2-process benchmark
group (Gloo, TCP and ZeroMQ side by side) hung until the deadline, 6 of 6 passed with it.
"""

import subprocess
import sys

PROBE = """
import threading, zmq
from zmq.utils.garbage import gc
from openprime.transports.zmq.zerocopy import ready_zero_copy
assert gc._push is None and not gc.is_alive()  # a fresh process: nothing set up yet
ready_zero_copy()
push, mutex = gc._push, gc._push_mutex
assert gc.is_alive() and push is not None and mutex, (gc.is_alive(), push, mutex)
ready_zero_copy()  # once per process: the same socket stays
assert gc._push is push and gc._push_mutex == mutex

# Eight threads make their first tracked zero-copy sends at once; every tracker completes.
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
port = pull.bind_to_random_port("tcp://127.0.0.1")
done, start = [], threading.Barrier(8)
def send(i):
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    start.wait(10)
    tracker = sock.send(bytearray(1 << 20), copy=False, track=True)
    tracker.wait(10)
    done.append(i)
    sock.close(linger=0)
threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
for t in threads: t.start()
for _ in range(8): pull.recv()
for t in threads: t.join(20)
assert sorted(done) == list(range(8)), done
assert gc._push is push  # nobody replaced it
pull.close(linger=0)
ctx.term()
print("ok")
"""


def test_zero_copy_bookkeeping_is_ready_before_any_writer_thread():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
