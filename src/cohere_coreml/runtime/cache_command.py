"""`cohere-coreml cache list|clear|prune`: the compiled-model cache (`compiled_cache`) seen and tidied.

The folder is the one the Core ML backend and the Swift package use (`compiled_cache.default_cache_dir`,
`--cache` for another); entries are listed least recently used first.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from . import compiled_cache


class CacheUsageError(ValueError):
    """A `cache` command asked for nothing it can do (reported in one line)."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: str) -> float:
    """`--older-than`: a number and a unit (s, m, h, d, w): `30d`, `12h`."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a number and a unit s/m/h/d/w (e.g. 30d, 12h), got {text!r}")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of GiB >= 0, got {text!r}")
    return value


def age(seconds: float) -> str:
    """`5 min`, `3 h`, `2 d`: how long ago, to people."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _folder(args) -> Path:
    return Path(args.cache).expanduser() if args.cache else compiled_cache.default_cache_dir()


def _summary(removed: list[compiled_cache.CacheEntry], folder: Path) -> str:
    return f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, " \
           f"{sum(e.size for e in removed) / 1e6:.1f} MB, from {folder}"


def cmd_list(args) -> int:
    folder = _folder(args)
    found = compiled_cache.entries(folder)
    if args.json:
        print(json.dumps({"folder": str(folder), "entries": [e.to_dict() for e in found],
                          "total_bytes": sum(e.size for e in found)}, indent=2))
        return 0
    now = time.time()
    for e in found:
        state = "" if e.complete else (" (incomplete: an install or removal under way or interrupted)"
                                       if e.temporary else " (incomplete)")
        print(f"{e.size / 1e6:10.1f} MB  {age(now - e.last_used):>7} ago  {e.path.name}{state}"
              + (f"  <- {e.source}" if e.source else ""))
    print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {sum(e.size for e in found) / 1e6:.1f} MB in {folder}")
    return 0


def cmd_clear(args) -> int:
    folder = _folder(args)
    print(_summary(compiled_cache.clear(folder), folder))
    return 0


def cmd_prune(args) -> int:
    if args.keep is None and args.older_than is None and args.max_gb is None:
        raise CacheUsageError("say what to prune: --keep N, --older-than DURATION and/or --max-gb GIB")
    folder = _folder(args)
    max_bytes = None if args.max_gb is None else int(args.max_gb * 2**30)
    print(_summary(compiled_cache.prune(folder, keep=args.keep, older_than=args.older_than, max_bytes=max_bytes), folder))
    return 0


def add_command(subparsers) -> None:
    """Register `cohere-coreml cache`."""
    p = subparsers.add_parser(
        "cache", help="list, clear or prune the compiled-model cache (Core ML's compiled packages)",
        description="Core ML compiles each .mlpackage once into the compiled-model cache (default "
        f"{compiled_cache.default_cache_dir()}; ${compiled_cache.CACHE_ENV} moves it), shared with the Swift "
        "package, under a name derived from the package's content. After each install the entries of the same "
        "package's earlier contents are removed, then the least recently used ones while the folder holds "
        f"more than ${compiled_cache.MAX_GB_ENV} GiB (default {compiled_cache.DEFAULT_MAX_GB:g}; 0: no cap).",
    )
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=None, metavar="DIR", help="cache folder (default: the one above)")
    ls = sub.add_parser("list", parents=[common], help="entries with size, last use and source package")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_list)
    sub.add_parser("clear", parents=[common], help="remove every entry").set_defaults(func=cmd_clear)
    pr = sub.add_parser("prune", parents=[common], help="remove old or surplus entries",
                        description="Remove entries (and interrupted installs' leftovers) by any of the rules given.")
    pr.add_argument("--keep", type=_positive_int, default=None, metavar="N",
                    help="per package name (encoder, decoder, ...), keep the N most recently used")
    pr.add_argument("--older-than", type=duration, default=None, metavar="DURATION",
                    help="remove entries unused for longer (e.g. 30d, 12h)")
    pr.add_argument("--max-gb", type=_gib, default=None, metavar="GIB",
                    help="remove the least recently used entries while the folder holds more")
    pr.set_defaults(func=cmd_prune)
