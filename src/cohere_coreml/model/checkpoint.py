"""Checkpoints: load a Cohere Transcribe checkpoint and describe it (`cohere-coreml info`).

`load_reference` is the one way the project reads a checkpoint (a Hugging Face Hub id, optionally at
a revision, or a local folder): the `transformers` reference model `CohereAsrForConditionalGeneration`
plus its `CohereAsrProcessor`, in eval mode, weights from safetensors only, never remote code.
`cohere-coreml info` reads the same facts from the checkpoint's files (config.json, the safetensors
headers, the processor and tokenizer files) without torch or transformers (`describe_files`), and
loads the reference only when a file leaves a value to transformers' defaults.

Small checkpoints for tests and the demo model are made by the dev package
(`tools/cohere_coreml_dev/checkpoints.py`), not here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULT_HUB_ID
from .tokens import LANGUAGES, export_vocab, prompt_ids

logger = logging.getLogger(__name__)

MODEL_TYPE = "cohere_asr"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Files a checkpoint needs; pickled weights (*.bin, *.pt) are never fetched nor loaded.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.md"]
# Tensors a checkpoint stores that are buffers of the model, not parameters: BatchNorm's running statistics
_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")
ENCODER_PREFIX = "model.encoder."  # the encoder's tensors, in the checkpoint as in the loaded model


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, of the wrong type, unsafe, or unreachable."""


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint came from (recorded in exported packages and published model cards).

    `model_id` never holds a local path (a published bundle must not carry the user's home folder):
    the Hub id, else the checkpoint folder's name. `base_model`: the Hub id when known (given, or the
    checkpoint config's `_name_or_path` when that is a Hub id), else None."""

    model_id: str
    revision: str | None
    local_dir: Path
    base_model: str | None = None


def hub_id_from_config(folder: Path) -> str | None:
    """The Hub id a checkpoint folder's config.json names (`_name_or_path`), when it is one."""
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(name, str) and _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        return name
    return None


def check_hub_id(text: str, what: str = "--base-model") -> str:
    """`text` when it is a Hub id (owner/name), else CheckpointError."""
    if not isinstance(text, str) or not _HUB_ID.match(text):
        raise CheckpointError(f"{what} must be a Hugging Face Hub id like 'owner/name', got {text!r}")
    return text


def resolve_checkpoint(model: str | os.PathLike, revision: str | None = None) -> CheckpointSource:
    """Local folder for `model` (a folder, or a Hub id fetched into the local cache)."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; a checkpoint is a folder with config.json and *.safetensors")
        hub_id = hub_id_from_config(path)
        return CheckpointSource(model_id=hub_id or path.resolve().name, revision=revision, local_dir=path,
                                base_model=hub_id)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") != 1 or os.sep + os.sep in text
    if looks_local or not _HUB_ID.match(text):
        raise CheckpointError(f"checkpoint folder {text!r} does not exist (and it is not a Hub id like 'owner/name')")
    return CheckpointSource(model_id=text, revision=revision, local_dir=_download(text, revision), base_model=text)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download  # heavy (the Hub's HTTP stack): only a download needs it
    from huggingface_hub.errors import (  # heavy (as above)
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    logger.info("fetching %s%s from the Hugging Face Hub", repo_id, f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise CheckpointError(
            f"the Hub has no accessible repository {repo_id!r} ({type(err).__name__}); check the id, "
            "or log in (HF_TOKEN) for gated models"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"repository {repo_id!r} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OSError) as err:
        raise CheckpointError(
            f"could not reach the Hugging Face Hub to fetch {repo_id!r} ({type(err).__name__}). "
            "Download the checkpoint on a machine with access and pass its local folder instead, "
            "e.g. `--model /path/to/cohere-transcribe-03-2026`."
        ) from None


def checkpoint_digest(folder: str | os.PathLike) -> str:
    """sha256 over a checkpoint folder's files, names and bytes (its model card and other *.md aside),
    streamed (a full-size checkpoint is ~4 GB): what tells an export's packages of one checkpoint from
    another's in the same folder, a retrained one of the same shapes included."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".md"):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 23), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def check_checkpoint_dir(path: Path) -> dict:
    """Validate a checkpoint folder before anything is loaded; returns its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from None
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"{path} holds a {model_type!r} checkpoint, not a Cohere Transcribe one (model_type {MODEL_TYPE!r})"
        )
    if not list(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
        extra = f" (found {', '.join(pickled)}: pickled weights are never loaded)" if pickled else ""
        raise CheckpointError(f"{path} has no *.safetensors weights{extra}")
    return config


def load_reference(model: str | os.PathLike = DEFAULT_HUB_ID, revision: str | None = None, dtype=None):
    """(model, processor): the `transformers` reference for a Hub id or a local folder.

    The model is a `CohereAsrForConditionalGeneration` in eval mode (float32 unless `dtype` is given),
    loaded from safetensors only, without remote code. Raises `CheckpointError` naming the problem.
    """
    import torch  # heavy: only loading the reference needs it
    from transformers import AutoProcessor, CohereAsrForConditionalGeneration, CohereAsrProcessor  # heavy (as torch)

    source = resolve_checkpoint(model, revision)
    check_checkpoint_dir(source.local_dir)
    try:
        # disable_mmap: read the file, do not map it. transformers 5 loads safetensors through a memory
        # map that stays mapped after loading (the pages it read stay resident) although every weight is
        # converted to float32 copies; at full size that is the 4.1 GB bf16 file on top of the 8.2 GB
        # model for the whole export (the full-size export's peak RSS either way: docs/quantization.md).
        # Reading costs the same load-time peak (file + model) and frees the file bytes after loading.
        reference = CohereAsrForConditionalGeneration.from_pretrained(
            source.local_dir, use_safetensors=True, dtype=dtype or torch.float32, disable_mmap=True
        )
        processor = AutoProcessor.from_pretrained(source.local_dir)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"could not load the checkpoint in {source.local_dir}: {err}") from err
    if not isinstance(processor, CohereAsrProcessor):
        raise CheckpointError(
            f"{source.local_dir} has a {type(processor).__name__}, not a CohereAsrProcessor "
            "(preprocessor_config.json / processor_config.json missing or of another model)"
        )
    reference.eval()
    reference.source = source  # where it came from, for package metadata
    return reference, processor


def _summary(source: str | None, parameters: int, encoder_parameters: int, config: Mapping, encoder: Mapping,
             front_end: Mapping, tokenizer) -> dict:
    """What `cohere-coreml info` prints, from the config values (config.json's names; KeyError when one
    is missing), the feature extractor's settings and a tokenizer (`len`, `convert_tokens_to_ids`)."""
    return {
        "source": source,
        "parameters": parameters,
        "encoder_parameters": encoder_parameters,
        "encoder": {
            "hidden_size": encoder["hidden_size"],
            "layers": encoder["num_hidden_layers"],
            "heads": encoder["num_attention_heads"],
            "ffn": encoder["intermediate_size"],
            "subsampling_factor": encoder["subsampling_factor"],
            "mel_bins": encoder["num_mel_bins"],
        },
        "decoder": {
            "hidden_size": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "head_dim": config["head_dim"],
            "ffn": config["intermediate_size"],
            "max_positions": config["max_position_embeddings"],
            "vocab_size": config["vocab_size"],
        },
        "tokens": {
            "eos": config["eos_token_id"],
            "pad": config["pad_token_id"],
            "decoder_start": config["decoder_start_token_id"],
            "tokenizer_size": len(tokenizer),
            "prompt_en": prompt_ids(tokenizer, "en") if "en" in LANGUAGES else None,
        },
        "front_end": {
            "sampling_rate": front_end["sampling_rate"],
            "n_fft": front_end["n_fft"],
            "win_length": front_end["win_length"],
            "hop_length": front_end["hop_length"],
            "mel_bins": front_end["feature_size"],
            "dither": front_end["dither"],
        },
    }


def describe(model, processor) -> dict:
    """Shapes and ids of a loaded checkpoint (what `cohere-coreml info` prints)."""
    config = model.config
    return _summary(
        getattr(getattr(model, "source", None), "model_id", None),
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.model.encoder.parameters()),
        config.to_dict(), config.encoder_config.to_dict(), processor.feature_extractor.to_dict(), processor.tokenizer,
    )


