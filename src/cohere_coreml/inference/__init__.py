"""Inference: transcribe with a bundle (or the PyTorch reference behind the same interface).

Takes: a `Bundle` and audio (files, arrays, or live chunks).
Gives: transcripts, per window and per file, with word timings when asked; streaming partials and finals.
May import: bundle, model, storage, runtime (and the top-level config, export_errors and cli_options).

    transcribe       `Transcriber`: audio -> windows -> encoder -> stateful decoder -> text (`transcribe`)
    encoder_runtime  the encoder's functions (length buckets, parts) called with the host's length masks
    decoder_runtime  the decoder's functions on one state (bind, step, prefill, extend; host state writes)
    decoding         greedy and beam search, the repetition guard, stop reasons
    engines          one transcriber interface: the PyTorch reference and a bundle
    longform         files longer than a window: checked first, streamed in windows
    streaming        live transcription: partial and final text while audio arrives
    alignment        word timings from cross-attention: the rule (normalise, DTW, tokens -> words, times)
    words            a window's words on the audio's timeline (the rule on its attention, clamped to it)
    subtitles        SRT / WebVTT cues from word timings
    vad              speech probabilities per 32 ms chunk: the bundle's vad.mlpackage or the PyTorch module
"""
