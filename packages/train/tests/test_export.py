"""Tests of the Hugging Face export: an exported debug model loads in transformers with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test requirement (requirements.txt); export.py itself needs only safetensors

from openprime.core.errors import ConfigError
from openprime.train import export
from openprime.train.export import hf_config, to_hf_state_dict, write_hf_checkpoint
from openprime.train.model import FLAVORS, Llama

DEBUG = FLAVORS["debug"]
LOGIT_ATOL = 1e-4


def _perturbed_debug_model() -> Llama:
    """The debug model with random norm gains, so that a dropped or misplaced norm changes the logits,
    and wq, wk scaled up 10x: at init (std 0.02) attention is nearly uniform and RoPE barely matters."""
    torch.manual_seed(0)
    model = Llama(DEBUG)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("attention.wq.weight", "attention.wk.weight")):
                param.mul_(10.0)
    return model.eval()


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, DEBUG.vocab_size, (2, 100), generator=generator)


def _hf_logits(out_dir, tokens: torch.Tensor) -> torch.Tensor:
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits


@pytest.fixture(scope="module")
def model() -> Llama:
    return _perturbed_debug_model()


@pytest.fixture(scope="module")
def reference_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens())


def test_exported_model_gives_the_same_logits_in_transformers(model, reference_logits, tmp_path):
    out_dir = tmp_path / "hf"
    write_hf_checkpoint(model.state_dict(), DEBUG, out_dir)
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name != "hf"]  # the staging directory is gone
    hf_logits = _hf_logits(out_dir, _tokens())
    max_diff = (hf_logits - reference_logits).abs().max().item()
    print(f"max abs logit difference openprime vs transformers: {max_diff:.3g}")
    assert hf_logits.shape == reference_logits.shape
    assert max_diff < LOGIT_ATOL


def test_config_json_matches_the_model_config(model, tmp_path):
    write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf", dtype=torch.bfloat16)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written == hf_config(DEBUG, torch.bfloat16)
    assert written["intermediate_size"] == 384 and written["num_key_value_heads"] == 2
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert loaded.rms_norm_eps == DEBUG.norm_eps
    assert loaded.max_position_embeddings == DEBUG.max_seq_len
    assert not loaded.tie_word_embeddings


def test_rope_permutation_is_needed(model, reference_logits, tmp_path, monkeypatch):
    # Exporting wq / wk unpermuted loads fine but rotates the wrong channel pairs: the logits differ.
    monkeypatch.setattr(export, "_rope_to_halves", lambda weight, num_heads, head_dim: weight)
    write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf")
    max_diff = (_hf_logits(tmp_path / "hf", _tokens()) - reference_logits).abs().max().item()
    print(f"max abs logit difference without the RoPE permutation: {max_diff:.3g}")
    assert max_diff > 1000 * LOGIT_ATOL


def test_rope_permutation_takes_even_rows_then_odd_rows_per_head():
    rows = torch.arange(2 * 6, dtype=torch.float32)[:, None]  # 2 heads of dim 6, one input column
    permuted = export._rope_to_halves(rows, num_heads=2, head_dim=6)
    assert permuted[:, 0].tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]


def test_wq_and_wk_are_permuted_and_the_rest_only_renamed(model):
    state_dict = model.state_dict()
    hf = to_hf_state_dict(state_dict, DEBUG)
    assert len(hf) == len(state_dict)
    assert torch.equal(hf["lm_head.weight"], state_dict["output.weight"])
    assert torch.equal(hf["model.layers.3.mlp.up_proj.weight"], state_dict["layers.3.feed_forward.w3.weight"])
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], state_dict["layers.0.attention.wv.weight"])
    wk = state_dict["layers.0.attention.wk.weight"]
    assert not torch.equal(hf["model.layers.0.self_attn.k_proj.weight"], wk)
    assert torch.equal(hf["model.layers.0.self_attn.k_proj.weight"][DEBUG.head_dim // 2], wk[1])


def test_mismatched_state_dict_is_refused_naming_the_tensor_and_both_shapes(model):
    state_dict = dict(model.state_dict())
    state_dict["layers.1.attention.wk.weight"] = torch.zeros(32, 128)
    with pytest.raises(ConfigError, match=r"'layers\.1\.attention\.wk\.weight' has shape \(32, 128\) .*"
                                          r"expects \(64, 128\)"):
        to_hf_state_dict(state_dict, DEBUG)
    del state_dict["layers.1.attention.wk.weight"]
    with pytest.raises(ConfigError, match=r"no tensor 'layers\.1\.attention\.wk\.weight' \(expected shape \(64, 128\)"):
        to_hf_state_dict(state_dict, DEBUG)
    extra = {**model.state_dict(), "_orig_mod.norm.weight": torch.ones(128)}
    with pytest.raises(ConfigError, match=r"'_orig_mod\.norm\.weight' of shape \(128,\) that Llama\(cfg\) does not"):
        to_hf_state_dict(extra, DEBUG)


def test_non_empty_out_dir_is_refused_and_left_alone(model, tmp_path):
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not an empty directory"):
        write_hf_checkpoint(model.state_dict(), DEBUG, out_dir)
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_empty_out_dir_is_filled(model, tmp_path):
    (tmp_path / "hf").mkdir()
    write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_an_export_that_cannot_be_written_is_a_clear_error(model, tmp_path, monkeypatch, capsys):
    # Before, a full or read-only disk ended `openprime export` in a traceback.
    from openprime.train import checkpointing, cli

    monkeypatch.setattr(checkpointing, "load_model_weights", lambda source: (DEBUG, model.state_dict(), source))
    (tmp_path / "a-file").write_text("")
    out_dir = tmp_path / "a-file" / "hf"
    assert cli.main(["export", str(tmp_path / "run"), str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"openprime: error: cannot write the export to {out_dir}: File exists "), err
    assert err.rstrip().endswith("free space, or choose another OUT_DIR")


def test_the_export_is_readable_by_others_under_the_umask(model, tmp_path):
    # safetensors creates its file 0600 and mkdtemp its directory 0700: another user (a serving job) could not read
    # the exported model, though config.json beside it was readable (found 2026-12-07).
    import os
    import stat

    old = os.umask(0o022)
    try:
        write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "hf", *(tmp_path / "hf").iterdir()]}
    assert modes == {"hf": 0o755, "config.json": 0o644, "model.safetensors": 0o644}


def test_openprime_export_refuses_a_used_out_dir_before_it_reads_the_checkpoint(tmp_path, monkeypatch, capsys):
    # At 10B the checkpoint is tens of GB, read and checksummed before a one-line refusal (found 2026-12-07).
    from openprime.train import checkpointing, cli

    def must_not_read(source):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(checkpointing, "load_model_weights", must_not_read)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export", "status"])
@pytest.mark.parametrize("config_json", ['{"model_type": "llama"}', "not json"])
def test_a_directory_whose_config_json_is_not_a_run_s_is_a_clear_error(tmp_path, capsys, command, config_json):
    # A Hugging Face export's directory (its own config.json): export ended in a KeyError traceback, and status said
    # "cannot read the run in ...: 'config'".
    from openprime.train import cli

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(config_json)
    args = [command, str(tmp_path / "hf")] + ([str(tmp_path / "out")] if command == "export" else [])
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'hf' / 'config.json'} is not the config of an openprime run" in err, err
    assert "Hugging Face export" in err and not (tmp_path / "out").exists()


def test_an_empty_out_dir_behind_a_symbolic_link_is_filled(model, reference_logits, tmp_path, monkeypatch):
    # An existing empty OUT_DIR was replaced by renaming a sibling directory over it, which rename(2) refuses for a
    # symbolic link to a directory on a bigger disk ("Not a directory") and for a mount point such as a container's
    # output volume ("Device or resource busy"): `openprime export` said "free space, or choose another OUT_DIR".
    import os

    (tmp_path / "big-disk" / "hf").mkdir(parents=True)
    (tmp_path / "hf").symlink_to(tmp_path / "big-disk" / "hf")
    write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf")
    assert (tmp_path / "hf").is_symlink()  # the link stays; the files are where it points
    assert sorted(p.name for p in (tmp_path / "big-disk" / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-disk", "hf"]  # no staging directory left
    max_diff = (_hf_logits(tmp_path / "hf", _tokens()) - reference_logits).abs().max().item()
    assert max_diff < LOGIT_ATOL
    # A failure while the files move in (here the second, config.json) leaves the directory as empty as it was.
    (tmp_path / "big-disk" / "other").mkdir()
    (tmp_path / "other").symlink_to(tmp_path / "big-disk" / "other")
    replace = os.replace

    def fail_on_config(src, dst):
        if str(dst).endswith("config.json"):
            raise OSError(28, "No space left on device", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_config)
    with pytest.raises(OSError, match="No space left"):
        write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "other")
    assert not list((tmp_path / "big-disk" / "other").iterdir())


def test_a_symbolic_link_to_nothing_is_refused_before_the_checkpoint_is_read(tmp_path, monkeypatch, capsys):
    # It passed the check, the checkpoint was read, and the rename over the link failed: "cannot write the export to
    # .../hf: Not a directory ...; free space, or choose another OUT_DIR".
    from openprime.train import checkpointing, cli

    def must_not_read(source):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(checkpointing, "load_model_weights", must_not_read)
    (tmp_path / "hf").symlink_to(tmp_path / "missing")
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'hf'} is a symbolic link to {tmp_path / 'missing'}, which does not exist" in err, err


def _tokenizer_file(tmp_path):
    """A run's tokenizer.json: the byte-level BPE openprime.train.data trains, on a few documents."""
    from openprime.train.data.prepare import train_tokenizer

    documents = ["In the beginning God created the heaven and the earth.", "def f(x):\n    return x + 1\n"] * 20
    path = tmp_path / "run" / "tokenizer.json"
    path.parent.mkdir()
    train_tokenizer(documents, vocab_size=300).save(str(path))
    return path


