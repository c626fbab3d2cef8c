"""LoRA adapters: read (mlx-lm's and PEFT's layouts) and fused into a loaded model before export."""
