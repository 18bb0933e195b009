"""`cohere-coreml`: the command line of the toolkit.

Each sub-command lives next to the stage it drives and is registered here explicitly (flags that
several commands share, such as --bundle, are defined once in cohere_coreml.cli_options):

    prepare-default   this module (the checkout's default checkpoint)
    info, vocab       cohere_coreml.model.checkpoint
    mel               cohere_coreml.model.audio
    export            cohere_coreml.export.pipeline
    transcribe        cohere_coreml.inference.transcribe
    verify            cohere_coreml.evaluation.verify
    quantize          cohere_coreml.quantize
    bundle, upload    cohere_coreml.publish.hub
    bench             cohere_coreml.evaluation.bench
    ane-check         cohere_coreml.bundle.ane_check
    serve-runtime     cohere_coreml.runtime.serve
    cache             cohere_coreml.runtime.cache_command

`cohere-coreml <command> --help` explains each.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import sys
from pathlib import Path

from . import __version__, quantize
from .bundle import ane_check
from .config import DEFAULT_HUB_ID
from .evaluation import bench, verify
from .export import pipeline as export
from .inference import transcribe
from .model import audio, checkpoint
from .publish import hub as publish
from .runtime import cache_command, serve

logger = logging.getLogger("cohere_coreml")

# The source checkout this module runs from (an editable install), if any: its committed small
# trained model is the built-in default of `make demo`. The only place that knows the checkout.
CHECKOUT_DIR = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = CHECKOUT_DIR / "models" / "cohere-tiny-synth"

DESCRIPTION = f"""\
Convert Cohere Transcribe (Conformer encoder + Transformer decoder) to Core ML packages, run them
on Linux (MIL interpreter) or macOS (Core ML), and check them against the PyTorch reference.

Typical flow:
  cohere-coreml prepare-default                 # the checkout's small trained checkpoint (no download)
  cohere-coreml info --model MODEL              # what a checkpoint holds
  cohere-coreml export --model MODEL --out DIR  # frontend, encoder and decoder .mlpackage, parity-gated
  cohere-coreml transcribe AUDIO --bundle DIR --language en
  cohere-coreml verify --model MODEL --bundle DIR --audio AUDIO
  cohere-coreml quantize --bundle f16 --out q8 --preset q8   # compressed weights, gated vs f16
  cohere-coreml bundle check DIR                # every file's sha256 vs manifest.json
  cohere-coreml upload --bundle DIR --repo-id ORG/NAME --dry-run
  cohere-coreml cache list                      # Core ML's compiled models (also: clear, prune)

MODEL is a Hugging Face Hub id (default checkpoint: {DEFAULT_HUB_ID}) or a local checkpoint folder.
"""


class CliError(Exception):
    """An error to report to the user in one line (exit code 2)."""


def cmd_prepare_default(args) -> int:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise CliError(f"no default checkpoint at {DEFAULT_MODEL_DIR}: it ships with the source checkout "
                       "(models/cohere-tiny-synth); pass --model <checkpoint folder or Hub id> to the commands instead")
    print(DEFAULT_MODEL_DIR)
    if args.describe:
        return checkpoint.cmd_info(argparse.Namespace(model=str(DEFAULT_MODEL_DIR), revision=None, json=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cohere-coreml", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging: -v every step and the gates' per-case tables (also in each package's "
                        "<component>.parity.json) and the converters' progress bars; -vv the libraries' debug "
                        "logs too. Default: progress lines, one verdict line per package, the results")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "prepare-default",
        help="print the folder of the built-in default checkpoint (the checkout's small trained model)",
        description="The built-in default checkpoint: the project's committed small trained model "
        "(models/cohere-tiny-synth in the source checkout). Needs no download.",
    )
    p.add_argument("--describe", action="store_true", help="also print what the checkpoint holds")
    p.add_argument("--json", action="store_true", help="with --describe: print JSON")
    p.set_defaults(func=cmd_prepare_default)

    checkpoint.add_commands(sub)  # info, vocab
    audio.add_command(sub)  # mel
    export.add_command(sub)  # export
    transcribe.add_command(sub)  # transcribe
    verify.add_command(sub)  # verify
    quantize.add_command(sub)  # quantize
    publish.add_commands(sub)  # bundle check|finalize, upload
    bench.add_command(sub)  # bench
    ane_check.add_command(sub)  # ane-check
    serve.add_command(sub)  # serve-runtime
    cache_command.add_command(sub)  # cache list|clear|prune
    return parser


def _is_user_error(err: BaseException) -> bool:
    """Errors of this package that name a problem with the user's input (reported in one line)."""
    return isinstance(err, (CliError, ValueError, RuntimeError, FileNotFoundError)) and type(err).__module__.startswith(
        __package__
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose >= 2 else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # -v: this package's DEBUG lines (each step, the gates' cases); NOTSET: the root's level (INFO)
    logger.setLevel(logging.DEBUG if args.verbose else logging.NOTSET)
    for noisy in ("transformers", "huggingface_hub", "torch"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    # coremltools warns at import that its Core ML runtime is missing, on every Linux run: expected here
    logging.getLogger("coremltools").setLevel(logging.ERROR if args.verbose < 2 else logging.DEBUG)
    for note in getattr(args, "deprecations", None) or []:  # old spellings still read (cli_options)
        logger.warning("%s", note)
    try:
        return int(args.func(args) or 0)
    except Exception as err:  # noqa: BLE001 - only the package's own error types are reported briefly
        full = _disk_full(err)
        if full is not None:
            where = f" writing {full.filename}" if full.filename else ""
            print(f"cohere-coreml {args.command}: error: {full.strerror or 'no space left on device'}{where}: free "
                  "space and run the command again (nothing incomplete was put in place: docs/reliability.md)",
                  file=sys.stderr)
            return 2
        if not _is_user_error(err):
            raise
        print(f"cohere-coreml {args.command}: error: {err}", file=sys.stderr)
        return 2


def _disk_full(err: BaseException) -> OSError | None:
    """The OSError ENOSPC / EDQUOT (full disk, quota) behind `err` (itself or a cause), if any.

    `shutil.copytree` (coremltools saves packages with it) gathers its failures into one
    `shutil.Error` without an errno: [(src, dst, "[Errno 28] No space left on device: ...")]."""
    full = (errno.ENOSPC, errno.EDQUOT)
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
            for entry in err.args[0]:
                if len(entry) == 3 and any(f"[Errno {code}]" in str(entry[2]) for code in full):
                    code = next(c for c in full if f"[Errno {c}]" in str(entry[2]))
                    return OSError(code, os.strerror(code), entry[1])
        if isinstance(err, OSError) and err.errno in full:
            return err
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
