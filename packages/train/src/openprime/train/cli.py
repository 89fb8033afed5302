"""The `openprime` command.

    openprime run RECIPE [--nodes N] [--run-dir DIR] [--network SITE.toml] [--transport gloo|tcp|zmq]
                         [--join HOST:PORT] [--resume latest|PATH] [--set key=value ...] [--dry-run]
    openprime mesh serve [--bind tcp://0.0.0.0:29500] [--min-nodes N] [--set key=value ...]
    openprime export RUN_OR_CHECKPOINT OUT_DIR [--dtype float32|bfloat16]
    openprime plan RECIPE --nodes N --bandwidth 1.6gbit [--gpus-per-node N] [--gpu h100] [--mfu 0.433]
                          [--set key=value ...]

Everything about an experiment lives in its recipe; a site file holds what belongs to the network
(transport, addresses, secret, shaping, timeouts); `--set` changes one config field for one run and
wins over both. The config is built and validated before any process starts, and a bad value ends the
command with one message naming the field; on a machine with CUDA, `run` also checks that there is a GPU
for every local rank and that the planner's memory per GPU fits (openprime.train.hardware). `--dry-run`
builds the model on the meta device, applies the FSDP2 plan over a fake group of the node's local ranks,
prints the shards and the plan for H100s, and fails the same way if the model does not fit them; with `--resume`
it checks the checkpoint as the launch would (checksums, model, local ranks), all but the data layout.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pathlib
import re
import shlex
import signal
import socket
import sys

import torch

from openprime.ckpt import Checkpoint, list_steps
from openprime.ckpt.store import verify_log
from openprime.core.auth import AuthConfig
from openprime.core.config import override_all, split_overrides
from openprime.core.errors import ConfigError, OpenPrimeError
from openprime.mesh import Coordinator, MeshConfig
from openprime.train.config import RunConfig, TransportKind
from openprime.train.data import PreparedData, prepare_data
from openprime.train.hardware import check_hardware
from openprime.train.metrics import METRICS_FILE, records_of_kind
from openprime.train.processes import nodes_hold_run_lock
from openprime.train.recipe import loaded_recipe_files, recipe_config
from openprime.train.resuming import check_resume_spec, resume_from, set_aside
from openprime.train.run_lock import RunDirInUse, RunDirLock, new_run_dir
from openprime.train.site import site_overrides
from openprime.train.transports import check_installed, codec_for


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openprime", description="Decentralised training with DiLoCo.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a recipe: several nodes on this machine")
    run.add_argument("recipe", type=pathlib.Path, help="path of the recipe file, e.g. recipes/debug.py")
    run.add_argument("--nodes", type=int, default=2, help="number of nodes to start on this machine (default 2)")
    run.add_argument("--run-dir", type=pathlib.Path, default=None,
                     help="where config, recipe and metrics go (default runs/NAME-TIMESTAMP)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config field, e.g. --set diloco.num_inner_steps=10 (repeatable)")
    run.add_argument("--network", type=pathlib.Path, default=None, metavar="SITE.toml",
                     help="site file: transport, its options and timeouts for this network")
    run.add_argument("--transport", choices=[k.value for k in TransportKind], default=None,
                     help="swap the transport for this run (same as --set transport.kind=NAME)")
    run.add_argument("--join", default=None, metavar="HOST:PORT",
                     help="join the run of the coordinator at HOST:PORT (see `openprime mesh serve`), "
                          "at its start or mid-run, instead of starting a coordinator here")
    run.add_argument("--resume", default=None, metavar="latest|PATH",
                     help="continue from a checkpoint: `latest` (the newest complete one of --run-dir) or the "
                          "path of a checkpoint step directory or root")
    run.add_argument("--dry-run", action="store_true",
                     help="build the config and the model on the meta device, print them, start nothing; with "
                          "--resume, check the checkpoint too")
    mesh = commands.add_parser("mesh", help="membership services").add_subparsers(dest="mesh_command", required=True)
    serve = mesh.add_parser("serve", help="run a standalone coordinator for a multi-machine run")
    serve.add_argument("--bind", default="tcp://0.0.0.0:29500", help="address to listen on (default tcp://0.0.0.0:29500)")
    serve.add_argument("--store-port", type=int, default=0, help="port of the rendezvous store (default: any free)")
    serve.add_argument("--min-nodes", type=int, default=1, help="nodes that must join before the first outer step")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one MeshConfig field, e.g. --set heartbeat_interval_s=1")
    export = commands.add_parser("export", help="write a Hugging Face Llama checkpoint of a run or checkpoint")
    export.add_argument("source", type=pathlib.Path, metavar="RUN_OR_CHECKPOINT",
                        help="a run directory (its newest checkpoint), a checkpoint root, step or part")
    export.add_argument("out_dir", type=pathlib.Path, metavar="OUT_DIR", help="new directory to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the exported weights (default float32)")
    status = commands.add_parser("status", help="where a run stands: its launch, nodes, outer step and checkpoints")
    status.add_argument("run_dir", type=pathlib.Path, metavar="RUN_DIR", help="the run's --run-dir")
    plan = commands.add_parser("plan", help="memory, compute and communication of a recipe, computed by hand")
    plan.add_argument("recipe", type=pathlib.Path, help="path of the recipe file, e.g. recipes/intellect1_10b.py")
    plan.add_argument("--nodes", type=int, required=True, help="number of nodes (DiLoCo replicas)")
    plan.add_argument("--bandwidth", required=True, metavar="RATE",
                      help="bandwidth of each node to its ring neighbour, e.g. 1.6gbit, 500mbit, 100MB/s")
    plan.add_argument("--gpus-per-node", type=int, default=None,
                      help="GPUs per node, FSDP inside it (default: the recipe's fsdp.num_local_ranks)")
    plan.add_argument("--gpu", default="h100", help="h100, h100-pcie, h200 or a100 (default h100)")
    plan.add_argument("--mfu", type=float, default=None,
                      help="MFU of the inner steps as a fraction (default 0.433, the paper's without communication)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override one config field, e.g. --set diloco.compression=int8 (repeatable)")
    return parser


def print_plan(args: argparse.Namespace) -> int:
    """`openprime plan`: the planner's numbers; exit status 1 if the model does not fit the GPUs."""
    from openprime.train import planner

    try:
        # Said here, as the flag: planner.with_node's check named FSDPConfig.num_local_ranks, which the user had not
        # set (found 2026-12-07 by review).
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        cfg = recipe_config(args.recipe, args.overrides)
        mfu = planner.NO_COMM_MFU if args.mfu is None else args.mfu
        plan = planner.plan_run(cfg, num_nodes=args.nodes, bandwidth_bps=planner.parse_bandwidth(args.bandwidth),
                                gpus_per_node=args.gpus_per_node, gpu=args.gpu, mfu=mfu)
    except ConfigError as e:
        return _error(str(e))
    print(f"plan of {cfg.name!r} ({args.recipe})\n{planner.format_plan(plan)}")
    if not plan.fits:
        try:
            planner.check_fits(planner.with_node(cfg, gpus_per_node=args.gpus_per_node), plan.gpu)
        except ConfigError as e:  # what to change, as `openprime run` would say it (here --gpus-per-node, if given,
            # sets the local ranks: a --set of them would be overridden)
            message = str(e)
            if args.gpus_per_node is not None:
                message = re.sub(r"--set fsdp\.num_local_ranks=(\d+)", r"--gpus-per-node \1", message)
            print(f"openprime: {message}", file=sys.stderr)
    return 0 if plan.fits else 1


