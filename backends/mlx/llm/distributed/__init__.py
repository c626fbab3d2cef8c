"""Tensor-parallel programs over MLX's distributed layer: sharding a model per rank (shard.py), exporting one
file per rank (llm/decoder/tensor_parallel.py), naming them (rank_files.py) and starting the ranks of a run (launch.py).
docs/distributed.md says how to use them."""
