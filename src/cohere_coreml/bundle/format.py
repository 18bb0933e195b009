"""The bundle format: its name and version, the file names of its packages, the value sets its fields
take, and `BundleError`. A bundle folder holds

    frontend.mlpackage       16 kHz samples -> the encoder's input_features (cohere_coreml.export.frontend)
    encoder.mlpackage        features -> cross-attention memory (see docs/contract.md)
    decoder.mlpackage        stateful decode step (see docs/decoder.md)
    vad.mlpackage            optional: Silero VAD, speech probability per 32 ms chunk (cohere_coreml.export.vad_package)
    manifest.json            ids, prompts, shapes, capacities, file names (cohere_coreml.bundle.manifest); and,
                             from cohere_coreml.storage.integrity, preset, recipe, min_os and the sha256 + size
                             of every other file (`write_manifest`)
    vocab.json               id -> SentencePiece piece (cohere_coreml.model.tokens.export_vocab)
    tokenizer.json, tokenizer_config.json, processor_config.json
                             the checkpoint's tokenizer and feature-extractor settings

The manifest format is documented for Swift developers in docs/bundle.md.
"""

from __future__ import annotations

from ..config import BIND_FUNCTION

FORMAT_NAME = "cohere-coreml-bundle"
# 3: the encoder's length masks are host inputs. 2: the decoder keeps the cross memory in its state
# (bind_memory once per window; the step takes only input_ids and position). 1: the step took
# cross_k / cross_v / cross_mask at every call.
FORMAT_VERSION = 3
# what each format changed (the refusal of an older bundle says why it cannot be read)
FORMAT_CHANGES = {
    2: f"the decoder keeps the cross memory in its state, bound once per window by its {BIND_FUNCTION!r} function",
    3: "the encoder takes its length masks from the host as fp16 inputs (encoder.length_masks) instead of a "
       "feature_length input, so its program holds no integer or fp32 length arithmetic",
}
ENCODER_FILE = "encoder.mlpackage"
DECODER_FILE = "decoder.mlpackage"
FRONTEND_FILE = "frontend.mlpackage"
VAD_FILE = "vad.mlpackage"
VOCAB_FILE = "vocab.json"
FILES = {"encoder": ENCODER_FILE, "frontend": FRONTEND_FILE, "decoder": DECODER_FILE}


class BundleError(ValueError):
    """A bundle folder is missing files or carries an unreadable / inconsistent manifest."""


# the values the manifest's fields may take (cohere_coreml.bundle.checks)

MAX_DIM = 2**31 - 1  # Core ML shapes and int32 ids
COMPUTE_UNITS = ("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne")
IO_DTYPES = ("float16", "float32", "int32")
PRECISIONS = ("fp16", "fp32")
