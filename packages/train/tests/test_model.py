"""Tests of the Llama-3 model: shapes, parameter counts, causality, GQA, RoPE, init, config checks."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from openprime.core.errors import ConfigError
from openprime.train.model import (
    FLAVORS,
    InitScheme,
    Llama,
    ModelConfig,
    apply_rope,
    count_parameters,
    ffn_hidden_dim,
    num_flops_per_token,
    num_parameters,
    rope_tables,
)

DEBUG = FLAVORS["debug"]


def _debug_model(seed: int = 0, **changes) -> Llama:
    model = Llama(attrs.evolve(DEBUG, **changes))
    model.init_weights(seed)
    return model


def test_ffn_hidden_dim_follows_llama():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336  # INTELLECT-1 / Llama-3 8B
    assert FLAVORS["10B"].ffn_hidden_dim == 14336
    assert ffn_hidden_dim(4096, 256, None) == 11008  # Llama-2 7B: int(8*4096/3) = 10922 -> 11008
    assert DEBUG.ffn_hidden_dim == 384  # int(8*128/3) = 341 -> 384


def test_10b_parameter_count_on_meta_device():
    cfg = FLAVORS["10B"]
    D, V, K_E, F_, layers = 4096, 128256, 1024, 14336, 42
    per_layer = 4096 * 4096 + 2 * 4096 * K_E + 4096 * 4096 + 3 * D * F_ + 2 * D  # q, k+v, o, ffn, norms
    by_hand = 2 * V * D + layers * per_layer + D
    assert by_hand == 10_211_381_248

    with torch.device("meta"):
        model = Llama(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert num_parameters(model) == count_parameters(cfg) == by_hand


def test_flops_per_token_is_6n_plus_attention():
    cfg = FLAVORS["10B"]
    non_embedding = count_parameters(cfg) - 128256 * 4096
    assert num_flops_per_token(cfg, 8192) == 6 * non_embedding + 12 * 42 * 4096 * 8192


def test_debug_count_matches_built_model():
    assert num_parameters(Llama(DEBUG)) == count_parameters(DEBUG) == 1_836_160


def test_debug_forward_shapes_and_dtype():
    model = _debug_model()
    tokens_BL = torch.randint(0, DEBUG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logits_BLV = model(tokens_BL)
    assert logits_BLV.shape == (2, 32, DEBUG.vocab_size)
    assert logits_BLV.dtype == torch.float32
    assert torch.isfinite(logits_BLV).all()
    # The output init (std dim**-0.5 on unit-RMS features) starts near the uniform loss ln V.
    loss = torch.nn.functional.cross_entropy(logits_BLV.flatten(0, 1), tokens_BL.flatten())
    assert abs(loss.item() - math.log(DEBUG.vocab_size)) < 1.5


def test_bf16_forward_still_returns_float32_logits():
    model = _debug_model().to(torch.bfloat16)
    model.init_weights(0)  # re-create the RoPE tables in float32 after the cast
    assert model.rope_cos.dtype == torch.float32
    assert model(torch.zeros(1, 8, dtype=torch.long)).dtype == torch.float32


def test_causality():
    model = _debug_model()
    tokens_BL = torch.randint(0, DEBUG.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    changed_BL = tokens_BL.clone()
    changed_BL[0, 25] = (changed_BL[0, 25] + 1) % DEBUG.vocab_size
    with torch.no_grad():
        a_BLV, b_BLV = model(tokens_BL), model(changed_BL)
    torch.testing.assert_close(a_BLV[:, :25], b_BLV[:, :25], rtol=0, atol=1e-5)
    assert not torch.allclose(a_BLV[:, 25:], b_BLV[:, 25:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = _debug_model(num_kv_heads=2)
    mha = Llama(attrs.evolve(DEBUG, num_kv_heads=DEBUG.num_heads))
    repeats, E = DEBUG.num_heads // 2, DEBUG.head_dim
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # (K*E, D) -> one copy per query head: head h reads kv head h // repeats.
            state[name] = w.view(2, E, DEBUG.dim).repeat_interleave(repeats, dim=0).reshape(-1, DEBUG.dim)
    mha.load_state_dict(state)
    tokens_BL = torch.randint(0, DEBUG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens_BL), mha(tokens_BL), rtol=1e-4, atol=1e-4)


def test_rope_scores_depend_only_on_relative_position():
    E = 16
    cos_LE2, sin_LE2 = rope_tables(E, 64, 500000.0)
    gen = torch.Generator().manual_seed(3)
    q_E, k_E = torch.randn(E, generator=gen), torch.randn(E, generator=gen)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        x_BLHE = torch.zeros(1, 64, 2, E)
        x_BLHE[0, q_pos, 0], x_BLHE[0, k_pos, 1] = q_E, k_E
        rotated = apply_rope(x_BLHE, cos_LE2, sin_LE2)
        return rotated[0, q_pos, 0] @ rotated[0, k_pos, 1]

    torch.testing.assert_close(score(10, 3), score(50, 43), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(10, 3), score(10, 4), atol=1e-3)


def test_init_is_deterministic_by_seed():
    a, b, c = _debug_model(seed=0), _debug_model(seed=0), _debug_model(seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_meta_model_materialises_like_a_cpu_model():
    with torch.device("meta"):
        meta = Llama(DEBUG)
    meta.to_empty(device="cpu")
    meta.init_weights(0)
    cpu = _debug_model(seed=0)
    for (name, pm), pc in zip(meta.named_parameters(), cpu.parameters(), strict=True):
        assert torch.equal(pm, pc), name
    assert torch.equal(meta.rope_cos, cpu.rope_cos) and torch.equal(meta.rope_sin, cpu.rope_sin)
    assert "rope_cos" not in meta.state_dict()  # derived, so not checkpointed


@pytest.mark.parametrize(("scheme", "layer", "expected"), [
    (InitScheme.DEPTH, 0, 0.02 / math.sqrt(2)),
    (InitScheme.DEPTH, 3, 0.02 / math.sqrt(8)),
    (InitScheme.GLOBAL, 0, 0.02 / math.sqrt(2 * DEBUG.num_layers)),
])
def test_init_scheme_scales_output_projections(scheme, layer, expected):
    model = _debug_model(init=scheme)
    w2 = model.layers[str(layer)].feed_forward.w2.weight  # 128 x 384 samples
    # Truncation at 3 std shrinks the std by about 1.3%.
    assert w2.std().item() == pytest.approx(expected * 0.987, rel=0.05)
    assert model.layers[str(layer)].attention.wq.weight.std().item() == pytest.approx(0.02 * 0.987, rel=0.05)


@pytest.mark.parametrize(("changes", "names"), [
    ({"dim": 100, "num_heads": 3}, ("dim", "num_heads")),
    ({"num_kv_heads": 3}, ("num_heads", "num_kv_heads")),
    ({"dim": 12, "num_heads": 4, "num_kv_heads": 4}, ("head dim",)),
    ({"dim": 0}, ("ModelConfig.dim",)),
    ({"ffn_dim_multiplier": -1.0}, ("ModelConfig.ffn_dim_multiplier",)),
    ({"init": "depth"}, ("ModelConfig.init",)),
    ({"norm_eps": 0.0}, ("ModelConfig.norm_eps",)),
])
def test_bad_configs_raise_config_error_naming_the_field(changes, names):
    with pytest.raises(ConfigError) as info:
        attrs.evolve(DEBUG, **changes)
    for name in names:
        assert name in str(info.value)


def test_sequence_longer_than_max_seq_len_is_refused():
    model = Llama(attrs.evolve(DEBUG, max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_a_few_steps_fit_one_batch():
    torch.manual_seed(0)
    model = _debug_model()
    tokens_BL = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(4))
    inputs_BL, targets_BL = tokens_BL[:, :-1], tokens_BL[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(inputs_BL).flatten(0, 1), targets_BL.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_flavors_validate_and_default_is_10b():
    assert ModelConfig() == FLAVORS["10B"]
    assert set(FLAVORS) >= {"debug", "10B"}
