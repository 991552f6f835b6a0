"""Model directories: resolving the configured one, the embedded tiny model and its SFT, the vLLM engine factory."""
