"""Checkpoint formats of other tools: Hugging Face transformers (`mllm.interop.hf`)."""
