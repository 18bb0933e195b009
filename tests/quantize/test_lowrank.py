"""quantize.lowrank: the two-pass statistics, the rank rule, the rewrite, and the lowrank presets end to end."""

from __future__ import annotations

import copy
import json
import logging
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn

from cohere_coreml import cli
from cohere_coreml.model.checkpoint import load_reference
from cohere_coreml.quantize import lowrank, lowrank_search
from cohere_coreml.quantize.command import quantize_bundle
from cohere_coreml.quantize.compression_gates import QuantizeGateError
from cohere_coreml.quantize.recipes import GATES, LOWRANK_ENERGY, QuantizeError

from ..fixture_data import HELDOUT_DIR, TRAINED_MODEL

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    """A private copy of the default model (the tests rewrite it)."""
    model, processor = load_reference(TRAINED_MODEL)
    return model, processor


@pytest.fixture(scope="module")
def windows():
    """Two random feature windows of different lengths (1, T, n_mels) with their masks (more encoder frames
    than the widest output, so the covariances have full rank)."""
    rng = np.random.default_rng(0)
    out = []
    for t in (1600, 1131):
        x = torch.from_numpy(rng.standard_normal((1, t, 128)).astype(np.float32))
        out.append((x, torch.ones(1, t, dtype=torch.long)))
    return out


def test_a_calibration_folder_that_is_not_a_dataset_is_a_quantize_error(tmp_path):
    """The folder is checked as `--data` is (`datasets.load_folder`); its error arrives as a QuantizeError
    naming the folder (the CLI's clean error), not a DatasetError traceback from inside the library."""
    folder = tmp_path / "calib"
    folder.mkdir()
    shutil.copy(HELDOUT_DIR / "en_heldout_00000.flac", folder / "a.flac")
    (folder / "manifest.json").write_text(json.dumps({"clips": [{"file": "a.flac", "language": None, "text": ""}]}))
    with pytest.raises(QuantizeError, match="calibration folder: .*manifest.json: entry 0 has no language"):
        lowrank.calibration_clips(folder)
    good = json.loads((HELDOUT_DIR / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**good, "utterances": [{**good["utterances"][0], "file": "a.flac"}]}))
    assert lowrank.calibration_clips(folder) == [folder / "a.flac"]


def direct_outputs(encoder, windows, names):
    """Each target's output rows over all windows, captured by plain hooks (the numpy reference)."""
    rows = {n: [] for n in names}
    modules = lowrank.targets(encoder)
    handles = [modules[n].register_forward_hook(
        lambda m, i, o, n=n: rows[n].append(lowrank.output_rows(m, o).numpy())) for n in names]
    with torch.no_grad():
        for x, mask in windows:
            encoder(x, attention_mask=mask)
    for h in handles:
        h.remove()
    return {n: np.concatenate(r) for n, r in rows.items()}


def all_statistics(groups):
    """{name: OutputStatistics} of every group `collect_statistics` yields (small models only)."""
    return {n: s for group in groups for n, s in group.items()}


def reference_statistics(encoder, windows):
    """The calibration before groups, by its arithmetic: every target at once, float64 sums of each window's
    rows in order (mean), then of the centred outer products (covariance), each divided by n; all the
    eigenvectors, by eigh (not through `principal_axes`)."""
    modules = lowrank.targets(encoder)
    per_window = {n: [] for n in modules}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: per_window[n].append(lowrank.output_rows(m, o).numpy()))
               for n, m in modules.items()]
    with torch.no_grad():
        for x, mask in windows:
            encoder(x, attention_mask=mask)
    for h in handles:
        h.remove()
    stats = {}
    for n, rows in per_window.items():
        sums, count = np.zeros(rows[0].shape[1]), 0
        for r in rows:
            sums += r.sum(0)
            count += r.shape[0]
        mean = sums / count
        outer = np.zeros((len(mean),) * 2)
        for r in rows:
            centred = r - mean
            outer += centred.T @ centred
        stats[n] = lowrank.OutputStatistics(count=count, mean=mean, cov=outer / count)
    pcs = {n: np.linalg.eigh(s.cov) for n, s in stats.items()}
    order = {n: np.argsort(values)[::-1] for n, (values, _) in pcs.items()}
    return stats, lowrank.Analysis(stats=stats, eigenvalues={n: np.clip(v[order[n]], 0.0, None) for n, (v, _) in pcs.items()},
                                   axes={n: vectors[:, order[n]] for n, (_, vectors) in pcs.items()},
                                   max_rank={n: min(lowrank.features(m)) for n, m in modules.items()})


