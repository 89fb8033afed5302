"""The `openprime` command.

    openprime run RECIPE [--nodes N] [--run-dir DIR] [--network SITE.toml] [--transport gloo|tcp|zmq]
                         [--join HOST:PORT] [--resume latest|PATH] [--set key=value ...] [--dry-run]
    openprime mesh serve [--bind tcp://0.0.0.0:29500] [--min-nodes N] [--set key=value ...]
    openprime export RUN_OR_CHECKPOINT OUT_DIR [--dtype float32|bfloat16]
    openprime plan RECIPE --nodes N --bandwidth 1.6gbit [--gpus-per-node 8] [--gpu h100] [--mfu 0.433]
                          [--set key=value ...]

Everything about an experiment lives in its recipe; a site file holds what belongs to the network
(transport, addresses, secret, shaping, timeouts); `--set` changes one config field for one run and
wins over both. The config is built and validated before any process starts, and a bad value ends the
command with one message naming the field.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import pathlib
import signal
import sys

import torch

from openprime.ckpt import Checkpoint, check_compatible
from openprime.core.config import override
from openprime.core.errors import ConfigError, OpenPrimeError
from openprime.mesh import Coordinator, MeshConfig
from openprime.train.config import RunConfig, TransportKind
from openprime.train.model import Llama, count_parameters, num_flops_per_token
from openprime.train.recipe import loaded_recipe_files, recipe_config
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
                     help="build the config and the model on the meta device, print them, start nothing")
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
    plan = commands.add_parser("plan", help="memory, compute and communication of a recipe, computed by hand")
    plan.add_argument("recipe", type=pathlib.Path, help="path of the recipe file, e.g. recipes/intellect1_10b.py")
    plan.add_argument("--nodes", type=int, required=True, help="number of nodes (DiLoCo replicas)")
    plan.add_argument("--bandwidth", required=True, metavar="RATE",
                      help="bandwidth of each node to its ring neighbour, e.g. 1.6gbit, 500mbit, 100MB/s")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, FSDP inside it (default 8)")
    plan.add_argument("--gpu", default="h100", help="h100, h200 or a100 (default h100)")
    plan.add_argument("--mfu", type=float, default=None,
                      help="MFU of the inner steps as a fraction (default 0.433, the paper's without communication)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override one config field, e.g. --set diloco.compression=int8 (repeatable)")
    return parser


def print_plan(args: argparse.Namespace) -> int:
    """`openprime plan`: the planner's numbers; exit status 1 if the model does not fit the GPUs."""
    from openprime.train import planner

    try:
        cfg = recipe_config(args.recipe, args.overrides)
        mfu = planner.NO_COMM_MFU if args.mfu is None else args.mfu
        plan = planner.plan_run(cfg, num_nodes=args.nodes, bandwidth_bps=planner.parse_bandwidth(args.bandwidth),
                                gpus_per_node=args.gpus_per_node, gpu=args.gpu, mfu=mfu)
    except ConfigError as e:
        print(f"openprime: error: {e}", file=sys.stderr)
        return 2
    print(f"plan of {cfg.name!r} ({args.recipe})\n{planner.format_plan(plan)}")
    return 0 if plan.fits else 1


def export_model(args: argparse.Namespace) -> int:
    """`openprime export`: the newest (or given) checkpoint as config.json + model.safetensors."""
    from openprime.train.checkpointing import load_model_weights
    from openprime.train.export import write_hf_checkpoint

    try:
        model_cfg, weights, part = load_model_weights(args.source)
        write_hf_checkpoint(weights, model_cfg, args.out_dir, dtype=getattr(torch, args.dtype))
    except OpenPrimeError as e:
        print(f"openprime: error: {e}", file=sys.stderr)
        return 2
    print(f"openprime: exported {part} to {args.out_dir} ({args.dtype}); load it with "
          f"transformers.LlamaForCausalLM.from_pretrained({str(args.out_dir)!r})")
    return 0


