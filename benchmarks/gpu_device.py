"""Runs a GPU kit (benchmarks/gpu_kit.py) on the GPU host: etmlx's C++ tools on the GPU and the CPU, and mlx-lm on
the GPU, in one process tree, and prints one table (JSON of everything with --json).

Needs only python3 with numpy, mlx (a CUDA or Metal build) and mlx-lm: it imports nothing of etmlx, so
it runs where the exporter cannot (no torch 2.13, no ExecuTorch Python). `--bin DIR` holds `etmlx_bench`
and `etmlx_decode`; their libraries come from LD_LIBRARY_PATH (docs/cpp-tools.md, "Carrying binaries to a
GPU host").

    python3 benchmarks/gpu_device.py KIT [--bin BIN] [--json OUT.json] [--dot DIR]   (BIN: KIT/bin by default)

For each decoder: etmlx_bench (prefill and decode tok/s) with ETMLX_DEVICE=gpu and =cpu; greedy and seeded
tokens from etmlx_decode on both devices (equal tokens, or the first step where they part); mlx-lm's
generate_step on the same directory on the GPU (prefill, decode tok/s, greedy tokens against etmlx's).
For each sampler program: median call time on both devices over the kit's logits, the token each returned
(equal across devices unless two candidates' noisy scores tie within rounding), mlx-lm's make_sampler with
the same settings on the GPU, and the one-read floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def tool(bin_dir: Path, name: str, args: list[str], device: str, timeout: float = 600) -> dict:
    env = dict(os.environ, ETMLX_DEVICE=device)
    done = subprocess.run([str(bin_dir / name), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} on {device}: exit {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    # benchmarks/timing.py's timer, repeated on purpose: this script imports nothing of etmlx (timing.py imports
    # torch, which a GPU host may lack).
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_mlx_lm_model(config: dict):
    """mlx-lm's model class for `config`, 4-bit as its "quantization" says, with its own random weights."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    q = config["quantization"]
    nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    mx.eval(model.parameters())
    return model


def mlx_lm_model(source, device: str):
    """mlx-lm's model on `device`; source: an mlx-lm directory, or a config dict (random weights: timings only)."""
    import mlx.core as mx
    import mlx_lm

    mx.set_default_device(getattr(mx, device))
    return random_mlx_lm_model(source) if isinstance(source, dict) else mlx_lm.load(str(source))[0]


def mlx_lm_decoder(model, prompt: list[int], steps: int, runs: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)
    prefill, decode, tokens = [], [], None
    for run in range(runs + 1):  # the first run warms up (kernel compilation)
        stream = generate_step(mx.array(prompt), model, max_tokens=steps + 1, sampler=sampler)
        t0 = time.perf_counter()
        got = [int(next(stream)[0])]
        t1 = time.perf_counter()
        got += [int(next(stream)[0]) for _ in range(steps)]
        t2 = time.perf_counter()
        stream.close()
        mx.synchronize()
        if run:
            prefill.append(len(prompt) / (t1 - t0))
            decode.append(steps / (t2 - t1))
        tokens = got
    return {"prefill_tokens_per_s": statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode),
            "tokens": tokens}


