"""shapes: the single facts (window sizes, cache capacity, bucket names) and the one bucket chooser."""

from __future__ import annotations

import pytest

from cohere_coreml.model.shapes import (
    ShapeError,
    WindowTooLongError,
    bucket_function_name,
    cache_capacity,
    choose_bucket,
    choose_frontend_function,
    memory_len,
    window_frames,
    window_samples,
)

# listed largest first and out of order on purpose: "the first function that fits" (in dict order)
# would give "main" for every short window, so the smallest-window rule is what these tests see
BUCKETS = {"main": 3500, "window_10s": 1000, "window_2s": 200}


@pytest.mark.parametrize("frames, expected", [
    (0, "window_2s"),  # nothing valid yet still goes to the smallest window
    (1, "window_2s"),
    (200, "window_2s"),  # a window holds exactly its own frames (>=, not >)
    (201, "window_10s"),  # one frame more: the next window, not the smallest
    (1000, "window_10s"),
    (1001, "main"),
    (3500, "main"),
])
def test_choose_bucket_takes_the_smallest_window_that_holds_the_frames(frames, expected):
    assert choose_bucket(BUCKETS, frames) == expected


def test_choose_bucket_is_independent_of_the_listing_order():
    for order in (BUCKETS, dict(reversed(list(BUCKETS.items()))), dict(sorted(BUCKETS.items()))):
        assert [choose_bucket(order, n) for n in (5, 500, 2000)] == ["window_2s", "window_10s", "main"]


def test_choose_bucket_raises_past_every_window():
    with pytest.raises(WindowTooLongError, match=r"3501 mel frames do not fit any encoder window \[200, 1000, 3500\]"):
        choose_bucket(BUCKETS, 3501)
    assert issubclass(WindowTooLongError, ShapeError)  # callers that catch ShapeError still see it
    with pytest.raises(WindowTooLongError):  # a single-function encoder: no silent fallback to "main"
        choose_bucket({"main": 400}, 401)
    assert choose_bucket({"main": 400}, 400) == "main"


def test_choose_bucket_refuses_no_function_and_breaks_ties_by_name():
    with pytest.raises(ShapeError, match="lists no function"):
        choose_bucket({}, 1)
    assert choose_bucket({"window_b": 100, "window_a": 100, "main": 300}, 50) == "window_a"


def test_choose_frontend_function_needs_samples_and_frames():
    functions = {"main": {"samples": 64000, "frames": 400}, "window_1s": {"samples": 16000, "frames": 100}}
    assert choose_frontend_function(functions, 16000) == "window_1s"
    assert choose_frontend_function(functions, 16000, min_frames=101) == "main"  # frames decide too
    with pytest.raises(ShapeError, match="longest front-end window holds 64000"):
        choose_frontend_function(functions, 64001)


def test_single_facts():
    assert window_samples(35, 16000) == 560000 and window_frames(35, 16000, 160) == 3500
    assert window_frames(2.0, 16000, 160) == 200
    with pytest.raises(ShapeError, match="shorter than one mel frame"):
        window_frames(0.001, 16000, 160)
    assert memory_len(438) == 448 and memory_len(448) == 448 and memory_len(449) == 480
    assert cache_capacity(256, 10) == 288 and cache_capacity(54, 10) == 64 and cache_capacity(55, 10) == 96
    with pytest.raises(ShapeError, match="max_new_tokens must be >= 1"):
        cache_capacity(0)
    assert bucket_function_name(10) == "window_10s" and bucket_function_name(2.5) == "window_2_5s"
