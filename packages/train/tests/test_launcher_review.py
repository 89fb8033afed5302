"""Review of the launch's edges (2026-12-08): what a researcher gets from `openprime run` where a site file, a lock or
a stop goes a way the other tests do not take."""

import os
import pathlib

import pytest

from openprime.train import cli

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEBUG = str(ROOT / "recipes" / "debug.py")


@pytest.mark.parametrize(("text", "expected"), [
    ('transport = "tcp"\n', "'transport' must be a table of settings, got the value 'tcp'; write it as\n[transport]"),
    ("timeouts = 120\n", "'timeouts' must be a table of settings, got the value 120; write it as\n[timeouts]"),
    ('[[transport]]\nkind = "tcp"\n', "'transport' must be a table of settings, got an array of tables ([[...]])"),
])
def test_a_site_file_whose_table_is_a_plain_value_is_a_clear_error(tmp_path, capsys, text, expected):
    # Before: `openprime run --network site.toml` ended in an AttributeError traceback ('str' object has no
    # attribute 'items') out of site.py's flattening.
    site = tmp_path / "site.toml"
    site.write_text(text)
    assert cli.main(["run", DEBUG, "--network", str(site), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openprime: error: site file {site}: ") and expected in err, err
    assert not (tmp_path / "run").exists()


CLOSED_STDOUT_LAUNCH = """
import json, os, pathlib, sys
from openprime.train.entry import start_fork_server
if __name__ == "__main__":
    start_fork_server()  # first, as `openprime run` starts it
    from openprime.train.metrics import say
    from openprime.train.processes import NodeProcess, nodes_hold_run_lock
    from openprime.train.run_lock import LOCK_NAME, RunDirLock
    run_dir = pathlib.Path(sys.argv[1])
    lock = RunDirLock(run_dir, shared=False)  # opened as the cli opens it: the lowest free descriptor, 1
    with nodes_hold_run_lock(lock.fileno):
        node = NodeProcess(target=say, args=("a node's progress line",), name="node-0")
        node.start()
    node.join(120)
    json.loads((run_dir / LOCK_NAME).read_text())  # the record still names the launch (status, a refusal read it)
    print("node", node.exitcode, repr((run_dir / LOCK_NAME).read_text().splitlines()[1:]), file=sys.stderr)
    lock.release()
"""


def test_a_launch_started_with_stdout_closed_hands_its_nodes_no_file_of_its_own_as_stdout(tmp_path):
    """`openprime run ... >&-`: the launcher's descriptor 1 is free, and the next file it opens takes it: the run
    directory's lock file. Its nodes were handed descriptor 1 as their stdout, and wrote every progress line into
    RUN_DIR/.openprime.lock after the launch's record (a second launch's refusal and `openprime status` could no
    longer read who holds the directory). They have no stdout, as their launcher has none."""
    import subprocess
    import sys

    script = tmp_path / "launch.py"
    script.write_text(CLOSED_STDOUT_LAUNCH)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=180, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0, done.stderr
    assert "node 0 []" in done.stderr, done.stderr  # nothing but the record in the lock file
    assert "a node's progress line" not in done.stderr, done.stderr
    assert "its output cannot be written ([Errno 9] stdout is closed); it trains on" in done.stderr, done.stderr


def test_a_refusal_names_a_launch_of_another_machine_as_such(tmp_path, monkeypatch):
    """A run directory on a disk that two machines share (NFS, whose client takes flock across machines): the
    refusal on the second machine read "the node processes of launch pid P, which ended ...; they leave within
    seconds" of a launch that trains on, on the first."""
    import socket

    from openprime.core.errors import ConfigError
    from openprime.train.run_lock import RunDirLock

    monkeypatch.setattr(socket, "gethostname", lambda: "machine-a")
    first = RunDirLock(tmp_path, shared=False)
    try:
        monkeypatch.setattr(socket, "gethostname", lambda: "machine-b")
        with pytest.raises(ConfigError) as refused:
            RunDirLock(tmp_path, shared=False)
        assert f"(pid {os.getpid()} on host machine-a, started " in str(refused.value), refused.value
        assert "which ended" not in str(refused.value), refused.value
    finally:
        first.release()


def test_a_value_a_recipe_sets_that_its_config_refuses_names_the_recipes_line(tmp_path, capsys):
    # Before: "openprime: error: TrainConfig.num_steps must be >= 1, got 0", and nothing of the recipe or its line
    # (a `--set` of the same value names its key; this one came from nowhere the person could see).
    recipe = tmp_path / "short.py"
    recipe.write_text(f"import attrs\nfrom openprime.train.recipe import load_recipe\n\n"
                      f"base = load_recipe({DEBUG!r})\n\n"
                      "def config():\n    cfg = base.config()\n"
                      "    return attrs.evolve(cfg, train=attrs.evolve(cfg.train, num_steps=0))\n")
    assert cli.main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openprime: error: recipe {recipe}: TrainConfig.num_steps must be >= 1, got 0\n"
                          f"  File \"{recipe}\", line 8, in config\n"
                          f"    return attrs.evolve(cfg, train=attrs.evolve(cfg.train, num_steps=0))"), err
