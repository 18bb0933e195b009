"""Checkpoints: load a Cohere Transcribe checkpoint and describe it (`cohere-coreml info`).

`load_reference` is the one way the project reads a checkpoint (a Hugging Face Hub id, optionally at
a revision, or a local folder): the `transformers` reference model `CohereAsrForConditionalGeneration`
plus its `CohereAsrProcessor`, in eval mode, weights from safetensors only, never remote code.

Small checkpoints for tests and the demo model are made by the dev package
(`tools/cohere_coreml_dev/checkpoints.py`), not here.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_HUB_ID
from .tokens import LANGUAGES, export_vocab, prompt_ids

logger = logging.getLogger(__name__)

MODEL_TYPE = "cohere_asr"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Files a checkpoint needs; pickled weights (*.bin, *.pt) are never fetched nor loaded.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.md"]


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
    from huggingface_hub import snapshot_download  # heavy (the Hub's HTTP stack, ~0.2 s): only a download needs it
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
        # model for the whole export (full-size gated export: 18.0 -> 13.97 GiB peak RSS, docs/quantization.md).
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


def describe(model, processor) -> dict:
    """Shapes and ids of a loaded checkpoint (what `cohere-coreml info` prints)."""
    config = model.config
    enc = config.encoder_config
    n_params = sum(p.numel() for p in model.parameters())
    n_encoder = sum(p.numel() for p in model.model.encoder.parameters())
    fe = processor.feature_extractor
    return {
        "source": getattr(getattr(model, "source", None), "model_id", None),
        "parameters": n_params,
        "encoder_parameters": n_encoder,
        "encoder": {
            "hidden_size": enc.hidden_size,
            "layers": enc.num_hidden_layers,
            "heads": enc.num_attention_heads,
            "ffn": enc.intermediate_size,
            "subsampling_factor": enc.subsampling_factor,
            "mel_bins": enc.num_mel_bins,
        },
        "decoder": {
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "ffn": config.intermediate_size,
            "max_positions": config.max_position_embeddings,
            "vocab_size": config.vocab_size,
        },
        "tokens": {
            "eos": config.eos_token_id,
            "pad": config.pad_token_id,
            "decoder_start": config.decoder_start_token_id,
            "tokenizer_size": len(processor.tokenizer),
            "prompt_en": prompt_ids(processor.tokenizer, "en") if "en" in LANGUAGES else None,
        },
        "front_end": {
            "sampling_rate": fe.sampling_rate,
            "n_fft": fe.n_fft,
            "win_length": fe.win_length,
            "hop_length": fe.hop_length,
            "mel_bins": fe.feature_size,
            "dither": fe.dither,
        },
    }


# --------------------------------------------------------------------------------------------------
# `cohere-coreml info`, `cohere-coreml vocab`
# --------------------------------------------------------------------------------------------------


def cmd_info(args) -> int:
    model, processor = load_reference(args.model, revision=args.revision)
    info = describe(model, processor)
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
