"""The `openprime` command: bad input ends it at once with one message naming the field; dry runs that shard
the model over a fake group of local ranks and print the plan; the GPU checks before a run starts."""

import math
import pathlib
import re
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from openprime.train.cli import main
from openprime.train.recipe import recipe_config

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


def test_an_error_in_a_recipe_shows_the_recipes_lines_only(capsys, tmp_path):
    # Before, a typo or a bug in a recipe ended the command in a traceback through the cli and importlib.
    (tmp_path / "typo.py").write_text("def config(:\n    pass\n")
    err = _fails(capsys, tmp_path, str(tmp_path / "typo.py"))
    assert err.startswith(f"openprime: error: recipe {tmp_path / 'typo.py'} failed:\n  File "), err
    assert "line 1\n    def config(:\n" in err and err.rstrip().endswith("SyntaxError: invalid syntax")
    (tmp_path / "base.py").write_text("def config():\n    return {}['model']\n")
    (tmp_path / "variant.py").write_text("import pathlib\nfrom openprime.train.recipe import load_recipe\n"
                                         "base = load_recipe(pathlib.Path(__file__).with_name('base.py'))\n"
                                         "def config():\n    return base.config()\n")
    err = _fails(capsys, tmp_path, str(tmp_path / "variant.py"))
    assert f'File "{tmp_path / "variant.py"}", line 5, in config' in err
    assert f'File "{tmp_path / "base.py"}", line 2, in config' in err and "KeyError: 'model'" in err
    assert "cli.py" not in err and "importlib" not in err


@pytest.mark.parametrize("body", ["import sys\nsys.exit(3)\n",
                                  "raise SystemExit\n",
                                  "import sys\ndef config():\n    sys.exit('no config today')\n"])
def test_a_recipe_that_exits_is_a_clear_error(capsys, tmp_path, body):
    # Before: SystemExit is no Exception, and the command ended with the recipe's exit code and no word of why
    # (or with argparse's usage of a recipe written as a script) (found 2026-12-07 by review).
    (tmp_path / "script.py").write_text(body)
    err = _fails(capsys, tmp_path, str(tmp_path / "script.py"))
    assert f"openprime: error: recipe {tmp_path / 'script.py'} exited (sys.exit(" in err, err
    assert 'put script code under `if __name__ == "__main__":`' in err, err


@pytest.mark.parametrize(("setting", "expected"), [
    ("diloco=3", "unknown config key 'diloco': it is a section, not one setting; --set one of its keys, e.g. "
                 "--set diloco.num_inner_steps=VALUE"),
    ("transport.options=x", "unknown config key 'transport.options': it is a section"),
    ("data.mixture=kjv", "data.mixture holds WeightedSource values, which --set cannot write: change it in the "
                         "recipe"),
    ("name=", "name '' cannot start a run directory's name: give a non-empty name without '/'"),
    ("name=../elsewhere", "name '../elsewhere' cannot start a run directory's name"),
])
def test_a_setting_that_set_cannot_write_says_what_to_do(capsys, tmp_path, setting, expected):
    # Before: "unknown config key 'diloco'" with no suggestion; "fields of type <class '...WeightedSource'> cannot
    # be set"; an empty name made runs/-TIMESTAMP, and "../x" a run directory outside runs/ (2026-12-07 review).
    err = _fails(capsys, tmp_path, DEBUG, "--dry-run", "--set", setting)
    assert expected in err, err


def test_a_site_file_that_cannot_be_read_is_a_clear_error(capsys, tmp_path):
    # Before: IsADirectoryError / UnicodeDecodeError tracebacks out of the command (found 2026-12-07 by review).
    (tmp_path / "sites").mkdir()
    err = _fails(capsys, tmp_path, DEBUG, "--network", str(tmp_path / "sites"))
    assert f"cannot read the site file {tmp_path / 'sites'}: Is a directory; give --network the path of a TOML " \
           f"file" in err, err
    (tmp_path / "site.bin").write_bytes(b"kind = \xff\xfe\n")
    err = _fails(capsys, tmp_path, DEBUG, "--network", str(tmp_path / "site.bin"))
    assert f"site file {tmp_path / 'site.bin'} is not text (not UTF-8)" in err, err