def test_targets_are_the_block_linears_and_pointwise_convs_only(model):
    names = lowrank.targets(model[0].model.encoder)
    assert len(names) == 4 * 10  # 4 blocks: q, k, v, o, 2 ffn x 2 linears, 2 pointwise convs
    assert {lowrank.layer_type(n) for n in names} == set(lowrank.LAYER_TYPES)
    assert not any("relative_k_proj" in n or "depthwise" in n or "subsampling" in n for n in names)
    assert lowrank.layer_type("layers.0.self_attn.k_proj") == "attn_qk"
    assert lowrank.layer_type("layers.0.self_attn.o_proj") == "attn_vo"
    assert lowrank.layer_type("layers.0.conv.depthwise_conv") is None


def test_two_pass_statistics_match_numpy(model, windows):
    """Mean and covariance (divided by n) of every output, against np.mean / np.cov on the captured rows."""
    encoder = model[0].model.encoder
    names = ["layers.1.self_attn.q_proj", "layers.2.conv.pointwise_conv1", "layers.3.feed_forward2.linear1"]
    stats = all_statistics(lowrank.collect_statistics(encoder, lambda: iter(windows), names))
    rows = direct_outputs(encoder, windows, names)
    for n in names:
        y = rows[n]
        with torch.no_grad():
            frames = sum(encoder(x, attention_mask=m).last_hidden_state.shape[1] for x, m in windows)
        assert stats[n].count == y.shape[0] == frames
        np.testing.assert_allclose(stats[n].mean, y.mean(0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(stats[n].cov, np.cov(y, rowvar=False, bias=True), rtol=1e-9, atol=1e-12)
    # the covariance of a pointwise conv's output is over channels (288), not over time
    assert stats["layers.2.conv.pointwise_conv1"].cov.shape == (288, 288)


def test_rank_rule():
    values = np.array([6.0, 3.0, 1.0, 0.0])  # energy 0.6, 0.9, 1.0, 1.0
    assert [lowrank.rank_for_energy(values, e) for e in (0.5, 0.6, 0.61, 0.9, 0.95, 1.0)] == [1, 1, 2, 2, 3, 3]
    assert lowrank.saves(71, 144, 144) and not lowrank.saves(72, 144, 144)  # r (in + out) < in out
    assert lowrank.saves(115, 144, 576) and not lowrank.saves(116, 144, 576)
    with pytest.raises(QuantizeError, match="energy threshold"):
        lowrank.rank_for_energy(values, 0.0)


def test_grouped_statistics_equal_the_one_group_ones_exactly(model, windows, caplog):
    """A budget of two 144-wide covariances: per block ffn1.linear1 (576) | linear2 + q | k + v | o | pw1 (288) |
    pw2 | ffn2.linear1 | linear2, 32 groups; every count, mean, covariance, eigenvalue and kept axis
    bit-identical to one group and to the arithmetic before groups."""
    encoder = model[0].model.encoder
    modules = lowrank.targets(encoder)
    budget = 2 * lowrank.covariance_bytes(144)
    reference, before = reference_statistics(encoder, windows)
    caplog.set_level(logging.INFO, logger=lowrank.__name__)
    grouped = list(lowrank.collect_statistics(encoder, lambda: iter(windows), budget_bytes=budget))
    groups = lowrank.statistic_groups({n: lowrank.features(m)[1] for n, m in modules.items()}, budget)
    assert [list(g) for g in grouped] == groups and [n for g in groups for n in g] == list(modules)

    def size(names):
        return sum(lowrank.covariance_bytes(lowrank.features(modules[n])[1]) for n in names)

    # within the budget (a wider target alone), and greedy: the next group's first target did not fit
    assert all(size(g) <= budget or len(g) == 1 for g in groups)
    assert all(size(g + h[:1]) > budget for g, h in zip(groups, groups[1:]))
    assert len(groups) == 32 and groups[1] == ["layers.0.feed_forward1.linear2", "layers.0.self_attn.q_proj"]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("calibration group")]
    assert len(progress) == 32 and progress[1] == "calibration group 2/32: 2 targets, 0.0 GB of statistics"
    one = lowrank.collect_statistics(encoder, lambda: iter(windows), budget_bytes=1 << 60)
    one = next(one), next(one, None)
    assert one[1] is None and list(one[0]) == list(modules)  # a single group
    grouped = all_statistics(grouped)
    for n in modules:
        for s in (one[0][n], reference[n]):
            assert grouped[n].count == s.count
            np.testing.assert_array_equal(grouped[n].mean, s.mean)
            np.testing.assert_array_equal(grouped[n].cov, s.cov)
    analysis = lowrank.analyse(encoder, lambda: iter(windows), budget_bytes=budget)
    assert list(analysis.axes) == list(modules) and not hasattr(analysis.stats[n], "cov")  # covariances not kept
    for n, m in modules.items():
        kept = lowrank.kept_rank(*lowrank.features(m), min(lowrank.features(m)))
        assert analysis.stats[n].count == reference[n].count
        np.testing.assert_array_equal(analysis.stats[n].mean, reference[n].mean)
        np.testing.assert_array_equal(analysis.eigenvalues[n], before.eigenvalues[n])
        np.testing.assert_array_equal(analysis.axes[n], before.axes[n][:, :kept])


def test_kept_axes_are_the_largest_saving_rank():
    """kept_rank = the largest r with r (in + out) < in out (at least 1, at most max_rank), by brute force."""
    for in_f, out_f in [(144, 144), (144, 576), (576, 144), (144, 288), (1280, 5120), (5120, 1280), (1, 1),
                        (2, 3), (7, 1000)]:
        saving = [r for r in range(1, min(in_f, out_f) + 1) if lowrank.saves(r, in_f, out_f)]
        assert lowrank.kept_rank(in_f, out_f, min(in_f, out_f)) == max(saving, default=1)
    assert lowrank.kept_rank(144, 144, min(144, 144)) == 71 and lowrank.kept_rank(1280, 5120, 1280) == 1023
    assert lowrank.kept_rank(144, 576, 100) == 100


@pytest.fixture(scope="module")
def grouped_analysis(model, windows):
    """The default model's analysis in groups (a budget of three 144-wide covariances) and the reference
    (before groups: one pass pair over every target, full axes)."""
    encoder = model[0].model.encoder
    budget = 3 * lowrank.covariance_bytes(144)
    return lowrank.analyse(encoder, lambda: iter(windows), budget_bytes=budget), reference_statistics(encoder, windows)[1]


def threshold_for_rank(analysis, name, rank):
    """The energy threshold whose rank for `name` is `rank` (the energy kept at that rank)."""
    return float(lowrank.energy_curve(analysis.eigenvalues[name])[rank - 1])


def test_kept_axes_width_and_a_plan_past_them_is_refused(model, grouped_analysis):
    encoder = model[0].model.encoder
    analysis, _ = grouped_analysis
    for n, m in lowrank.targets(encoder).items():
        in_f, out_f = lowrank.features(m)
        assert analysis.axes[n].shape == (out_f, max(r for r in range(1, in_f + 1) if lowrank.saves(r, in_f, out_f)))
    name = "layers.0.self_attn.q_proj"  # 144 x 144: ranks up to 71 save
    thresholds = {"attn_qk": threshold_for_rank(analysis, name, 71)}
    plan = {p.name: p for p in lowrank.plan_ranks(encoder, analysis, thresholds)}[name]
    assert plan.rank == 71
    broken = lowrank.Analysis(stats=analysis.stats, eigenvalues=analysis.eigenvalues,
                              axes={n: a[:, :-1] for n, a in analysis.axes.items()}, max_rank=analysis.max_rank)
    with pytest.raises(QuantizeError, match="rank-71 plan needs 71 principal axes, the calibration kept 70"):
        lowrank.plan_ranks(encoder, broken, thresholds)
    with pytest.raises(QuantizeError, match="principal axes"):
        lowrank.rewrite_encoder(copy.deepcopy(encoder), broken, [plan])


@pytest.mark.parametrize("thresholds", [
    {t: 0.9 for t in lowrank.LAYER_TYPES},
    {"attn_qk": 0.95, "attn_vo": 0.98, "ffn": 0.98, "conv_pw": 0.99},
    {"attn_qk": 0.999999, "ffn": 0.5, "conv_pw": 0.8},
    "largest saving ranks",
])
def test_plans_and_rewrite_equal_the_ones_before_groups(model, windows, grouped_analysis, thresholds):
    """Grouped statistics with truncated axes give the same plans and bit-identical rewritten encoders as
    one pass pair over every target with the full axes."""
    encoder = model[0].model.encoder
    analysis, before = grouped_analysis
    if thresholds == "largest saving ranks":  # each type's threshold hits the largest saving rank of its layer-0 tensor
        names = {"attn_qk": "layers.0.self_attn.k_proj", "attn_vo": "layers.0.self_attn.v_proj",
                 "ffn": "layers.0.feed_forward1.linear1", "conv_pw": "layers.0.conv.pointwise_conv2"}
        thresholds = {t: threshold_for_rank(analysis, n, analysis.axes[n].shape[1]) for t, n in names.items()}
        assert all(p.rank == analysis.axes[p.name].shape[1] for p in lowrank.plan_ranks(encoder, analysis, thresholds)
                   if p.name in names.values())
    plans = lowrank.plan_ranks(encoder, analysis, thresholds)
    assert plans == lowrank.plan_ranks(encoder, before, thresholds) and any(p.rank for p in plans)
    new, old = copy.deepcopy(encoder), copy.deepcopy(encoder)
    assert lowrank.rewrite_encoder(new, analysis, plans) == lowrank.rewrite_encoder(old, before, plans) > 0
    old_state = old.state_dict()
    assert all(torch.equal(t, old_state[k]) for k, t in new.state_dict().items())
    with torch.no_grad():
        for x, mask in windows:
            out = new(x, attention_mask=mask).last_hidden_state
            assert torch.equal(out, old(x, attention_mask=mask).last_hidden_state)
            assert not torch.equal(out, encoder(x, attention_mask=mask).last_hidden_state)


def test_plan_leaves_full_what_saves_nothing(model, windows):
    encoder = model[0].model.encoder
    analysis = lowrank.analyse(encoder, lambda: iter(windows))
    plans = lowrank.plan_ranks(encoder, analysis, {"attn_qk": 0.999999, "ffn": 0.5})
    by = {p.name: p for p in plans}
    qk = by["layers.0.self_attn.q_proj"]
    assert qk.rank is None and qk.rank_for_threshold >= 72 and qk.params_after == qk.params_before  # saves nothing
    ffn = by["layers.0.feed_forward1.linear1"]
    assert ffn.rank is not None and ffn.rank == ffn.rank_for_threshold and ffn.energy_kept >= 0.5
    assert ffn.params_after == ffn.rank * (144 + 576) + 576 and ffn.macs_after == ffn.rank * 720
    assert by["layers.0.self_attn.v_proj"].rank is None  # no threshold for the type: full
    with pytest.raises(QuantizeError, match="unknown layer type"):
        lowrank.plan_ranks(encoder, analysis, {"mlp": 0.9})


def rewritten(module, x, stats, rank, broken=False):
    """The LowRankLinear of `module` at `rank` (broken: the mean term left out), applied to x."""
    w, b = lowrank.weight_matrix(module)
    _, axes = lowrank.principal_axes(stats.cov)
    mean = np.zeros_like(stats.mean) if broken else stats.mean
    down, up, up_bias = lowrank.factorise(w, b, mean, axes[:, :rank])
    with torch.no_grad():
        return lowrank.LowRankLinear(module, down, up, up_bias)(x)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_rewrite_is_exact_at_full_rank_and_the_pca_residual_at_low_rank(kind):
    """Full rank: the original output. Rank r: the squared error over the calibration rows is exactly the
    discarded eigenvalues' sum (the PCA identity); a rewrite without the mean term is measurably worse."""
    torch.manual_seed(0)
    d_in, d_out, n = 24, 40, 500
    module = nn.Linear(d_in, d_out) if kind == "linear" else nn.Conv1d(d_in, d_out, 1)
    module = module.double()
    with torch.no_grad():
        module.bias.add_(3.0)  # a large mean: the mean term matters
    # correlated inputs so the output spectrum decays (rows x: (n, in) for a linear, (1, in, n) for a conv)
    x = torch.randn(n, d_in, dtype=torch.float64) @ torch.diag(torch.logspace(0, -2, d_in, dtype=torch.float64))
    inputs = x if kind == "linear" else x.T[None]
    with torch.no_grad():
        y = lowrank.output_rows(module, module(inputs)).numpy()
    stats = lowrank.OutputStatistics(count=n, mean=y.mean(0), cov=np.cov(y, rowvar=False, bias=True))
    values, _ = lowrank.principal_axes(stats.cov)

    def rows(out):
        return lowrank.output_rows(module, out).numpy()

    full = rows(rewritten(module, inputs, stats, d_out))
    np.testing.assert_allclose(full, y, rtol=1e-10, atol=1e-10)
    r = 6
    err = np.sum((rows(rewritten(module, inputs, stats, r)) - y) ** 2) / n
    np.testing.assert_allclose(err, values[r:].sum(), rtol=1e-8)
    broken = np.sum((rows(rewritten(module, inputs, stats, r, broken=True)) - y) ** 2) / n
    assert broken > 10 * err


def test_rewrite_replaces_modules_in_place_and_the_encoder_still_runs(windows):
    model, processor = load_reference(TRAINED_MODEL)
    encoder = model.model.encoder
    x, mask = windows[0]
    with torch.no_grad():
        before = encoder(x, attention_mask=mask).last_hidden_state
    analysis = lowrank.analyse(encoder, lambda: iter(windows))
    params = lowrank.encoder_parameters(encoder)
    plans = lowrank.plan_ranks(encoder, analysis, {t: 0.9 for t in lowrank.LAYER_TYPES})
    n = lowrank.rewrite_encoder(encoder, analysis, plans)
    assert n == sum(p.rank is not None for p in plans) > 0
    assert isinstance(encoder.layers[0].conv.pointwise_conv1, lowrank.LowRankLinear)
    assert isinstance(encoder.layers[0].conv.pointwise_conv1.down, nn.Conv1d)
    after = lowrank.encoder_parameters(encoder)
    assert params - after == sum(p.params_before - p.params_after for p in plans) > 0
    with torch.no_grad():
        out = encoder(x, attention_mask=mask).last_hidden_state
    assert out.shape == before.shape and torch.isfinite(out).all() and not torch.equal(out, before)


def test_lowrank_presets_are_registered_with_their_gates():
    for preset in ("lowrank", "q8-lowrank"):
        assert set(LOWRANK_ENERGY[preset]) == set(lowrank.LAYER_TYPES)
        assert set(GATES[preset]) == set(GATES["q8"])


def test_energy_scales_and_the_bisection():
    """One scale on the preset's thresholds (s = 1: the thresholds themselves; s = 2 doubles every type's lost
    energy), candidates ordered largest encoder first; the bisection returns the largest passing index with at
    most ceil(log2(n + 1)) evaluations, None when the first fails."""
    base = LOWRANK_ENERGY["lowrank"]
    assert lowrank_search.scaled_energy(base, 1.0) == base
    assert lowrank_search.scaled_energy(base, 2.0)["ffn"] == pytest.approx(1 - 2 * (1 - base["ffn"]))
    scales = lowrank_search.ENERGY_SCALES
    assert list(scales) == sorted(scales) and 1.0 in scales
    for t in base:  # larger scale, lower threshold, smaller ranks
        row = [lowrank_search.scaled_energy(base, s)[t] for s in scales]
        assert row == sorted(row, reverse=True)
    for k in [None, *range(len(scales))]:
        asked = []

        def passes(i, k=k, asked=asked):
            asked.append(i)
            return k is not None and i <= k

        assert lowrank_search.bisect_largest_passing(len(scales), passes) == k
        assert len(asked) <= int(np.ceil(np.log2(len(scales) + 1)))


def test_a_search_that_chose_none_refuses_with_every_candidate():
    """No candidate passing refuses the build (`QuantizeGateError`, the refusal's figures the search report),
    naming each candidate's scale, size, PSNR and deciding figure; a chosen one does not raise."""
    found = {"chosen": None, "thresholds": None, "candidates": [
        {"scale": 1.0, "reduction": 0.663, "encoder_psnr_db": 25.6, "decided_by": "en WER +2.00 points: wholly above"},
        {"scale": 0.25, "reduction": 0.548, "encoder_psnr_db": 35.3, "decided_by": "en WER +0.90 points: holds"}]}
    with pytest.raises(QuantizeGateError) as refused:
        lowrank_search.raise_if_none_passed(found)
    msg = str(refused.value)
    assert "s=1: -66.3 %, 25.6 dB, en WER +2.00 points" in msg and "s=0.25: -54.8 %, 35.3 dB" in msg
    assert refused.value.report["component"] == "lowrank_search" and refused.value.report["passed"] is False
    lowrank_search.raise_if_none_passed({**found, "chosen": 0.25})


def test_search_keeps_the_passing_plan_and_a_plan_cut_far_below_fails_the_gate(f16_bundle, eval_dir, f16_gate_data):
    """The search on one calibration: near-full ranks pass the floor and are undecided by the held-out verdict
    on one clip per language (taken with `accept_undecided`; without it, no candidate passes); ranks cut far
    below (scale 40: every type keeps half its energy) are refused by the encoder PSNR floor, and the search
    returns the passing candidate, each candidate's PSNR, size and verdict recorded."""
    from cohere_coreml.inference.engines import PyTorchEngine
    from cohere_coreml.quantize.measure import clips_of

    data = f16_gate_data(f16_bundle, clips_of(eval_dir))
    engine = PyTorchEngine(TRAINED_MODEL)
    analysis = lowrank.calibrate(engine.model, engine.processor, lowrank.calibration_clips(eval_dir))
    settings = lowrank_search.SearchSettings(windows=data.windows, heldout=[eval_dir], gates=GATES["lowrank"],
                                             scales=(0.25, 40.0), accept_undecided=True)
    window, _ = lowrank.bundle_windows(json.loads((f16_bundle / "manifest.json").read_text()))
    before = [p.detach().clone() for p in engine.model.parameters()]
    found = lowrank_search.search_energy(engine, analysis, LOWRANK_ENERGY["lowrank"], settings, window)
    kept, cut = found["candidates"]
    assert found["chosen"] == 0.25
    assert found["thresholds"] == lowrank_search.scaled_energy(LOWRANK_ENERGY["lowrank"], 0.25)
    assert kept["passed"] and kept["encoder_psnr_db"] >= GATES["lowrank"]["encoder_psnr_db"]
    assert kept["heldout"][0]["verdict"] == "undecided" and "rule of three" in kept["decided_by"]
    assert not cut["passed"] and "floor" in cut["decided_by"]
    assert cut["encoder_psnr_db"] < GATES["lowrank"]["encoder_psnr_db"] and cut["reduction"] > kept["reduction"]
    # the engine's model is the unmodified one again (each candidate rewrote a copy)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    # undecided is not a pass unless accepted: the same candidate on the same clips, none chosen
    strict = lowrank_search.SearchSettings(windows=data.windows, heldout=[eval_dir], gates=GATES["lowrank"],
                                           scales=(0.25,), baselines=settings.baselines)
    refused = lowrank_search.search_energy(engine, analysis, LOWRANK_ENERGY["lowrank"], strict, window)
    assert refused["chosen"] is None and refused["candidates"][0]["heldout"][0]["verdict"] == "undecided"


def test_lowrank_without_model_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["quantize", "--bundle", str(tmp_path), "--out", str(tmp_path / "lr"), "--preset", "lowrank"])
    err = capsys.readouterr()
    assert rc != 0 and "--model" in err.err and "lowrank" in err.err and err.out == ""
    with pytest.raises(QuantizeError, match="calibration"):
        quantize_bundle(tmp_path, tmp_path / "lr", "lowrank", model=str(TRAINED_MODEL), eval_dir=None)


