"""The Llama-3 decoder that INTELLECT-1 trained (arXiv 2412.01152, section 3), written torchtitan-style.

Architecture (Llama 3, arXiv 2407.21783; torchtitan `models/llama`): token embedding, `num_layers`
pre-norm blocks of grouped-query attention with rotary position embeddings and a SwiGLU feed-forward,
a final RMSNorm and an untied output projection. INTELLECT-1 is the "10B" flavor below: 42 layers,
dim 4096, 32 query heads sharing 8 KV heads, FFN 14336, vocab 128256, RoPE theta 500000.

The model builds under `torch.device("meta")` without allocating, so a 10B run can be planned (and
counted) on a laptop; after `to_empty(device=...)` the caller runs `init_weights`, which also recomputes
the RoPE tables (non-persistent buffers are not in checkpoints and come back empty from `to_empty`).

Shape legend for tensor names (`x_BLD` is batch x sequence x model dim):
    B batch, L sequence length, D model dim, H query heads, K kv heads, E head dim (D / H),
    F ffn hidden dim, V vocab size.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F  # noqa: N812 (the universal torch spelling)
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from openprime.core.config import config, field, one_of_enum, positive_float, positive_int
from openprime.core.errors import ConfigError


class InitScheme(enum.Enum):
    """How the std of the projections that write into the residual stream (wo, w2, w3) is scaled."""

    DEPTH = "depth"  # torchtitan depth_init: 0.02 / sqrt(2 * (layer_id + 1)), deeper layers smaller
    GLOBAL = "global"  # 0.02 / sqrt(2 * num_layers) for every layer (GPT-2 style)


@config
class ModelConfig:
    """Shape of a Llama-3 model (torchtitan `ModelArgs`). Defaults are INTELLECT-1 10B."""

    dim: int = field(4096, doc="model (residual stream) width D", validator=positive_int())
    num_layers: int = field(42, doc="number of transformer blocks", validator=positive_int())
    num_heads: int = field(32, doc="number of query heads H; head dim is dim / num_heads",
                           validator=positive_int())
    num_kv_heads: int = field(8, doc="number of key/value heads K (grouped-query attention)",
                              validator=positive_int())
    vocab_size: int = field(128256, doc="vocabulary size V; must match the tokenizer",
                            validator=positive_int())
    ffn_dim_multiplier: float | None = field(
        1.3, doc="Llama multiplier on the SwiGLU hidden size 8*dim/3 (None for 1.0)",
        validator=attrs.validators.optional(positive_float()))
    multiple_of: int = field(1024, doc="the SwiGLU hidden size is rounded up to a multiple of this",
                             validator=positive_int())
    norm_eps: float = field(1e-5, doc="RMSNorm epsilon", validator=positive_float())
    rope_theta: float = field(500000.0, doc="RoPE base frequency theta", validator=positive_float())
    max_seq_len: int = field(8192, doc="longest sequence the RoPE tables cover", validator=positive_int())
    init: InitScheme = field(InitScheme.DEPTH, doc="std scaling of residual-writing projections",
                             validator=one_of_enum(InitScheme))

    def __attrs_post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ConfigError(f"ModelConfig: dim {self.dim} is not divisible by num_heads {self.num_heads}; "
                              f"choose num_heads dividing dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig: num_heads {self.num_heads} is not divisible by num_kv_heads "
                              f"{self.num_kv_heads}; choose num_kv_heads dividing num_heads")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig: head dim (dim / num_heads) = {self.head_dim} is odd, but RoPE "
                              f"rotates pairs of channels; choose dim and num_heads so that it is even")

    @property
    def head_dim(self) -> int:
        """E, the width of one attention head."""
        return self.dim // self.num_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """F, the SwiGLU hidden width."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


FLAVORS: dict[str, ModelConfig] = {
    # Small enough to train on a laptop CPU in seconds; F = 341 rounded up to 384. ~1.8M parameters.
    "debug": ModelConfig(dim=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=4096,
                         ffn_dim_multiplier=None, multiple_of=64, norm_eps=1e-5, rope_theta=500000.0,
                         max_seq_len=256, init=InitScheme.DEPTH),
    # INTELLECT-1 (arXiv 2412.01152, table 1): the Llama-3 8B shape with 42 instead of 32 layers.
    "10B": ModelConfig(dim=4096, num_layers=42, num_heads=32, num_kv_heads=8, vocab_size=128256,
                       ffn_dim_multiplier=1.3, multiple_of=1024, norm_eps=1e-5, rope_theta=500000.0,
                       max_seq_len=8192, init=InitScheme.DEPTH),
}


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU hidden width F, as Llama computes it.

    A plain FFN uses 4*dim; SwiGLU has three matrices instead of two, so Llama takes 2/3 of that to
    keep the parameter count, scales by `ffn_dim_multiplier`, and rounds up to `multiple_of` for
    matmul-friendly shapes. For dim 4096, multiplier 1.3, multiple_of 1024:
    int(8*4096/3) = 10922, int(1.3 * 10922) = 14198, rounded up to 14336 (= 14 * 1024).
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def count_parameters(cfg: ModelConfig) -> int:
    """Number of parameters of `Llama(cfg)`, by hand from the shapes (no model is built).

    Per layer: wq D*H*E, wk and wv D*K*E each, wo H*E*D, SwiGLU 3*D*F, two RMSNorm weights of D.
    Plus the untied embedding and output matrices (V*D each) and the final norm (D).
    INTELLECT-1: 2*128256*4096 + 42*(2*4096*4096 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 4096
    = 10,211,381,248.
    """
    D, H, K, E = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F_, V = cfg.ffn_hidden_dim, cfg.vocab_size
    attention = D * H * E + 2 * D * K * E + H * E * D
    per_layer = attention + 3 * D * F_ + 2 * D
    return 2 * V * D + cfg.num_layers * per_layer + D