@pytest.mark.parametrize("existing_dir", [False, True], ids=["new", "empty"])
def test_the_run_s_tokenizer_is_exported_for_auto_tokenizer(model, tmp_path, existing_dir):
    # The export held the weights alone: the ids the model reads and writes meant nothing without the run's tokenizer,
    # which only the data cache held.
    from tokenizers import Tokenizer

    from openprime.train.data import EOT_TOKEN

    tokenizer = _tokenizer_file(tmp_path)
    out_dir = tmp_path / "hf"
    if existing_dir:
        out_dir.mkdir()
    write_hf_checkpoint(model.state_dict(), DEBUG, out_dir, tokenizer=tokenizer)
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                          "tokenizer_config.json"]
    ours = Tokenizer.from_file(str(tokenizer))
    hf = transformers.AutoTokenizer.from_pretrained(out_dir)
    text = "And God said, Let there be light: def g(y): return y"
    assert hf(text)["input_ids"] == ours.encode(text).ids
    assert hf.decode(ours.encode(text).ids) == text
    eot_id = ours.token_to_id(EOT_TOKEN)
    config = json.loads((out_dir / "config.json").read_text())
    assert hf.eos_token == EOT_TOKEN and hf.eos_token_id == eot_id == config["eos_token_id"] == 0
    assert transformers.AutoConfig.from_pretrained(out_dir).eos_token_id == 0


def test_a_tokenizer_without_the_end_of_text_token_is_refused(model, tmp_path):
    from tokenizers import Tokenizer, models

    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(tokenizer))
    with pytest.raises(ConfigError, match="has no <\\|end_of_text\\|> token: it is not the tokenizer of an openprime "
                                          "run"):
        write_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / "hf", tokenizer=tokenizer)
    assert not (tmp_path / "hf").exists()
