"""The `openprime` command: bad input ends it at once with one message naming the field; dry runs."""

import pathlib
import subprocess
import sys

import pytest

from openprime.train.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEBUG = str(ROOT / "recipes" / "debug.py")
TEN_B = str(ROOT / "recipes" / "intellect1_10b.py")


def _fails(capsys, tmp_path, *args: str) -> str:
    run_dir = tmp_path / "run"
    assert main(["run", *args, "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists(), "nothing may be written or started for a bad command"
    err = capsys.readouterr().err
    assert err.startswith("openprime: error: ") and err.count("openprime: error") == 1
    return err


def test_missing_recipe(capsys, tmp_path):
    err = _fails(capsys, tmp_path, str(tmp_path / "nope.py"))
    assert "recipe not found" in err and "nope.py" in err


def test_recipe_without_config(capsys, tmp_path):
    recipe = tmp_path / "empty.py"
    recipe.write_text("X = 1\n")
    err = _fails(capsys, tmp_path, str(recipe))
    assert "defines no run config" in err and "def config() -> RunConfig" in err


def test_unknown_key_lists_valid_keys(capsys, tmp_path):
    err = _fails(capsys, tmp_path, DEBUG, "--set", "diloco.inner_stepz=3")
    assert "unknown config key 'diloco.inner_stepz'" in err
    assert "diloco.num_inner_steps" in err and "optim.lr" in err


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("diloco.num_inner_steps=0", "DiLoCoConfig.num_inner_steps must be >= 1, got 0"),
        ("optim.lr=-0.1", "OptimizerConfig.lr must be > 0"),
        ("train.num_steps=many", "train.num_steps: expected int, got 'many'"),
        ("model.num_heads=5", "num_heads"),
        ("diloco.outer_optimizer=adam", "'adam' is not one of: nesterov, momentum, sgd"),
        ("train.num_steps=210", "not a multiple of diloco.num_inner_steps 20"),
        ("train.seq_len=1024", "exceeds model.max_seq_len 256"),
        ("lr", "--set takes key=value"),
    ],
)
def test_bad_values_name_the_field(capsys, tmp_path, setting, expected):
    err = _fails(capsys, tmp_path, DEBUG, "--set", setting)
    assert expected in err, err


def test_nodes_must_be_positive(capsys, tmp_path):
    assert "--nodes must be >= 1" in _fails(capsys, tmp_path, DEBUG, "--nodes", "0")


def test_dry_run_counts_10b_without_allocating(capsys):
    assert main(["run", TEN_B, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "10,211,381,248 parameters (10.21B" in out
    assert "42 layers, dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256" in out


def test_installed_command_reports_errors():
    proc = subprocess.run([sys.executable, "-m", "openprime.train.cli", "run", DEBUG, "--set", "optim.lr=-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "OptimizerConfig.lr must be > 0" in proc.stderr


def _site(tmp_path, text: str) -> str:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return str(path)


def test_site_file_sets_transport_and_timeouts(tmp_path):
    from openprime.train.recipe import recipe_config
    from openprime.train.site import site_overrides

    site = _site(tmp_path, """
[transport]
kind = "tcp"
hostname = "127.0.0.2"
num_connections = 8
[transport.shaping]
rate_bps = 1e9
latency_s = 0.04
[transport.auth]
run_id = "intellect-1"
secret_file = "/etc/openprime/secret"
[timeouts]
connect_s = 90
""")
    cfg = recipe_config(DEBUG, site_overrides(site))
    assert cfg.transport.kind.value == "tcp"
    assert cfg.transport.options.hostname == "127.0.0.2" and cfg.transport.options.num_connections == 8
    assert cfg.transport.options.shaping.rate_bps == 1e9 and cfg.transport.options.shaping.latency_s == 0.04
    assert cfg.transport.options.auth.run_id == "intellect-1"
    assert cfg.transport.options.auth.secret_file == "/etc/openprime/secret"
    assert cfg.timeouts.connect_s == 90


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[model]\ndim = 3\n", "unknown table(s) ['model']"),
        ("[transport\n", "is not valid TOML"),
        ("[transport]\nkind = \"carrier-pigeon\"\n", "'carrier-pigeon' is not one of: gloo, tcp, zmq"),
        ("[transport]\nnum_conections = 2\n", "unknown config key 'transport.options.num_conections'"),
        ("[transport.shaping]\nrate_bps = 1e9\n", "the gloo transport has neither WAN shaping nor authentication"),
        ("[transport.shaping]\nrate_bps = 1000\n", "did you mean bits"),
    ],
)
def test_bad_site_files(capsys, tmp_path, text, expected):
    err = _fails(capsys, tmp_path, DEBUG, "--network", _site(tmp_path, text))
    assert expected in err, err


def test_missing_site_file(capsys, tmp_path):
    assert "site file not found" in _fails(capsys, tmp_path, DEBUG, "--network", str(tmp_path / "nope.toml"))


def test_transport_not_installed_names_the_pip_command(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openprime.transports.tcp" else real(name, *a))
    err = _fails(capsys, tmp_path, DEBUG, "--transport", "tcp")
    assert "transport 'tcp' is not installed; install it with: pip install ./transports/tcp" in err


def test_set_wins_over_site_file(tmp_path):
    from openprime.train.recipe import recipe_config
    from openprime.train.site import site_overrides

    site = _site(tmp_path, "[transport]\nkind = \"tcp\"\nnum_connections = 8\n")
    cfg = recipe_config(DEBUG, [*site_overrides(site), "transport.options.num_connections=2"])
    assert cfg.transport.options.num_connections == 2
