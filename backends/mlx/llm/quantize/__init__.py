"""Quantized weights for decoder export: MLX's affine scheme (quantize a float model, or load an
mlx-lm quantized checkpoint as it is)."""
