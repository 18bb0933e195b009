"""Export: a checkpoint in, parity-gated Core ML packages out (`cohere-coreml export`).

Takes: a checkpoint (`cohere_coreml.model.checkpoint`) and export settings.
Gives: frontend.mlpackage, encoder.mlpackage (+ parts), decoder.mlpackage, each installed only when
its gate passed, and the bundle's manifest written from them (`cohere_coreml.bundle.manifest`).
May import: inference (the gates run the packages through its runtimes), bundle, model, storage,
runtime (and the top-level config and export_errors).

    pipeline          the orchestrator: plan, each component staged and gated, the bundle written
    convert           the shared converter (trace, convert, metadata, merge of functions)
    multifunction     single-function packages merged into one, a tensor at a time
    frontend          the front-end package (16 kHz samples -> input_features)
    encoder           the encoder's traced module, conversion and gate cases
    encoder_packages  the encoder's package(s) written, gated, installed: buckets and parts
    decoder_modules   the PyTorch modules traced for each decoder function
    decoder           the stateful decoder package: tracing, conversion, staging
    decoder_gate      the decoder's gate: teacher forcing against `transformers`, negative controls
    gate              one gate interface for every component (`stage_gated`, `GateReport`)
    parity            parity arithmetic (PSNR, errors, the near-tie rule)
    memory            the heap a freed model leaves, handed back between stages
    alignment_heads   the cross-attention heads word timings read: chosen on a calibration set, gated
"""

