"""The table of tools/bench/bench_compression.py: its rows, the Pareto front (bytes vs error rate) and
the Markdown, apart from the runs that produce them (so they are tested without a bundle)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path


def parse_row(spec: str) -> tuple[str, str, list[str]]:
    """'label=preset --flag v' -> (label, preset, flags); 'q8' -> ('q8', 'q8', [])."""
    label, _, rest = spec.partition("=")
    words = shlex.split(rest) if rest else [label]
    if not words or words[0].startswith("-"):
        raise SystemExit(f"row {spec!r}: expected 'label=preset [flags]' or a preset name")
    return label.strip(), words[0], words[1:]


def mean_rate(languages: dict) -> float:
    return sum(v["rate"] for v in languages.values()) / len(languages)


def token_disagreement(row: dict) -> float:
    """Share of PyTorch's greedy tokens the bundle does not reproduce at the same position."""
    return 1.0 - row["agreeing_tokens"] / row["baseline_tokens"] if row["baseline_tokens"] else 0.0


def pareto_front(rows: list[dict], error=lambda r: mean_rate(r["languages"])) -> list[str]:
    """Labels of the shippable rows (gates passed) no other shippable row beats: another row is at
    most as large and at most as wrong (`error`: mean error rate over languages by default, or
    `token_disagreement`), and better on one of the two. A refused row is plotted, never on the front:
    its bundle is not written."""
    scored = [r for r in rows if r.get("languages") and r.get("passed")]
    front = []
    for r in scored:
        b, e = r["bytes"], error(r)
        beaten = any(o is not r and o["bytes"] <= b and error(o) <= e and (o["bytes"] < b or error(o) < e)
                     for o in scored)
        if not beaten:
            front.append(r["label"])
    return front


def heldout_row(heldout: dict) -> dict:
    """The held-out figures of one bundle (`heldout.parity.json`, or a GateReport's details)."""
    return {"languages": {lang: {k: v[k] for k in ("metric", "rate", "baseline", "clips", "identical_clips")}
                          for lang, v in heldout["languages"].items()},
            "identical_clips": heldout["identical_clips"], "clips": heldout["clips"],
            "agreeing_tokens": heldout["agreeing_tokens"], "baseline_tokens": heldout["baseline_tokens"]}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    rows = report["rows"]
    langs = sorted({lang for r in rows for lang in r.get("languages", {})})
    head = ["bundle", "gate", "bytes", "B/param", *(["B/param full size"] if report.get("full_size") else []),
            "enc PSNR dB", "dec PSNR dB", "dec mean KL", "log-prob err p99 / max (nats)",
            *[f"{lang} (PyTorch)" for lang in langs], "clips identical", "tokens identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        g = r.get("gate", {})
        lp = g.get("log_prob_error_nats") or {}
        verdict = "ref" if r["label"] == "f16" else ("pass" if r["passed"] else "REFUSED")
        if r["label"] in report["pareto_front"]:
            verdict += " *"
        if r["label"] in report.get("pareto_front_tokens", ()):
            verdict += " †"
        cells = [r["label"], verdict, f"{r['bytes']:,}" if "bytes" in r else "-", fmt(r.get("bytes_per_parameter"), ".3f")]
        if report.get("full_size"):
            cells.append(fmt(report["full_size"].get(r["label"]), ".3f"))
        cells += [fmt(g.get("encoder_psnr_db"), ".1f"), fmt(g.get("decoder_psnr_db"), ".1f"),
                  fmt(g.get("decoder_mean_kl"), ".2e"),
                  f"{lp['p99']:.3f} / {lp['max']:.3f}" if lp else "-"]
        for lang in langs:
            v = r.get("languages", {}).get(lang)
            cells.append(f"{100 * v['rate']:.2f} ({100 * v['baseline']:.2f})" if v else "-")
        cells += [f"{r['identical_clips']}/{r['clips']}" if "clips" in r else "-",
                  f"{r['agreeing_tokens']}/{r['baseline_tokens']}" if "clips" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"{report['parameters']:,} checkpoint parameters ({report['model']}); held-out set "
              f"`{report['data']}`; error rates in % (WER, CER for ja/zh/ko); PSNR / KL vs the f16 packages; "
              "* = on the Pareto front of bytes vs mean error rate, † = of bytes vs tokens differing from "
              "PyTorch (error rates move by whole words: one word is 0.5-1 point per language here, and a lucky "
              "change can lower them)."]
    lines += [f"{r['label']}: no figures, {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines) + "\n"




def split_folder(data: Path, out: Path, calibration_per_language: int) -> tuple[Path, Path]:
    """Copy the dataset folder `data` (manifest.json with `utterances`) into two disjoint folders:
    `out/calibration` (the first N utterances of each language) and `out/evaluation` (the rest), so
    a preset calibrated on audio (lowrank) is never scored on the clips it was calibrated on."""
    manifest = json.loads((data / "manifest.json").read_text())
    taken: dict[str, int] = {}
    parts: dict[str, list] = {"calibration": [], "evaluation": []}
    for utt in manifest["utterances"]:
        lang = utt["language"]
        part = "calibration" if taken.get(lang, 0) < calibration_per_language else "evaluation"
        taken[lang] = taken.get(lang, 0) + (part == "calibration")
        parts[part].append(utt)
    short = sorted(lang for lang, n in taken.items() if not any(u["language"] == lang for u in parts["evaluation"]))
    if short:
        raise SystemExit(f"{data}: no clip left to evaluate in {short} after {calibration_per_language} for calibration")
    folders = []
    for part, utts in parts.items():
        folder = out / part
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for utt in utts:
            shutil.copy2(data / utt["file"], folder / utt["file"])
        (folder / "manifest.json").write_text(json.dumps({**manifest, "utterances": utts}, indent=1))
        folders.append(folder)
    return folders[0], folders[1]