def node_kinds(dot: Path) -> dict[str, int]:
    """How many nodes of each MLX primitive a Graphviz file of one step holds (MLX's export_to_dot and the
    runtime's ETMLX_DOT both label a node with its primitive's name first): on a GPU, roughly the kernels a
    step launches, which is what bounds a host-bound decode step."""
    import re

    kinds: dict[str, int] = {}
    for name in re.findall(r'label ="([A-Za-z]+)', dot.read_text()):
        kinds[name] = kinds.get(name, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def mlx_lm_step_dot(model, prompt: list[int], path: Path) -> None:
    """One greedy decode step of mlx-lm (after the prompt's prefill) as Graphviz: its logits' argmax and the
    cache it writes, unevaluated."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)
    arrays = lambda: [a for c in cache for a in c.state if isinstance(a, mx.array)]  # noqa: E731 (state ends in ints)
    mx.eval(token, *arrays())
    token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
    mx.export_to_dot(str(path), token, *arrays())
    mx.eval(token)


def step_graphs(kit: Path, bin_dir: Path, item: dict, device: str, dot_dir: Path, model) -> dict:
    """Node kinds of one decode step: etmlx's (ETMLX_DOT of etmlx_bench's last call, a decode step) and
    mlx-lm's (`model`, on `device`)."""
    pte = str(kit / item["pte"])
    etmlx_dot, mlx_lm_dot = dot_dir / f"{item['name']}-etmlx-{device}.dot", dot_dir / f"{item['name']}-mlx_lm-{device}.dot"
    env = dict(os.environ, ETMLX_DEVICE=device, ETMLX_DOT=str(etmlx_dot))
    subprocess.run([str(bin_dir / "etmlx_bench"), pte, "--prompt-len", str(len(item["prompt_ids"])),
                    "--decode-steps", "4", "--runs", "1"], env=env, capture_output=True, check=True, timeout=600)
    mlx_lm_step_dot(model, item["prompt_ids"], mlx_lm_dot)
    out = {}
    for engine, path in (("etmlx", etmlx_dot), ("mlx_lm", mlx_lm_dot)):
        kinds = node_kinds(path)
        out[engine] = {"nodes": sum(kinds.values()), "kinds": kinds}
    return out


def run_decoder(kit: Path, bin_dir: Path, item: dict, runs: int, devices: list[str], dot_dir: Path | None = None) -> dict:
    pte = str(kit / item["pte"])
    prompt = item["prompt_ids"]
    steps = item["decode_steps"]
    ids = ",".join(map(str, prompt))
    out = {"name": item["name"], "kind": "decoder", "parameters": item["parameters"]}
    for device in devices:
        out[f"bench_{device}"] = tool(bin_dir, "etmlx_bench", [pte, "--prompt-len", str(len(prompt)),
                                                               "--decode-steps", str(steps), "--runs", str(runs + 1)],
                                      device)
        out[f"greedy_{device}"] = tool(bin_dir, "etmlx_decode", [pte, "--prompt-ids", ids, "--max-tokens",
                                                                 str(steps + 1), "--json"], device)["tokens"]
        s = item["sampled"]
        out[f"sampled_{device}"] = tool(bin_dir, "etmlx_decode", [
            pte, "--prompt-ids", ids, "--max-tokens", str(steps + 1), "--json", "--temperature", str(s["temperature"]),
            "--seed", str(s["seed"])], device)["tokens"]
        if "speculative" in item:  # the --draft-tokens export of the same weights: the plain tokens, faster
            out[f"speculative_{device}"] = speculative(kit / item["speculative"], len(prompt), steps, runs, device,
                                                       bin_dir, out[f"bench_{device}"])
    first, last = devices[0], devices[-1]
    out["greedy_cpu_gpu_agree"] = common_prefix(out[f"greedy_{first}"], out[f"greedy_{last}"])
    out["sampled_cpu_gpu_agree"] = common_prefix(out[f"sampled_{first}"], out[f"sampled_{last}"])
    same_weights = "mlx_lm_dir" in item
    model = mlx_lm_model(kit / item["mlx_lm_dir"] if same_weights else item["mlx_lm_config"], first)
    out["mlx_lm"] = mlx_lm_decoder(model, prompt, steps, runs)
    out["mlx_lm_agree_with_etmlx"] = common_prefix(out[f"greedy_{first}"], out["mlx_lm"]["tokens"]) \
        if same_weights else None
    if dot_dir is not None:
        out["step_graph"] = step_graphs(kit, bin_dir, item, first, dot_dir, model)
    return out


