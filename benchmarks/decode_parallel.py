"""`etmlx bench decode --tensor-parallel N` / `--pipeline-parallel N`: an N-rank program against the one-rank
program, in one run.

One random Llama (SHAPE: 8 layers of hidden 512, tied embedding of 4096 rows, so ~8% of the weights are
replicated, about what a 7B model replicates; QUICK: a tiny one), exported as one rank and as N ranks (float32; tensor parallel: every layer sharded, llm/distributed/shard.py;
pipeline parallel: a block of layers per rank, llm/distributed/pipeline.py).
Each program runs in its own processes (the N ranks over the loopback, MLX's ring backend, as `etmlx generate`
starts them), loads, prefills the same prompt and decodes `steps` greedy tokens twice (a warm-up, then timed).
Reported, per rank and for the one-rank program:
  weight bytes     MLX's active memory after the load (the weights and the KV cache), and its ratio to one rank's
  decode tok/s     steps / time after the first token; the N-rank / one-rank ratio
  bytes sent/token what the rank's TCP sockets (the ring's) sent during the timed decode (TCP_INFO bytes acked
                   by the peer), per token, against the floor: tensor parallel, the all-sums' 2 x layers x
                   2 (N-1)/N x hidden x 4 B; pipeline parallel, one hidden state (hidden x 4 B) to the next rank
                   (none from the last) plus the logits' all-sum, 2 (N-1)/N x vocab x 4 B
  collectives      (tensor parallel) the time 2 x layers all_sums of one token's hidden state take alone
                   (mx.distributed.all_sum on the same group, evaluated one by one as the decode's chain does)
The ranks must produce the one-rank program's tokens (checked). On this 2-core host N ranks share the cores, so
N ranks are expected slower than one; the ratio says how much.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, tie_word_embeddings=True)
QUICK_SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True)
PROMPT_LEN = 32

# Runs in each rank's process (and in the one-rank program's): `path`, `prompt`, `steps`, `layers`, `hidden` bound.
RANK = """
import json, time
from pathlib import Path
import mlx.core as mx
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams

def tcp_bytes_sent():
    # Bytes the peers acknowledged on this process's TCP sockets (struct tcp_info's tcpi_bytes_acked, offset 120):
    # what the ring backend sent; on the loopback every byte is acknowledged within the step.
    import os, socket, struct
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
                total += struct.unpack_from("Q", info, 120)[0]
    return total

decoder = Decoder(Path(path))
active = mx.get_active_memory()
list(decoder.stream(prompt, steps, SamplingParams(), stop_at_eos=False))  # warm-up
times, tokens, io = [], [], []
for step in decoder.stream(prompt, steps, SamplingParams(), stop_at_eos=False):
    times.append(time.perf_counter())
    io.append(tcp_bytes_sent())
    tokens.append(step.token)
result = dict(active=active, tokens=tokens, decode_tps=(steps - 1) / (times[-1] - times[0]),
              sent_per_token=(io[-1] - io[0]) / (steps - 1))
group = mx.distributed.init()
if group.size() > 1 and split == "tensor":
    x = mx.zeros((1, 1, hidden), dtype=mx.float32)
    mx.eval(mx.distributed.all_sum(x, group=group))
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(2 * layers):
            x = mx.distributed.all_sum(x, group=group) * 0.5
            mx.eval(x)
    result["collective_s_per_token"] = (time.perf_counter() - start) / steps