@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_plan_names_gpus_per_node_not_the_field_it_sets(capsys, gpus):
    # Before: "FSDPConfig.num_local_ranks must be >= 1", a setting the command line did not name (2026-12-07 review).
    assert main(["plan", DEBUG, "--nodes", "2", "--bandwidth", "1gbit", "--gpus-per-node", gpus]) == 2
    assert capsys.readouterr().err == f"openprime: error: --gpus-per-node must be >= 1, got {gpus}\n"


def test_unknown_key_lists_valid_keys(capsys, tmp_path):
    err = _fails(capsys, tmp_path, DEBUG, "--set", "diloco.inner_stepz=3")
    assert "unknown config key 'diloco.inner_stepz' (did you mean 'diloco.num_inner_steps'" in err
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


def test_a_run_that_saved_no_checkpoint_is_neither_resumed_nor_overwritten(capsys, tmp_path):
    # A run killed before its first checkpoint left its metrics: neither command may go ahead, and neither may send
    # the user to the other.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "start", "node": 0}\n')
    for extra in ([], ["--resume", "latest"]):
        assert main(["run", DEBUG, "--run-dir", str(run_dir), *extra]) == 2
        err = capsys.readouterr().err
        assert "saved no checkpoint" in err and "another --run-dir" in err and "continue it with" not in err, err
    (run_dir / "checkpoints" / "step-00000020").mkdir(parents=True)
    assert main(["run", DEBUG, "--run-dir", str(run_dir)]) == 2
    assert "already holds a run; continue it with --resume latest" in capsys.readouterr().err


