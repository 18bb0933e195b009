"""`Bundle.load`: a bundle folder (or several) read for inference: the manifest checked field by field
(`cohere_coreml.bundle.checks`) and against its packages (`cohere_coreml.bundle.package_checks`), file
paths resolved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..model.tokens import UnknownLanguageError
from ..storage.integrity import MANIFEST_NAME, IntegrityError, check_sizes, safe_path
from .checks import check_manifest, show_value
from .format import FORMAT_CHANGES, FORMAT_NAME, FORMAT_VERSION, BundleError
from .package_checks import check_packages


@dataclass
class Bundle:
    """A loaded bundle: the manifest plus resolved file paths (searched over one or more folders)."""

    dirs: list[Path]
    manifest: dict
    paths: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, dirs: str | os.PathLike | Sequence[str | os.PathLike], check_package_io: bool = True) -> Bundle:
        """Read and check the manifest (`check_manifest`: every field the loop reads, its type, range and
        consistency), the presence and size of every listed file, and (`check_package_io`) that every
        package function has the io the manifest lists (`check_packages`). Any problem: BundleError
        naming the field or file."""
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = [Path(d) for d in dirs]
        if not dirs:
            raise BundleError("no bundle folder given")
        for d in dirs:
            if not d.is_dir():
                raise BundleError(f"bundle folder {d} does not exist")
        manifest_path = next((d / MANIFEST_NAME for d in dirs if (d / MANIFEST_NAME).is_file()), None)
        if manifest_path is None:
            raise BundleError(
                f"no {MANIFEST_NAME} in {', '.join(map(str, dirs))}: export the bundle with `cohere-coreml export`"
            )
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise BundleError(f"{manifest_path} is not readable JSON: {err}") from err
        if not isinstance(manifest, dict):
            raise BundleError(f"{manifest_path} is not a {FORMAT_NAME} manifest (not a JSON object)")
        if manifest.get("format") != FORMAT_NAME:
            raise BundleError(f"{manifest_path} is not a {FORMAT_NAME} manifest")
        version = manifest.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise BundleError(f"{manifest_path}: field 'format_version' must be a positive integer, got {show_value(version)}")
        if version > FORMAT_VERSION:
            raise BundleError(
                f"{manifest_path} has format_version {version}; this tool reads format {FORMAT_VERSION}: update cohere-coreml"
            )
        if version < FORMAT_VERSION:
            raise BundleError(
                f"{manifest_path} has format_version {version}, an older bundle format this tool no longer reads "
                f"(format {FORMAT_VERSION}: {FORMAT_CHANGES[FORMAT_VERSION]}); re-export the bundle with "
                "`cohere-coreml export --force`"
            )
        bundle = cls(dirs=dirs, manifest=manifest)

        files = manifest.get("files")
        if not isinstance(files, dict):
            raise BundleError(f"{manifest_path}: field 'files' must be an object naming the bundle's files, "
                              f"got {show_value(files)}")
        try:  # every file the manifest names stays inside the bundle
            for key, name in files.items():
                if name is not None:
                    safe_path(name, f"{manifest_path}: files.{key}")
        except IntegrityError as err:
            raise BundleError(str(err)) from err
        suffixes = {"encoder": ".mlpackage", "decoder": ".mlpackage", "frontend": ".mlpackage", "vad": ".mlpackage",
                    "vocab": ".json",
                    "tokenizer": "tokenizer.json", "processor_config": ".json", "tokenizer_config": ".json"}
        for key, suffix in suffixes.items():
            name = files.get(key)
            if name is not None and not name.endswith(suffix):
                raise BundleError(f"{manifest_path}: field 'files.{key}' is {name!r}; it names a {suffix} file")
        for key in ("encoder", "decoder", "vocab", "tokenizer", "processor_config"):
            name = files.get(key)
            if name is None:
                raise BundleError(f"{manifest_path} describes no {key}: export it (`cohere-coreml export`)")
            found = next((d / name for d in dirs if (d / name).exists()), None)
            if found is None:
                raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
            bundle.paths[key] = found
        bundle.paths["tokenizer_dir"] = bundle.paths["tokenizer"].parent
        part_keys = [k for k in files if k.startswith("encoder_part")]  # an encoder in parts: its later programs
        for key in ("frontend", "vad", *part_keys):  # optional: frontend.mlpackage, vad.mlpackage, encoder_part<k>
            name = files.get(key)
            if key in part_keys and (not isinstance(name, str) or not name.endswith(".mlpackage")):
                raise BundleError(f"{manifest_path}: field 'files.{key}' is {name!r}; it names a .mlpackage file")
            if name is not None:
                found = next((d / name for d in dirs if (d / name).exists()), None)
                if found is None:
                    raise BundleError(f"bundle is missing {name} (looked in {', '.join(map(str, dirs))})")
                bundle.paths[key] = found
        try:
            check_sizes(dirs, manifest)  # presence and size of every file the manifest lists
        except IntegrityError as err:
            raise BundleError(str(err) if MANIFEST_NAME in str(err) else f"{manifest_path}: {err}") from err
        vocab = _read_json(bundle.paths["vocab"], "files.vocab")
        if not isinstance(vocab, dict) or not all(isinstance(v, str) for v in vocab.values()):
            raise BundleError(f"{bundle.paths['vocab']} (files.vocab) is not an {{id: piece}} table")
        processor = _read_json(bundle.paths["processor_config"], "files.processor_config")
        check_manifest(manifest, str(manifest_path), vocab=vocab, processor=processor)
        if check_package_io:
            check_packages(bundle, str(manifest_path))
        return bundle

    # convenience accessors ------------------------------------------------------------------
    @property
    def eos_ids(self) -> set[int]:
        return {int(i) for i in self.manifest["tokens"]["eos_token_ids"]}

    @property
    def capacity(self) -> int:
        return int(self.manifest["decoder"]["capacity"])

    @property
    def window_frames(self) -> int:
        return int(self.manifest["encoder"]["window_frames"])

    @property
    def languages(self) -> list[str]:
        return sorted(self.manifest["languages"])

    @property
    def vad_chunks(self) -> int | None:
        """Chunks per call of vad.mlpackage's block function (the manifest's), None without a VAD."""
        vad = self.manifest.get("vad")
        return None if vad is None else int(vad["functions"]["block"]["chunks"])

    def prompt(self, language: str, punctuation: bool = True) -> list[int]:
        if language not in self.manifest["languages"]:
            raise UnknownLanguageError(language)
        return [int(i) for i in self.manifest["languages"][language]["punctuation" if punctuation else "no_punctuation"]]


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BundleError(f"{path} ({what}) is not readable JSON: {err}") from err
