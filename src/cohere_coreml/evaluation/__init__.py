"""Evaluation: how good a bundle is, and where it departs from PyTorch.

Takes: bundles, a checkpoint, audio datasets.
Gives: `bench` reports (WER/CER with intervals, word-timing error, speed by stage, memory, loops) and `verify`'s
stage-by-stage parity (near-ties told from real differences).
May import: export (parity arithmetic, the decoder's gate, matching words to a truth), inference, bundle, model, storage,
runtime (and the top-level config, export_errors and cli_options).

    bench     `cohere-coreml bench`: engines side by side on a dataset
    bench_report  its tables (bench.md) and chart (bench.png)
    verify    `cohere-coreml verify`: stage-by-stage parity against `transformers`
    metrics   text normalisers, WER/CER, bootstrap intervals
    datasets  evaluation datasets (a folder with a manifest, or a Hub dataset)
"""
