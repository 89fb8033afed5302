"""A small version of the INTELLECT-1 recipe that trains on this machine's CPUs in about a minute.

It keeps the paper's algorithm (AdamW inner, Nesterov outer with lr 0.7 and momentum 0.9, max-z-loss,
WSD with 1-sqrt cooldown) and shrinks the model, the sequences, H and the run, on real offline text
(the King James Bible and CPython's standard library): H = 20 inner steps per outer step and 200
steps give 10 outer steps.
"""

import pathlib

import attrs

from openprime.diloco import Compression
from openprime.fsdp import FSDPConfig
from openprime.train.data import DataConfig
from openprime.train.model import FLAVORS
from openprime.train.recipe import load_recipe

base = load_recipe(pathlib.Path(__file__).with_name("intellect1_10b.py"))


def config():
    paper = base.config()
    return attrs.evolve(
        paper,
        name="debug",
        model=FLAVORS["debug"],
        data=DataConfig(vocab_size=FLAVORS["debug"].vocab_size, max_chars_per_source=1_000_000),
        # A tiny model trains at a far higher lr than a 10B one.
        optim=attrs.evolve(paper.optim, lr=3e-3),
        schedule=attrs.evolve(paper.schedule, num_warmup_steps=20, num_decay_steps=40),
        # One process per node, the whole batch in one forward: no sharding, fp32, nothing recomputed.
        train=attrs.evolve(paper.train, num_steps=200, seq_len=128, batch_size=8, micro_batch_size=0, log_every=20),
        fsdp=FSDPConfig(),
        # fp32 pseudo-gradients: on CPU the quantizer costs more than the bytes it saves on loopback
        # (--set diloco.compression=int8 for the paper's).
        diloco=attrs.evolve(paper.diloco, num_inner_steps=20, compression=Compression.NONE),
        mesh=attrs.evolve(paper.mesh, max_nodes=8),
        checkpoint=attrs.evolve(paper.checkpoint, interval_steps=20),
    )