def test_energy_flag_names_a_bad_value_and_belongs_to_the_lowrank_presets(tmp_path, capsys):
    """`--energy` gives the thresholds instead of the search: a bad type or value is one line naming the
    types, and another preset refuses it; the search needs a held-out folder to judge by."""
    for bad in ("ffn=2", "mlp=0.9", "ffn"):
        with pytest.raises(SystemExit) as exited:  # argparse's own error exit (status 2, one usage line)
            cli.main(["quantize", "--bundle", str(tmp_path), "--preset", "lowrank", "--energy", bad])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "--energy" in err and "attn_qk" in err and "Traceback" not in err
    with pytest.raises(QuantizeError, match="only|applies to the low-rank presets"):
        quantize_bundle(tmp_path, tmp_path / "q8", "q8", energy={"ffn": 0.9})
    with pytest.raises(QuantizeError, match="searches its ranks to the held-out verdict"):
        quantize_bundle(tmp_path, tmp_path / "lr", "lowrank", model=str(TRAINED_MODEL), eval_dir=None,
                        calibration=HELDOUT_DIR)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["lowrank", "q8-lowrank"])
def test_lowrank_preset_end_to_end(f16_bundle, eval_dir, shared_gate_data, tmp_path, preset):
    """The trained bundle (4 s window + 2 s bucket): encoder re-exported from the rewritten checkpoint,
    conversion-gated, gated vs the f16 encoder and on the held-out clips vs PyTorch; figures in compression.json.
    Calibrated on the whole held-out folder (the gate's one clip per language is too little audio for a PCA)."""
    out = tmp_path / preset
    # lowrank searches its thresholds; q8-lowrank takes them as given (--energy: the explicit choice, no search)
    energy = dict(LOWRANK_ENERGY[preset]) if preset == "q8-lowrank" else None
    report = quantize_bundle(f16_bundle, out, preset, model=str(TRAINED_MODEL), eval_dir=eval_dir,
                             calibration=HELDOUT_DIR, energy=energy, accept_undecided=True)
    saved = json.loads((out / "compression.json").read_text())
    enc = saved["components"]["encoder"]
    lr = enc["lowrank"]
    if energy is None:  # the search's choice is what was built, every candidate recorded
        search = lr["search"]
        assert search["chosen"] in search["scales"] and lr["thresholds"] == search["thresholds"]
        passed = [c["scale"] for c in search["candidates"] if c["passed"]]
        bisection = int(np.ceil(np.log2(len(search["scales"]) + 1)))  # candidates a bisection may evaluate
        assert search["chosen"] == max(passed) and 1 <= len(search["candidates"]) <= bisection
        assert all(c["scale"] > search["chosen"] for c in search["candidates"] if not c["passed"])
    else:
        assert "search" not in lr and lr["thresholds"] == energy
    assert lr["encoder_parameters"]["reduction"] >= 0.30
    # the f16 bundle's windows: main + the 2 s bucket, each function gated against the rewritten model
    assert lr["conversion_gate"]["passed"] and "main" in lr["conversion_gate"]["functions"]
    assert len(lr["conversion_gate"]["functions"]) == 2
    assert all({"rank", "energy_kept", "bytes_fp16", "macs_per_frame"} <= set(t) for t in lr["tensors"])
    assert any(t["rank"] is not None for t in lr["tensors"])
    assert report["gate"]["passed"] and report["gate"]["heldout"]["baseline"] == "pytorch"
    assert report["gate"]["encoder"]["worst_psnr_db"] >= GATES[preset]["encoder_psnr_db"]
    assert lr["weight_file_bytes"]["after"] < lr["weight_file_bytes"]["f16"]
    if preset == "q8-lowrank":
        assert enc["tensors"]["compressed"] > 0 and lr["weight_file_bytes"]["after"] < lr["weight_file_bytes"]["lowrank_fp16"]
    if preset == "lowrank":  # a low-rank bundle keeps fp16 weights: weight compression may start from it
        again = quantize_bundle(out, tmp_path / "lr-q8", "q8", skip_verify=True)
        assert again["source_preset"] == "lowrank"
        ranks = again["source_compression"]["components"]["encoder"]["lowrank"]["tensors"]
        assert [t["rank"] for t in ranks] == [t["rank"] for t in lr["tensors"]]
        q8_enc = again["components"]["encoder"]
        assert q8_enc["tensors"]["compressed"] > 0
        assert q8_enc["weight_file_bytes"]["after"] < q8_enc["weight_file_bytes"]["before"] == lr["weight_file_bytes"]["after"]
        with pytest.raises(QuantizeError, match="rewrites the encoder of the f16 export"):
            quantize_bundle(out, tmp_path / "twice", "lowrank", model=str(TRAINED_MODEL), eval_dir=eval_dir)
        with pytest.raises(QuantizeError, match="already a 'q8' bundle"):
            quantize_bundle(tmp_path / "lr-q8", tmp_path / "q8-again", "q8", skip_verify=True)
        # a manifest that disagrees with compression.json about the preset is refused
        odd = tmp_path / "odd"
        shutil.copytree(out, odd)
        manifest = json.loads((odd / "manifest.json").read_text())
        manifest.pop("checksums")
        manifest["preset"] = "f16"
        (odd / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(QuantizeError, match="its manifest says preset 'f16'"):
            quantize_bundle(odd, tmp_path / "odd-q8", "q8", skip_verify=True)