print("RESULT " + json.dumps(result))
"""


def _export(shape: dict, ranks: int, out: Path, max_seq_len: int, log, split: str) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.decoder.pipeline_parallel import export_pipeline_parallel
    from backends.mlx.llm.decoder.tensor_parallel import export_tensor_parallel

    out.mkdir(parents=True, exist_ok=True)
    one, tp = out / "one.pte", out / f"{split}{ranks}.pte"
    if one.is_file() and tp.is_file():
        return one, tp
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=4 * max_seq_len, bos_token_id=None,
                                         eos_token_id=None)).eval()
    log(f"exporting the one-rank program and the {ranks}-rank {split}-parallel one into {out}")
    if not one.is_file():
        export_decoder(model, one, max_seq_len, verify=False)
    export = export_tensor_parallel if split == "tensor" else export_pipeline_parallel
    export(model, tp, ranks, max_seq_len=max_seq_len, verify=False)
    return one, tp


def _run(files: list[Path], shape: dict, prompt: list[int], steps: int, split: str = "tensor",
         timeout: float = 900) -> list[dict]:
    """RANK in one process per file; as ranks of one group over the loopback when there are several."""
    from backends.mlx.llm.distributed.hosts import loopback_hostfile

    with tempfile.TemporaryDirectory(prefix="etmlx-bench-tp-") as tmp:
        hosts = loopback_hostfile(len(files), Path(tmp)) if len(files) > 1 else None
        procs = []
        for rank, path in enumerate(files):
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
            env["PYTHONPATH"] = str(ROOT)
            if hosts is not None:
                env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts))
            code = (f"path, prompt, steps, split = {str(path)!r}, {prompt!r}, {steps}, {split!r}\n"
                    f"layers, hidden = {shape['num_hidden_layers']}, {shape['hidden_size']}\n{RANK}")
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        results = []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                out, err = "", f"no result within {timeout:g} s"
            if proc.returncode != 0:  # the others would wait for it in their next collective
                for other in procs:
                    other.kill()
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = err.strip().splitlines()[-1:] or [f"status {proc.returncode}"]
                raise RuntimeError(f"rank {rank} of {len(files)} failed: {tail[0]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
        return results


def _floors(shape: dict, ranks: int, split: str) -> list[int]:
    """Per rank, the bytes it must send per decode token over a ring (docstring)."""
    share = 2 * (ranks - 1) / ranks  # of an all-summed array, sent by each rank (reduce-scatter + all-gather)
    if split == "tensor":
        return [round(2 * shape["num_hidden_layers"] * share * shape["hidden_size"] * 4)] * ranks
    logits = round(share * shape["vocab_size"] * 4)
    return [logits + (shape["hidden_size"] * 4 if r < ranks - 1 else 0) for r in range(ranks)]


def run(ranks: int = 2, quick: bool = False, steps: int | None = None, cache_dir: str = "out/bench", log=print,
        split: str = "tensor") -> dict:
    from backends.mlx.llm.distributed.rank_files import rank_file

    if split not in ("tensor", "pipeline"):
        raise ValueError(f"split must be tensor or pipeline, got {split!r}")
    if ranks < 2:
        raise ValueError(f"--{split}-parallel must be >= 2, got {ranks}")
    if split == "pipeline" and ranks > (QUICK_SHAPE if quick else SHAPE)["num_hidden_layers"]:
        raise ValueError(f"--pipeline-parallel {ranks}: the benchmark's model has fewer layers than that")
    shape = QUICK_SHAPE if quick else SHAPE
    steps = steps or (16 if quick else 64)
    max_seq_len = PROMPT_LEN + 2 * steps + 16
    name = "quick" if quick else "llama-512x8"
    one, tp = _export(shape, ranks, Path(cache_dir) / "parallel" / f"{name}-{max_seq_len}", max_seq_len, log, split)
    prompt = torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    log("decoding with one rank")
    (alone,) = _run([one], shape, prompt, steps, split)
    log(f"decoding with {ranks} ranks over the loopback")
    per_rank = _run([rank_file(tp, r) for r in range(ranks)], shape, prompt, steps, split)
    for rank, result in enumerate(per_rank):
        if result["tokens"] != alone["tokens"]:
            raise RuntimeError(f"rank {rank} decoded other tokens than the one-rank program")
    floors = _floors(shape, ranks, split)
    return dict(
        machine=f"{platform.machine()} {os.cpu_count()} cores", shape=shape, split=split, ranks=ranks, steps=steps,
        one_rank=dict(active_bytes=alone["active"], decode_tps=round(alone["decode_tps"], 1),
                      file_bytes=one.stat().st_size),
        per_rank=[dict(rank=r, active_bytes=res["active"], weight_ratio=round(res["active"] / alone["active"], 3),
                       file_bytes=rank_file(tp, r).stat().st_size, decode_tps=round(res["decode_tps"], 1),
                       bytes_sent_per_token=round(res["sent_per_token"]), floor_bytes_per_token=floors[r],
                       **({"collective_ms_per_token": round(1e3 * res["collective_s_per_token"], 3)}
                          if "collective_s_per_token" in res else {}))
                  for r, res in enumerate(per_rank)],
        decode_ratio=round(per_rank[0]["decode_tps"] / alone["decode_tps"], 3),
        tokens_agree=True)


def format_report(report: dict) -> str:
    one = report["one_rank"]
    lines = [f"{report['split']} parallel, {report['ranks']} ranks over the loopback ({report['machine']}), "
             f"{report['steps']} greedy steps, tokens equal to the one-rank program's",
             f"one rank: {one['active_bytes'] / 1e6:.1f} MB after load, {one['decode_tps']} tok/s"]
    for r in report["per_rank"]:
        line = (f"rank {r['rank']}: {r['active_bytes'] / 1e6:.1f} MB ({r['weight_ratio']:.3f}x one rank), "
                f"{r['decode_tps']} tok/s, {r['bytes_sent_per_token']} B sent/token (floor {r['floor_bytes_per_token']} B)")
        if "collective_ms_per_token" in r:
            line += f", all_sums alone {r['collective_ms_per_token']} ms/token"
        lines.append(line)
    lines.append(f"{report['ranks']}-rank / one-rank decode: {report['decode_ratio']:.3f}x")
    return "\n".join(lines)


def main(json_path: str | None = None, ranks: int = 2, quick: bool = False, steps: int | None = None,
         cache_dir: str = "out/bench", split: str = "tensor") -> int:
    report = run(ranks, quick, steps, cache_dir, split=split)
    print(format_report(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0