def speculative(pte: Path, prompt_len: int, steps: int, runs: int, device: str, bin_dir: Path, plain: dict) -> dict:
    """Decode tok/s of a draft-verifying program with its own greedy continuation as the prediction and without
    drafts, and each over the plain program's (`plain`: its etmlx_bench result on this device). etmlx_bench
    checks every run against its cold run's tokens; their sum must equal the plain program's too."""
    # Rates per sequence (tokens after the first call over the time after it): a plain program's
    # decode_tokens_per_s is its median call, which a call bringing several tokens cannot be compared with.
    out = {"plain_tokens_per_s": plain["sequence_tokens_per_s"]}
    for source in ("prediction", "none"):
        r = tool(bin_dir, "etmlx_bench", [str(pte), "--prompt-len", str(prompt_len), "--decode-steps", str(steps),
                                          "--runs", str(runs + 1), "--drafts", source], device)
        if r["token_sum"] != plain["token_sum"]:
            raise RuntimeError(f"{pte.name} with {source} drafts decoded other tokens than the plain program on {device}")
        out[source] = {"tokens_per_s": r["sequence_tokens_per_s"], "draft": r["draft"],
                       "vs_plain": r["sequence_tokens_per_s"] / plain["sequence_tokens_per_s"],
                       "decode_ms": r["decode"], "decode_host": r.get("decode_host")}  # where a call's time goes
    return out


def run_sampler(kit: Path, bin_dir: Path, item: dict, calls: int, devices: list[str]) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.sample_utils import make_sampler

    out = {"name": item["name"], "kind": "sampler", "vocab": item["vocab"], "batch": item["batch"]}
    flags = ["--calls", str(calls), "--warmup", "5"]
    for device in devices:
        r = tool(bin_dir, "etmlx_bench", [str(kit / item["pte"]), "--inputs", str(kit / item["inputs"]), *flags], device)
        out[f"etmlx_{device}_ms"] = r["call"]["median_ms"]
        out[f"tokens_{device}"] = r["output0"]
        out[f"read_{device}_ms"] = tool(bin_dir, "etmlx_bench", [str(kit / item["reader"]), "--inputs",
                                                                  str(kit / item["reader_inputs"]), *flags],
                                        device)["call"]["median_ms"]
    mx.set_default_device(getattr(mx, devices[0]))
    z = mx.array(np.load(kit / item["logits"]))
    sampler = make_sampler(temp=item["temperature"], top_p=item["top_p"], top_k=item["top_k"])
    # As mlx-lm's generate_step calls it: log-probabilities in, and the token read back to the host.
    out["mlx_lm_ms"] = median_ms(lambda: sampler(z - mx.logsumexp(z, axis=-1, keepdims=True)).tolist(), calls)
    # MLX's own floor on this device: one max over logits already there, and over logits sent from the host
    # each call (as a program's input is).
    host = np.load(kit / item["logits"])
    out["mlx_read_ms"] = median_ms(lambda: mx.max(z, axis=-1).tolist(), calls)
    out["mlx_upload_read_ms"] = median_ms(lambda: mx.max(mx.array(host), axis=-1).tolist(), calls)
    out["tokens_cpu_gpu_equal"] = out[f"tokens_{devices[0]}"] == out[f"tokens_{devices[-1]}"]
    return out


