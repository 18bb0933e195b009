"""`cohere-coreml bench`'s report rendered: bench.md (the tables) and bench.png (accuracy vs size, time per
stage) beside bench.json, from the report `bench.run_bench` builds."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..storage.files import write_json_atomic

logger = logging.getLogger(__name__)

STAGES = ("features_s", "encoder_s", "bind_s", "prompt_s", "decode_s")  # bind: the decoder's bind_memory



def percent(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.2f}"


def rate_cell(language: dict) -> str:
    """"1.50 [0.40-3.10]": the rate and its 95 % bootstrap interval over the clips (when there is one)."""
    interval = language.get("rate_interval")
    if not interval or any(x != x for x in interval):
        return percent(language.get("rate"))
    return f"{percent(language.get('rate'))} [{percent(interval[0])}-{percent(interval[1])}]"


def format_agreement(a: dict | None) -> str:
    if not a:
        return "-"
    return (f"{a['identical_clips']}/{a['clips']}, "
            f"{a['agreeing_tokens']}/{a['baseline_tokens']}")


def _num(x, digits: int) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def format_placement(placement, reason=None) -> str:
    """One cell: per package function, the Neural Engine's share of the estimated cost (of ops counted) and
    how many ops run elsewhere; or "unavailable" and why."""
    if not isinstance(placement, dict):
        return f"{placement or 'unavailable'}" + (f": {reason}" if reason else "")
    cells = []
    for f in placement.get("functions", []):
        name = f"{Path(str(f.get('package'))).stem}.{f.get('function')}"
        if f.get("error"):
            cells.append(f"{name}: {f['error']}")
            continue
        share = (f.get("cost_share") or {}).get("neural_engine")
        cells.append(f"{name}: ANE {percent(share)} % of cost, {len(f.get('not_on_neural_engine') or [])} ops elsewhere")
    return "; ".join(cells) or "no function"


def format_word_timing(w: dict | None) -> str:
    """"55 / 149 (80/84)": median and p90 |start error| in ms, words timed / words with a true start."""
    if not w:
        return "-"
    if w["median_s"] is None:
        return f"- (0/{w['truth_words']})"
    return f"{1000 * w['median_s']:.0f} / {1000 * w['p90_s']:.0f} ({w['words_timed']}/{w['truth_words']})"


def batch_cell(engine: dict) -> str:
    """How an engine decoded a clip's windows: "B=4, ahead 4" (batched, the encoder that many windows ahead),
    "B=1" (one at a time), "-" (an engine that does not say: PyTorch, a device run)."""
    batch = engine.get("decoder_batch")
    if batch is None:
        return "-"
    return f"B={batch}" + (f", ahead {engine.get('encoder_ahead') or 0}" if batch > 1 else "")


def format_markdown(report: dict) -> str:
    langs = sorted({l for e in report["engines"] for l in e["languages"]})
    head = ["engine", "size MB"] + [f"{l} {report['engines'][0]['languages'].get(l, {}).get('metric', 'wer').upper()} % [95 % CI]"
                                    for l in langs]
    head += ["S/D/I", "same as reference (clips, tokens)", "loops %", "trunc %", "RTFx", "tokens/s", "load s",
             "first run s", "peak RSS MB"]
    timed = any("word_timing" in e for e in report["engines"]) and report["dataset"].get("word_times")
    if timed:
        head.insert(2 + len(langs), "word start error ms: median / p90 (timed / with truth)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in report["engines"]:
        size = e.get("bundle", {}).get("size_mb")
        sdi = [sum(v[k] for v in e["languages"].values()) for k in ("substitutions", "deletions", "insertions")]
        cells = [e["label"], f"{size:.2f}" if size else "-"]
        cells += [rate_cell(e["languages"].get(l, {})) for l in langs]
        cells += ["/".join(map(str, sdi)), format_agreement(e.get("agreement")), percent(e["loop_rate"]),
                  percent(e["truncation_rate"]), f"{e['rtfx']:.2f}",
                  f"{e['tokens_per_s']:.1f}", f"{e['load_s']:.1f}",
                  f"{e['first_run_s']:.2f}" if e["first_run_s"] is not None else "-", f"{e['peak_rss_mb']:.0f}"]
        if timed:
            cells.insert(2 + len(langs), format_word_timing(e.get("word_timing")))
        lines.append("| " + " | ".join(cells) + " |")
    stage_head = ["engine"] + [s.replace("_s", "") + " s" for s in STAGES] + [
        "VAD s", "RTFx VAD / front end / encoder / decoder / whole", "tokens/s decoder / whole", "decoder batch, encoder ahead",
        "encoder wait s", "audio s", "clips", "windows", "audio decoded %", "problems"]
    lines += ["", "| " + " | ".join(stage_head) + " |", "|" + "---|" * len(stage_head)]
    for e in report["engines"]:
        cells = [e["label"]] + [f"{e['stages_s'][s]:.2f}" for s in STAGES]
        rtfx = e.get("stage_rtfx") or {}
        cells += [_num(e.get("vad_s"), 2),
                  " / ".join(_num(x, 1) for x in (rtfx.get("vad"), rtfx.get("front_end"), rtfx.get("encoder"),
                                                   rtfx.get("decoder"), e.get("rtfx"))),
                  f"{_num(e.get('tokens_per_s'), 1)} / {_num(e.get('tokens_per_s_whole'), 1)}", batch_cell(e),
                  _num(e.get("encoder_wait_s"), 2)]
        cells += [f"{e['audio_s']:.1f}", f"{e['clips_scored']}/{e['clips_total']}", str(e["windows"]),
                  percent(e.get("decoded_share")) + (" (VAD)" if (e.get("vad") or {}).get("on") else ""),
                  str(len(e["problems"]))]
        lines.append("| " + " | ".join(cells) + " |")
    devices = [e for e in report["engines"] if e.get("kind") == "swift"]
    if devices:
        head = ["device run", "machine", "runtime", "compute units", "cold load s", "warm load s", "first run s",
                "peak memory MB", "ms / decoder call", "placement (share of estimated cost on the Neural Engine)"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in devices:
            sw, mem = e["swift"], e["swift"].get("memory") or {}
            m = sw.get("machine") or {}
            child = mem.get("interpreter_child_peak_mb")
            cells = [e["label"], " ".join(str(x) for x in (m.get("device"), m.get("chip"), m.get("os"), m.get("os_version"))
                                          if x), str(e.get("backend")), str(e.get("compute_units") or "-"),
                     _num(e.get("load_s"), 2), _num(e.get("warm_load_s"), 2), _num(e.get("first_run_s"), 2),
                     _num(e.get("peak_rss_mb"), 0) + (f" ({mem.get('measure')})" if mem.get("measure") else "")
                     + (f", interpreter child {child:.0f}" if child else ""),
                     _num(e.get("ms_per_decoder_call"), 2), format_placement(e.get("placement"), e.get("placement_reason"))]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    opts = report["engines"][0]["options"] if report["engines"] else {}
    lines += ["", f"dataset `{report['dataset']['name']}` (manifest sha256 {str(report['dataset']['manifest_sha256'])[:12]}), "
              f"beams {opts.get('beams')}, max_new_tokens {opts.get('max_new_tokens')}, repetition guard "
              f"{'on' if opts.get('repetition_guard') else 'off'}; tool {report['tool_version']} "
              f"({report['tool_git_hash'][:12]}); {report['machine']['platform']}, {report['machine']['cpus']} CPUs"]
    return "\n".join(lines) + "\n"


def write_chart(report: dict, path: Path) -> Path | None:
    """bench.png: mean WER/CER over languages vs package size, and time per audio second by stage."""
    try:
        import matplotlib  # heavy and optional: only the chart needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"), as matplotlib requires
    except ImportError:
        logger.warning("no chart: matplotlib is not installed")
        return None
    engines = report["engines"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for e in engines:
        rates = [v["rate"] for v in e["languages"].values()]
        mean = 100 * sum(rates) / len(rates)
        size = e.get("bundle", {}).get("size_mb")
        if size:
            device = e.get("kind") == "swift"  # a device run: triangle, label below (often the same bundle's size)
            ax1.scatter([size], [mean], s=40, marker="^" if device else "o")
            ax1.annotate(e["label"], (size, mean), textcoords="offset points", xytext=(4, -11 if device else 4),
                         fontsize=8)
        else:
            ax1.axhline(mean, linestyle="--", color="grey", linewidth=1)
            ax1.annotate(f"{e['label']} (reference)", (0, mean), xycoords=("axes fraction", "data"),
                         textcoords="offset points", xytext=(4, 4), fontsize=8, color="grey")
    ax1.set_xlabel("encoder + decoder packages (MB)")
    ax1.set_ylabel("mean WER / CER over languages (%)")
    ax1.set_title("accuracy vs size")
    sizes = [e.get("bundle", {}).get("size_mb") or 0.0 for e in engines]
    ax1.set_xlim(0, 1.6 * max(sizes + [1.0]))  # room for the labels right of the points
    ax1.set_ylim(bottom=0)
    labels = [e["label"] + (f"\ncold load {e['load_s']:.1f} s, warm {e['warm_load_s']:.1f} s"
                            if e.get("kind") == "swift" and e.get("warm_load_s") is not None else "") for e in engines]
    bottom = [0.0] * len(engines)
    for stage in STAGES:
        vals = [1000 * e["stages_s"][stage] / e["audio_s"] if e["audio_s"] else 0.0 for e in engines]
        ax2.barh(labels, vals, left=bottom, label=stage.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("ms of processing per second of audio")
    ax2.set_title("time per stage (warm runs)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"cohere-coreml bench: {Path(report['dataset']['name']).name}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_outputs(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json_atomic(report, out / "bench.json")}
    md = out / "bench.md"
    tmp = md.with_name(f"bench.md.tmp-{os.getpid()}")
    tmp.write_text(format_markdown(report))
    os.replace(tmp, md)
    paths["markdown"] = md
    chart = write_chart(report, out / "bench.png")
    if chart:
        paths["chart"] = chart
    return paths
