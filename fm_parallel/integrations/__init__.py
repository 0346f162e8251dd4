"""Integrations with other libraries (transformers; DeepSpeed to come)."""
