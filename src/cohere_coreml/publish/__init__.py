"""Publish: a checked bundle to the Hugging Face Hub (`bundle check|finalize`, `upload`).

Takes: a finished bundle folder and, optionally, its `bench` report.
Gives: the model card and example script in the bundle, verified checksums, the upload.
May import: evaluation (the card's figures), export (gate report names), bundle, model, storage,
runtime (and the top-level config and errors).

    card  the model card (README.md) and example_inference.py
    hub   `bundle check|finalize`, `upload`
"""


def __getattr__(name: str):  # the names of the module this folder replaced (`cohere_coreml.bundle.Bundle`)
    from .. import replaced_module_attribute

    return replaced_module_attribute(__name__, name)
