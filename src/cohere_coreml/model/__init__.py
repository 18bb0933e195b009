"""The model: a Cohere Transcribe checkpoint and what the host computes around the network.

Takes: a checkpoint folder or Hub id, audio files or samples.
Gives: the `transformers` model and processor (the reference, never re-implemented), log-mel
features, the exported programs' static shapes and length masks, decoder prompts and detokenised text.
May import: storage, runtime (and the top-level config and export_errors).

    checkpoint  load and describe a checkpoint (safetensors only, no remote code): `info`, `vocab`
    layer_stream  the reference with its encoder layers read from the checkpoint while used (the export's memory)
    reference   the PyTorch reference of the cross-attention memory (what the encoder package outputs)
    alignment_reference  the reference's teacher-forced cross-attention per layer and head (word timings)
    audio       load audio; the features `CohereAsrFeatureExtractor` computes (`mel`)
    shapes      windows, buckets, frames and the length masks, in one place
    tokens      prompts, decoding of generated ids, vocab.json
    silero      Silero VAD's network from the pinned silero-vad package's weights; the package's model as oracle
"""
