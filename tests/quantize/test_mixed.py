"""quantize.mixed: the byte predictor vs coremltools' packages, the assignment, the flags' errors."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import subprocess

import numpy as np
import pytest

from cohere_coreml import cli
from cohere_coreml.quantize import mixed as M
from cohere_coreml.quantize import quantize_bundle
from cohere_coreml.quantize.command import check_budget
from cohere_coreml.quantize.compress import compress_package
from cohere_coreml.quantize.inventory import load_function
from cohere_coreml.quantize.recipes import QuantizeError, Recipe
from cohere_coreml.storage.files import weight_file_bytes

from ..fixture_data import TRAINED_MODEL


@pytest.fixture(scope="module")
def proxy_results():
    return {}


@pytest.fixture(autouse=True)
def proxy_computed_once_per_encoder(proxy_results, monkeypatch):
    """`mixed.proxy_sensitivity` is a function of the encoder's weights alone (6 s of k-means on the
    trained encoder): the plans and builds of this module that ask it of the same weights (same names,
    shapes, axes and bytes) get the result of its one run on them, as a fresh copy."""
    real = M.proxy_sensitivity

    def once(tensors, values):
        key = hashlib.sha256(repr(sorted(tensors.items())).encode())
        for name in sorted(values):
            value = np.ascontiguousarray(values[name])
            key.update(f"{name}\0{value.dtype.str}{value.shape}".encode() + value.tobytes())
        if key.hexdigest() not in proxy_results:
            proxy_results[key.hexdigest()] = real(tensors, values)
        return copy.deepcopy(proxy_results[key.hexdigest()])

    monkeypatch.setattr(M, "proxy_sensitivity", once)


@pytest.fixture(scope="module")
def mixed_package(f16_bundle, tmp_path_factory):
    """The trained bundle's multifunction encoder (4 s window + 2 s bucket) compressed with every
    width in turn over its compressible tensors (2, 3, 4, 6, 8, 16, 2, ...)."""
    src = f16_bundle / "encoder.mlpackage"
    tensors, values = M.encoder_tensors(load_function(src, "main"))
    tied, _ = M.tied_tensors(src, values)
    opts = M.options(tensors, {n: {b: 50.0 for b in t.widths()} for n, t in tensors.items()}, tied)
    cycle = itertools.cycle((2, 3, 4, 6, 8, 16))
    choice = {}
    for name, o in opts.items():
        want = next(cycle)
        choice[name] = want if want in o else 8
    recipe = Recipe("mixed", keep_fp16=tuple(n for n, b in choice.items() if b == 16), fallback="int8",
                    per_tensor=tuple((n, M.bits_scheme(b)) for n, b in choice.items() if b != 16))
    dst = tmp_path_factory.mktemp("mixed") / "encoder.mlpackage"
    section = compress_package(src, dst, recipe)
    return src, dst, tensors, tied, choice, section


def test_byte_predictor_equals_the_written_weight_file(mixed_package):
    """Per tensor: the stored bytes compression.json measures; per package: weight.bin (blob headers,
    64-byte alignment, the bucket's own position tables) to within the last blob's padding; every
    width was used."""
    src, dst, tensors, tied, choice, section = mixed_package
    assert {b for b in choice.values()} == {2, 3, 4, 6, 8, 16}
    measured = {c["name"]: c for c in section["compressed"]}
    for name, b in choice.items():
        if b == 16:
            assert name not in measured
        else:
            assert measured[name]["scheme"] == M.bits_scheme(b), name
            assert measured[name]["bytes_after"] == M.stored_bytes(tensors[name], b), name
    copies = [c for cs in tied.values() for c in cs]
    assert copies, "the 2 s bucket has its own position tables"
    non_weight = weight_file_bytes(src) - M.BLOB_HEADER - sum(M.file_bytes(t, 16) for t in [*tensors.values(), *copies])
    width = {n: choice.get(n, 16) for n in tensors}
    predicted = (M.BLOB_HEADER + non_weight + sum(M.file_bytes(t, width[n]) for n, t in tensors.items())
                 + sum(M.file_bytes(c, width[n]) for n, cs in tied.items() for c in cs))
    # exact but for the last blob: weight.bin ends at its data, unpadded (the f16 file's and this
    # one's last blobs differ from run to run of the merge: measured -2 and +26 bytes)
    assert abs(predicted - weight_file_bytes(dst)) < M.BLOB_ALIGN
    # a predictor without the palette tables (indices only) is off: the check above can fail
    broken = {n: math.ceil(tensors[n].size * b / 8) for n, b in choice.items() if b in (2, 3, 4, 6)}
    assert any(broken[n] != measured[n]["bytes_after"] for n in broken)


def test_assignment_meets_the_budget_and_keeps_sensitive_tensors_wide():
    """A fixture whose answer is known: two tensors of the same size, one 20 dB more sensitive at
    every width. The assignment is the brute-force optimum for each budget, within budget, and
    gives the sensitive tensor at least the other's width; a sensitivity-blind assignment is
    rejected by the same optimality check."""
    t = M.Tensor("a", (64, 256), 0)
    per = {"sensitive": {2: 20.0, 3: 26.0, 4: 32.0, 6: 44.0, 8: 56.0},
           "robust": {2: 40.0, 3: 46.0, 4: 52.0, 6: 64.0, 8: 76.0}}
    tensors = {"sensitive": t, "robust": M.Tensor("robust", t.shape, 0)}
    opts = M.options(tensors, per)

    def cost(choice):
        return sum(opts[n][b][0] for n, b in choice.items()), sum(opts[n][b][1] for n, b in choice.items())

    every = [dict(zip(opts, c)) for c in itertools.product(*(sorted(o) for o in opts.values()))]
    sizes = sorted({cost(c)[0] for c in every})
    for budget in sizes[1:-1]:
        choice = M.assign(opts, budget)
        used, err = cost(choice)
        best = min(cost(c)[1] for c in every if cost(c)[0] <= budget)
        assert used <= budget and err == pytest.approx(best)
        assert choice["sensitive"] >= choice["robust"]
    # sensitivity-blind choices within the same budget: one width for both (as q4), or the widths
    # swapped; both are refused by the optimality check above
    budget = cost({"sensitive": 6, "robust": 3})[0]
    best = min(cost(c)[1] for c in every if cost(c)[0] <= budget)
    assert cost(M.assign(opts, budget))[1] == pytest.approx(best)
    for blind in ({"sensitive": 4, "robust": 4}, {"sensitive": 3, "robust": 6}):
        assert cost(blind)[0] <= budget and cost(blind)[1] > 1.5 * best
    with pytest.raises(QuantizeError, match="below the narrowest"):
        M.assign(opts, sizes[0] - 1)


def test_error_model_adds_noise_powers():
    """Two tensors each at 40 dB alone predict 40 - 10 log10(2) = 37.0 dB together."""
    assert M.predicted_psnr(M.noise(40.0) + M.noise(40.0)) == pytest.approx(40 - 10 * math.log10(2))
    assert M.noise(float("inf")) == 0.0


def test_budget_flags_errors(f16_bundle, tmp_path, capsys):
    with pytest.raises(QuantizeError, match="exactly one of --target-bytes"):
        check_budget("mixed", None)
    with pytest.raises(QuantizeError, match="exactly one of --target-bytes"):
        check_budget("mixed", M.Budget(target_bytes=10, bytes_per_param=0.5, parameters=10))
    with pytest.raises(QuantizeError, match="needs the parameter count"):
        check_budget("mixed", M.Budget(bytes_per_param=0.45))
    with pytest.raises(QuantizeError, match="only apply to --preset mixed"):
        check_budget("q8", M.Budget(target_bytes=1000))
    assert M.Budget(bytes_per_param=0.45, parameters=2_065_647_872).bytes() == 929_541_542
    # through the CLI: one line on stderr naming the problem, nothing on stdout
    base = ["quantize", "--bundle", str(f16_bundle), "--out", str(tmp_path / "m"), "--preset", "mixed",
            "--proxy", "--dry-run"]
    assert cli.main(base) == 2
    err = capsys.readouterr()
    assert "exactly one of --target-bytes" in err.err and err.out == ""
    assert cli.main([*base, "--target-bytes", "1000"]) == 2
    assert "below the smallest mixed bundle" in capsys.readouterr().err
    assert cli.main([*base, "--target-bytes", str(10**9)]) == 2
    assert "above the bundle with an fp16 encoder" in capsys.readouterr().err


def test_proxy_dry_run_meets_its_budget(f16_bundle, tmp_path, capsys):
    """--dry-run --proxy: a plan whose predicted bytes are within the budget, nothing written but the plan."""
    plan_file = tmp_path / "plan.json"
    assert cli.main(["quantize", "--bundle", str(f16_bundle), "--out", str(tmp_path / "m"), "--preset", "mixed",
                   "--proxy", "--dry-run", "--target-bytes", "1", "--plan-out", str(plan_file)]) == 2
    msg = capsys.readouterr().err
    lo = int(msg.split("(")[1].split(" bytes")[0].replace(",", ""))
    budget = lo + 200_000
    rc = cli.main(["quantize", "--bundle", str(f16_bundle), "--out", str(tmp_path / "m"), "--preset", "mixed",
                   "--proxy", "--dry-run", "--target-bytes", str(budget), "--plan-out", str(plan_file)])
    assert rc == 0
    plan = json.loads(plan_file.read_text())
    assert plan["predicted_bundle_bytes"] <= budget and plan["budget_bytes"] == budget
    assert sum(plan["bits_histogram"].values()) == len(plan["tensors"])
    assert not (tmp_path / "m").exists()


def du_sb(path) -> int:
    """`du -sb` itself: the bytes a mixed budget bounds (apparent sizes of every file and directory)."""
    return int(subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True, text=True).stdout.split()[0])


def three_quarters_of(q8) -> int:
    """75 % of the q8 bundle's bytes as `du -sb` counts them, its vad.mlpackage (copied unchanged into every
    bundle; a fifth of this small model's bundle, a rounding error of the full-size one's) counted whole."""
    vad = du_sb(q8 / "vad.mlpackage") if (q8 / "vad.mlpackage").is_dir() else 0
    return int(0.75 * (du_sb(q8) - vad)) + vad


@pytest.mark.slow
def test_delivered_bundle_is_within_the_budget_as_du_counts_it(f16_bundle, q8_bundle, eval_dir, shared_gate_data,
                                                              tmp_path):
    """75 % of the gated q8 bundle as `du -sb` counts it (`three_quarters_of`). The delivered bundle (model card,
    example, compression.json, gate reports, checksums and directory entries included) is within it,
    and spends it (not refused, not far below)."""
    q8, _ = q8_bundle
    budget = three_quarters_of(q8)
    out = tmp_path / "mixed"
    quantize_bundle(f16_bundle, out, "mixed", model=str(TRAINED_MODEL), eval_dir=eval_dir,
                    budget=M.Budget(target_bytes=budget), proxy=True, accept_undecided=True)
    delivered = du_sb(out)
    assert (out / "README.md").is_file() and (out / "example_inference.py").is_file()
    assert 0.97 * budget < delivered <= budget, (delivered, budget)


@pytest.mark.slow
def test_bytes_per_param_budget_bounds_the_delivered_bundle(f16_bundle, q8_bundle, tmp_path, capsys):
    """--target-bytes-per-param through the command line: the delivered bundle is within
    floor(X * parameters) as `du -sb` counts it."""
    q8, _ = q8_bundle
    params = M.count_parameters(TRAINED_MODEL)
    per_param = round(three_quarters_of(q8) / params, 4)
    out = tmp_path / "mixed"
    rc = cli.main(["quantize", "--bundle", str(f16_bundle), "--out", str(out), "--preset", "mixed", "--proxy",
                   "--skip-verify", "--target-bytes-per-param", str(per_param), "--model", str(TRAINED_MODEL)])
    assert rc == 0, capsys.readouterr().err
    budget = math.floor(per_param * params)
    assert 0.97 * budget < du_sb(out) <= budget, (du_sb(out), budget)


def test_replan_adds_what_the_build_measured_and_refuses_what_cannot_fit():
    """After a build over its budget: the next plan carries the measured excess plus the margin; a
    budget below the narrowest bundle with that overhead, or one missed `MAX_BUILDS` times, is
    refused naming the budget, the delivered bytes and the smallest achievable."""
    t = M.Tensor("w", (64, 256), 0)
    analysis = M.Analysis({"w": t}, {}, {"other_files": 100_000})
    narrowest = analysis.range()[0]
    assert narrowest == 100_000 + M.package_bytes(t, 2)
    build = {"predicted_bundle_bytes": 120_000, "delivered_bytes": 125_000, "overhead": 0}
    budget = M.Budget(target_bytes=121_000)
    assert M.replan_overhead(analysis, budget, [build]) == 5_000 + M.REPLAN_MARGIN
    # the narrowest widths with the measured overhead exceed a budget just above the predicted narrowest
    tight = M.Budget(target_bytes=narrowest + 10)
    with pytest.raises(QuantizeError) as err:
        M.replan_overhead(analysis, tight, [build])
    smallest = narrowest + 5_000 + M.REPLAN_MARGIN
    assert str(err.value).startswith(f"budget {narrowest + 10:,} bytes cannot be met: ")
    assert "125,000 bytes as `du -sb` counts it" in str(err.value) and f"about {smallest:,} bytes" in str(err.value)
    with pytest.raises(QuantizeError, match=f"not met in {M.MAX_BUILDS} builds: .* 125,000 bytes"):
        M.replan_overhead(analysis, budget, [build] * M.MAX_BUILDS)


def build_mixed(f16_bundle, out, budget: int, **kwargs) -> dict:
    """An ungated mixed bundle with the proxy (the bytes do not depend on the sensitivity's source)."""
    return quantize_bundle(f16_bundle, out, "mixed", budget=M.Budget(target_bytes=budget), proxy=True,
                           skip_verify=True, **kwargs)


@pytest.mark.slow
def test_a_bundle_over_its_budget_is_replanned_and_built_again(f16_bundle, q8_bundle, tmp_path, monkeypatch):
    """The reports estimated at nothing (as if the estimate were wrong): the first build comes out
    over the budget, the second, planned with what the first measured, is within it and the report
    names the first."""
    monkeypatch.setattr(M, "REPORT_BYTES", 0)
    monkeypatch.setattr(M, "REPORT_BYTES_PER_TENSOR", 0)
    q8, _ = q8_bundle
    budget = three_quarters_of(q8)
    out = tmp_path / "mixed"
    report = build_mixed(f16_bundle, out, budget)
    (first,) = report["mixed"]["earlier_builds"]
    assert first["delivered_bytes"] > budget >= first["predicted_bundle_bytes"] and first["overhead"] == 0
    assert 0.97 * budget < du_sb(out) <= budget, (du_sb(out), budget)
    assert json.loads((out / "compression.json").read_text())["mixed"]["earlier_builds"] == [first]


@pytest.mark.slow
def test_a_budget_no_build_can_meet_is_refused_and_leaves_nothing(f16_bundle, tmp_path, monkeypatch, capsys):
    """With the reports estimated at nothing, the predicted narrowest bundle passes the range check
    but the bundle built for it is bigger: refused, naming the budget, the delivered bytes and the
    smallest achievable; no output folder, no temporary folder left."""
    monkeypatch.setattr(M, "REPORT_BYTES", 0)
    monkeypatch.setattr(M, "REPORT_BYTES_PER_TENSOR", 0)
    assert cli.main(["quantize", "--bundle", str(f16_bundle), "--preset", "mixed", "--proxy", "--dry-run",
                     "--target-bytes", "1"]) == 2
    narrowest = int(capsys.readouterr().err.split("(")[1].split(" bytes")[0].replace(",", ""))
    out = tmp_path / "mixed"
    with pytest.raises(QuantizeError) as err:
        build_mixed(f16_bundle, out, narrowest)
    msg = str(err.value)
    assert msg.startswith(f"budget {narrowest:,} bytes cannot be met: the mixed bundle built for it is "), msg
    delivered = int(msg.split("built for it is ")[1].split(" bytes")[0].replace(",", ""))
    smallest = int(msg.split("achievable about ")[1].split(" bytes")[0].replace(",", ""))
    assert delivered > narrowest and smallest > narrowest
    assert not out.exists() and list(tmp_path.iterdir()) == []
