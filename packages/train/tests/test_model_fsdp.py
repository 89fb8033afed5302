"""The Llama under FSDP2: built on the meta device, materialised sharded over two local ranks, its initial
weights are exactly the unsharded model's (the init draws each full parameter and keeps its own rows), and
its forward pass gives the same logits."""

import torch

from openprime.core.testing import run_group
from openprime.fsdp import (
    ActivationCheckpointing,
    FSDPConfig,
    destroy_local_mesh,
    init_local_mesh,
    materialize,
    parallelize,
)
from openprime.train.model import Llama, ModelConfig

CFG = ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)


def _body(_transport, ctx) -> dict:
    mesh = init_local_mesh(rank=ctx.rank, world_size=ctx.world_size, rendezvous=ctx.rendezvous, timeout_s=30)
    try:
        with torch.device("meta"):
            sharded = Llama(CFG)
        parallelize(sharded, sharded.layers, mesh,
                    config=FSDPConfig(num_local_ranks=2, activation_checkpointing=ActivationCheckpointing.FULL))
        materialize(sharded, device="cpu", init=lambda: sharded.init_weights(seed=3))
        plain = Llama(CFG)
        plain.init_weights(seed=3)
        exact = all(torch.equal(p.detach().full_tensor(), q) for p, q in
                    zip(sharded.parameters(), plain.parameters(), strict=True))
        tokens_BL = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(ctx.rank))
        with torch.no_grad():
            gap = float((sharded(tokens_BL) - plain(tokens_BL)).abs().max())
        return {"exact": exact, "gap": gap, "names": list(sharded.state_dict()) == list(plain.state_dict())}
    finally:
        destroy_local_mesh()


def test_meta_built_sharded_llama_equals_the_unsharded_one():
    for r in run_group(2, _body, factory=None, timeout_s=120):
        assert r["exact"]
        assert r["gap"] < 1e-5
        assert r["names"]
