"""Cohere Transcribe -> Core ML conversion toolkit."""
__version__ = "0.1.0"
