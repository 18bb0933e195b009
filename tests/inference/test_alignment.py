"""The word-timing rule (`inference.alignment`) on synthetic attention, and its test vectors.

tests/data/alignment_vectors.json holds inputs (small attention arrays, pieces, probabilities, offsets) and the
rule's outputs (word times) for the Swift and example-script ports; `python tests/inference/test_alignment.py`
rewrites it from `vector_cases()`. The planted cases are checked against the plant, not only the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cohere_coreml.inference.alignment import (
    AlignmentError,
    align_words,
    alignment_rows,
    clip_pauses,
    dtw_path,
    naive_word_starts,
    word_groups,
)

VECTORS = Path(__file__).resolve().parents[1] / "data" / "alignment_vectors.json"
FRAME = 0.08


def planted(spans: list[tuple[int, int]], frames: int, heads: int = 2, peak: float = 0.9, seed: int = 0) -> np.ndarray:
    """(heads, rows, frames) attention whose row r puts `peak` of its mass on frames spans[r] = [a, b) and the rest
    spread (with noise) over all frames."""
    rng = np.random.default_rng(seed)
    att = np.zeros((heads, len(spans), frames))
    for h in range(heads):
        for r, (a, b) in enumerate(spans):
            rest = rng.uniform(0.5, 1.5, frames)
            att[h, r] = (1 - peak) * rest / rest.sum()
            att[h, r, a:b] += peak / (b - a)
    return att


def spans_of(lengths: list[int]) -> list[tuple[int, int]]:
    edges = np.concatenate([[0], np.cumsum(lengths)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


# pieces of "Wake me up at two thirty." (as the default model's tokenizer splits them), one lead row, eos row
PIECES = ["\u2581Wa", "k", "e", "\u2581me", "\u2581u", "p", "\u2581", "at", "\u2581two", "\u2581thirty", "."]
LENGTHS = [6, 2, 1, 2, 3, 2, 2, 1, 2, 3, 5, 1, 8]  # lead, 11 tokens, eos (frames per row)
PROBS = [0.9, 0.8, 0.7, 0.95, 0.6, 0.9, 0.5, 0.7, 0.99, 0.85, 0.4]


def expected_words(lengths, groups, lead=1, offset=0.0):
    """(start, end) of each word from the planted spans: the centre of the first token's first frame, the centre
    of the frame after the last token's span (capped at the last frame's end)."""
    spans = spans_of(lengths)
    total = sum(lengths)
    return [(offset + (spans[lead + g[0]][0] + 0.5) * FRAME, offset + min(spans[lead + g[-1]][1] + 0.5, total) * FRAME)
            for g in groups]


def test_a_planted_diagonal_gives_exact_word_boundaries():
    att = planted(spans_of(LENGTHS), sum(LENGTHS))
    words = align_words(att, PIECES, PROBS, frame_seconds=FRAME)
    assert [w.word for w in words] == ["Wake", "me", "up", "at", "two", "thirty."]
    groups = [[0, 1, 2], [3], [4, 5], [6, 7], [8], [9, 10]]
    assert [list(w.tokens) for w in words] == groups
    for w, (start, end) in zip(words, expected_words(LENGTHS, groups)):
        assert w.start == pytest.approx(start) and w.end == pytest.approx(end)
    assert words[0].start == pytest.approx(6.5 * FRAME)  # the lead row took the leading frames


@pytest.mark.parametrize("damage", ["reversed", "shuffled"])
def test_reversed_or_shuffled_attention_misses_the_plant(damage):
    """The exactness above is evidence: the same check fails on attention that does not follow the speech."""
    att = planted(spans_of(LENGTHS), sum(LENGTHS))
    if damage == "reversed":
        att = att[:, :, ::-1]
    else:
        att = att[:, :, np.random.default_rng(1).permutation(att.shape[2])]
    words = align_words(att, PIECES, PROBS, frame_seconds=FRAME)
    groups = [[0, 1, 2], [3], [4, 5], [6, 7], [8], [9, 10]]
    got = [(w.start, w.end) for w in words]
    assert not np.allclose(got, expected_words(LENGTHS, groups))
    # monotonic all the same: DTW never goes back in time
    assert all(a.start <= b.start for a, b in zip(words, words[1:])) and all(w.start <= w.end for w in words)


def test_the_window_offset_moves_every_word():
    att = planted(spans_of(LENGTHS), sum(LENGTHS))
    base = align_words(att, PIECES, PROBS, frame_seconds=FRAME)
    moved = align_words(att, PIECES, PROBS, frame_seconds=FRAME, offset_seconds=35.0)
    assert [w.start + 35.0 for w in base] == pytest.approx([w.start for w in moved])
    assert [w.end + 35.0 for w in base] == pytest.approx([w.end for w in moved])
    assert moved[0].start == pytest.approx(35.0 + 6.5 * FRAME)


def test_more_lead_rows_take_the_leading_frames():
    lengths = [3, 3] + LENGTHS[1:]  # two rows before the text
    att = planted(spans_of(lengths), sum(lengths))
    words = align_words(att, PIECES, PROBS, frame_seconds=FRAME, lead_rows=2)
    assert words[0].start == pytest.approx(6.5 * FRAME)
    with pytest.raises(AlignmentError, match="rows"):  # the same attention read with one lead row
        align_words(att, PIECES, PROBS, frame_seconds=FRAME, lead_rows=1)


def test_punctuation_merges_into_the_neighbouring_word():
    pieces = ["\u2581\u00bf", "Qu", "\u00e9", "\u2581hora", "\u2581es", "?", "\u2581!"]
    assert [[pieces[k] for k in g] for g in word_groups(pieces)] == [
        ["\u2581\u00bf", "Qu", "\u00e9"], ["\u2581hora"], ["\u2581es", "?", "\u2581!"]]
    # a lone punctuation piece before the first word joins it
    assert word_groups(["\u2581\"", "\u2581Hi", "\u2581there", "."]) == [[0, 1], [2, 3]]
    # a word of digits is a word
    assert word_groups(["\u258142", "\u2581km"]) == [[0], [1]]


def test_ja_and_zh_words_are_characters_with_byte_pieces_joined():
    # "今天，好" with the second character as three byte-fallback pieces (天 = e5 a4 a9)
    pieces = ["\u2581\u4eca", "<0xE5>", "<0xA4>", "<0xA9>", "\uff0c", "\u597d"]
    groups = word_groups(pieces, "zh")
    assert groups == [[0], [1, 2, 3, 4], [5]]
    lengths = [2, 2, 1, 1, 1, 1, 2, 2]
    att = planted(spans_of(lengths), sum(lengths))
    words = align_words(att, pieces, [0.9] * 6, frame_seconds=FRAME, language="zh")
    assert [w.word for w in words] == ["\u4eca", "\u5929\uff0c", "\u597d"]
    assert [w.start for w in words] == pytest.approx([2.5 * FRAME, 4.5 * FRAME, 8.5 * FRAME])
    # the same pieces read as a spaced language: one word (no piece after the first opens a word)
    assert len(align_words(att, pieces, [0.9] * 6, frame_seconds=FRAME, language="en")) == 1


def test_confidence_is_the_mean_of_the_word_tokens_probabilities():
    att = planted(spans_of(LENGTHS), sum(LENGTHS))
    words = align_words(att, PIECES, PROBS, frame_seconds=FRAME)
    assert [w.probability for w in words] == pytest.approx(
        [np.mean([PROBS[k] for k in w.tokens]) for w in words])
    assert words[0].probability == pytest.approx((0.9 + 0.8 + 0.7) / 3)  # not the min (0.7) nor the first
    low = list(PROBS)
    low[1] = 0.05
    assert align_words(att, PIECES, low, frame_seconds=FRAME)[0].probability < words[0].probability


def test_long_words_at_pauses_are_clipped_to_twice_the_median_word():
    texts = ["Stop.", "Go", "now", "please.", "Then", "rest"]
    spans = [(0.0, 1.5), (1.5, 3.0), (3.0, 3.3), (3.3, 4.9), (4.9, 5.2), (5.2, 5.5)]
    # median duration 0.9 s, capped at 0.7: the longest a word at a pause may last is 1.4 s
    got = clip_pauses(texts, spans)
    assert got[0] == pytest.approx((0.1, 1.5))  # the first word: its start moves to end - 1.4
    assert got[1] == pytest.approx((1.6, 3.0))  # after a sentence end: its start
    assert got[3] == pytest.approx((3.3, 4.7))  # a sentence's last word: its end
    assert got[2] == spans[2] and got[4] == spans[4] and got[5] == spans[5]  # short or not at a pause
    assert clip_pauses(["long", "word"], [(0.0, 3.0), (3.0, 3.1)])[1] == (3.0, 3.1)  # "long" ends no sentence


def test_dtw_is_monotonic_and_covers_every_row_and_frame():
    rng = np.random.default_rng(3)
    for rows, frames in ((5, 40), (12, 7), (1, 1), (3, 1)):
        r, f = dtw_path(rng.normal(size=(rows, frames)))
        assert (r[0], f[0]) == (0, 0) and (r[-1], f[-1]) == (rows - 1, frames - 1)
        steps = np.stack([np.diff(r), np.diff(f)], 1)
        assert set(map(tuple, steps)) <= {(1, 1), (1, 0), (0, 1)}
        assert set(r) == set(range(rows)) and set(f) == set(range(frames))


def test_times_stay_inside_the_window():
    """More rows than frames: rows share frames, and no time passes the last frame's end."""
    att = np.random.default_rng(4).dirichlet(np.ones(4), size=(2, len(PIECES) + 2))
    words = align_words(att, PIECES, PROBS, frame_seconds=FRAME, offset_seconds=10.0)
    assert all(10.0 + 0.5 * FRAME <= w.start <= w.end <= 10.0 + 4 * FRAME for w in words)
    assert words[-1].end <= 10.0 + 4 * FRAME