def test_a_resume_without_the_checkpoint_directory_the_run_saves_in_names_it(capsys, tmp_path):
    """A run whose last launch saved elsewhere (`--set checkpoint.directory=X`), resumed without that --set: it was
    told the run 'saved no checkpoint' and to start it again elsewhere or remove it (review of 2026-12-07)."""
    from openprime.train.launcher import write_run_files

    run_dir, elsewhere = tmp_path / "run", tmp_path / "else where"
    cfg = recipe_config(DEBUG, [f"checkpoint.directory={elsewhere}"])
    write_run_files(run_dir, cfg, recipe=pathlib.Path(DEBUG), recipe_files=[], overrides=[], num_nodes=2)
    (run_dir / "metrics.jsonl").write_text('{"kind": "start", "node": 0}\n')
    (elsewhere / "step-00000020").mkdir(parents=True)
    assert main(["run", DEBUG, "--run-dir", str(run_dir), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert f"holds a run that saves its checkpoints in {elsewhere} (checkpoint.directory of its last launch), not " \
           f"in {run_dir / 'checkpoints'}: add --set checkpoint.directory='{elsewhere}'" in err, err


def test_a_new_run_is_refused_a_checkpoint_directory_that_holds_another_run_s_steps(capsys, tmp_path):
    # checkpoint.directory outside the run directory is shared by every launch of the recipe: a new run (its own new
    # run directory) saved beside another run's steps, and its --resume latest continued theirs.
    shared = tmp_path / "scratch"
    (shared / "step-00000020").mkdir(parents=True)
    (shared / "step-00000040").mkdir()
    err = _fails(capsys, tmp_path, DEBUG, "--set", f"checkpoint.directory={shared}")
    assert f"checkpoint.directory {shared} already holds checkpoints (steps [20, 40]) of another run or of an " \
           f"earlier launch of this one" in err, err
    assert "Continue that run with --resume latest and its --run-dir, or give this run another checkpoint.directory" \
           in err


def test_a_launch_that_ended_hands_its_run_lock_to_no_later_node(capsys, tmp_path):
    """A launch refused once it held its run directory's lock left the lock's descriptor handed to the nodes after the
    file was closed: every node this process started later was sent that closed or reused descriptor, and one CI
    run's send failed and killed the fork server under 17 elastic tests (2026-12-07)."""
    from openprime.train.processes import run_lock_handed

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["run", DEBUG, "--run-dir", str(run_dir), "--resume", "latest"]) == 2  # no checkpoint to resume
    assert "no checkpoint under" in capsys.readouterr().err
    assert (run_dir / ".openprime.lock").exists()  # it was refused holding the lock
    assert run_lock_handed() is None


def test_a_launch_joining_a_run_may_share_only_the_live_run_s_directory(capsys, tmp_path, monkeypatch):
    # Found by hand: a `--join` launch into the directory of a finished run appended its records to that run's, and
    # its first checkpoints were pruned at once as older than that run's newest; the hint then named the old run's.
    from openprime.mesh import Coordinator, MeshClient

    launched = []
    monkeypatch.setattr("openprime.train.launcher.launch", lambda cfg, **kw: launched.append(kw) or 0)
    mesh = recipe_config(DEBUG, []).mesh
    coordinator = Coordinator(mesh).start()
    live = MeshClient(coordinator.address, mesh, node_id="live-node")
    try:
        live.join()
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        metrics = run_dir / "metrics.jsonl"
        metrics.write_text('{"kind": "start", "node": 0, "node_id": "gone-node"}\n')
        join = ["run", DEBUG, "--run-dir", str(run_dir), "--join", coordinator.address]
        assert main(join) == 2 and not launched
        err = capsys.readouterr().err
        assert f"{run_dir} holds a run whose nodes are not in the run at {coordinator.address}: continue that run " \
               f"with --resume latest, or give this launch another --run-dir" in err, err
        # The directory of the run being joined (another launch of it, on the same disk, started there): shared.
        metrics.write_text(metrics.read_text() + '{"kind": "start", "node": 1, "node_id": "live-node"}\n')
        assert main(join) == 0 and len(launched) == 1
        assert launched[0]["first_node"] == 2  # its nodes' records follow the other launch's nodes 0 and 1
    finally:
        live.close()
        coordinator.stop()


def test_resuming_an_older_step_than_the_run_directory_holds_is_refused(capsys, tmp_path):
    # A rollback (`--resume PATH` of an older step) into the root that holds later steps: the later ones would be
    # another timeline mixed with this run's saves, and a crash would resume them.
    from openprime.ckpt import write_part

    root = tmp_path / "run" / "checkpoints"
    for step in (20, 40):
        write_part(root, step, "slot-0", {"model": {"w": torch.zeros(2)}}, parts=["slot-0"])
    older = root / "step-00000020"
    assert main(["run", DEBUG, "--nodes", "1", "--run-dir", str(tmp_path / "run"), "--resume", str(older)]) == 2
    err = capsys.readouterr().err
    assert f"holds checkpoints of steps [40] after the one resumed ({older}, step 20)" in err, err
    assert "Move them out of" in err


def test_a_resume_says_first_that_it_checks_a_large_checkpoints_checksums(capsys, tmp_path, monkeypatch):
    # A 10B model's node holds about 200 GB: minutes of SHA-256 in which the command said nothing. Here every
    # checkpoint counts as large; the resume is then refused (another model), after the line.
    from openprime.ckpt import store, write_part

    monkeypatch.setattr(store, "SAY_CHECKING_BYTES", 1)
    root = tmp_path / "run" / "checkpoints"
    write_part(root, 20, "slot-0", {"model": {"w": torch.zeros(2)}}, parts=["slot-0"])
    assert main(["run", DEBUG, "--nodes", "1", "--run-dir", str(tmp_path / "run"), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    checking = f"openprime: checking the SHA-256 checksums of {root / 'step-00000020'}: 0.0 GB in 1 part(s), about 0 s"
    assert checking in err, err
    assert err.index(checking) < err.index("has no tensor 'model/tok_embeddings.weight'"), err


def test_nodes_must_be_positive(capsys, tmp_path):
    assert "--nodes must be >= 1" in _fails(capsys, tmp_path, DEBUG, "--nodes", "0")


def test_more_nodes_than_data_slots_is_refused_before_starting(capsys, tmp_path):
    """`--nodes 3 --set mesh.max_nodes=2`: the third node was refused as the run was full and the other two waited
    for it for ever (mesh.sync_timeout_s, 2 hours), saying nothing (review of 2026-12-07)."""
    err = _fails(capsys, tmp_path, DEBUG, "--nodes", "3", "--set", "mesh.max_nodes=2")
    assert "--nodes 3 is more than mesh.max_nodes=2, the data slots the run cuts its data into (one a node): add " \
           "--set mesh.max_nodes=3" in err


def test_dry_run_counts_10b_without_allocating(capsys):
    assert main(["run", TEN_B, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "10,211,381,248 parameters (10.21B" in out
    assert "42 layers, dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256" in out
    assert not torch.distributed.is_initialized(), "the fake process group must be gone"


def _shard_by_hand(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """Parameters of local rank 0 under FSDP2: every parameter split along dim 0 into `ranks` chunks of
    ceil(rows / ranks) rows (rank 0's chunk is always full; the last ranks' are padded up to it)."""
    return sum(-(-shape[0] // ranks) * math.prod(shape[1:]) for shape in shapes)


def _llama_shapes(V, D, L, H, K, E, F) -> list[tuple[int, ...]]:
    block = [(H * E, D), (K * E, D), (K * E, D), (D, H * E), (F, D), (D, F), (F, D), (D,), (D,)]
    return [(V, D), *block * L, (D,), (V, D)]


def _per_rank(out: str) -> int:
    match = re.search(r"^per local rank: ([\d,]+) parameters, ([\d,]+) bytes of fp32 weights", out, re.MULTILINE)
    assert match, out
    numel, nbytes = (int(g.replace(",", "")) for g in match.groups())
    assert nbytes == 4 * numel
    return numel


def test_dry_run_10b_shards_over_a_fake_8_rank_group_within_a_minute():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "openprime.train", "run", TEN_B, "--dry-run", "--nodes", "2"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 60, f"the dry run took {elapsed:.1f} s"
    out = proc.stdout
    # INTELLECT-1 10B over 8 ranks: every dim 0 (V = 128256, D = 4096, K*E = 1024, F = 14336) divides by 8,
    # so each rank holds exactly P / 8, no padding.
    hand = _shard_by_hand(_llama_shapes(V=128256, D=4096, L=42, H=32, K=8, E=128, F=14336), 8)
    assert hand == 10_211_381_248 // 8 == 1_276_422_656
    assert _per_rank(out) == hand
    assert "0 parameters of dim-0 padding over the 8 ranks" in out
    sharding = ("FSDP2 over a fake 8-rank group (meta device): 43 units (42 blocks + root), bf16 compute, fp32 "
                "gradient reduce-scatter; micro-batch 1 x 16 accumulated per rank per inner step, activation "
                "checkpointing full")
    assert sharding in out
    # The planner's plan for the node, with the same weights per GPU.
    assert "2 nodes x 8 H100 SXM" in out and "the planner's: 4 x 10,211,381,248 / 8 = 5,105,690,624 bytes" in out
    assert re.search(r"total +69\.5 GiB +fits, 9\.6 GiB to spare", out), out  # of 79.1 GiB, as CUDA reports an H100


def test_dry_run_shards_are_padded_along_dim_0(capsys):
    # The debug model over 3 ranks: 4096 vocabulary rows give rank 0 1366 of them (3 x 1366 = 4098: 2 rows of
    # padding on the last rank), D = 128 gives 43 (1 row of padding), and so on for every parameter.
    assert main(["run", DEBUG, "--dry-run", "--set", "train.batch_size=6", "--set", "fsdp.num_local_ranks=3"]) == 0
    out = capsys.readouterr().out
    shapes = _llama_shapes(V=4096, D=128, L=4, H=4, K=2, E=32, F=384)
    hand = _shard_by_hand(shapes, 3)
    assert hand == 613_763 and _per_rank(out) == hand
    num_params = sum(math.prod(s) for s in shapes)
    assert num_params == 1_836_160 and f"{3 * hand - num_params:,} parameters of dim-0 padding over the 3 ranks" in out
    assert not torch.distributed.is_initialized()


def test_dry_run_of_a_model_that_does_not_fit_says_by_how_much(capsys):
    # 10B on one local rank of an H100 (79.1 GiB as CUDA reports it): 16 bytes per parameter alone are 152.2 GiB.
    assert main(["run", TEN_B, "--dry-run", "--set", "fsdp.num_local_ranks=1"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT: 88.6 GiB more than the 79.1 GiB of one H100 SXM" in captured.out  # the plan, printed
    err = captured.err
    assert err.startswith("openprime: error: 'intellect1-10b' does not fit one H100 SXM: with 1 local rank per node "
                          "each GPU needs 167.7 GiB, 88.6 GiB more than its 79.1 GiB")
    assert "--set fsdp.num_local_ranks=8 (69.5 GiB)" in err
    assert not torch.distributed.is_initialized()


def test_a_validation_split_too_small_for_one_sequence_is_refused_before_the_nodes_start(capsys, tmp_path):
    # The nodes trained up to their first evaluation (train.eval_every steps: hours, in a real run) and stopped there.
    err = _fails(capsys, tmp_path, DEBUG, "--set", "data.val_fraction=0.00001", "--set", "train.eval_every=10")
    assert "source 'kjv' has no validation sequence of 129 tokens (its held-out tail, val_fraction=1e-05, is " in err
    assert "raise data.val_fraction or shorten train.seq_len" in err


def _debug_checkpoint(root: pathlib.Path, step: int, model_cfg) -> pathlib.Path:
    """One node's part of a checkpoint of `model_cfg` as a node saves it (what a resume checks before starting)."""
    from openprime.ckpt import write_part
    from openprime.core.config import to_dict
    from openprime.train.model import Llama

    model = Llama(model_cfg)
    write_part(root, step, "slot-0", {"model": model.state_dict(), "model_config": to_dict(model_cfg)},
               parts=("slot-0",))
    return root / f"step-{step:08d}"


def test_dry_run_checks_the_checkpoint_it_would_resume_from(capsys, tmp_path):
    # `--dry-run --resume` ignored the resume and exited 0, even for a checkpoint that does not exist.
    from openprime.train.model import FLAVORS

    assert main(["run", DEBUG, "--dry-run", "--resume", str(tmp_path / "nowhere")]) == 2
    captured = capsys.readouterr()
    assert "run 'debug'" in captured.out  # the plan is printed first
    assert captured.err.startswith("openprime: error: ") and str(tmp_path / "nowhere") in captured.err, captured.err
    saved = _debug_checkpoint(tmp_path / "ckpt", 40, FLAVORS["debug"])
    assert main(["run", DEBUG, "--dry-run", "--resume", str(saved)]) == 0
    out = capsys.readouterr().out
    assert f"resume: from {saved} (step 40, 1 node(s) saved it; checksums verified, the model and local ranks match " \
           f"the recipe); its data layout is checked when the run starts" in out, out
    # What the launch refuses, the dry run refuses: another model, other local ranks, a damaged file.
    assert main(["run", DEBUG, "--dry-run", "--resume", str(saved), "--set", "model.norm_eps=1e-6"]) == 2
    assert "was saved from another model: model.norm_eps" in capsys.readouterr().err
    assert main(["run", DEBUG, "--dry-run", "--resume", str(saved), "--set", "fsdp.num_local_ranks=2"]) == 2
    assert "resume with --set fsdp.num_local_ranks=1" in capsys.readouterr().err
    data_file = next((saved / "slot-0").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:-1])
    assert main(["run", DEBUG, "--dry-run", "--resume", str(saved)]) == 2
    assert f"openprime: error: checkpoint {saved} is corrupt: part slot-0 is corrupt: file {data_file.name} has " \
           in capsys.readouterr().err


def test_run_checks_the_gpus_before_starting(capsys, tmp_path, monkeypatch):
    """On a machine with CUDA, `openprime run` refuses a model that does not fit its GPUs, and more local ranks
    than GPUs, before it writes or starts anything; on CPU there is nothing to check."""
    from openprime.train import hardware

    monkeypatch.setattr(hardware, "detect_device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    err = _fails(capsys, tmp_path, TEN_B, "--set", "fsdp.num_local_ranks=1")
    assert "does not fit one NVIDIA H100 80GB HBM3" in err and "87.7 GiB more than its 80 GiB" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    err = _fails(capsys, tmp_path, TEN_B)
    assert "fsdp.num_local_ranks is 8, but this machine shows 4 CUDA device(s)" in err
    hardware.check_hardware(recipe_config(DEBUG))  # the debug recipe fits one GPU


def test_installed_command_reports_errors():
    proc = subprocess.run([sys.executable, "-m", "openprime.train", "run", DEBUG, "--set", "optim.lr=-1"],
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
        ("[transport]\nlisten_host = \"0.0.0.0\"\n", "use transport.kind=tcp or zmq for transport.options.listen_host"),
    ],
)
def test_bad_site_files(capsys, tmp_path, text, expected):
    err = _fails(capsys, tmp_path, DEBUG, "--network", _site(tmp_path, text))
    assert expected in err, err


@pytest.mark.parametrize("address", ["foo", ":", "127.0.0.1:", ":29500", "127.0.0.1:99999", "127.0.0.1:0"])
def test_a_join_address_that_is_not_host_and_port_is_refused(capsys, tmp_path, address):
    # Before: every node failed with a ZeroMQ traceback ("Invalid argument"), or waited for a port that cannot exist.
    err = _fails(capsys, tmp_path, DEBUG, "--join", address)
    assert f"--join {address!r}: expected HOST:PORT of the run's coordinator" in err, err


def test_an_ipv6_join_address_is_refused_as_not_supported_yet(capsys, tmp_path):
    # Not wired through (ZeroMQ's IPV6 option, the rendezvous store's host): it waited for the store's timeout.
    err = _fails(capsys, tmp_path, DEBUG, "--join", "[::1]:29500")
    assert "IPv6 addresses are not supported yet" in err, err


def test_a_run_directory_that_cannot_be_written_is_a_clear_error(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["run", DEBUG, "--run-dir", str(blocker / "run"), "--set", "train.num_threads=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openprime: error: cannot write the run directory {blocker / 'run'}: ") and \
        "choose another with --run-dir" in err, err


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


@pytest.mark.parametrize("bind", ["foo", "tcp://127.0.0.1:99999", "tcp://:29500"])
def test_mesh_serve_refuses_a_bind_address_that_is_not_host_and_port(capsys, bind):
    assert main(["mesh", "serve", "--bind", bind]) == 2
    assert "expected tcp://HOST:PORT to listen on" in capsys.readouterr().err


def test_mesh_serve_on_a_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["mesh", "serve", "--bind", f"tcp://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"the coordinator cannot listen on 'tcp://127.0.0.1:{port}': Address already in use" in err, err


@pytest.mark.parametrize("store_port", ["taken", "70000"])
def test_mesh_serve_with_a_store_port_it_cannot_take_is_a_clear_error(capsys, store_port):
    """A --store-port in use, or out of range, ended in a traceback (torch's DistNetworkError, a TypeError)."""
    from openprime.train.testing import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1]) if store_port == "taken" else store_port
        assert main(["mesh", "serve", "--bind", f"tcp://127.0.0.1:{free_port()}", "--store-port", port]) == 2
    err = capsys.readouterr().err
    assert f"the coordinator's rendezvous store cannot listen on port {port}: " in err, err
    assert "give --store-port a free port (0: any free one)" in err and "Traceback" not in err


def test_ctrl_c_before_the_nodes_start_exits_130_without_a_traceback(capsys, tmp_path, monkeypatch):
    # Verifying a large checkpoint's checksums, or training the tokenizer, takes minutes before any node starts.
    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("openprime.train.launcher.launch", interrupted)
    assert main(["run", DEBUG, "--run-dir", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == "openprime: interrupted\n"


def test_a_missing_dataset_is_one_message_before_anything_is_written(capsys, tmp_path):
    # It was a traceback out of the launch, after the run directory had been made.
    recipe = tmp_path / "missing_data.py"
    recipe.write_text(f"""
import pathlib
import attrs
from openprime.train.data import WeightedSource
from openprime.train.recipe import load_recipe

base = load_recipe(pathlib.Path({DEBUG!r}))


def config():
    cfg = base.config()
    fineweb = WeightedSource(source={str(tmp_path / 'fineweb')!r})
    return attrs.evolve(cfg, data=attrs.evolve(cfg.data, mixture=(fineweb,)))
""")
    err = _fails(capsys, tmp_path, str(recipe))
    assert f"{tmp_path / 'fineweb'} does not exist; download the data there" in err, err


def test_an_unwritable_data_cache_is_one_message_naming_the_setting(capsys, tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    err = _fails(capsys, tmp_path, DEBUG, "--set", f"data.cache_dir={not_a_directory}")
    assert f"cannot write the data cache {not_a_directory}" in err, err
    assert "set data.cache_dir (--set data.cache_dir=DIR) or $OPENPRIME_CACHE" in err


@pytest.mark.parametrize("key", ["mesh.secret_file", "transport.options.auth.secret_file"])
def test_a_secret_file_that_cannot_be_read_or_is_short_is_one_message_naming_its_setting(capsys, tmp_path, key):
    # Found by the coordinator (a traceback from the launcher) or by every node (each refused), after the run
    # directory was made.
    missing = tmp_path / "missing.secret"
    err = _fails(capsys, tmp_path, DEBUG, "--transport", "tcp", "--set", f"{key}={missing}")
    assert f"{key}: cannot read {missing}: No such file or directory" in err, err
    short = tmp_path / "short.secret"
    short.write_text("0123456789\n")
    err = _fails(capsys, tmp_path, DEBUG, "--transport", "tcp", "--set", f"{key}={short}")
    assert f"{key}: the secret in {short} is 10 bytes; use at least 16" in err, err


def test_the_command_that_continues_a_run_repeats_the_flags_that_shaped_its_config(tmp_path):
    """The launcher's "continue with" line repeats the recipe, the site file, the transport and every `--set` as
    they were typed (quoted for a shell): without them a resume trained on under the recipe's own settings (the
    transport, the compression, the data) or was refused for another model."""
    import shlex

    from openprime.train.cli import _parser, recipe_args

    site = tmp_path / "my site.toml"
    args = _parser().parse_args(["run", "recipes/debug.py", "--nodes", "2", "--network", str(site), "--transport",
                                 "tcp", "--set", "diloco.compression=int8", "--run-dir", "r", "--set",
                                 "data.name=two words"])
    line = recipe_args(args)
    assert shlex.split(line) == ["recipes/debug.py", "--network", str(site), "--transport", "tcp", "--set",
                                 "diloco.compression=int8", "--set", "data.name=two words"]
    assert recipe_args(_parser().parse_args(["run", "recipes/debug.py"])) == "recipes/debug.py"


@pytest.mark.parametrize(("args", "expected"), [
    (["--min-nodes", "-3"], "--min-nodes -3: the first outer step needs at least 1 node"),  # it was taken as 1
    # The fix named mesh.max_nodes, a key `mesh serve --set` does not know (its keys have no "mesh.").
    (["--min-nodes", "3", "--set", "max_nodes=1"], "Give --min-nodes 1 or less, or --set max_nodes=3"),
    (["--set", "sync_timeout_s=1"], "Use --set sync_timeout_s=18 or more"),
])
def test_mesh_serve_names_its_own_flags_in_a_refusal(capsys, args, expected):
    assert main(["mesh", "serve", "--bind", "tcp://127.0.0.1:0", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "mesh." not in err, err


def test_plan_with_gpus_per_node_names_that_flag_in_its_remedy(capsys):
    # --gpus-per-node sets the local ranks: the remedy's --set fsdp.num_local_ranks=8 was overridden by it.
    assert main(["plan", str(ROOT / "recipes" / "intellect1_10b.py"), "--nodes", "2", "--bandwidth", "1gbit",
                 "--gpus-per-node", "2"]) == 1
    err = capsys.readouterr().err
    assert "more local ranks: --gpus-per-node 8 (69.5 GiB)" in err and "fsdp.num_local_ranks" not in err, err


def test_export_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    assert main(["export", str(tmp_path / "no-such-run"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'no-such-run'} does not exist: give a run directory or a checkpoint" in capsys.readouterr().err


def test_resume_latest_without_a_run_dir_is_refused_before_a_run_directory_is_made(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flags in ([], ["--dry-run"]):
        assert main(["run", DEBUG, "--resume", "latest", *flags]) == 2
        assert "--resume latest needs the --run-dir of the run to continue" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
