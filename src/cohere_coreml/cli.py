"""`cohere-coreml`: the command line of the toolkit.

Each sub-command is a thin layer over a package module; `cohere-coreml <command> --help` explains it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .config import DEFAULT_HUB_ID, DEFAULT_MODEL_DIR, DEFAULT_OUT_DIR

logger = logging.getLogger("cohere_coreml")

DESCRIPTION = """\
Convert Cohere Transcribe (Conformer encoder + Transformer decoder) to Core ML packages, run them
on Linux (MIL interpreter) or macOS (Core ML), and check them against the PyTorch reference.

Typical flow:
  cohere-coreml prepare-default                 # the built-in small checkpoint (no download)
  cohere-coreml info --model MODEL              # what a checkpoint holds
  cohere-coreml export --model MODEL --out DIR  # encoder.mlpackage + decoder.mlpackage, parity-gated
  cohere-coreml transcribe AUDIO --bundle DIR --language en
  cohere-coreml verify --model MODEL --bundle DIR --audio AUDIO

MODEL is a Hugging Face Hub id (default checkpoint: %s) or a local checkpoint folder.
""" % DEFAULT_HUB_ID


class CliError(Exception):
    """An error to report to the user in one line (exit code 2)."""


# --------------------------------------------------------------------------------------------------
# Sub-commands of the foundation
# --------------------------------------------------------------------------------------------------


def default_model(out_dir: Path = DEFAULT_OUT_DIR) -> Path:
    """The built-in default checkpoint: the committed trained small model, else a random tiny one."""
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    from .checkpoint import make_tiny_checkpoint

    path = out_dir / "tiny-random"
    if not (path / "config.json").is_file():
        logger.info("writing a random-weight tiny checkpoint to %s", path)
        make_tiny_checkpoint(path, seed=0)
    return path


def cmd_prepare_default(args) -> int:
    path = default_model(Path(args.out))
    print(path)
    if args.describe:
        return cmd_info(argparse.Namespace(model=str(path), revision=None, json=args.json))
    return 0


def cmd_info(args) -> int:
    from .checkpoint import describe, load_reference

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
    from transformers import AutoTokenizer

    from .checkpoint import check_checkpoint_dir, resolve_checkpoint
    from .tokens import export_vocab

    source = resolve_checkpoint(args.model, args.revision)
    check_checkpoint_dir(source.local_dir)
    tokenizer = AutoTokenizer.from_pretrained(source.local_dir)
    print(export_vocab(tokenizer, args.out))
    return 0


def cmd_mel(args) -> int:
    import numpy as np

    from .audio import FrontEndConfig, load_audio, log_mel, split_points

    config = FrontEndConfig.from_pretrained(args.model) if args.model else FrontEndConfig()
    wav = load_audio(args.audio)
    pieces = split_points(wav, config)
    for start, end in pieces:
        features, n_valid = log_mel(wav[start:end], config)
        print(
            f"{start / config.sampling_rate:8.2f}s-{end / config.sampling_rate:8.2f}s  features {features.shape} "
            f"valid {n_valid}  mean {features[:, :n_valid].mean():+.4f} std {features[:, :n_valid].std():.4f}"
        )
        if args.save:
            np.save(args.save, features)
    return 0


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


def _add_model_args(p, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help=f"Hugging Face Hub id (e.g. {DEFAULT_HUB_ID}) or a local checkpoint folder",
    )
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of --model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cohere-coreml", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "prepare-default",
        help="locate (or create) the built-in default checkpoint and print its folder",
        description="The built-in default checkpoint: the project's committed small trained model "
        f"({DEFAULT_MODEL_DIR.relative_to(DEFAULT_MODEL_DIR.parents[1])}) when present, otherwise a "
        "random-weight tiny checkpoint written under --out. Needs no download.",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT_DIR), help="where a generated checkpoint goes (default: %(default)s)")
    p.add_argument("--describe", action="store_true", help="also print what the checkpoint holds")
    p.add_argument("--json", action="store_true", help="with --describe: print JSON")
    p.set_defaults(func=cmd_prepare_default)

    p = sub.add_parser("info", help="describe a checkpoint: widths, layers, token ids, front end")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("vocab", help="write vocab.json (id -> piece) of a checkpoint's tokenizer")
    _add_model_args(p)
    p.add_argument("--out", required=True, help="output path of vocab.json")
    p.set_defaults(func=cmd_vocab)

    p = sub.add_parser("mel", help="compute the model's log-mel features of an audio file (stats per window)")
    p.add_argument("audio", help="audio file (wav, flac, mp3, ...); resampled to 16 kHz mono")
    p.add_argument("--model", default=None, help="checkpoint folder whose preprocessor config to use")
    p.add_argument("--save", default=None, help="save the (last window's) features as .npy")
    p.set_defaults(func=cmd_mel)

    _add_stage_commands(sub)
    return parser


# Stage modules that add a sub-command: module name -> name of its `add_<command>_command(subparsers)`.
STAGE_COMMANDS = (
    ("encoder", "add_export_command"),
    ("transcribe", "add_transcribe_command"),
    ("verify", "add_verify_command"),
)


def _add_stage_commands(sub) -> None:
    """Sub-commands of the export / transcription stages (each module registers its own options)."""
    import importlib
    import importlib.util

    for module_name, hook in STAGE_COMMANDS:
        if importlib.util.find_spec(f"{__package__}.{module_name}") is None:
            continue
        module = importlib.import_module(f"{__package__}.{module_name}")
        if hasattr(module, hook):
            getattr(module, hook)(sub)


def _is_user_error(err: BaseException) -> bool:
    """Errors of this package that name a problem with the user's input (reported in one line)."""
    return isinstance(err, (CliError, ValueError, RuntimeError, FileNotFoundError)) and type(err).__module__.startswith(
        __package__
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "huggingface_hub", "torch"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    # coremltools warns at import that its Core ML runtime is missing, on every Linux run: expected here
    logging.getLogger("coremltools").setLevel(logging.ERROR if args.verbose < 2 else logging.DEBUG)
    try:
        return int(args.func(args) or 0)
    except Exception as err:  # noqa: BLE001 - only the package's own error types are reported briefly
        if not _is_user_error(err):
            raise
        print(f"cohere-coreml {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
