"""Analyses and rewrites over tensor-expression programs, independent of ONNX."""
