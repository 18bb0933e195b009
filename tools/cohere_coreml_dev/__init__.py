"""Development-only code of cohere-transcribe-coreml: the demo model's training and synthetic
speech, tiny checkpoints and tokenizers for tests. Imported by tests/ and tools/ scripts (which put
`tools/` on sys.path); never by the product package `cohere_coreml`, and not in its wheel.
"""