def serve_mesh(args: argparse.Namespace) -> int:
    """`openprime mesh serve`: a coordinator on this machine until interrupted."""
    try:
        cfg = MeshConfig(min_nodes=max(1, args.min_nodes))
        for item in args.overrides:
            key, _, value = item.partition("=")
            cfg = override(cfg, key.strip(), value.strip())
    except ConfigError as e:
        print(f"openprime: error: {e}", file=sys.stderr)
        return 2
    bind = args.bind if "://" in args.bind else f"tcp://{args.bind}"
    coordinator = Coordinator(cfg, bind=bind, store_port=args.store_port)
    print(f"openprime: coordinator at {coordinator.address}, rendezvous store at {coordinator.store}; "
          f"nodes join with `openprime run RECIPE --join {coordinator.address.split('://')[-1]}`", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        coordinator.serve_forever()
    return 0


def dry_run(cfg: RunConfig, num_nodes: int) -> None:
    """Print the config and the model's size; the model is built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    num_params = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    embed = cfg.model.vocab_size * cfg.model.dim
    tokens_per_outer = cfg.train.batch_size * cfg.train.seq_len * cfg.diloco.num_inner_steps * num_nodes
    print(f"run {cfg.name!r}: {num_nodes} nodes, {cfg.train.num_steps:,} inner steps, "
          f"{cfg.num_outer_steps:,} outer steps of H={cfg.diloco.num_inner_steps}")
    print(f"model: {num_params:,} parameters ({num_params / 1e9:.2f}B; counted by hand: "
          f"{count_parameters(cfg.model):,}); {cfg.model.num_layers} layers, dim {cfg.model.dim}, "
          f"{cfg.model.num_heads} heads, {cfg.model.num_kv_heads} KV heads, FFN {cfg.model.ffn_hidden_dim}, "
          f"vocab {cfg.model.vocab_size}; embeddings + output {2 * embed:,}")
    print(f"compute: {num_flops_per_token(cfg.model, cfg.train.seq_len) / 1e9:.1f} GFLOP per token; "
          f"{tokens_per_outer:,} tokens per outer step across the nodes")
    print(f"host memory per node for the DiLoCo state (fp32 weights, momentum, pseudo-gradient): "
          f"{3 * 4 * num_params / 2**30:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "mesh":
        return serve_mesh(args)
    if args.command == "export":
        return export_model(args)
    if args.command == "plan":
        return print_plan(args)
    try:
        if args.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
        overrides = site_overrides(args.network) if args.network else []
        if args.transport:
            overrides.append(f"transport.kind={args.transport}")
        overrides += args.overrides
        cfg = recipe_config(args.recipe, overrides)
        check_installed(cfg.transport)
        codec_for(cfg.diloco.compression)
    except ConfigError as e:
        print(f"openprime: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        dry_run(cfg, args.nodes)
        return 0
    from openprime.train.launcher import launch, write_run_files

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or pathlib.Path("runs") / f"{cfg.name}-{stamp}").resolve()
    resume = None
    try:
        if args.resume:
            resume = _resume_from(args, cfg, run_dir)
        elif (run_dir / "metrics.jsonl").exists() and not args.join:
            raise ConfigError(f"{run_dir} already holds a run; continue it with --resume latest, "
                              f"or choose another --run-dir")
    except OpenPrimeError as e:
        print(f"openprime: error: {e}", file=sys.stderr)
        return 2
    write_run_files(run_dir, cfg, recipe=args.recipe.resolve(), recipe_files=loaded_recipe_files(),
                    overrides=overrides, num_nodes=args.nodes, resumed_from=resume.path if resume else None)
    return launch(cfg, num_nodes=args.nodes, run_dir=run_dir, coordinator=args.join, resume=resume)


def _resume_from(args: argparse.Namespace, cfg: RunConfig, run_dir: pathlib.Path) -> Checkpoint:
    """The checkpoint that `--resume` names, checked against the nodes asked for."""
    from openprime.train.checkpointing import find_checkpoint

    if args.resume == "latest" and args.run_dir is None and not cfg.checkpoint.directory:
        raise ConfigError("--resume latest needs the --run-dir of the run to continue")
    found = find_checkpoint(args.resume, cfg.checkpoint, run_dir)
    if args.nodes != len(found.parts):
        raise ConfigError(f"checkpoint {found.path} holds {len(found.parts)} nodes ({', '.join(found.parts)}) but "
                          f"--nodes is {args.nodes}: resume with --nodes {len(found.parts)}; more nodes can join "
                          f"afterwards with --join")
    with torch.device("meta"):  # the recipe's model, to compare shapes with the saved one: nothing allocated
        model = Llama(cfg.model)
    check_compatible(found.part(found.parts[0]), {"model": model.state_dict()})
    print(f"openprime: resuming from {found.path} ({len(found.parts)} nodes, checksums verified)", flush=True)
    return found


if __name__ == "__main__":
    sys.exit(main())
