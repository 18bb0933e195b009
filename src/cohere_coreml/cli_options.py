"""Flags that several commands share, spelled once so that one flag means one thing everywhere.

    --bundle DIR            one bundle (transcribe, verify: given once; bench: repeatable, one bundle each)
    --bundle DIR,DIR2       one bundle whose files are searched in DIR, then DIR2 (`bundle.Bundle.load`)
    --max-new-tokens, --beams, --repetition-guard    decoding (transcribe, bench)
    --vad auto|on|off, --vad-threshold, ...          voice activity: inference.speech_regions.add_vad_args

Deprecated for one release (accepted, not shown in --help, one warning line on stderr):
`transcribe|verify --bundle DIR DIR2` (space-separated folders of one bundle), now `--bundle DIR,DIR2`.
The warning is collected on the parsed namespace (`args.deprecations`) and logged by `cli.main`
once logging is set up.
"""

from __future__ import annotations

import argparse


class BundleAction(argparse.Action):
    """`--bundle`: each occurrence names ONE bundle, its folders comma-separated -> [folder, ...].

    `repeatable=False` (transcribe, verify): args.bundle is one folder list; a second --bundle is an
    error; several space-separated values (the old spelling) are read as one bundle's folders, with
    a deprecation line. `repeatable=True` (bench): args.bundle is a list of folder lists."""

    def __init__(self, option_strings, dest, repeatable: bool = False, **kwargs):
        self.repeatable = repeatable
        # nargs="+" only to keep reading the deprecated space-separated folders of transcribe / verify
        super().__init__(option_strings, dest, nargs=None if repeatable else "+", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        values = [values] if isinstance(values, str) else list(values)
        folders = [f for v in values for f in v.split(",") if f]
        if not folders:
            parser.error(f"{option_string}: no bundle folder given")
        if self.repeatable:
            setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), folders])
            return
        if getattr(namespace, self.dest, None):
            parser.error(f"{option_string} names one bundle: give it once (one bundle over several folders: "
                         f"{option_string} DIR,DIR2)")
        if len(values) > 1:
            note = (f"`{option_string} {' '.join(values)}` is deprecated (space-separated folders of one bundle): "
                    f"write `{option_string} {','.join(values)}`; the old spelling goes in the next release")
            setattr(namespace, "deprecations", [*(getattr(namespace, "deprecations", None) or []), note])
        setattr(namespace, self.dest, folders)


class HelpFormatter(argparse.HelpFormatter):
    """Shows `--bundle DIR[,DIR...]` (one value) although the action still reads the deprecated
    space-separated folders: the old spelling stays out of --help. (`_format_args` is argparse's
    hook for an action's metavar; the one override of this formatter.)"""

    def _format_args(self, action, default_metavar):
        if isinstance(action, BundleAction):
            return action.metavar or "DIR[,DIR...]"
        return super()._format_args(action, default_metavar)


def add_bundle_arg(p: argparse.ArgumentParser, repeatable: bool = False, required: bool = True) -> None:
    """--bundle: one bundle per occurrence (folders comma-separated); `repeatable` for several bundles."""
    what = ("bundle (repeatable: one bundle each)" if repeatable else "the bundle")
    p.add_argument("--bundle", action=BundleAction, repeatable=repeatable, required=required,
                   default=[] if repeatable else None, metavar="DIR[,DIR...]",
                   help=f"{what}: an export folder holding manifest.json and the packages, or several folders "
                   "searched in order, comma-separated (one bundle)")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """--max-new-tokens, --beams, --repetition-guard (transcribe and bench)."""
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="stop a window after N new tokens (default: the decoder cache capacity; PyTorch: 256)")
    p.add_argument("--beams", type=int, default=1,
                   help="beam search with N hypotheses, length-normalised; 1 = greedy (default: %(default)s)")
    p.add_argument("--repetition-guard", action="store_true",
                   help="stop a window whose tail repeats an n-gram run (a decoder loop), keep it once, report it")



def add_decoder_batch_arg(p: argparse.ArgumentParser) -> None:
    """--decoder-batch, --encoder-ahead (transcribe and bench): windows of one clip decoded at once, and encoded
    ahead of them."""
    p.add_argument("--decoder-batch", type=int, default=None, metavar="B",
                   help="a clip of several windows: decode B windows at once through the decoder's batched step "
                   "(greedy, without word timings; the same tokens per window up to fp16 near-ties); 1 = one window "
                   "at a time. Default: the bundle's (manifest decoder.batch.size, 1 without one); docs/decoder.md")
    p.add_argument("--encoder-ahead", type=int, default=None, metavar="N",
                   help="with --decoder-batch above 1: a worker thread computes the features and encoder of the next N "
                   "windows while the batch decodes (at most B + N windows' encoder outputs held); 0 = each window "
                   "encoded when the batch has room for it. The same tokens. Default: B")
