"""The in-memory test transport's queues: one per (sender, receiver, tag), even when threads race to create it."""

import sys
import threading

from openprime.core.harness import _Hub


def test_threads_racing_on_a_new_key_share_one_queue():
    # With a defaultdict(queue.Queue) instead, 8 threads released together on a new key got two different
    # queues in about 11 of 300 keys here (the factory runs Python code, so a thread can be switched out
    # between creating its queue and storing it): a message put into one was never seen by a receiver
    # waiting on the other. A tiny switch interval makes the threads interleave inside that window.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for k in range(300):
            hub, ids, barrier = _Hub(), [], threading.Barrier(8)

            def touch(hub=hub, ids=ids, barrier=barrier, k=k):
                barrier.wait(timeout=10)
                ids.append(id(hub[(0, 1, k)]))

            threads = [threading.Thread(target=touch) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            assert len(ids) == 8 and len(set(ids)) == 1, k
    finally:
        sys.setswitchinterval(old)
