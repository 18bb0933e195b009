"""Settings of the fuzz tests (hypothesis): a short seeded run by default, a long one with COHERE_FUZZ=long.

    make test / pytest tests/test_fuzz_*.py     default: derandomized (fixed seed), a few dozen cases per class
    COHERE_FUZZ=long pytest tests/test_fuzz_*.py  thousands of cases per class (docs/reliability.md)
    COHERE_FUZZ_REPORT=DIR                      each fuzz test writes its outcome counts to DIR/<test>.json

Every run is reproducible: `derandomize=True` derives the examples from the test itself, so a failure
found by one run is found by the next; no example database is written.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings

LONG = os.environ.get("COHERE_FUZZ", "").lower() == "long"
SEED = 0  # documented; derandomize=True makes hypothesis' choices a function of the test only


def fuzz_settings(default: int, long: int):
    """hypothesis settings: `default` examples (or `long` with COHERE_FUZZ=long), deterministic, no deadline."""
    return settings(max_examples=long if LONG else default, derandomize=True, deadline=None, database=None,
                    print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


class Outcomes(Counter):
    """Outcome counts of one fuzz test ("loaded", "named_error", ...), written to $COHERE_FUZZ_REPORT."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def write(self) -> None:
        folder = os.environ.get("COHERE_FUZZ_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{self.name}.json").write_text(
                json.dumps({"test": self.name, "mode": "long" if LONG else "default", "cases": sum(self.values()),
                            "outcomes": dict(self)}, indent=1))