def table(results: list[dict], devices: list[str]) -> str:
    first, last = devices[0], devices[-1]
    lines = [f"decoders (tok/s, prefill/decode; agree: leading tokens equal, {first} vs {last}; mlx-lm on {first})",
             f"{'program':<15}" + "".join(f"{'etmlx ' + d:>20}" for d in devices) + f"{'mlx-lm':>20}"
             f"{'/mlx-lm':>9}{'greedy agree':>14}{'seeded agree':>14}{'mlx-lm agree':>14}"]
    for r in results:
        if r["kind"] != "decoder":
            continue
        m, n = r["mlx_lm"], len(r[f"greedy_{first}"])
        lines.append(f"{r['name']:<15}" + "".join(
            f"{r['bench_' + d]['prefill_tokens_per_s']:>11.0f}/{r['bench_' + d]['decode_tokens_per_s']:<8.1f}"
            for d in devices) + f"{m['prefill_tokens_per_s']:>11.0f}/{m['decode_tokens_per_s']:<8.1f}"
            f"{r['bench_' + first]['decode_tokens_per_s'] / m['decode_tokens_per_s']:>8.2f}x"
            f"{r['greedy_cpu_gpu_agree']:>10}/{n:<3}{r['sampled_cpu_gpu_agree']:>10}/{n:<3}"
            + (f"{r['mlx_lm_agree_with_etmlx']:>10}/{n:<3}" if r["mlx_lm_agree_with_etmlx"] is not None
               else f"{'(own weights)':>14}"))
    for r in results:
        g = r.get("step_graph")
        if g:
            top = lambda kinds: ", ".join(f"{k} {n}" for k, n in list(kinds.items())[:8])  # noqa: E731
            lines.append(f"{r['name']:<15}one decode step on {first}: etmlx {g['etmlx']['nodes']} nodes ({top(g['etmlx']['kinds'])}); "
                         f"mlx-lm {g['mlx_lm']['nodes']} ({top(g['mlx_lm']['kinds'])})")
    lines.append(f"speculative decoding, K = 8, greedy (decode tok/s; prediction = the program's own continuation)")
    for r in results:
        for d in devices:
            s = r.get(f"speculative_{d}")
            if s:
                lines.append(f"{r['name']:<15}{d:>5}  plain {s['plain_tokens_per_s']:>8.1f}  prediction "
                             f"{s['prediction']['tokens_per_s']:>8.1f} (x{s['prediction']['vs_plain']:.2f}, "
                             f"{s['prediction']['draft']['accepted']}/{s['prediction']['draft']['proposed']} accepted)"
                             f"  none {s['none']['tokens_per_s']:>8.1f} (x{s['none']['vs_plain']:.2f})")
    lines += [f"samplers (median ms per call, T=0.8; mlx-lm and ratios on {first}; tokens equal {first} vs {last})",
              f"{'program':<30}" + "".join(f"{'etmlx ' + d:>11}{'read ' + d:>10}" for d in devices)
              + f"{'mlx-lm':>9}{'/mlx-lm':>8}{'/read':>7}{'tokens':>8}{'mlx read':>9}{'+upload':>8}"]
    for r in results:
        if r["kind"] != "sampler":
            continue
        lines.append(f"{r['name']:<30}" + "".join(f"{r['etmlx_' + d + '_ms']:>11.3f}{r['read_' + d + '_ms']:>10.3f}"
                                                  for d in devices)
                     + f"{r['mlx_lm_ms']:>9.3f}{r['etmlx_' + first + '_ms'] / r['mlx_lm_ms']:>8.2f}"
                     f"{r['etmlx_' + first + '_ms'] / r['read_' + first + '_ms']:>7.2f}"
                     f"{'equal' if r['tokens_cpu_gpu_equal'] else 'DIFFER':>8}"
                     f"{r['mlx_read_ms']:>9.3f}{r['mlx_upload_read_ms']:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kit", type=Path)
    p.add_argument("--bin", type=Path, help="directory with etmlx_bench and etmlx_decode (default: KIT/bin, where "
                   "`etmlx bench gpu-kit --with-binaries` puts them)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--runs", type=int, default=4, help="timed decoder runs (after one warm-up)")
    p.add_argument("--calls", type=int, default=50, help="timed sampler calls")
    p.add_argument("--only", choices=["decoder", "sampler"], help="one kind of item")
    p.add_argument("--devices", default="gpu,cpu", help="comma-separated ETMLX_DEVICE values; mlx-lm runs on the first")
    p.add_argument("--dot", type=Path, help="write one decode step's graph of etmlx and of mlx-lm (first device) here "
                   "and count its nodes by kind")
    a = p.parse_args(argv)
    devices = a.devices.split(",")
    a.bin = a.bin or a.kit / "bin"
    if not (a.bin / "etmlx_bench").is_file():
        p.error(f"no etmlx_bench in {a.bin}: pass --bin, or make the kit with `etmlx bench gpu-kit --with-binaries`")
    if a.dot:
        a.dot.mkdir(parents=True, exist_ok=True)
    items = json.loads((a.kit / "manifest.json").read_text())["items"]
    results = []
    for item in items:
        if a.only and item["kind"] != a.only:
            continue
        t0 = time.perf_counter()
        try:
            r = run_decoder(a.kit, a.bin, item, a.runs, devices, a.dot) if item["kind"] == "decoder" else \
                run_sampler(a.kit, a.bin, item, a.calls, devices)
        except Exception as e:  # one broken item must not lose the others' figures
            r = {"name": item["name"], "kind": "error", "error": f"{type(e).__name__}: {e}"}
            print(f"{item['name']}: {r['error']}", file=sys.stderr)
        results.append(r)
        print(f"{item['name']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
    print(table(results, devices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
