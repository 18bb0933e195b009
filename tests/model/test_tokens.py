import json

import pytest

from cohere_coreml.model.tokens import (
    LANGUAGES,
    SPECIAL_TOKENS,
    UnknownLanguageError,
    decode_ids,
    export_vocab,
    join_windows,
    prompt_ids,
)
from cohere_coreml_dev.tokenizer import build_tokenizer


@pytest.mark.parametrize("punctuation", [True, False])
@pytest.mark.parametrize("language", LANGUAGES)
def test_prompt_equals_processor(tiny_reference, language, punctuation):
    _, processor = tiny_reference
    expected = processor.get_decoder_prompt_ids(language=language, punctuation=punctuation)
    assert prompt_ids(processor.tokenizer, language, punctuation) == expected
    assert len(expected) == 10


def test_prompt_ids_come_from_the_tokenizer():
    # A tokenizer with extra pieces before nothing changes the layout; but a different piece list moves
    # the "▁" id: the prompt must follow it (no hard-coded ids).
    a = build_tokenizer([("\u2581x", -1.0)])
    b = build_tokenizer([("\u2581x", -1.0), ("y", -2.0)])
    assert prompt_ids(a, "en")[0] == a.convert_tokens_to_ids("\u2581")
    assert prompt_ids(a, "fr")[4] == a.convert_tokens_to_ids("<|fr|>")
    assert prompt_ids(a, "en", punctuation=False)[6] == a.convert_tokens_to_ids("<|nopnc|>")
    assert b.convert_tokens_to_ids("y") != a.unk_token_id


def test_unknown_language_lists_supported(tiny_reference):
    _, processor = tiny_reference
    with pytest.raises(UnknownLanguageError) as err:
        prompt_ids(processor.tokenizer, "xx")
    message = str(err.value)
    assert "'xx'" in message
    for language in LANGUAGES:
        assert language in message


def test_special_tokens_are_single_ids(tiny_reference):
    _, processor = tiny_reference
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert tok.unk_token_id not in ids[1:]
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<pad>"


@pytest.mark.parametrize(
    "text",
    ["set a timer for ten minutes", "Grüße aus Köln, 12:30!", "日本語のテキストです", "你好，世界", "안녕하세요", "Xin chào"],
)
def test_text_round_trips_with_byte_fallback(tiny_reference, text):
    _, processor = tiny_reference
    tok = processor.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids
    assert decode_ids(tok, ids) == text


def test_decode_skips_prompt_and_eos(tiny_reference):
    _, processor = tiny_reference
    tok = processor.tokenizer
    body = tok.encode("turn on the lights", add_special_tokens=False)
    ids = prompt_ids(tok, "en") + body + [tok.eos_token_id]
    assert decode_ids(tok, ids) == "turn on the lights"


def test_export_vocab(tiny_reference, tmp_path):
    _, processor = tiny_reference
    tok = processor.tokenizer
    path = export_vocab(tok, tmp_path / "bundle" / "vocab.json")
    vocab = json.loads(path.read_text(encoding="utf-8"))
    assert len(vocab) == len(tok)
    assert sorted(int(k) for k in vocab) == list(range(len(tok)))
    for token in ["<|endoftext|>", "<|en|>", "<0xE6>", "\u2581"]:
        assert vocab[str(tok.convert_tokens_to_ids(token))] == token
    # a client can detokenize from the file alone: pieces -> bytes -> text
    ids = tok.encode("日本 set", add_special_tokens=False)
    out = bytearray()
    for i in ids:
        piece = vocab[str(i)]
        if piece.startswith("<0x") and piece.endswith(">"):
            out.append(int(piece[3:-1], 16))
        else:
            out.extend(piece.replace("\u2581", " ").encode("utf-8"))
    assert out.decode("utf-8").strip() == "日本 set"


def test_join_windows():
    assert join_windows(["hello there ", " world"], "en") == "hello there world"
    assert join_windows(["こんにちは", "世界"], "ja") == "こんにちは世界"
    assert join_windows(["", "  ", "a"], "en") == "a"


def reordered_tokenizer(tokenizer):
    """The same pieces with another id layout: the vocabulary reversed (so "▁", the control and the
    language tokens all get other ids than the project's `build_tokenizer` gives them)."""
    import json as _json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = _json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]  # [[piece, score], ...] in id order
    new_id = {piece: len(vocab) - 1 - i for i, (piece, _) in enumerate(vocab)}
    data["model"]["vocab"] = vocab[::-1]
    data["model"]["unk_id"] = new_id[vocab[data["model"]["unk_id"]][0]]
    for added in data["added_tokens"]:
        added["id"] = new_id[added["content"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_json.dumps(data)), unk_token="<unk>", pad_token="<pad>",
        eos_token="<|endoftext|>", bos_token="<|startoftranscript|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<unk>", "<pad>", "<|endoftext|>",
                                                                      "<|startoftranscript|>")], split_special_tokens=True,
    )


def test_manifest_prompts_follow_the_tokenizer_layout(tiny_reference):
    """Hard-coded prompt ids would be caught: with another id layout the manifest's prompts change
    and still equal what CohereAsrProcessor builds from that tokenizer."""
    from transformers import CohereAsrProcessor

    from cohere_coreml.bundle.manifest import build_manifest

    model, processor = tiny_reference
    other = reordered_tokenizer(processor.tokenizer)
    other_processor = CohereAsrProcessor(feature_extractor=processor.feature_extractor, tokenizer=other)
    manifests = {name: build_manifest(model, tok, {}, encoder=None, decoder=None)
                 for name, tok in (("default", processor.tokenizer), ("reordered", other))}
    for lang in LANGUAGES:
        for punctuation, key in ((True, "punctuation"), (False, "no_punctuation")):
            default = manifests["default"]["languages"][lang][key]
            reordered = manifests["reordered"]["languages"][lang][key]
            assert default == processor.get_decoder_prompt_ids(language=lang, punctuation=punctuation)
            assert reordered == other_processor.get_decoder_prompt_ids(language=lang, punctuation=punctuation)
            assert all(a != b for a, b in zip(default, reordered)), (lang, default, reordered)
    # same pieces, other ids: decoding is unchanged
    ids = other.encode("set a timer", add_special_tokens=False)
    assert decode_ids(other, ids) == "set a timer"