def test_alignment_rows_cuts_the_rows_predicting_prompt_tail_text_and_eos():
    prompt, tokens, frames = 10, 4, 6
    full = np.arange(prompt + tokens + 1)[None, :, None] * np.ones((2, 1, frames))  # row value = its position
    rows = alignment_rows(full, prompt, tokens, lead_rows=1)
    # position p predicts token p + 1: the row predicting the first text token is position prompt - 1
    assert rows[0, :, 0].tolist() == [8, 9, 10, 11, 12, 13]
    assert alignment_rows(full, prompt, tokens, lead_rows=3)[0, :, 0].tolist()[:3] == [6, 7, 8]
    with pytest.raises(AlignmentError, match="positions"):
        alignment_rows(full[:, :12], prompt, tokens)


@pytest.mark.parametrize("attention, pieces, probs, match", [
    (np.zeros((0, 4, 5)), ["\u2581a", "b"], [1, 1], "no heads"),
    (np.ones((2, 5, 5)), ["\u2581a", "b"], [1, 1], "5 rows, expected 4"),
    (np.ones((4, 5)), ["\u2581a", "b"], [1, 1], "dimension"),
    (np.ones((1, 4, 0)), ["\u2581a", "b"], [1, 1], "no encoder frame"),
    (np.ones((1, 4, 5)), ["\u2581a", "b"], [1], "1 token probabilities for 2"),
    (np.full((1, 4, 5), np.nan), ["\u2581a", "b"], [1, 1], "finite"),
])
def test_bad_input_gives_a_one_line_error(attention, pieces, probs, match):
    with pytest.raises(AlignmentError, match=match) as err:
        align_words(attention, pieces, probs, frame_seconds=FRAME)
    assert "\n" not in str(err.value)


