"""Deterministic ONNX builders for the SOUFFLE evaluation models (paper and tiny test configurations)."""
