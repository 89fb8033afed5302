"""Imported by the launcher's fork server, and only there (processes.NodeProcess preloads it): the server
ignores the signals that stop a run.

The fork server is the parent of every node process; the launcher learns that a node ended, and its exit code,
from the server. A stop that reaches the whole process group (a closed terminal's SIGHUP, a job scheduler's or
systemd's SIGTERM) killed the server too: every node then read as ended (code 255) while it was still leaving,
and the launcher printed the run's checkpoints and exited before the nodes finished writing them (seen with
SIGHUP, 2026-12-06). The server has nothing to save and exits by itself when the launcher does (its pipe from
the launcher closes), so it ignores them; a node process installs its own handlers (openprime.train.leaving).
"""

import signal

from openprime.train.leaving import STOP_SIGNALS

for _stop in STOP_SIGNALS:
    signal.signal(_stop, signal.SIG_IGN)