def test_the_naive_baseline_spreads_words_by_characters():
    assert naive_word_starts(["ab", "c", "defg"], 1.0, 2.4) == pytest.approx([1.0, 1.4, 1.6])


# --------------------------------------------------------------------------------------------------
# Test vectors for the ports
# --------------------------------------------------------------------------------------------------


def vector_cases() -> list[dict]:
    """The inputs of tests/data/alignment_vectors.json (rounded so that the JSON holds them exactly)."""
    rng = np.random.default_rng(57)
    cases = []

    def add(name, att, pieces, probs, **options):
        att = np.round(np.asarray(att, dtype=np.float64), 6)
        cases.append({"name": name, "attention": att.tolist(), "pieces": pieces,
                      "probabilities": [round(float(p), 6) for p in probs], "frame_seconds": FRAME,
                      "offset_seconds": 0.0, "lead_rows": 1, "language": "en", "standardise": False,
                      "median_width": 1, **options})

    add("planted diagonal", planted(spans_of(LENGTHS), sum(LENGTHS)), PIECES, PROBS)
    add("planted, window at 35 s", planted(spans_of(LENGTHS), sum(LENGTHS), seed=1), PIECES, PROBS,
        offset_seconds=35.0)
    lengths = [3, 3] + LENGTHS[1:]
    add("two lead rows", planted(spans_of(lengths), sum(lengths), heads=3, seed=2), PIECES, PROBS, lead_rows=2)
    zh = ["\u2581\u4eca", "<0xE5>", "<0xA4>", "<0xA9>", "\uff0c", "\u597d"]
    zl = [2, 2, 1, 1, 1, 1, 2, 2]
    add("zh characters, byte pieces", planted(spans_of(zl), sum(zl), seed=3), zh, [0.9, 0.5, 0.6, 0.7, 0.8, 0.3],
        language="zh")
    es = ["\u2581\u00bf", "Qu", "\u00e9", "\u2581hora", "\u2581es", "?"]
    soft = rng.dirichlet(np.ones(14), size=(2, len(es) + 2))  # no plant: the rule's own output is the vector
    add("random attention, punctuation", soft, es, rng.uniform(0.2, 1.0, len(es)), language="es")
    add("random attention, standardised and filtered", rng.dirichlet(np.ones(20), size=(3, 7)),
        ["\u2581one", "\u2581two", "\u2581th", "ree", "."], rng.uniform(0.2, 1.0, 5), standardise=True,
        median_width=3)
    pause = [2, 3, 2, 12, 3, 1, 2]  # lead, "▁Stop", ".", "▁Go" (took the pause), "▁now", ".", eos
    add("a long word after a sentence end", planted(spans_of(pause), sum(pause), seed=4),
        ["\u2581Stop", ".", "\u2581Go", "\u2581now", "."], [0.9, 0.8, 0.7, 0.6, 0.9])
    add("more rows than frames", rng.dirichlet(np.ones(4), size=(1, 9)), PIECES[:7], PROBS[:7])
    # cases the ports need pinned: every DTW move ties (uniform weights, then all zero: the log floor), so the
    # path is the tie order's alone; ja with a bare space and an opening quote before the first character
    # (carried into it) and a character in byte pieces; an inverted question mark as its own first word, a long
    # first word (start clipped) and a long sentence end (end clipped), with an even count of words (the median
    # of the two middle durations) in a window at 12.5 s
    add("uniform attention: every move ties", np.full((2, 7, 9), 1 / 9), PIECES[:5], PROBS[:5])
    add("zero attention: the log floor ties", np.zeros((1, 6, 4)), PIECES[:4], PROBS[:4])
    # fp16 attention underflows to exact zeros: the floor sets their cost (this one's path differs with 1e-6,
    # 1e-9 or 1e-14)
    add("exact zeros: the floor's value counts", np.random.default_rng(1368).dirichlet(np.full(8, 0.03), size=(1, 6)),
        PIECES[:4], PROBS[:4])
    # the last cell's row move and frame move tie below the diagonal (the centre frame is unlikely for the word):
    # the row move wins, so the word takes the last frame
    add("row move and frame move tie", [[[0.45, 0.45, 0.1], [0.45, 0.1, 0.45], [0.1, 0.45, 0.45]]], ["\u2581hi"], [0.8])
    ja = ["\u2581", "\u300c", "\u6771", "<0xE4>", "<0xBA>", "<0xAC>", "\u300d", "\u3002"]
    jl = [2, 1, 1, 3, 1, 1, 1, 1, 1, 2]  # lead, 8 pieces, eos
    add("ja, a quote before the first character", planted(spans_of(jl), sum(jl), seed=5), ja,
        [0.5, 0.6, 0.9, 0.8, 0.7, 0.6, 0.95, 0.99], language="ja")
    qs = ["\u2581\u00bf", "\u2581Qu\u00e9", "\u2581hora", "\u2581es", "?", "\u2581Son", "\u2581las", "\u2581dos", "."]
    ql = [2, 1, 14, 3, 2, 1, 4, 2, 12, 1, 3]  # lead, 9 pieces, eos
    add("inverted question mark first, long first and last words", planted(spans_of(ql), sum(ql), seed=6), qs,
        [0.3, 0.9, 0.8, 0.7, 0.6, 0.95, 0.85, 0.75, 0.65], language="es", offset_seconds=12.5)
    # slow speech: the median word lasts over 0.7 s, so the clip counts 0.7 s (a first word of 2.4 s starts 1.4 s
    # before its end, not 2 x its median before)
    slow = [3, 30, 12, 14, 11, 2, 3]  # lead, "▁Slow", "▁and", "▁steady", "▁wins", ".", eos
    add("slow speech: the median word counted at most 0.7 s", planted(spans_of(slow), sum(slow), seed=7),
        ["\u2581Slow", "\u2581and", "\u2581steady", "\u2581wins", "."], [0.9, 0.8, 0.7, 0.6, 0.5])
    return cases


