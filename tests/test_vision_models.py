"""A small CNN and a ViT block lower whole into the etmlx delegate and match eager PyTorch."""

from __future__ import annotations

import torch
from torch import nn

from helpers import assert_matches, export_fn
from backends.mlx.runtime.runner import run


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, stride=1, padding=1, groups=2), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AvgPool2d(2), nn.Conv2d(16, 16, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class ViTBlock(nn.Module):
    """Patch embedding, class token, position embedding and one pre-norm transformer block."""

    def __init__(self, dim=32, heads=4, patch=4, image=16):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.1)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], 1) + self.pos
        h = self.norm1(tokens)
        tokens = tokens + self.attn(h, h, h, need_weights=False)[0]
        return tokens + self.mlp(self.norm2(tokens))


def _randomize_batch_norm_stats(model):
    """Running statistics away from (0, 1), so a normalization mistake changes the result."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)


def test_small_cnn_lowers_whole_and_matches_eager():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    _randomize_batch_norm_stats(model)
    x = torch.randn(2, 3, 16, 16)
    result = export_fn(model, [x])
    assert result.ops_outside == 0, result.summary()
    with torch.no_grad():
        assert_matches(run(result.pte, [x]), [model(x)])


def test_vit_block_lowers_whole_and_matches_eager():
    torch.manual_seed(0)
    model = ViTBlock().eval()
    x = torch.randn(2, 3, 16, 16)
    result = export_fn(model, [x])
    assert result.ops_outside == 0, result.summary()
    with torch.no_grad():
        assert_matches(run(result.pte, [x]), [model(x)])