def num_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, the torchtitan / PaLM (arXiv 2204.02311, app. B) way.

    6N: each non-embedding parameter costs one multiply-add (2 FLOPs) per token forward and twice that
    backward. N excludes the token embedding (a lookup, not a matmul) but includes the output layer.
    12 * num_layers * dim * seq_len: attention scores QK^T and the weighted sum AV are two matmuls of
    seq_len * dim multiply-adds per token per layer (4 * L * D FLOPs forward), times 3 for forward and
    backward. Like torchtitan this counts the full square, not the causal half, so MFU figures compare.
    """
    num_params = count_parameters(cfg) - cfg.vocab_size * cfg.dim
    return 6 * num_params + 12 * cfg.num_layers * cfg.dim * seq_len


# ---------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) with a learned gain, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        # Normalising in float32 matters under bf16 autocast: the mean of squares loses precision fast.
        x32_BLD = x_BLD.float()
        normed_BLD = x32_BLD * torch.rsqrt(x32_BLD.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed_BLD.type_as(x_BLD) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles (Su et al. 2021), each (max_seq_len, head_dim / 2), float32.

    Channel pair i of position p is rotated by angle p * theta^(-2i / head_dim): low pairs spin fast,
    high pairs slowly, so that theta = 500000 reaches wavelengths beyond the 8192-token context. On the meta
    device, two empty tables: torch.arange there imports torch._dynamo (about 2 s of a node's start) to compute
    nothing.
    """
    if torch.empty(0, device=device).is_meta:
        return (torch.empty(max_seq_len, head_dim // 2, device=device),
                torch.empty(max_seq_len, head_dim // 2, device=device))
    freqs_E2 = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions_L = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles_LE2 = torch.outer(positions_L, freqs_E2)
    return angles_LE2.cos(), angles_LE2.sin()


def apply_rope(x_BLHE: torch.Tensor, cos_LE2: torch.Tensor, sin_LE2: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x[2i], x[2i+1]) of every head by the position's angles.

    Adjacent pairs, not halves, as in Meta's Llama code (`view_as_complex` over the last dim), so that
    Llama checkpoints load unchanged. In complex form: (x0 + i x1) * (cos + i sin).
    """
    B, L, H, E = x_BLHE.shape
    pairs = x_BLHE.float().reshape(B, L, H, E // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos = cos_LE2[:L].view(1, L, 1, E // 2)
    sin = sin_LE2[:L].view(1, L, 1, E // 2)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.reshape(B, L, H, E).type_as(x_BLHE)


def repeat_kv(x_BLKE: torch.Tensor, num_repeats: int) -> torch.Tensor:
    """Expand K kv heads to H = K * num_repeats: query head h reads kv head h // num_repeats."""
    if num_repeats == 1:
        return x_BLKE
    B, L, K, E = x_BLKE.shape
    return x_BLKE[:, :, :, None, :].expand(B, L, K, num_repeats, E).reshape(B, L, K * num_repeats, E)


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): H query heads share K key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)

    def init_weights(self, out_std: float, generator: torch.Generator | None) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, 0.02, generator)
        _trunc_normal(self.wo.weight, out_std, generator)

    def forward(self, x_BLD: torch.Tensor, cos_LE2: torch.Tensor, sin_LE2: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q_BLHE = apply_rope(self.wq(x_BLD).view(B, L, self.num_heads, self.head_dim), cos_LE2, sin_LE2)
        k_BLKE = apply_rope(self.wk(x_BLD).view(B, L, self.num_kv_heads, self.head_dim), cos_LE2, sin_LE2)
        v_BLKE = self.wv(x_BLD).view(B, L, self.num_kv_heads, self.head_dim)
        # Repeating kv explicitly (as torchtitan does) rather than SDPA's enable_gqa keeps every SDPA
        # backend (flash, memory-efficient, cuDNN, math) available; the copy is K/H of the q size.
        num_repeats = self.num_heads // self.num_kv_heads
        k_BLHE, v_BLHE = repeat_kv(k_BLKE, num_repeats), repeat_kv(v_BLKE, num_repeats)
        out_BHLE = F.scaled_dot_product_attention(
            q_BLHE.transpose(1, 2), k_BLHE.transpose(1, 2), v_BLHE.transpose(1, 2), is_causal=True)
        return self.wo(out_BHLE.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float, generator: torch.Generator | None) -> None:
        # torchtitan scales w3 like w2: both feed the product that w2 writes into the residual stream.
        _trunc_normal(self.w1.weight, 0.02, generator)
        _trunc_normal(self.w2.weight, out_std, generator)
        _trunc_normal(self.w3.weight, out_std, generator)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BLD)) * self.w3(x_BLD))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, layer_id: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.init is InitScheme.DEPTH:
            self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        else:
            self.out_std = 0.02 / math.sqrt(2 * cfg.num_layers)

    def init_weights(self, generator: torch.Generator | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std, generator)
        self.feed_forward.init_weights(self.out_std, generator)

    def forward(self, x_BLD: torch.Tensor, cos_LE2: torch.Tensor, sin_LE2: torch.Tensor) -> torch.Tensor:
        h_BLD = x_BLD + self.attention(self.attention_norm(x_BLD), cos_LE2, sin_LE2)
        return h_BLD + self.feed_forward(self.ffn_norm(h_BLD))


