"""Session setup for every test directory (pyproject's testpaths).

The code under test must be this checkout's. A non-editable install of some packages (`pip install
./packages/mesh`, without -e) puts a copy of them in the environment's site-packages, where it shadows the
editable install: on 2026-12-06 a copy of core, diloco, fsdp and mesh made eight hours before had every local run
test that old mesh, whatever the checkout said (CI builds a fresh environment and was not affected). The session
now refuses to start when any part of the `openprime` namespace lies outside this checkout.

Multi-process tests fork their processes from one server per pytest process (multiprocessing's "forkserver"),
which imports a list of modules once so that its children start with them loaded. The server starts at the
first fork and keeps the list it was started with: a later `set_forkserver_preload` has no effect. The
transports' harness (openprime.core.harness) asks for openprime.core.testing, the launcher for what
`openprime run`'s own server imports (openprime.train.entry.FORK_SERVER_PRELOAD); in a whole-suite run the harness
came first, and every launcher child then imported openprime.train itself, about 1 CPU-s each (test_launcher's 20
children: 23 s instead of 1.4 s). Starting the server here with both lists gives every child of the session what
it needs. Left out: openprime.train.forkserver, which makes the server ignore SIGTERM and SIGINT; the harness's
children would inherit that, and its tests stop them with SIGTERM.
"""

import multiprocessing as mp
import pathlib
from multiprocessing import forkserver

import pytest
import torch

import openprime
from openprime.train.entry import FORK_SERVER_PRELOAD

ROOT = pathlib.Path(__file__).resolve().parent
SESSION_PRELOAD = [m for m in FORK_SERVER_PRELOAD if m != "openprime.train.forkserver"] + ["openprime.core.testing"]


def outside_checkout(paths: list[str], root: pathlib.Path) -> list[str]:
    """The portions of a namespace package (its __path__) that are not sources of `root`: outside it, or in an
    environment's site-packages (the environment may lie in the checkout, as .ci/run's .venv does)."""
    return [p for p in paths
            if not (path := pathlib.Path(p).resolve()).is_relative_to(root) or "site-packages" in path.parts]


def pytest_configure(config) -> None:
    if stray := outside_checkout(list(openprime.__path__), ROOT):
        raise pytest.UsageError(
            f"openprime is imported in part from {', '.join(stray)}, not from this checkout ({ROOT}): the tests "
            f"would run that code. Remove those directories (a non-editable `pip install ./packages/...` left "
            f"them) and install the checkout again: pip install -r {ROOT / 'requirements.txt'}")
    mp.set_forkserver_preload(SESSION_PRELOAD)
    forkserver.ensure_running()
    # One compute thread in the test process, as in every node process: two threads of one process stall for
    # seconds at the barriers of torch's parallel loops whenever the tests' subprocesses share the 2 cores
    # (test_restore_after_skip: 2 s alone, 24 s in a CI run of a busy machine).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_run_lock_left_handed_to_nodes():
    """A test that runs `openprime run` in this process must not leave the run lock's descriptor handed to the nodes
    started after it: every later node was sent that closed or reused descriptor through the fork server, and one
    CI run's send killed the server under 17 elastic tests (2026-12-07). This names the test that left it."""
    yield
    from openprime.train import processes

    handed = processes.run_lock_handed()
    processes._run_lock_fd = None  # the tests after it start clean: only this one fails
    assert handed is None, f"this test left the run lock (descriptor {handed}) handed to the nodes started after it"
