"""Benchmarks (`etmlx bench ...`): each prints ratios against baselines measured in the same run."""
