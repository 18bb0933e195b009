"""Tests of the shared converter (cohere_coreml.convert) on a small traced module."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from cohere_coreml.convert import (
    MIN_PSNR_DB,
    ExportError,
    ExportSettings,
    ExportSettingsError,
    ParityError,
    convert_module,
    kl_divergence,
    psnr,
    report_correctness,
    save_package_atomic,
    weight_file_bytes,
)
from cohere_coreml.config import round_up
from cohere_coreml.shapes import ShapeError, window_frames


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, n):
        # x: (1, 3, 8) float; n: (1,) int32
        return self.lin(x) * n.to(x.dtype), (n + 1).to(torch.int32)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    import coremltools as ct

    torch.manual_seed(0)
    traced = torch.jit.trace(_Small().eval(), (torch.zeros(1, 3, 8), torch.tensor([2], dtype=torch.int32)))
    settings = ExportSettings(out_dir=tmp_path_factory.mktemp("conv"), precision="fp32", model_id="org/model",
                              revision="abc123")
    mlmodel = convert_module(
        traced,
        [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32),
         ct.TensorType(name="n", shape=(1,), dtype=np.int32)],
        [ct.TensorType(name="y"), ct.TensorType(name="m")],
        settings,
        metadata={"com.cohere_coreml.component": "small", "com.cohere_coreml.shapes": {"x": [1, 3, 8]}},
        descriptions={"x": "the input", "y": "the output"},
    )
    return mlmodel, settings


def test_settings_validation():
    assert ExportSettings().precision == "fp16"
    assert ExportSettings().deployment_target == "macOS15"
    assert ExportSettings(precision="fp32").gate_psnr_db == MIN_PSNR_DB["fp32"] == 60.0
    assert ExportSettings(precision="fp16").gate_psnr_db == 35.0
    with pytest.raises(ExportSettingsError, match="precision"):
        ExportSettings(precision="int8")
    with pytest.raises(ExportSettingsError, match="deployment_target"):
        ExportSettings(deployment_target="iOS16")
    with pytest.raises(ExportSettingsError, match="window_seconds"):
        ExportSettings(window_seconds=0)
    with pytest.raises(ExportSettingsError, match="window_seconds"):
        ExportSettings(window_seconds=float("nan"))
    assert issubclass(ExportSettingsError, ValueError) and issubclass(ExportError, RuntimeError)


def test_window_frames_and_round_up():
    assert window_frames(35.0, 16000, 160) == 3500
    assert window_frames(2.0, 16000, 160) == 200
    assert round_up(438, 32) == 448 and round_up(448, 32) == 448 and round_up(1, 32) == 32
    with pytest.raises(ShapeError, match="shorter than one mel frame"):
        window_frames(0.001, 16000, 160)


def test_metadata_and_descriptions(small_model):
    mlmodel, _ = small_model
    spec = mlmodel.get_spec()
    meta = dict(spec.description.metadata.userDefined)
    assert meta["com.cohere_coreml.source_model"] == "org/model"
    assert meta["com.cohere_coreml.source_revision"] == "abc123"
    assert meta["com.cohere_coreml.precision"] == "fp32"
    assert meta["com.cohere_coreml.deployment_target"] == "macOS15"
    assert meta["com.cohere_coreml.license"] == "Apache-2.0"
    assert meta["com.cohere_coreml.tool_git_hash"]
    assert json.loads(meta["com.cohere_coreml.shapes"]) == {"x": [1, 3, 8]}
    assert spec.description.metadata.license == "Apache-2.0"
    descr = {f.name: f.shortDescription for f in list(spec.description.input) + list(spec.description.output)}
    assert descr["x"] == "the input" and descr["y"] == "the output"
    assert spec.specificationVersion >= 9  # iOS18 / macOS15
    # the int32 output stays int32
    from coremltools.proto import FeatureTypes_pb2 as ft

    outs = {o.name: o.type.multiArrayType.dataType for o in spec.description.output}
    assert outs["m"] == ft.ArrayFeatureType.INT32


def test_unknown_description_is_refused():
    import coremltools as ct

    traced = torch.jit.trace(_Small().eval(), (torch.zeros(1, 3, 8), torch.tensor([2], dtype=torch.int32)))
    with pytest.raises(ExportError, match="unknown features"):
        convert_module(
            traced,
            [ct.TensorType(name="x", shape=(1, 3, 8), dtype=np.float32),
             ct.TensorType(name="n", shape=(1,), dtype=np.int32)],
            [ct.TensorType(name="y"), ct.TensorType(name="m")],
            ExportSettings(precision="fp32"),
            descriptions={"nope": "x"},
        )


def test_save_atomic_skip_force_and_failed_verify(small_model, tmp_path):
    mlmodel, _ = small_model
    path = tmp_path / "small.mlpackage"
    assert save_package_atomic(mlmodel, path) is True
    assert (path / "Manifest.json").exists()
    assert weight_file_bytes(path) > 0
    stamp = (path / "Manifest.json").stat().st_mtime_ns
    # present and not forced: skipped, untouched
    assert save_package_atomic(mlmodel, path) is False
    assert (path / "Manifest.json").stat().st_mtime_ns == stamp

    seen = []

    def failing(tmp):
        seen.append(tmp)
        assert tmp.exists() and tmp != path
        raise ParityError("deliberate")

    # forced but the verification fails: the old package survives, no temp left behind
    with pytest.raises(ParityError):
        save_package_atomic(mlmodel, path, force=True, verify=failing)
    assert path.exists() and (path / "Manifest.json").stat().st_mtime_ns == stamp
    assert not seen[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.mlpackage"]

    # a fresh path with a failing verification leaves nothing at all
    fresh = tmp_path / "fresh.mlpackage"
    with pytest.raises(ParityError):
        save_package_atomic(mlmodel, fresh, verify=failing)
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.mlpackage"]

    with pytest.raises(ExportSettingsError):
        save_package_atomic(mlmodel, tmp_path / "bad.bin")


def test_psnr_and_kl():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    assert psnr(a, a) == math.inf
    noise = 1e-3 * rng.standard_normal(a.shape)
    expected = 10 * math.log10(float(np.max(np.abs(a))) ** 2 / np.mean(noise**2))
    assert psnr(a, a + noise) == pytest.approx(expected, rel=1e-9)
    bad = a.copy()
    bad[0, 0] = np.nan
    assert psnr(a, bad) == -math.inf
    with pytest.raises(ValueError):
        psnr(a, a[:2])
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(a, a + 5.0) == pytest.approx(0.0, abs=1e-9)  # shift invariant (logits)
    assert kl_divergence(a, -a) > 0.1


def test_report_correctness():
    rng = np.random.default_rng(1)
    ref = {"h": rng.standard_normal((2, 8)).astype(np.float32), "n": np.array([5], np.int32)}
    good = {"h": ref["h"] + 1e-6, "n": np.array([5], np.int32)}
    r = report_correctness(ref, good, 60.0, exact=("n",))
    assert r.passed and r.worst_psnr_db > 60
    assert "PASS" in r.summary()
    r.raise_if_failed()

    off_by_one = {"h": ref["h"], "n": np.array([6], np.int32)}
    r = report_correctness(ref, off_by_one, 60.0, exact=("n",))
    assert not r.passed
    with pytest.raises(ParityError, match="n"):
        r.raise_if_failed()

    noisy = {"h": ref["h"] + 0.1 * rng.standard_normal((2, 8)), "n": ref["n"]}
    assert not report_correctness(ref, noisy, 60.0, exact=("n",)).passed
    assert not report_correctness(ref, {"n": ref["n"]}, 60.0, exact=("n",)).passed  # missing output
    assert not report_correctness(ref, {"h": ref["h"][:1], "n": ref["n"]}, 60.0).passed  # wrong shape
    d = report_correctness(ref, good, 60.0, exact=("n",)).to_dict()
    json.dumps(d)
    assert d["passed"] is True and len(d["outputs"]) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux); a no-op elsewhere")
def test_release_memory_returns_freed_heap_to_the_os():
    """Freed blocks below glibc's mmap threshold stay resident until `release_memory` trims the heap
    (holes between live blocks: what a freed model leaves); in a fresh process, so this test's heap
    is its own."""
    script = textwrap.dedent('''
        import numpy as np
        from cohere_coreml.convert import release_memory
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        big = np.ones(16 * 2**20 // 8); del big  # freeing a 16 MB mmapped block raises the mmap threshold
        blocks = [np.ones(2**20 // 2) for _ in range(300)]  # 300 x 4 MB, now from the heap
        kept = blocks[1::2]  # every other block stays alive: the freed ones are holes
        del blocks
        before = rss(); release_memory(); print(before, rss())
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert before > 1000 and before - after > 400, (before, after)  # 600 MB of holes given back
