import json
import math
from pathlib import Path

import pytest
import torch

from cohere_coreml.model.checkpoint import (
    CheckpointError,
    describe,
    describe_files,
    load_reference,
    resolve_checkpoint,
    safetensors_shapes,
)
from cohere_coreml_dev.checkpoints import make_tiny_checkpoint


def test_tiny_checkpoint_is_a_complete_hf_folder(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "processor_config.json" in names or "preprocessor_config.json" in names
    assert not any(n.endswith((".bin", ".pt")) for n in names)


def test_load_reference_gives_eval_model_and_processor(tiny_reference):
    from transformers import AutoProcessor, CohereAsrForConditionalGeneration, CohereAsrProcessor

    model, processor = tiny_reference
    assert isinstance(model, CohereAsrForConditionalGeneration)
    assert isinstance(processor, CohereAsrProcessor)
    assert not model.training
    assert isinstance(AutoProcessor.from_pretrained(model.source.local_dir), CohereAsrProcessor)
    assert model.config.decoder_start_token_id == processor.tokenizer.convert_tokens_to_ids("\u2581")
    assert model.config.eos_token_id == processor.tokenizer.eos_token_id


def test_same_seed_same_weights_and_generate_runs(tmp_path, tiny_reference):
    """Same seed: same weights and the same generate() output; another seed: other weights."""
    a = make_tiny_checkpoint(tmp_path / "a", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", seed=3)
    c = make_tiny_checkpoint(tmp_path / "c", seed=4)
    ma, _ = load_reference(a)
    mb, _ = load_reference(b)
    mc, _ = load_reference(c)
    wa = ma.proj_out.weight
    assert torch.equal(wa, mb.proj_out.weight)
    assert not torch.equal(wa, mc.proj_out.weight)
    feats = torch.randn(1, 200, ma.config.encoder_config.num_mel_bins, generator=torch.Generator().manual_seed(0))
    start = torch.tensor([[ma.config.decoder_start_token_id]])
    with torch.no_grad():
        out_a, out_b = (m.generate(input_features=feats, decoder_input_ids=start, max_new_tokens=5, do_sample=False)
                        for m in (ma, mb))
    assert out_a.shape == (1, 6) and torch.equal(out_a, out_b)
    assert out_a.max() < ma.config.vocab_size


def test_overrides_reach_every_config_field(tmp_path):
    path = make_tiny_checkpoint(
        tmp_path / "wide",
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=80,
        vocab_size=512,
        encoder_hidden_size=48,
        encoder_num_hidden_layers=1,
        encoder_num_attention_heads=2,
        encoder_intermediate_size=72,
        encoder_subsampling_factor=4,
        encoder_subsampling_conv_channels=8,
        num_mel_bins=64,
    )
    model, processor = load_reference(path)
    c, e = model.config, model.config.encoder_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (96, 3, 6, 2)
    assert (c.intermediate_size, c.vocab_size) == (80, 512)
    assert (e.hidden_size, e.num_hidden_layers, e.num_attention_heads, e.intermediate_size) == (48, 1, 2, 72)
    assert (e.subsampling_factor, e.subsampling_conv_channels, e.num_mel_bins) == (4, 8, 64)
    assert processor.feature_extractor.feature_size == 64
    assert model.model.decoder.layers[0].self_attn.k_proj.out_features == 2 * c.head_dim
    # it runs end to end
    features = torch.randn(1, 120, 64)  # (batch, frames, mel bins), as the extractor returns
    out = model.generate(input_features=features, decoder_input_ids=torch.tensor([processor.get_decoder_prompt_ids("en")]), max_new_tokens=3)
    assert out.shape[1] >= 11


def test_unknown_override_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="hiden_size"):
        make_tiny_checkpoint(tmp_path / "x", hiden_size=12)


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="vocab_size"):
        make_tiny_checkpoint(tmp_path / "x", vocab_size=100)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_reference(tmp_path / "nothing-here")


def test_wrong_model_type(tmp_path, tiny_checkpoint):
    import shutil

    bad = tmp_path / "whisper"
    shutil.copytree(tiny_checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "whisper"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'whisper' checkpoint, not a Cohere Transcribe"):
        load_reference(bad)


def test_no_safetensors_refuses_pickles(tmp_path, tiny_checkpoint):
    import shutil

    bad = tmp_path / "pickled"
    shutil.copytree(tiny_checkpoint, bad)
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors.*pytorch_model.bin"):
        load_reference(bad)


def test_not_a_checkpoint_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_reference(tmp_path / "empty")


def test_unreachable_hub_suggests_local_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="could not reach the Hugging Face Hub.*local folder"):
        load_reference("CohereLabs/not-a-real-model-for-tests")