def print_status(args: argparse.Namespace) -> int:
    """`openprime status RUN_DIR`."""
    from openprime.train.status import format_status, run_status

    try:
        print(format_status(run_status(args.run_dir.resolve()), args.run_dir.resolve()))
    except (OpenPrimeError, OSError, ValueError, KeyError) as e:
        return _error(f"cannot read the run in {args.run_dir}: {e}")
    return 0


def _site_file_overrides(path: pathlib.Path) -> list[str]:
    """site_overrides(path), an unreadable site file a ConfigError: `--network` given a directory, a file this user
    may not read or one that is not text was a Python traceback (IsADirectoryError, PermissionError,
    UnicodeDecodeError) out of the command (found 2026-12-07 by review)."""
    try:
        return site_overrides(path)
    except OSError as e:
        raise ConfigError(f"cannot read the site file {path}: {e.strerror or e}; give --network the path of a "
                          f"TOML file (e.g. site.toml)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"site file {path} is not text (not UTF-8); give --network the path of a TOML file "
                          f"(e.g. site.toml)") from None


def _error(message: str) -> int:
    print(f"openprime: error: {message}", file=sys.stderr)
    return 2


def export_model(args: argparse.Namespace) -> int:
    """`openprime export`: the newest (or given) checkpoint as config.json + model.safetensors."""
    from openprime.train.checkpointing import load_model_weights
    from openprime.train.export import check_out_dir, find_tokenizer, write_hf_checkpoint

    try:
        check_out_dir(args.out_dir)
        model_cfg, weights, part = load_model_weights(args.source)
    except OSError as e:
        return _error(f"cannot read {args.source}: {e.strerror or e} ({e.filename or args.source})")
    except OpenPrimeError as e:
        return _error(str(e))
    tokenizer = find_tokenizer(args.source, part)
    try:
        write_hf_checkpoint(weights, model_cfg, args.out_dir, dtype=getattr(torch, args.dtype), tokenizer=tokenizer)
    except OSError as e:  # a full disk, a read-only one: nothing is left there (the export is written atomically)
        return _error(f"cannot write the export to {args.out_dir}: {e.strerror or e} ({e.filename or args.out_dir}); "
                      f"free space, or choose another OUT_DIR")
    except OpenPrimeError as e:
        return _error(str(e))
    out = repr(str(args.out_dir))
    if tokenizer is not None:
        print(f"openprime: exported {part} and the run's tokenizer to {args.out_dir} ({args.dtype}); load them with "
              f"transformers.LlamaForCausalLM.from_pretrained({out}) and transformers.AutoTokenizer.from_pretrained("
              f"{out})")
    else:  # the weights are still worth having: the tokenizer can be added by hand
        print(f"openprime: exported {part} to {args.out_dir} ({args.dtype}) without a tokenizer: no tokenizer.json in "
              f"the run directory of {args.source} (launches before 2026-12-08 wrote none; it is in the data cache, "
              f"`tokenizer.json` of ~/.cache/openprime/data-*, or export from the run directory); load it with "
              f"transformers.LlamaForCausalLM.from_pretrained({out})")
    return 0


