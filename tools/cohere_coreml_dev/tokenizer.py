"""A Cohere-Transcribe-style tokenizer built from unigram pieces (tiny checkpoints, the demo model).

Not part of the product package: exported bundles carry the checkpoint's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from cohere_coreml.model.tokens import (
    BOS_TOKEN,
    BYTE_TOKENS,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    WORD_BOUNDARY,
)


def build_tokenizer(pieces: Sequence[tuple[str, float]]):
    """A Cohere-Transcribe-style fast tokenizer from unigram `pieces` [(piece, log-prob score)].

    Layout of the vocabulary: the control tokens (in the released order), the 14 language tokens, the
    256 byte-fallback pieces `<0x00>`..`<0xFF>`, "▁", then `pieces` (duplicates of the above skipped).
    The result behaves like the released tokenizer: SentencePiece word boundaries ("▁" prefix),
    byte fallback (so any text, CJK included, round-trips), `split_special_tokens=True`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: list[tuple[str, float]] = [(t, 0.0) for t in SPECIAL_TOKENS]
    vocab += [(b, 0.0) for b in BYTE_TOKENS]
    seen = {t for t, _ in vocab}
    for piece, score in [(WORD_BOUNDARY, -2.0), *pieces]:
        if piece in seen or not piece:
            continue
        seen.add(piece)
        vocab.append((piece, float(score)))

    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(WORD_BOUNDARY, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    extra = [t for t in SPECIAL_TOKENS if t not in (UNK_TOKEN, PAD_TOKEN, EOS_TOKEN, BOS_TOKEN)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        additional_special_tokens=extra,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    return tokenizer
