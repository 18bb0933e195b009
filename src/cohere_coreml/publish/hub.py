"""Published bundles: `bundle check|finalize` (checksums; the model card and example written by
`cohere_coreml.publish.card`) and the Hub upload.

`cohere-coreml upload --bundle q8/ --repo-id ORG/NAME` is a thin layer over
`huggingface_hub.HfApi.upload_folder`: the bundle's checksums are verified first, the files go to
one folder per preset in the repository (`f16/`, `q8/`...), the token comes from `HF_TOKEN` or the
Hugging Face login and is never printed, and an unreachable Hub is a one-line error (requests
time out after `HF_HUB_ETAG_TIMEOUT`/`--timeout` seconds; `HF_HUB_OFFLINE=1` fails at once).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..bundle import ane_check
from ..bundle.manifest import MANIFEST_NAME, refresh_manifest, write_manifest
from ..model.checkpoint import CheckpointError, check_hub_id
from ..storage.files import sweep_stale_temporaries, write_text_atomic
from ..storage.integrity import IntegrityError, check_bundle, manifest_sections
from .card import EXAMPLE, README, example_source, model_card

logger = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """The bundle cannot be published (names the problem)."""


def finalize_bundle(bundle_dir: str | os.PathLike, bench: str | os.PathLike | None = None,
                    base_model: str | None = None) -> Path:
    """Write example_inference.py, ane_check.json (the static Neural Engine census) and README.md (with
    `bench`, a bench.json, the presets table), then the manifest's integrity sections (last). `base_model`:
    the checkpoint's Hub id, recorded in the manifest and the card's metadata (for a bundle exported from
    a folder whose config named none).

    Each file is written atomically and only when its content changes, and the manifest last: an
    interrupted finalize leaves the bundle as it was or with a file the manifest does not list yet
    (`bundle check` refuses it), never a partial file, and running it again completes it. Finalizing a
    finalized bundle again (same bench report) changes nothing."""
    root = Path(bundle_dir)
    if not (root / MANIFEST_NAME).is_file():
        raise PublishError(f"{root} has no manifest.json: export the bundle first")
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text())
    except json.JSONDecodeError as err:
        raise PublishError(f"{root / MANIFEST_NAME} is not readable JSON: {err}") from err
    if base_model is not None:
        try:
            manifest["base_model"] = check_hub_id(base_model)
        except CheckpointError as err:
            raise PublishError(str(err)) from None
    report = None
    if bench is not None:
        try:
            report = json.loads(Path(bench).read_text())
            report["engines"], report["dataset"]["name"]  # noqa: B018 - the shape of a bench report
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PublishError(f"{bench} is not a `cohere-coreml bench` report (bench.json): {err}") from err
    sweep_stale_temporaries(root)  # `.README.md.tmp-<pid>` of a finalize that was killed
    write_text_atomic(root / EXAMPLE, example_source(), if_changed=True)
    ane_check.write_report(root)  # ane_check.json of the packages as they are now (the card quotes its summary)
    card = model_card(root, report, manifest={**manifest, **manifest_sections(root)})  # preset, min_os from disk
    write_text_atomic(root / README, card, if_changed=True)
    if base_model is None:
        return refresh_manifest(root)

    current = json.loads((root / MANIFEST_NAME).read_text())
    return write_manifest({**current, "base_model": base_model}, root)  # the manifest last, as always


# --------------------------------------------------------------------------------------------
# Upload
# --------------------------------------------------------------------------------------------


def upload_plan(bundle_dir: str | os.PathLike) -> tuple[str, list[tuple[str, int]]]:
    """(preset folder in the repository, [(path in repo, size)]) after verifying every checksum."""
    root = Path(bundle_dir)
    check_bundle(root, hashes=True)
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    preset = manifest.get("preset")
    if not preset:
        raise PublishError(f"{root}/manifest.json names no preset: finalize the bundle first")
    files = [(f"{preset}/{rel}", info["size"]) for rel, info in manifest["checksums"]["files"].items()]
    files.append((f"{preset}/{MANIFEST_NAME}", (root / MANIFEST_NAME).stat().st_size))
    return preset, sorted(files)


def upload_bundle(bundle_dir: str | os.PathLike, repo_id: str, revision: str | None = None, private: bool = False,
                  dry_run: bool = False, timeout: float = 10.0) -> dict:
    """Upload a verified bundle into `<repo_id>/<preset>/` (thin over `HfApi.upload_folder`)."""
    root = Path(bundle_dir)
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise PublishError(f"--repo-id must be ORG/NAME, got {repo_id!r}")
    preset, files = upload_plan(root)
    result = {"repo_id": repo_id, "folder": preset, "files": files, "bytes": sum(s for _, s in files),
              "dry_run": dry_run}
    if dry_run:
        return result
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(int(timeout)))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(int(timeout)))
    try:
        from huggingface_hub import HfApi  # heavy (the Hub's HTTP stack): only an upload needs it
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled  # heavy (as above)
    except ImportError as err:  # pragma: no cover - huggingface_hub is a dependency
        raise PublishError(f"huggingface_hub is not installed: {err}") from err
    api = HfApi()  # token: HF_TOKEN or the `hf auth login` file; never read or printed here
    allow = [path.split("/", 1)[1] for path, _ in files]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(folder_path=str(root), repo_id=repo_id, path_in_repo=preset, revision=revision,
                                   allow_patterns=allow, commit_message=f"Upload {preset} bundle")
    except OfflineModeIsEnabled as err:
        raise PublishError(f"cannot upload: the Hugging Face Hub is disabled here (HF_HUB_OFFLINE=1): {err}") from err
    except HfHubHTTPError as err:
        raise PublishError(f"the Hugging Face Hub refused the upload to {repo_id}: {_first_line(err)}") from err
    except (OSError, ConnectionError) as err:
        raise PublishError(f"cannot reach the Hugging Face Hub to upload {repo_id}: {_first_line(err)}") from err
    except Exception as err:  # requests/httpx timeouts and connection errors from the client
        if "timeout" in type(err).__name__.lower() or "connect" in type(err).__name__.lower():
            raise PublishError(f"cannot reach the Hugging Face Hub to upload {repo_id}: {_first_line(err)}") from err
        raise
    result["commit"] = str(getattr(commit, "commit_url", commit))
    return result


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# --------------------------------------------------------------------------------------------
# Commands: `cohere-coreml bundle check|finalize`, `cohere-coreml upload`
# --------------------------------------------------------------------------------------------


def cmd_bundle(args) -> int:
    if args.action == "finalize":
        print(finalize_bundle(args.dir, bench=args.bench, base_model=args.base_model))
        return 0
    try:
        summary = check_bundle(args.dir, hashes=True)
    except IntegrityError as err:
        print(str(err))
        return 1
    print(f"{args.dir}: {summary['files']} files, {summary['bytes']:,} bytes: every sha256 matches manifest.json")
    return 0


def cmd_upload(args) -> int:
    result = upload_bundle(args.bundle, args.repo_id, revision=args.revision, private=args.private,
                           dry_run=args.dry_run, timeout=args.timeout)
    verb = "would upload" if result["dry_run"] else "uploaded"
    print(f"{verb} {len(result['files'])} files ({result['bytes']:,} bytes) to {result['repo_id']}/{result['folder']}/")
    for path, size in result["files"]:
        print(f"  {size:>14,}  {path}")
    if result.get("commit"):
        print(result["commit"])
    return 0


def add_commands(subparsers) -> None:
    """Register `cohere-coreml bundle check|finalize` and `cohere-coreml upload`."""
    p = subparsers.add_parser("bundle", help="check a bundle's files against its manifest, or finalize it",
                              description="check: re-hash every file of the bundle (package contents included) and "
                              "name each one that is missing, differs or is unlisted (exit 1). finalize: write "
                              "ane_check.json (`cohere-coreml ane-check`), README.md (model card) and "
                              "example_inference.py, then the manifest's checksums.")
    p.add_argument("action", choices=("check", "finalize"))
    p.add_argument("dir", help="bundle folder")
    p.add_argument("--bench", default=None,
                   help="finalize: a `cohere-coreml bench` report (bench.json of PyTorch and the bundles of each "
                   "preset on one dataset) whose table the model card shows")
    p.add_argument("--base-model", default=None, metavar="ORG/NAME",
                   help="finalize: the checkpoint's Hub id for the manifest and the model card's base_model "
                   "(when the export could not tell it)")
    p.set_defaults(func=cmd_bundle)

    p = subparsers.add_parser("upload", help="upload a verified bundle to the Hugging Face Hub (one folder per preset)",
                              description="Verify every checksum, then upload the bundle's files into "
                              "ORG/NAME/<preset>/ with huggingface_hub. Token: HF_TOKEN or `hf auth login` "
                              "(never printed).")
    p.add_argument("--bundle", required=True, help="bundle folder (f16/, q8/ ...)")
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the model repository")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, with sizes; upload nothing")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before an unreachable Hub is an error")
    p.set_defaults(func=cmd_upload)
