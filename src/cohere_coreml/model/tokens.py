"""Tokens: decoder prompts, decoding of generated ids, and the vocabulary for non-Python clients.

Cohere Transcribe's tokenizer is a SentencePiece-style unigram model with byte fallback, stored as a
`tokenizers` `tokenizer.json` and loaded by `transformers` as a fast tokenizer. Prompts are always
built from token *ids* (`convert_tokens_to_ids`), never by encoding the prompt as text: the released
tokenizer sets `split_special_tokens=True`, which would split `<|startofcontext|>` into characters.

Nothing here hard-codes a token id: ids are read from the tokenizer each time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..storage.files import write_text_atomic

logger = logging.getLogger(__name__)

# The 14 languages of the released model (same set as `CohereAsrProcessor`).
LANGUAGES: tuple[str, ...] = ("ar", "de", "el", "en", "es", "fr", "it", "ja", "ko", "nl", "pl", "pt", "vi", "zh")
# Languages whose window transcripts are joined without a space (as `CohereAsrProcessor.decode` does).
NO_SPACE_LANGUAGES: frozenset[str] = frozenset({"ja", "zh"})

# Piece that starts every decoder prompt (SentencePiece word boundary; the decoder start token).
WORD_BOUNDARY = "\u2581"  # "▁"

UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftranscript|>"

# Control tokens in the order of the released vocabulary (ids 0..16 there); language tokens follow.
CONTROL_TOKENS: tuple[str, ...] = (
    UNK_TOKEN,
    "<|nospeech|>",
    PAD_TOKEN,
    EOS_TOKEN,
    BOS_TOKEN,
    "<|pnc|>",
    "<|nopnc|>",
    "<|startofcontext|>",
    "<|itn|>",
    "<|noitn|>",
    "<|timestamp|>",
    "<|notimestamp|>",
    "<|diarize|>",
    "<|nodiarize|>",
    "<|spkchange|>",
    "<|audioseparator|>",
    "<|emo:undefined|>",
)


def language_token(language: str) -> str:
    return f"<|{language}|>"


SPECIAL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + tuple(language_token(lang) for lang in LANGUAGES)
BYTE_TOKENS: tuple[str, ...] = tuple(f"<0x{b:02X}>" for b in range(256))


class UnknownLanguageError(ValueError):
    """A language code that the model does not support."""

    def __init__(self, language: object):
        super().__init__(
            f"Unsupported language {language!r}. Supported languages: {', '.join(LANGUAGES)}."
        )
        self.language = language


class TokenizerError(ValueError):
    """The tokenizer lacks something the decoder prompt needs."""


def check_language(language: str) -> str:
    if language not in LANGUAGES:
        raise UnknownLanguageError(language)
    return language


def prompt_tokens(language: str, punctuation: bool = True) -> list[str]:
    """The 10 prompt pieces, as `CohereAsrProcessor.get_decoder_prompt_ids` builds them."""
    check_language(language)
    lang = language_token(language)
    return [
        WORD_BOUNDARY,
        "<|startofcontext|>",  # the context slot stays empty: the released model never learned to use it
        BOS_TOKEN,
        "<|emo:undefined|>",
        lang,
        lang,
        "<|pnc|>" if punctuation else "<|nopnc|>",
        "<|noitn|>",
        "<|notimestamp|>",
        "<|nodiarize|>",
    ]


def _token_id(tokenizer, token: str) -> int:
    """Id of `token`; error if the tokenizer does not know it (it would map it to <unk>)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    unk_id = tokenizer.unk_token_id
    if token_id is None or (token_id == unk_id and token != tokenizer.unk_token):
        raise TokenizerError(f"the tokenizer has no token {token!r}: is this a Cohere Transcribe tokenizer?")
    return int(token_id)


def prompt_ids(tokenizer, language: str, punctuation: bool = True) -> list[int]:
    """Decoder prompt ids for `language`, read from `tokenizer` (equal to `get_decoder_prompt_ids`)."""
    return [_token_id(tokenizer, token) for token in prompt_tokens(language, punctuation)]


def eos_id(tokenizer) -> int:
    return _token_id(tokenizer, EOS_TOKEN)


def decode_ids(tokenizer, ids: Iterable[int]) -> str:
    """Text of generated ids: special tokens skipped, byte-fallback pieces merged into UTF-8."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True).strip()


def join_windows(texts: Sequence[str], language: str) -> str:
    """Join per-window transcripts as `CohereAsrProcessor.decode` does (no space for ja/zh)."""
    separator = "" if language in NO_SPACE_LANGUAGES else " "
    parts = [t for t in texts if t and t.strip()]
    if not parts:
        return ""
    return separator.join([parts[0].rstrip()] + [t.strip() for t in parts[1:]])


def vocab_table(tokenizer) -> dict[str, str]:
    """id -> piece for every id of the tokenizer, including added special tokens."""
    table: dict[int, str] = {}
    for piece, idx in tokenizer.get_vocab().items():
        table[int(idx)] = piece
    missing = [i for i in range(max(table) + 1) if i not in table]
    if missing:
        raise TokenizerError(f"tokenizer vocabulary has holes at ids {missing[:10]}")
    return {str(i): table[i] for i in sorted(table)}


def export_vocab(tokenizer, path: str | os.PathLike, if_changed: bool = False, before_change=None) -> Path:
    """Write `vocab.json` (id -> piece) for clients that do not run Python.

    Pieces follow SentencePiece conventions: "▁" marks a word boundary (a space), `<0xNN>` is one raw
    byte of UTF-8 (consecutive byte pieces are joined, then decoded), and special tokens look like
    `<|...|>` and are dropped from transcripts.
    """
    path = Path(path)
    # atomically, through a hidden temporary (`if_changed`, `before_change`: see write_text_atomic)
    write_text_atomic(path, json.dumps(vocab_table(tokenizer), ensure_ascii=False, indent=0), if_changed=if_changed,
                      before_change=before_change)
    return path
