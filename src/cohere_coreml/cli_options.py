"""Flags that several commands share, spelled once so that one flag means one thing everywhere.

    --bundle DIR            one bundle (transcribe, verify: given once; bench: repeatable, one bundle each)
    --bundle DIR,DIR2       one bundle whose files are searched in DIR, then DIR2 (`bundle.Bundle.load`)
    --max-new-tokens, --beams, --repetition-guard    decoding (transcribe, bench)
    --vad auto|on|off, --vad-threshold, ...          voice activity (transcribe, its --stream, bench; docs/vad.md)

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


VAD_MODES = ("auto", "on", "off")  # inference.engines.VAD_MODES (not imported: this module stays light)


def add_vad_args(p: argparse.ArgumentParser) -> None:
    """--vad and the speech-region rule's options (docs/vad.md), silero-vad's defaults."""
    from .inference.speech_regions import VadOptions  # no heavy import: the rule is plain Python

    d = VadOptions()
    p.add_argument("--vad", default="auto", choices=VAD_MODES,
                   help="voice activity (docs/vad.md): transcribe only the windows of speech the bundle's vad.mlpackage "
                   "finds (with --stream: segments opened and closed by it); auto = on when the bundle has one "
                   "(default: %(default)s)")
    p.add_argument("--vad-threshold", type=float, default=d.threshold,
                   help="speech probability at which speech starts (0-1) (default: %(default)s)")
    p.add_argument("--vad-min-speech-ms", type=int, default=d.min_speech_ms,
                   help="drop regions of speech shorter than this (default: %(default)s)")
    p.add_argument("--vad-min-silence-ms", type=int, default=d.min_silence_ms,
                   help="silence that ends a region of speech (default: %(default)s)")
    p.add_argument("--vad-speech-pad-ms", type=int, default=d.speech_pad_ms,
                   help="audio kept on each side of a region (default: %(default)s)")
    p.add_argument("--vad-max-gap-s", type=float, default=d.max_gap_s,
                   help="longest pause kept inside one window; longer pauses are never decoded (default: %(default)s)")


def vad_options_of(args):
    """The `VadOptions` of the parsed --vad-* flags (a bad value: `VadOptionsError`, one line)."""
    from .inference.speech_regions import VadOptions

    return VadOptions(threshold=args.vad_threshold, min_speech_ms=args.vad_min_speech_ms,
                      min_silence_ms=args.vad_min_silence_ms, speech_pad_ms=args.vad_speech_pad_ms,
                      max_gap_s=args.vad_max_gap_s)