def _trunc_normal(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    # Cut at +-3 std. (torchtitan passes absolute bounds +-2, which at std 0.02 is no cut at all; a
    # relative cut keeps the same shape for every std, including the output layer's dim**-0.5.)
    _fill_random(weight, lambda w: nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std,
                                                          generator=generator))


def _fill_random(weight: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Fill `weight` in place with `fill`; a sharded (FSDP2 DTensor) weight gets the rows it holds of the full
    tensor drawn from the same generator stream, so the initial model does not depend on the sharding."""
    if not isinstance(weight, DTensor):
        fill(weight)
        return
    local = weight.to_local()
    full = torch.empty(weight.shape, dtype=weight.dtype, device=local.device)
    fill(full)
    # src_data_rank=None: every rank slices its own copy of `full`, no communication.
    local.copy_(distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None).to_local())


# ---------------------------------------------------------------- the model


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding; on the meta device without its own initialisation, a normal_() that imports torch._dynamo
    there (about 2 s of every node's start on this machine) to fill nothing: init_weights fills it once allocated."""
    if torch.empty(0).is_meta:  # built under `with torch.device("meta")`
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)


class Llama(nn.Module):
    """Llama-3 decoder: `forward(tokens_BL) -> logits_BLV` (float32 logits)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index (torchtitan) keeps parameter names stable when layers are
        # wrapped (FSDP, activation checkpointing) or removed (pipeline stages).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # RoPE tables are derived, not learned: non-persistent, so checkpoints leave them out and
        # init_weights rebuilds them after a meta-device model is materialised with to_empty.
        cos_LE2, sin_LE2 = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos_LE2, persistent=False)
        self.register_buffer("rope_sin", sin_LE2, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0, *, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and rebuild the RoPE buffers, deterministically from `seed`.

        Embeddings N(0, 1); q, k, v and w1 N(0, 0.02); wo, w2, w3 scaled by depth (see InitScheme); norms
        ones; output N(0, dim**-0.5) (torchtitan). `seed=None` draws from torch's global generator
        instead. The same seed gives the same weights on the same device type (CPU and CUDA generators
        produce different streams), sharded or not: an FSDP2 shard holds its rows of the full draw.
        """
        device = self.tok_embeddings.weight.device
        buffer_device = torch.device(buffer_device) if buffer_device is not None else self.rope_cos.device
        cos_LE2, sin_LE2 = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                                       device=buffer_device)
        self.rope_cos, self.rope_sin = cos_LE2, sin_LE2
        if device.type == "meta":
            return  # nothing to fill; a meta model stays a shape-only plan
        generator = None
        if seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
        _fill_random(self.tok_embeddings.weight, lambda w: nn.init.normal_(w, mean=0.0, std=1.0, generator=generator))
        for layer in self.layers.values():
            layer.init_weights(generator)
        self.norm.reset_parameters()
        _trunc_normal(self.output.weight, self.cfg.dim ** -0.5, generator)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        seq_len = tokens_BL.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds ModelConfig.max_seq_len "
                             f"{self.cfg.max_seq_len}; raise max_seq_len or shorten the sequences")
        h_BLD = self.tok_embeddings(tokens_BL)
        for layer in self.layers.values():
            h_BLD = layer(h_BLD, self.rope_cos, self.rope_sin)
        logits_BLV = self.output(self.norm(h_BLD))
        # float32 logits: the softmax over 128k classes and the z-loss on the max logit need the range.
        return logits_BLV.float()


def num_parameters(model: nn.Module) -> int:
    """Parameters of a built model (works on meta: numel needs no storage)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "FLAVORS",
    "Attention",
    "FeedForward",
    "InitScheme",
    "Llama",
    "ModelConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "count_parameters",
    "ffn_hidden_dim",
    "num_flops_per_token",
    "num_parameters",
    "repeat_kv",
    "rope_tables",
]
