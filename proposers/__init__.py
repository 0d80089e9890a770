"""Engine-agnostic proposers (no vLLM import)."""
