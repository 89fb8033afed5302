"""Session setup for every test directory (pyproject's testpaths).

Multi-process tests fork their processes from one server per pytest process (multiprocessing's "forkserver"),
which imports a list of modules once so that its children start with them loaded. The server starts at the
first fork and keeps the list it was started with: a later `set_forkserver_preload` has no effect. The
transports' harness (openprime.core.harness) asks for openprime.core.testing, the launcher for
openprime.train.launcher; in a whole-suite run the harness came first, and every launcher child then imported
openprime.train itself, about 1 CPU-s each (test_launcher's 20 children: 23 s instead of 1.4 s). Starting the
server here with both lists gives every child of the session what it needs.
"""

import multiprocessing as mp
from multiprocessing import forkserver

SESSION_PRELOAD = ["torch", "openprime.core.testing", "openprime.train.launcher"]


def pytest_configure(config) -> None:
    mp.set_forkserver_preload(SESSION_PRELOAD)
    forkserver.ensure_running()
