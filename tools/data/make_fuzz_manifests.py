"""Write the seeded corpus of mutated manifests the Swift fuzz test decodes (ManifestFuzzTests.swift).

    python tools/data/make_fuzz_manifests.py --manifest out/swift-fixtures/bundle/manifest.json \\
        --out out/fuzz-manifests [--count 400 --seed 22]

Same generator as tests/bundle/test_fuzz_manifest.py (cohere_coreml_dev.fuzz.corpus): 1-3 field mutations per
manifest, one in eight a corrupted JSON text (manifest-NNNN.json); and every field mutated by each value
class of cohere_coreml_dev.fuzz.TARGETED (manifest-tNNNN.json). index.json names the source, seed and
count, and records the Python loader's verdict of every file (`Bundle.load` beside the source bundle's
files: accepted, or refused, at which stage and the field named), which the Swift test asserts. `make swift-fixtures`
runs it. Deterministic: the same manifest and seed give the same files and verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the dev package (tools/cohere_coreml_dev) sits one folder up: put tools/ on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from cohere_coreml_dev.fuzz import corpus, targeted, verdicts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", required=True, help="a real exported manifest.json to mutate")
    p.add_argument("--out", required=True, help="folder for manifest-NNNN.json and index.json")
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--seed", type=int, default=22)
    args = p.parse_args(argv)
    manifest = json.loads(Path(args.manifest).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("manifest-*.json"):
        old.unlink()
    files = corpus(manifest, args.count, args.seed) + targeted(manifest)
    for name, text in files:
        (out / name).write_text(text, encoding="utf-8", errors="surrogatepass")
    source = Path(args.manifest).resolve()
    judged = verdicts(source.parent, files)
    (out / "index.json").write_text(json.dumps({"source": str(source), "seed": args.seed, "count": args.count,
                                                "files": [name for name, _ in files], "verdicts": judged}, indent=1))
    refused = sum(not v["accepted"] for v in judged.values())
    print(f"wrote {len(files)} mutated manifests to {out} (seed {args.seed}): the Python loader refuses {refused} "
          f"({sum(v['field'] is not None for v in judged.values())} naming a field), accepts {len(files) - refused}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
