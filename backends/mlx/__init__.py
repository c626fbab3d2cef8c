"""etmlx: an ExecuTorch delegate that runs programs on MLX."""
