"""Export an openprime Llama as a Hugging Face Llama checkpoint (`config.json` + `model.safetensors`, and the
run's tokenizer when there is one: `tokenizer.json` + `tokenizer_config.json`, for `AutoTokenizer`).

INTELLECT-1 (arXiv 2412.01152) was released as Hugging Face Llama checkpoints, which is how a model
trained here leaves too (issue 6). The architecture is the same (model.py); three things change:

- names: torchtitan's `layers.{i}.attention.wq` is HF's `model.layers.{i}.self_attn.q_proj`, etc.;
- RoPE layout: openprime rotates adjacent channel pairs (Meta's complex form), HF rotates the first
  half of each head against the second half (`rotate_half`), so wq and wk rows are permuted per head
  (the permutation of HF's `convert_llama_weights_to_hf.py`, see `_rope_to_halves`);
- the config: `ModelConfig` fields become `LlamaConfig` keys (`hf_config`).

Only `safetensors` is needed here, not `transformers`: a training node can export without it.

The tokenizer is the byte-level BPE the run trained on its data (openprime.train.data), which a launch copies into
its run directory as `tokenizer.json`: without it the exported model's token ids mean nothing to anyone.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from openprime.core.errors import ConfigError
from openprime.train.data import EOT_TOKEN
from openprime.train.model import Llama, ModelConfig

TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer (a launch copies it into its run directory), and the export's

# openprime name suffix -> HF name suffix, per transformer block.
_LAYER_RENAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_RENAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of a `LlamaForCausalLM` with the shape of `Llama(cfg)`.

    RoPE theta is written both the transformers-4 way (`rope_theta`) and the transformers-5 way
    (`rope_parameters`); the dtype likewise (`torch_dtype` and `dtype`). No special token ids: the
    tokenizer is not part of the model (openprime's data.py puts its end-of-text token at id 0).
    """
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _rope_to_halves(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the output rows of wq or wk from adjacent-pair RoPE to HF's half-split RoPE.

    Within one head of E rows, openprime rotates the pairs (2i, 2i+1) by frequency i; HF rotates
    (i, i + E/2) by frequency i. So HF's row i must be our row 2i and HF's row E/2 + i our row 2i + 1:
    view each head's rows as (E/2 pairs, 2 members), swap to (2 members, E/2 pairs) and flatten, which
    lists all first members (rows 0, 2, 4, ...) then all second members (rows 1, 3, 5, ...). Since q and
    k are both permuted the same way, q.k per head is unchanged; v and wo are not rotated, so they keep
    their order. (HF's `convert_llama_weights_to_hf.py` `permute` is this same reshape.)
    """
    dim_in = weight.shape[1]
    return (weight.view(num_heads, head_dim // 2, 2, dim_in)
            .transpose(1, 2)
            .reshape(num_heads * head_dim, dim_in))


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    # Built on meta: no memory, and always in step with model.py's parameter names and shapes.
    with torch.device("meta"):
        model = Llama(cfg)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _check_matches(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = _expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in state_dict:
            raise ConfigError(f"export: the state dict has no tensor {name!r} (expected shape {tuple(shape)}); "
                              f"pass the full state dict of Llama(cfg) for the cfg it was trained with")
        got = tuple(state_dict[name].shape)
        if got != tuple(shape):
            raise ConfigError(f"export: tensor {name!r} has shape {got} but the model config expects "
                              f"{tuple(shape)}; pass the ModelConfig the state dict was trained with")
    for name in state_dict:
        if name not in expected:
            raise ConfigError(f"export: the state dict has tensor {name!r} of shape {tuple(state_dict[name].shape)} "
                              f"that Llama(cfg) does not have; strip wrapper prefixes such as '_orig_mod.' "
                              f"or pass the ModelConfig the state dict was trained with")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename `Llama(cfg)`'s tensors to `LlamaForCausalLM`'s and permute wq / wk rows for HF's RoPE.

    Raises ConfigError, naming the first mismatched tensor and both shapes, if `state_dict` is not
    exactly the state dict of `Llama(cfg)`. Tensors are returned detached, on their own device.
    """
    _check_matches(state_dict, cfg)
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if name in _TOP_RENAMES:
            hf[_TOP_RENAMES[name]] = tensor
            continue
        _, layer, suffix = name.split(".", 2)  # "layers.{i}.{suffix}"
        if suffix == "attention.wq.weight":
            tensor = _rope_to_halves(tensor, cfg.num_heads, cfg.head_dim)
        elif suffix == "attention.wk.weight":
            tensor = _rope_to_halves(tensor, cfg.num_kv_heads, cfg.head_dim)
        hf[f"model.layers.{layer}.{_LAYER_RENAMES[suffix]}"] = tensor
    return hf


def check_out_dir(out_dir: pathlib.Path) -> None:
    """ConfigError unless `out_dir` is absent or an empty directory: what an export may write into. Checked before
    the checkpoint is read (tens of GB at 10B) and again when it is written."""
    if out_dir.is_symlink() and not out_dir.exists():
        raise ConfigError(f"export: {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist; "
                          f"create that directory or choose another output directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"export: {out_dir} already exists and is not an empty directory; "
                          f"choose a new output directory or remove it first")


def write_hf_checkpoint(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: pathlib.Path,
                        dtype: torch.dtype = torch.float32, tokenizer: pathlib.Path | None = None) -> None:
    """Write `config.json` and `model.safetensors` (tensors cast to `dtype`) into `out_dir`, atomically; with
    `tokenizer` (a run's tokenizer.json) also it and its `tokenizer_config.json`, and its end-of-text id in
    config.json.

    A new `out_dir` is written as a temporary sibling directory that is renamed to `out_dir` at the end, so a
    crash never leaves a half-written checkpoint behind. An existing empty `out_dir` (which may be a mount point,
    such as a container's output volume, or a symbolic link to a directory on another disk: neither can be
    renamed over) is filled from a temporary directory inside it, the weights first and `config.json` last, each
    file renamed whole. `out_dir` must not exist or be empty.
    """
    out_dir = pathlib.Path(out_dir)
    check_out_dir(out_dir)
    tensors = {name: tensor.to("cpu", dtype).contiguous()
               for name, tensor in to_hf_state_dict(state_dict, cfg).items()}
    files = _files(cfg, dtype, tokenizer)
    if out_dir.is_dir():
        _fill_empty_dir(out_dir, tensors, files)
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_files(staging, tensors, files)
        staging.chmod(0o777 & ~_umask())  # mkdtemp made it 0700: the checkpoint is for others to read too
        # rename(2) replaces an empty directory atomically, and fails if one appeared with contents.
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def find_tokenizer(source: pathlib.Path, part: pathlib.Path) -> pathlib.Path | None:
    """The tokenizer of the run an export reads: in the run directory given (`source`), or in the one that holds the
    checkpoint part read (step-N/part under RUN/checkpoints); None when neither has one (a run launched before
    2026-12-08, or checkpoints saved to a checkpoint.directory outside the run directory and exported from there)."""
    for directory in (source, *list(part.parents)[:3]):
        if (directory / "config.json").is_file() and (directory / TOKENIZER_FILE).is_file():
            return directory / TOKENIZER_FILE
    return None


def _files(cfg: ModelConfig, dtype: torch.dtype, tokenizer: pathlib.Path | None) -> dict[str, str]:
    """The export's JSON files by name, config.json last (the order they are moved into an existing directory: a
    directory with a config.json holds the whole export)."""
    config = hf_config(cfg, dtype)
    files = {}
    if tokenizer is not None:
        text = tokenizer.read_text()
        eot_id = next((t["id"] for t in json.loads(text).get("added_tokens", []) if t["content"] == EOT_TOKEN), None)
        if eot_id is None:
            raise ConfigError(f"{tokenizer} has no {EOT_TOKEN} token: it is not the tokenizer of an openprime run")
        # transformers' PreTrainedTokenizerFast reads tokenizer.json as the `tokenizers` package wrote it; the model
        # learned EOT_TOKEN as the end of every document, so it is the end of a generation too.
        files[TOKENIZER_FILE] = text
        files["tokenizer_config.json"] = json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT_TOKEN, "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False}, indent=2) + "\n"
        config["eos_token_id"] = eot_id
    files["config.json"] = json.dumps(config, indent=2) + "\n"
    return files


def _write_files(directory: pathlib.Path, tensors: dict[str, torch.Tensor], files: dict[str, str]) -> None:
    # "format": "pt" is the metadata transformers checks before it reads a safetensors file.
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, text in files.items():
        (directory / name).write_text(text)
    # safetensors creates its file 0600: the checkpoint is for others to read too (as config.json is, under the
    # umask).
    (directory / "model.safetensors").chmod(0o666 & ~_umask())


def _fill_empty_dir(out_dir: pathlib.Path, tensors: dict[str, torch.Tensor], files: dict[str, str]) -> None:
    """Write the export into the existing empty directory `out_dir` through a temporary directory inside it (the
    same file system, whatever `out_dir` is mounted on or linked to); on failure nothing of it is left there."""
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".export.", suffix=".tmp", dir=out_dir))
    moved = []
    try:
        _write_files(staging, tensors, files)
        if others := [p.name for p in out_dir.iterdir() if p != staging]:
            raise ConfigError(f"export: {out_dir} is no longer empty (it now holds {', '.join(sorted(others))}); "
                              f"choose a new output directory or remove it first")
        for name in ["model.safetensors", *files]:  # config.json last
            os.replace(staging / name, out_dir / name)
            moved.append(out_dir / name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for path in moved:
            path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


__all__ = ["TOKENIZER_FILE", "check_out_dir", "find_tokenizer", "hf_config", "to_hf_state_dict", "write_hf_checkpoint"]