def safetensors_shapes(folder: str | os.PathLike) -> dict[str, list[int]]:
    """name -> shape of every tensor in a checkpoint folder's *.safetensors files, from their headers
    (nothing loaded). Raises CheckpointError for a file whose header cannot be read."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        shapes.update(safetensors_file_shapes(path))
    return shapes


def safetensors_file_shapes(path: Path) -> dict[str, list[int]]:
    """name -> shape of every tensor in one safetensors file, from its header (`safetensors_shapes`)."""
    try:
        with open(path, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(min(size, path.stat().st_size - 8)))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def feature_extractor_settings(folder: Path) -> dict | None:
    """The feature extractor's saved settings, where transformers looks for them: processor_config.json's
    "feature_extractor" (or "audio_processor"), else preprocessor_config.json; None when neither has them."""
    for name, keys in (("processor_config.json", ("feature_extractor", "audio_processor")),
                       ("preprocessor_config.json", None)):
        try:
            saved = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        settings = saved if keys is None else next((saved[k] for k in keys if isinstance(saved, dict) and k in saved),
                                                   None)
        if isinstance(settings, dict):
            return settings
    return None


class TokenizerFile:
    """A checkpoint's tokenizer.json through `tokenizers` (what transformers' fast tokenizer wraps): the
    lookups `info` needs (`len`, `convert_tokens_to_ids`, the unknown token), without transformers."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer  # the Rust tokenizer alone (no torch)

        unk = json.loads((folder / "tokenizer_config.json").read_text()).get("unk_token")
        self.unk_token = unk.get("content") if isinstance(unk, dict) else unk
        if not isinstance(self.unk_token, str):
            raise ValueError("tokenizer_config.json names no unk_token")
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.unk_token_id = self._tokenizer.token_to_id(self.unk_token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return self.unk_token_id if found is None else found


def describe_files(source: CheckpointSource) -> dict | None:
    """`describe` of a checkpoint from its files alone, without torch or transformers: config.json, the
    safetensors headers (parameters: every stored tensor but BatchNorm's running statistics), the
    feature extractor's settings and tokenizer.json. None when a file or a value is missing (transformers
    would fill it in from its own defaults: then only the loaded reference tells)."""
    folder = source.local_dir
    config = check_checkpoint_dir(folder)
    front_end = feature_extractor_settings(folder)
    if front_end is None or not isinstance(config.get("encoder_config"), dict):
        logger.debug("%s: no feature extractor settings or encoder_config: loading the reference", folder)
        return None
    try:
        tokenizer = TokenizerFile(folder)
    except Exception as err:  # noqa: BLE001 - any unreadable tokenizer file: the reference path reports it
        logger.debug("tokenizer files of %s not read directly (%s): loading the reference", folder, err)
        return None
    params = {k: math.prod(s) for k, s in safetensors_shapes(folder).items() if not k.endswith(_BUFFER_SUFFIXES)}
    try:
        return _summary(source.model_id, sum(params.values()),
                        sum(n for k, n in params.items() if k.startswith(ENCODER_PREFIX)),
                        config, config["encoder_config"], front_end, tokenizer)
    except KeyError as err:
        logger.debug("%s does not say %s: loading the reference", folder, err)
        return None


# --------------------------------------------------------------------------------------------------
# `cohere-coreml info`, `cohere-coreml vocab`
# --------------------------------------------------------------------------------------------------


def cmd_info(args) -> int:
    info = describe_files(resolve_checkpoint(args.model, args.revision))
    if info is None:  # a value left to transformers' defaults
        info = describe(*load_reference(args.model, revision=args.revision))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint   {info['source']}")
    print(f"parameters   {info['parameters']:,} (encoder {info['encoder_parameters']:,})")
    for part in ("encoder", "decoder", "tokens", "front_end"):
        print(f"{part:<12} " + ", ".join(f"{k}={v}" for k, v in info[part].items()))
    return 0


def cmd_vocab(args) -> int:
    from transformers import AutoTokenizer  # heavy: only `vocab` needs it


    source = resolve_checkpoint(args.model, args.revision)
    check_checkpoint_dir(source.local_dir)
    tokenizer = AutoTokenizer.from_pretrained(source.local_dir)
    print(export_vocab(tokenizer, args.out))
    return 0


def _add_model_args(p) -> None:
    p.add_argument("--model", required=True,
                   help=f"Hugging Face Hub id (e.g. {DEFAULT_HUB_ID}) or a local checkpoint folder")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")


def add_commands(subparsers) -> None:
    """Register `cohere-coreml info` and `cohere-coreml vocab`."""
    p = subparsers.add_parser("info", help="describe a checkpoint: widths, layers, token ids, front end")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = subparsers.add_parser("vocab", help="write vocab.json (id -> piece) of a checkpoint's tokenizer")
    _add_model_args(p)
    p.add_argument("--out", required=True, help="output path of vocab.json")
    p.set_defaults(func=cmd_vocab)
