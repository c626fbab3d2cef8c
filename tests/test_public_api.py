"""The public Python API is `etmlx`: every documented name resolves, and the README's "Bring your own model"
example runs as written and samples what the eager model's logits say."""

from __future__ import annotations

import pytest
import torch

import etmlx
from etmlx.runtime import load_method


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(dim=1))  # [B, V] logits


def test_every_public_name_resolves():
    for name in etmlx.__all__:
        assert getattr(etmlx, name) is not None, name
    assert set(etmlx.__all__) <= set(dir(etmlx))


def test_the_readme_example_exports_and_samples(tmp_path):
    from etmlx import SamplingHead, export_program

    my_model = TinyLM().eval()
    ids = torch.tensor([[3, 5, 7, 11]])
    head = SamplingHead(my_model)
    program = export_program(head, (ids,), {"temperature": torch.tensor(0.8), "seed": torch.tensor(0)})
    program.save(tmp_path / "model.pte")
    assert "0 ops outside the etmlx delegate" in program.summary()

    method = load_method(tmp_path / "model.pte")
    greedy = method.execute([ids, torch.tensor(0.0), torch.tensor(0)])[0]
    assert greedy.tolist() == my_model(ids).argmax(-1).tolist()  # temperature 0: the eager argmax
    seeded = [method.execute([ids, torch.tensor(0.8), torch.tensor(s)])[0].item() for s in range(32)]
    again = [method.execute([ids, torch.tensor(0.8), torch.tensor(s)])[0].item() for s in range(32)]
    assert seeded == again and len(set(seeded)) > 1  # seeds repeat exactly; they do sample


def _tiny_llama(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.checkpoints import save_tokenizer

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    save_tokenizer(config.vocab_size, directory)
    return directory


def test_bad_export_options_name_the_keyword(tmp_path):
    with pytest.raises(ValueError, match="^quantize must be one of int4, int8, got 'int3'$"):
        etmlx.export(tmp_path, tmp_path / "m.pte", quantize="int3")
    with pytest.raises(ValueError, match="^draft_tokens must be >= 0"):
        etmlx.export(tmp_path, tmp_path / "m.pte", draft_tokens=-1)


@pytest.mark.slow
def test_export_writes_what_the_cli_writes(tmp_path):
    """etmlx.export is `etmlx export --model`: the program checks itself against the eager model on export
    (verify), and the same options give the same greedy tokens as the command's program."""
    from backends.mlx.cli.main import main

    source = _tiny_llama(tmp_path / "ckpt")
    etmlx.export(source, tmp_path / "api.pte", quantize="int8", max_seq_len=64)
    assert main(["export", "--model", str(source), "--out", str(tmp_path / "cli.pte"), "--quantize", "int8",
                 "--max-seq-len", "64"]) == 0
    prompt = [5, 17, 99, 3]
    api = etmlx.generate(etmlx.load(tmp_path / "api.pte"), prompt, max_tokens=12)
    cli = etmlx.generate(etmlx.load(tmp_path / "cli.pte"), prompt, max_tokens=12)
    assert api == cli and len(api) > 0
