"""Weight compression of an exported bundle: `f16/` -> `q8/` (or q8-hybrid, q4), gated.

One job per module, the analysis steps apart from the apply steps (as in ml-stable-diffusion):

    recipes      what is compressed: schemes, `Recipe`, presets and their gate thresholds
    inventory    what a package holds: functions, weight tensors, compressed tensors, the
                 per-tensor report of compression.json
    compress     apply a recipe to one package with coremltools.optimize.coreml (per function of
                 multifunction packages, the fallback pass, coremltools' skip reasons)
    measure      the f16 references (`build_gate_data`) and the measurements against them
                 (encoder PSNR, decoder teacher forcing, log-prob error, KL)
    sensitivity  per-weight sensitivity and `--target-psnr` (`choose_fp16`)
    lowrank      the low-rank encoder of `lowrank` / `q8-lowrank` (LiteASR): calibration statistics,
                 PCA ranks, the rewrite of the checkpoint, its re-export
    lowrank_search  the low-rank thresholds searched to the gate (one scale, bisection, each candidate
                 judged in PyTorch by the floor and the task verdict)
    activations  W8A8: activation statistics through the interpreter, applied by coremltools' own passes
    compression_gates  the component gates and the held-out task verdict (the bench's engines, datasets and
                 metrics; decided by the bootstrap interval, on larger sets while undecided)
    command      `quantize_bundle` (source check, bundle assembly, atomic install) and the CLI

Only the names other modules, tools and tests use are re-exported here.

Takes: an f16 bundle, a preset (or a byte budget), the checkpoint and a held-out set for the gates.
Gives: a compressed bundle, installed only when its gates passed, with compression.json and a card.
May import: publish (the bundle's card), evaluation, export, inference, bundle, model, storage,
runtime (and the top-level config and export_errors).
"""

from .command import add_command, check_source, format_summary, quantize_bundle, refusal_path, source_preset
from .compress import compress_mlmodel, compress_package, extract_function
from .compression_gates import (
    QuantizeGateError,
    compare_transcripts,
    component_gate,
    decide,
    engine_transcripts,
    heldout_gate,
    heldout_report,
    language_verdict,
    unseen_increase,
)
from .inventory import (
    compressed_ops,
    compressed_tensors,
    load_function,
    package_functions,
    tensor_report,
    weight_tensors,
)
from .measure import (
    GateData,
    build_gate_data,
    clips_of,
    decoder_outputs,
    decoder_runtime,
    encoder_outputs,
    encoder_psnr,
    gate_clips,
    log_prob_error,
    packaged_gate_clips,
)
from .recipes import (
    COMPONENTS,
    DEFAULT_PRESET,
    GATES,
    PRESETS,
    SCHEMES,
    WEIGHT_THRESHOLD,
    QuantizeError,
    Recipe,
    preset_recipes,
    scheme_config,
)
from .sensitivity import choose_fp16, sensitivity

__all__ = [
    "COMPONENTS", "DEFAULT_PRESET", "GATES", "PRESETS", "SCHEMES", "WEIGHT_THRESHOLD", "GateData", "QuantizeError",
    "QuantizeGateError", "Recipe", "add_command", "build_gate_data", "check_source", "choose_fp16",
    "compare_transcripts", "component_gate", "compress_mlmodel", "compress_package", "compressed_ops",
    "compressed_tensors", "decide", "decoder_outputs", "decoder_runtime", "encoder_outputs", "encoder_psnr", "engine_transcripts",
    "extract_function", "format_summary", "gate_clips", "heldout_gate", "heldout_report", "language_verdict", "load_function",
    "clips_of", "log_prob_error", "package_functions", "packaged_gate_clips", "preset_recipes", "quantize_bundle", "refusal_path",
    "scheme_config", "sensitivity", "source_preset", "tensor_report", "unseen_increase", "weight_tensors",
]