def serve_mesh(args: argparse.Namespace) -> int:
    """`openprime mesh serve`: a coordinator on this machine until interrupted."""
    if args.min_nodes < 1:
        return _error(f"--min-nodes {args.min_nodes}: the first outer step needs at least 1 node")
    try:
        items = split_overrides(args.overrides, example="heartbeat_interval_s=1")
        try:
            cfg = override_all(MeshConfig(min_nodes=args.min_nodes), items)
        except ConfigError as e:  # the mesh settings' names here: --min-nodes, and --set KEY=VALUE without "mesh."
            message = re.sub(r"Set mesh\.min_nodes=", "Give --min-nodes ", str(e))
            message = re.sub(r"mesh\.(\w+)=", r"--set \1=", message.replace("mesh.min_nodes", "--min-nodes"))
            raise ConfigError(message.replace("mesh.", "").replace("Set --set ", "Use --set ")) from None
        bind = args.bind if "://" in args.bind else f"tcp://{args.bind}"
        check_join_address(bind, "--bind")
        coordinator = Coordinator(cfg, bind=bind, store_port=args.store_port)
    except ConfigError as e:
        return _error(str(e))
    host, port = coordinator.address.split("://")[-1].rsplit(":", 1)
    store_port = coordinator.store.rsplit(":", 1)[1]
    where = ""
    if host in ("0.0.0.0", "*"):  # every interface: the nodes need one of this machine's addresses
        host, where = "HOST", f", HOST being an address of this machine that they reach (e.g. {socket.gethostname()})"
    print(f"openprime: coordinator at {coordinator.address} and its rendezvous store at port {store_port} (both must "
          f"be reachable from the nodes); nodes join with `openprime run RECIPE --join {host}:{port}`{where}",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        coordinator.serve_forever()
    return 0


class _SayOnStderr(logging.Handler):
    """A library's word meant for the person at the command (openprime.ckpt's "checking the checksums of ...
    about 200 s" before a resume's nodes start), as one of the command's own lines."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            print(f"openprime: {record.getMessage()}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    if not any(isinstance(h, _SayOnStderr) for h in verify_log.handlers):  # once per process (tests call main often)
        verify_log.addHandler(_SayOnStderr())
        verify_log.setLevel(logging.INFO)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the nodes started (a launch handles its own): the data, a checksum check
        print("openprime: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "mesh":
        return serve_mesh(args)
    if args.command == "export":
        return export_model(args)
    if args.command == "plan":
        return print_plan(args)
    if args.command == "status":
        return print_status(args)
    try:
        if args.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
        if args.join:
            check_join_address(args.join)
        overrides = _site_file_overrides(args.network) if args.network else []
        if args.transport:
            overrides.append(f"transport.kind={args.transport}")
        overrides += args.overrides
        cfg = recipe_config(args.recipe, overrides)
        if args.nodes > cfg.mesh.max_nodes:  # the nodes past the data slots were refused, the others waited for ever
            raise ConfigError(f"--nodes {args.nodes} is more than mesh.max_nodes={cfg.mesh.max_nodes}, the data slots "
                              f"the run cuts its data into (one a node): add --set mesh.max_nodes={args.nodes}"
                              + (" (a resumed run: with --set data.on_layout_change=restart)" if args.resume else ""))
        check_resume_spec(args.resume, cfg, args.run_dir)  # before a run directory is made for nothing
        check_installed(cfg.transport)
        codec_for(cfg.diloco.compression)
        check_secrets(cfg)
        if args.dry_run:
            from openprime.train.dry_run import dry_run, dry_run_resume

            dry_run(cfg, args.nodes)
            if args.resume:  # it was ignored: a dry run said nothing of a checkpoint that could not be resumed
                try:
                    dry_run_resume(args.resume, cfg, args.run_dir, num_nodes=args.nodes)
                except OpenPrimeError as e:  # CheckpointNotFound, CorruptCheckpoint: as the launch says them
                    return _error(str(e))
            return 0
        check_hardware(cfg, num_nodes=args.nodes)  # on CUDA: GPUs for the local ranks, large enough for the nodes
        # The tokenizer and the token streams (cached): a missing dataset or an unwritable cache is said here,
        # before a run directory is made (it was a traceback out of the launch).
        prepared = prepare_data(cfg.data)
        if cfg.train.eval_every:  # a validation split too small for one sequence stopped the nodes at their first eval
            from openprime.train.trainer import eval_batches

            eval_batches(cfg, prepared)
    except ConfigError as e:
        return _error(str(e))

    run_dir = (args.run_dir or pathlib.Path("runs")).resolve()  # what an error names until the run's is made
    try:  # the lock is held until the nodes have stopped
        if args.run_dir is None:
            run_dir, lock = new_run_dir(pathlib.Path("runs"), cfg.name, shared=bool(args.join))
        else:
            # Held by a launch with its own coordinator, a --join launch may write beside it if it joins that very
            # run (checked in _start); a resume restarts its nodes, never beside a run.
            lock = RunDirLock(run_dir, shared=bool(args.join), beside=bool(args.join and not args.resume))
    except RunDirInUse as e:
        return _error(str(e))
    except OSError as e:
        return _unwritable(run_dir, e)
    in_use = lock.beside
    # The nodes hold the lock too, until the last has exited (a killed launcher's nodes live on for seconds).
    with lock, nodes_hold_run_lock(lock.fileno):
        return _start(args, cfg, run_dir, overrides, prepared, in_use=in_use)


def check_secrets(cfg: RunConfig) -> None:
    """The secret files the run signs with can be read and are long enough (ConfigError naming the setting): the
    coordinator and the nodes read them as they start, and a missing one was a traceback from the launcher or a
    refusal of every node, after the run directory was made."""
    cfg.transport.options.auth.load_secret("transport.options.auth.secret_file")
    AuthConfig(run_id=cfg.mesh.run_id, secret_file=cfg.mesh.secret_file).load_secret("mesh.secret_file")


def _unwritable(run_dir: pathlib.Path, e: OSError) -> int:
    return _error(f"cannot write the run directory {run_dir}: {e.strerror or e} ({e.filename or run_dir}); choose "
                  f"another with --run-dir")


def _start(args: argparse.Namespace, cfg: RunConfig, run_dir: pathlib.Path, overrides: list[str],
           prepared: PreparedData, *, in_use: bool) -> int:
    """The launch, once it holds its run directory (or, `in_use`, joins the run of the launch that holds it): the
    directory and the checkpoint checked, the run's files written, the nodes started and waited for."""
    from openprime.train.checkpointing import checkpoint_root
    from openprime.train.launcher import launch, write_run_files

    resume = None
    try:
        first_node = _check_run_dir(args, cfg, run_dir, in_use=in_use)
        if args.resume:
            resume, other_timeline = resume_from(args.resume, cfg, run_dir, prepared, num_nodes=args.nodes,
                                                 joined=bool(args.join))
            if resume.step >= cfg.train.num_steps:
                return _nothing_to_train(resume, cfg.train.num_steps, run_dir)
            if other_timeline:  # once the launch goes ahead
                set_aside(checkpoint_root(cfg.checkpoint, run_dir), other_timeline, resume.step)
    except OpenPrimeError as e:
        return _error(str(e))
    try:
        write_run_files(run_dir, cfg, recipe=args.recipe.resolve(), recipe_files=loaded_recipe_files(),
                        overrides=overrides, num_nodes=args.nodes, resumed_from=resume.path if resume else None,
                        joined=in_use, tokenizer=prepared.tokenizer_path)
    except OSError as e:
        return _unwritable(run_dir, e)
    return launch(cfg, num_nodes=args.nodes, run_dir=run_dir, coordinator=args.join, resume=resume,
                  first_node=first_node, recipe_args=recipe_args(args))


def recipe_args(args: argparse.Namespace) -> str:
    """The recipe and the flags that shaped its config, as typed: the command that continues a run repeats them
    (without its `--set`s a resume trained on under the recipe's own settings, or was refused for another model)."""
    words = [str(args.recipe)]
    if args.network:
        words += ["--network", str(args.network)]
    if args.transport:
        words += ["--transport", args.transport]
    for override in args.overrides:
        words += ["--set", override]
    return shlex.join(words)


def _nothing_to_train(resume: Checkpoint, num_steps: int, run_dir: pathlib.Path) -> int:
    """A checkpoint at or past train.num_steps: say so, start no node (before, the nodes started, trained nothing
    and the run said "done", also when a mistyped train.num_steps was below the checkpoint's step)."""
    more = f"--set train.num_steps={2 * resume.step} (the schedule's cooldown moves to the new end)"
    if resume.step == num_steps:
        print(f"openprime: the run is complete: {resume.path} is at train.num_steps={num_steps}; to train it further "
              f"resume with {more}; export it with `openprime export {shlex.quote(str(run_dir))} OUT_DIR`", flush=True)
        return 0
    print(f"openprime: error: {resume.path} is at inner step {resume.step}, past train.num_steps={num_steps}: there "
          f"is nothing to train. Resume with train.num_steps above {resume.step}, e.g. {more}", file=sys.stderr)
    return 2


def check_join_address(address: str, flag: str = "--join") -> None:
    """`--join HOST:PORT` (or `mesh serve --bind`): a host and a port number from 1 to 65535 (ConfigError otherwise;
    before, nodes failed with a ZeroMQ traceback or waited for a port that cannot exist)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if ":" in host:  # [::1]:29500: the coordinator's store and sockets would need IPv6 set up throughout
        raise ConfigError(f"{flag} {address!r}: IPv6 addresses are not supported yet; use an IPv4 address or a "
                          f"hostname that resolves to one")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        what = ("HOST:PORT of the run's coordinator, e.g. 203.0.113.7:29500 (`openprime mesh serve` prints it)"
                if flag == "--join" else "tcp://HOST:PORT to listen on, e.g. tcp://0.0.0.0:29500")
        raise ConfigError(f"{flag} {address!r}: expected {what}, with a port from 1 to 65535")


def _check_run_dir(args: argparse.Namespace, cfg: RunConfig, run_dir: pathlib.Path, *, in_use: bool = False) -> int:
    """A run directory that holds a run is continued (`--resume latest`), not started again; one whose run saved no
    checkpoint (it ended before its first) can be neither. A launch joining a run without a checkpoint may share
    the directory of the run it joins (one disk for several launches), and no other run's: its nodes' records and
    checkpoints would mix with that run's, and its first saves would be pruned as older than that run's newest.
    Returns the number of this launch's first node (past the nodes of the launch it shares the directory with)."""
    from openprime.train.checkpointing import checkpoint_root, resolved_config, run_checkpoint_root

    if args.join and not args.resume:
        return _check_shared_run_dir(cfg, run_dir, args.join, in_use=in_use)
    root = checkpoint_root(cfg.checkpoint, run_dir)
    if not args.resume and cfg.checkpoint.directory and (steps := list_steps(root)):
        # A checkpoint.directory outside the run directory is not new with it: a new run saved beside another run's
        # steps there, and its `--resume latest` continued theirs (found 2026-12-08 by review).
        listed = f"{steps[:3]}{' ... ' + str(steps[-1]) if len(steps) > 3 else ''}"
        raise ConfigError(f"checkpoint.directory {root} already holds checkpoints (steps {listed}) of another run or "
                          f"of an earlier launch of this one: a new run would save beside them and a later --resume "
                          f"latest would continue theirs. Continue that run with --resume latest and its --run-dir, or "
                          f"give this run another checkpoint.directory (or move them out of {root})")
    if args.resume not in (None, "latest") or not (run_dir / METRICS_FILE).exists():
        return 0
    resolved = resolved_config(run_dir)
    saved_in = run_checkpoint_root(run_dir, resolved) if resolved is not None else root
    if not list_steps(root) and saved_in != root and list_steps(saved_in):
        raise ConfigError(f"{run_dir} holds a run that saves its checkpoints in {saved_in} (checkpoint.directory of "
                          f"its last launch), not in {root}: add "
                          f"--set checkpoint.directory={shlex.quote(str(saved_in))}")
    if not list_steps(root):
        raise ConfigError(f"{run_dir} holds a run that saved no checkpoint (it ended before its first one, at inner "
                          f"step {cfg.checkpoint.interval_steps}): there is nothing to resume; start it again in "
                          f"another --run-dir, or remove this one")
    if not args.resume:
        raise ConfigError(f"{run_dir} already holds a run; continue it with --resume latest, "
                          f"or choose another --run-dir")
    return 0


def _check_shared_run_dir(cfg: RunConfig, run_dir: pathlib.Path, coordinator: str, *, in_use: bool = False) -> int:
    """A fresh launch joining `coordinator` may write into `run_dir` only if the run there is the live one; returns
    the number its first node takes there (past the node numbers in the directory's records). `in_use`: another
    launch on this machine holds the directory (openprime.train.run_lock)."""
    from openprime.mesh import MeshClient

    starts = list(records_of_kind(run_dir, "start"))
    node_ids = {r.get("node_id", "") for r in starts} - {""}
    if not node_ids:
        if in_use:  # its nodes have not written a record yet: which run they are in, and their numbers, are unknown
            raise ConfigError(f"{run_dir} is in use by another openprime launch whose nodes have not started yet: "
                              f"join once they have, or give this launch another --run-dir")
        return 0
    client = MeshClient(coordinator, cfg.mesh, node_id="cli-run-dir-check")
    try:
        live = set(client.status()["nodes"])
    except OpenPrimeError as e:
        raise ConfigError(f"could not ask the coordinator at {coordinator} whether the run in {run_dir} is the one "
                          f"being joined: {e}") from e
    finally:
        client.close(leave=False)
    if not live & node_ids:
        raise ConfigError(f"{run_dir} holds a run whose nodes are not in the run at {coordinator}: continue that run "
                          f"with --resume latest, or give this launch another --run-dir")
    return 1 + max(int(r.get("node", 0)) for r in starts)


if __name__ == "__main__":  # as the `openprime` command does it (openprime.train.entry), less its early start
    from openprime.train.entry import main as entry_main

    sys.exit(entry_main())
