"""Publish: a checked bundle to the Hugging Face Hub (`bundle check|finalize`, `upload`).

Takes: a finished bundle folder and, optionally, its `bench` report.
Gives: the model card and example script in the bundle, verified checksums, the upload.
May import: evaluation (the card's figures), export (gate report names), bundle, model, storage,
runtime (and the top-level config and export_errors).

    card  the model card (README.md) and example_inference.py
    hub   `bundle check|finalize`, `upload`
"""

