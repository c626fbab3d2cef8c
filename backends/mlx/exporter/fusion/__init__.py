"""Pattern matching that replaces common transformer subgraphs with fused MLX nodes (plan.py)."""
