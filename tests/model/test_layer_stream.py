"""The reference with streamed encoder layers (cohere_coreml.model.layer_stream): the loaded reference's
outputs and the same encoder packages, bit for bit, with no layer left read after use."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from cohere_coreml.model.checkpoint import CheckpointError, load_reference
from cohere_coreml.model.layer_stream import load_streamed_reference, resident_layers


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """A tiny checkpoint with 3 encoder layers (so that parts differ), loaded whole and streamed."""
    from cohere_coreml_dev.checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "ckpt", seed=5, encoder_num_hidden_layers=3)
    return folder, load_reference(folder), load_streamed_reference(folder)


def _encoder_out(model, features, n_valid):
    mask = torch.zeros(1, features.shape[1], dtype=torch.int64)
    mask[:, :n_valid] = 1
    with torch.no_grad():
        return model.model.encoder(input_features=features, attention_mask=mask, output_hidden_states=True)


def test_streamed_reference_computes_the_loaded_reference_bit_for_bit(three_layers):
    _, (whole, _), (streamed, _) = three_layers
    stream = streamed.layer_stream
    features = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 250, 128)).astype(np.float32))
    before = stream.reads
    a, b = _encoder_out(whole, features, 170), _encoder_out(streamed, features, 170)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states, strict=True))
    assert stream.reads - before == 3 and stream.resident_layers() == []  # each layer read once, none kept
    assert all(p.device.type == "meta" for p in streamed.model.encoder.layers.parameters())
    with resident_layers(streamed, 1, 3):  # held: read once, kept through forward passes
        assert stream.resident_layers() == [1, 2]
        _encoder_out(streamed, features, 170)
        assert stream.resident_layers() == [1, 2] and stream.reads - before == 3 + 2 + 1
        full = dict(streamed.state_dict())
    assert stream.resident_layers() == []
    reference = whole.state_dict()
    assert set(full) == set(reference)
    for name in ("model.encoder.layers.1.self_attn.bias_u", "model.encoder.layers.2.conv.norm.running_var",
                 "model.decoder.proj.weight", "proj_out.weight"):
        assert full[name].dtype == reference[name].dtype and torch.equal(full[name], reference[name]), name


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.glob("*.mlpackage/Data/com.apple.CoreML/weights/*"))}


def test_encoder_parts_from_streamed_layers_are_the_bytes_of_the_loaded_model(three_layers, tmp_path):
    """Two parts converted from streamed layers: the weight files of the whole model's export, byte for byte;
    a stream that gives layer 0 layer 1's tensors (a part built from the wrong layers) writes other bytes."""
    from cohere_coreml.export.convert import ExportSettings
    from cohere_coreml.export.encoder_packages import stage_encoder

    _, (whole, processor), (streamed, _) = three_layers
    settings = ExportSettings(out_dir=tmp_path / "whole", window_seconds=2.0, skip_verify=True)
    digests = {}
    for name, model in (("whole", whole), ("streamed", streamed)):
        staged = stage_encoder(model, settings.replace(out_dir=tmp_path / name), processor, parts=2)
        staged.finish()
        digests[name] = _digests(tmp_path / name)
    assert len(digests["whole"]) == 2 and digests["streamed"] == digests["whole"]
    assert streamed.layer_stream.resident_layers() == []  # the trace kept nothing read in the model

    stream = streamed.layer_stream
    sources = list(stream.sources)
    stream.sources[0] = {name: (file, key.replace("layers.0.", "layers.1.")) for name, (file, key) in sources[0].items()}
    try:
        stage_encoder(streamed, settings.replace(out_dir=tmp_path / "wrong"), processor, parts=2).finish()
    finally:
        stream.sources[:] = sources
    wrong = _digests(tmp_path / "wrong")
    first = "encoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    assert wrong[first] != digests["whole"][first]  # the comparison above tells it apart
    assert wrong["encoder_part2.mlpackage/Data/com.apple.CoreML/weights/weight.bin"] == \
        digests["whole"]["encoder_part2.mlpackage/Data/com.apple.CoreML/weights/weight.bin"]


def _rewrite(folder, out, change):
    """A copy of checkpoint `folder` in `out` whose safetensors header is passed through `change`."""
    import shutil

    shutil.copytree(folder, out)
    path = next(out.glob("*.safetensors"))
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])
    return out


def test_a_checkpoint_without_a_layer_tensor_or_with_another_shape_is_refused(three_layers, tmp_path):
    folder = three_layers[0]
    key = "model.encoder.layers.2.feed_forward1.linear1.bias"

    def drop(header):  # renamed out of the model (its bytes stay: safetensors checks that they are all named)
        header["unused.tensor"] = header.pop(key)

    def reshape(header):
        entry = header[key]
        entry["shape"] = [entry["shape"][0] // 2, 2]

    with pytest.raises(CheckpointError, match="no checkpoint tensor for 1 encoder layer tensor"):
        load_streamed_reference(_rewrite(folder, tmp_path / "dropped", drop))
    with pytest.raises(CheckpointError, match=r"layers\.2\.feed_forward1\.linear1\.bias has shape"):
        load_streamed_reference(_rewrite(folder, tmp_path / "reshaped", reshape))


def test_passes_run_together_read_each_layer_once_and_compute_what_they_compute_alone(three_layers):
    from cohere_coreml.model.layer_stream import run_together

    _, (whole, _), (streamed, _) = three_layers
    stream = streamed.layer_stream
    rng = np.random.default_rng(1)
    inputs = [(torch.from_numpy(rng.standard_normal((1, frames, 128)).astype(np.float32)), valid)
              for frames, valid in ((250, 170), (250, 250), (90, 60), (400, 333))]
    alone = [_encoder_out(whole, f, n).last_hidden_state for f, n in inputs]
    before = stream.reads
    together = run_together(streamed, [lambda f=f, n=n: _encoder_out(streamed, f, n).last_hidden_state
                                       for f, n in inputs])
    assert stream.reads - before == 3 and stream.resident_layers() == []  # 4 passes, each layer read once
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    assert run_together(whole, [lambda: 1, lambda: 2]) == [1, 2]  # a model loaded whole: one after another

    def twice():
        _encoder_out(streamed, *inputs[0])
        _encoder_out(streamed, *inputs[0])

    with pytest.raises(RuntimeError, match="ran the encoder layers twice"):
        run_together(streamed, [twice, lambda: _encoder_out(streamed, *inputs[1])])
    assert stream.resident_layers() == []