def run_case(case: dict) -> list[dict]:
    words = align_words(np.array(case["attention"]), case["pieces"], case["probabilities"],
                        frame_seconds=case["frame_seconds"], offset_seconds=case["offset_seconds"],
                        lead_rows=case["lead_rows"], language=case["language"], standardise=case["standardise"],
                        median_width=case["median_width"])
    return [w.to_dict() for w in words]


def test_the_committed_vectors_are_the_rule_s_output():
    vectors = json.loads(VECTORS.read_text())
    cases = vector_cases()
    assert [c["name"] for c in vectors["cases"]] == [c["name"] for c in cases]
    for stored, case in zip(vectors["cases"], cases):
        assert stored["attention"] == case["attention"], f"{case['name']}: inputs changed (rewrite the vectors)"
        got = run_case(stored)
        assert [w["word"] for w in got] == [w["word"] for w in stored["words"]], stored["name"]
        assert [w["tokens"] for w in got] == [w["tokens"] for w in stored["words"]], stored["name"]
        for key in ("start", "end", "probability"):
            assert [w[key] for w in got] == pytest.approx([w[key] for w in stored["words"]], abs=1e-9), stored["name"]
    planted_case = vectors["cases"][0]  # the file's first case is also the plant's answer
    expected = expected_words(LENGTHS, [w["tokens"] for w in planted_case["words"]])
    assert [t for w in planted_case["words"] for t in (w["start"], w["end"])] == pytest.approx(
        [t for pair in expected for t in pair])