def test_describe(tiny_reference):
    info = describe(*tiny_reference)
    assert info["tokens"]["prompt_en"][0] == info["tokens"]["decoder_start"]
    assert info["front_end"]["mel_bins"] == info["encoder"]["mel_bins"] == 128
    assert info["parameters"] > info["encoder_parameters"] > 0


@pytest.mark.parametrize("which", ["tiny", "trained"])
def test_describe_files_is_describe_of_the_loaded_reference(which, tiny_checkpoint):
    """`info` without torch: the checkpoint's files give what the loaded reference gives, parameter
    counts included (the stored BatchNorm statistics are buffers, not parameters: counting every stored
    tensor would be off by 4 layers x (2 x hidden + 1) on the trained model)."""
    from ..fixture_data import TRAINED_MODEL

    folder = tiny_checkpoint if which == "tiny" else TRAINED_MODEL
    from_files = describe_files(resolve_checkpoint(folder))
    assert from_files == describe(*load_reference(folder))
    stored = sum(math.prod(s) for s in safetensors_shapes(folder).values())
    assert stored > from_files["parameters"] > from_files["encoder_parameters"] > 0


def test_describe_files_leaves_defaults_to_the_reference(tmp_path, capsys):
    """A value config.json or the processor config does not hold (transformers fills it in): no answer
    from the files; `info` then prints what the loaded reference says."""
    import shutil

    from cohere_coreml.cli import main

    from ..fixture_data import TRAINED_MODEL

    for name, drop in (("config.json", ("head_dim",)), ("processor_config.json", ("feature_extractor", "dither"))):
        folder = tmp_path / name / "cohere-tiny-synth"
        shutil.copytree(TRAINED_MODEL, folder)
        data = json.loads((folder / name).read_text())
        inner = data
        for key in drop[:-1]:
            inner = inner[key]
        del inner[drop[-1]]
        (folder / name).write_text(json.dumps(data))
        assert describe_files(resolve_checkpoint(folder)) is None, name
        capsys.readouterr()
        assert main(["info", "--model", str(folder), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == describe(*load_reference(folder)), name
    assert describe_files(resolve_checkpoint(TRAINED_MODEL)) is not None


def test_unreadable_safetensors_header_is_a_checkpoint_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{not json")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        safetensors_shapes(tmp_path)


def test_local_folder_is_named_by_its_hub_id_or_its_name_never_its_path(tmp_path, tiny_checkpoint):
    """A checkpoint given as a folder is recorded by the Hub id its config names, else by the folder's
    name: a published bundle never carries the user's local path."""
    import json
    import shutil

    from cohere_coreml.model.checkpoint import CheckpointError, check_hub_id, resolve_checkpoint

    plain = resolve_checkpoint(tiny_checkpoint)
    assert plain.model_id == Path(tiny_checkpoint).resolve().name and plain.base_model is None
    assert "/" not in plain.model_id
    for name, want in (("CohereLabs/cohere-transcribe-03-2026", "CohereLabs/cohere-transcribe-03-2026"),
                       (str(tmp_path / "somewhere"), None), ("./relative/x", None), ("not an id", None)):
        folder = tmp_path / f"ckpt-{abs(hash(name))}"
        shutil.copytree(tiny_checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        config["_name_or_path"] = name
        (folder / "config.json").write_text(json.dumps(config))
        source = resolve_checkpoint(folder)
        assert source.base_model == want, name
        assert source.model_id == (want or folder.name), name
        assert str(tmp_path) not in source.model_id
    assert check_hub_id("org/name") == "org/name"
    for bad in ("/home/me/ckpt", "name", "a/b/c", "../x"):
        with pytest.raises(CheckpointError, match="Hub id"):
            check_hub_id(bad)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_loaded_model_keeps_no_map_of_the_checkpoint_file(tiny_checkpoint):
    """transformers 5 leaves a safetensors file memory-mapped after `from_pretrained` (its pages stay
    resident: +4.1 GB for the whole full-size export, docs/quantization.md); `load_reference` reads the
    file instead. The control, transformers' default loading, keeps the map: this check can fail."""
    from transformers import CohereAsrForConditionalGeneration

    def mapped() -> bool:
        return any(line.rstrip().endswith(".safetensors") and str(tiny_checkpoint) in line
                   for line in Path("/proc/self/maps").read_text().splitlines())

    model, _ = load_reference(tiny_checkpoint)
    assert not mapped()
    control = CohereAsrForConditionalGeneration.from_pretrained(tiny_checkpoint, use_safetensors=True,
                                                                dtype=torch.float32)
    assert mapped()
    del control, model