def test_the_pause_vector_is_clipped():
    case = next(c for c in json.loads(VECTORS.read_text())["cases"] if c["name"].startswith("a long word"))
    stop, go, now = case["words"]
    # unclipped, "Go" would start where "Stop." ends (frame 7); clipped: 2 x the median word (0.4 s) before its end
    assert go["start"] == pytest.approx(go["end"] - 0.8) and go["start"] > stop["end"]
    unclipped = align_words(np.array(case["attention"]), case["pieces"], case["probabilities"], frame_seconds=FRAME,
                            pause_factor=0)
    assert unclipped[1].start == pytest.approx(stop["end"]) and unclipped[1].end == pytest.approx(go["end"])


def write_vectors(path: Path = VECTORS) -> None:
    cases = vector_cases()
    for case in cases:
        case["words"] = run_case(case)
    doc = {"about": "inputs and outputs of the word-timing rule (src/cohere_coreml/inference/alignment.py, "
                    "docs/word-timings.md): attention (heads, rows, frames) over valid encoder frames, rows = "
                    "lead_rows rows before the text, one per piece, one predicting eos; words: start/end in "
                    "seconds, probability = mean of the word's token probabilities, tokens = piece indices",
           "cases": cases}
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    write_vectors(Path(sys.argv[1]) if len(sys.argv) > 1 else VECTORS)
    print(f"wrote {VECTORS}")
