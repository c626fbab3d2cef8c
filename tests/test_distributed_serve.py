"""`etmlx serve` of a 2-rank tensor-parallel program (serve/rank_group.py, docs/distributed.md): the server starts
the ranks over the loopback and feeds each the same calls; greedy and seeded completions equal the one-rank
program's tokens (the Python Decoder, what `etmlx generate` runs); the prompt cache and structured output work
unchanged; a rank killed or stopped mid-stream ends that stream with an error, /health is 503 while the group is
down, the group is restarted and the next request gets the same tokens; a rank holding the wrong file is refused at
startup in one line; the group's check that every rank sampled rank 0's tokens (fake ranks). Tiny Llama (hidden
64, 2 layers), one export per module."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.tensor_parallel import export_tensor_parallel
from backends.mlx.llm.distributed.launch import run_ranks
from backends.mlx.llm.distributed.rank_files import rank_file
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.llm.distributed.hosts import RankPlacement, loopback_hostfile
from backends.mlx.serve.app import ServeLimits, ServerThread, load_service
from backends.mlx.serve.program_worker import _HEADER, WorkerDied, _encode
from backends.mlx.serve.rank_group import RankGroup
from free_ports import consecutive_free_ports
from serve_helpers import MAX_SEQ_LEN, stream_in_thread, tiny_pte, wait_for

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

TOKENS = 12
PROMPT_TEXT = "Once upon a time"
RANK_TIMEOUT = 5.0
CONFIG = SamplerConfig(top_k=True, logprobs=1, logit_bias=2, allowed_mask=True)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """(one-rank .pte, 2-rank .pte, tokenizer) of the tiny Llama: the serving tests' shared export (tiny_pte) and
    the same model (tiny_llama's seed) split over 2 ranks, with the mask input for structured output. The one-rank
    program's other sampler features draw nothing for these requests: its tokens are the reference."""
    tokenizer = train_tokenizer()
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id)
    tp = tmp_path_factory.mktemp("tp_serve") / "tp.pte"
    export_tensor_parallel(model, tp, 2, max_seq_len=MAX_SEQ_LEN, verify=False, config=CONFIG, batch=2,
                           tokenizer=tokenizer)
    return tiny_pte(tmp_path_factory), tp, tokenizer


@pytest.fixture(scope="module")
def server(programs, tmp_path_factory):
    # --hostfile's fixed loopback ports: a restarted group binds the same ports again (free ports: tested below)
    hosts = loopback_hostfile(2, tmp_path_factory.mktemp("hosts"))
    srv = ServerThread(programs[1], model_name="tp", limits=ServeLimits(rank_timeout=RANK_TIMEOUT),
                       placement=RankPlacement(hosts)).start()
    yield srv
    srv.stop()


def _post(server, body, timeout=60):
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({"model": "tp", **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _health(server) -> int:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _no_eos(tokenizer) -> dict:
    return {str(tokenizer.eos_token_id): -100}


def _served(server, tokenizer, **sampling) -> list[str]:
    status, body = _post(server, {"prompt": PROMPT_TEXT, "max_tokens": TOKENS, "logprobs": 0,
                                  "logit_bias": _no_eos(tokenizer), **sampling})
    assert status == 200, body
    return body["choices"][0]["logprobs"]["tokens"]


def _alone(one: Path, tokenizer, **sampling) -> list[str]:
    """The one-rank program's tokens (as text pieces) from the Python Decoder, EOS banned as in the request."""
    params = SamplingParams(logit_bias={tokenizer.eos_token_id: -100.0}, **sampling)
    prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return [tokenizer.decode([step.token]) for step in Decoder(one).stream(prompt, TOKENS, params)]


def test_two_ranks_serve_the_one_rank_programs_tokens(programs, server):
    one, _, tokenizer = programs
    greedy, seeded = _alone(one, tokenizer), _alone(one, tokenizer, temperature=1.0, seed=7)
    assert len(greedy) == TOKENS and seeded != greedy  # the seeded run samples: a control the comparison needs
    assert _served(server, tokenizer, temperature=0) == greedy
    # Every rank sampled these tokens too: the group compares each call's token outputs with rank 0's.
    assert _served(server, tokenizer, temperature=1.0, seed=7) == seeded


def test_the_prompt_cache_reuses_a_rows_prefix_on_every_rank(programs, server):
    _, _, tokenizer = programs
    prompt = "The quick brown fox jumps over the lazy dog and then"
    first = _post(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
    again = _post(server, {"prompt": prompt + " it", "max_tokens": 4, "temperature": 0})[1]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(tokenizer.encode(prompt, add_special_tokens=False)) - 1 > 0, (first, again)
    # the cached rows decode as a cold start does: the same request again gives the same text
    assert _post(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]["choices"][0]["text"] == \
        first["choices"][0]["text"]


def test_structured_output_holds_on_two_ranks(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    status, body = _post(server, {"prompt": "Give a number:", "max_tokens": 40, "temperature": 1.0, "seed": 3,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "n", "schema": schema}}})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"])["n"], int)


def _stream(server, tokenizer, events: list) -> threading.Thread:
    """A long streamed completion in a thread; `events` gets ("chunk", data) and finally ("end", error or None)."""
    return stream_in_thread(server.url, {"model": "tp", "prompt": "Hi", "max_tokens": 50, "temperature": 0,
                                         "stream": True, "logit_bias": _no_eos(tokenizer)}, events)


def _wait(condition) -> bool:
    return wait_for(condition, limit=90.0)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_killed_or_stopped_mid_stream_ends_it_and_the_group_restarts(programs, server, how):
    _, _, tokenizer = programs
    before = _served(server, tokenizer, temperature=0)
    supervisor = server.service.engine.program
    restarts, pids = supervisor.restarts, supervisor.worker.pids
    events = []
    thread = _stream(server, tokenizer, events)
    assert _wait(lambda: any(kind == "chunk" for kind, _ in events))
    os.kill(pids[1], signal.SIGSTOP)  # holds the stream mid-way (rank 0 waits in its next all-sum)...
    if how == "kill":
        os.kill(pids[1], signal.SIGKILL)  # ...and then rank 1 dies: seen at once, not after --rank-timeout
    thread.join(120)
    kind, error = events[-1]
    assert kind == "end" and error is not None
    assert ("rank 1 of 2 exited (killed by signal 9)" if how == "kill" else
            f"of 2 within {RANK_TIMEOUT:g} s while running a call") in error, error
    assert _wait(lambda: _health(server) == 503 or supervisor.restarts > restarts)  # down, or already back
    assert _wait(lambda: supervisor.restarts == restarts + 1 and _health(server) == 200)
    assert not set(supervisor.worker.pids) & set(pids)
    assert _served(server, tokenizer, temperature=0) == before


def test_a_rank_holding_another_ranks_file_is_refused_at_startup(programs, tmp_path):
    _, tp, _ = programs
    bad = tmp_path / tp.name
    for path in tp.parent.iterdir():  # the program's files, its metadata and tokenizer beside it
        os.symlink(path, tmp_path / path.name)
    rank_file(bad, 1).unlink()
    os.symlink(rank_file(tp, 0), rank_file(bad, 1))  # rank 1 would load rank 0's part
    with pytest.raises(ValueError) as refused:  # the ranks on free loopback ports
        load_service(bad)
    message = str(refused.value)  # `etmlx serve` prints it as its one error line (cli/main.py)
    assert "\n" not in message
    assert message.startswith("rank 1 of 2: ") and \
        "this file is rank 0's part of the program, but this process is rank 1" in message, message


def test_what_a_rank_group_cannot_serve_is_refused_before_starting(programs, monkeypatch, tmp_path):
    one, tp, _ = programs
    with pytest.raises(ValueError, match="rank 1's file of a 2-rank program: serve rank 0's file"):
        load_service(rank_file(tp, 1))
    with pytest.raises(ValueError, match="--hostfile: .* is a one-rank program"):
        load_service(one, placement=RankPlacement(tmp_path / "h.json"))
    with pytest.raises(ValueError, match="lists 3 ranks but the program runs on 2"):
        (tmp_path / "h.json").write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"], ["127.0.0.1:3"]]))
        load_service(tp, placement=RankPlacement(tmp_path / "h.json"))
    monkeypatch.setenv("MLX_RANK", "0")  # under mlx.launch: each rank's server would have no inputs to run
    with pytest.raises(ValueError, match="starts its ranks itself: run it outside mlx.launch"):
        load_service(tp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")  # a killed child not yet reaped by its shell counts as gone
    return not status.is_file() or "State:\tZ" not in status.read_text()


def test_a_rank_on_another_machine_is_started_there_over_ssh_and_killed_there(programs, tmp_path):
    """mlx.launch's hostfile naming another machine for rank 1: the server starts that rank through the ssh command
    (a stand-in running the remote shell script here with /bin/sh), serves the one-rank tokens, and when the rank
    stops answering kills it on its machine through its pid file and starts the group again there."""
    one, tp, tokenizer = programs
    log = tmp_path / "ssh.log"
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                    {"ssh": "node-b", "ips": ["127.0.0.1"]}]))
    ssh = f"{sys.executable} {Path(__file__).parent / 'fake_ssh.py'} {log}"
    placement = RankPlacement(hostfile, ssh=ssh, starting_port=consecutive_free_ports(2))
    srv = ServerThread(tp, model_name="tp", limits=ServeLimits(rank_timeout=RANK_TIMEOUT),
                       placement=placement).start()
    try:
        assert log.read_text().split() == ["node-b"]  # rank 0 started here, rank 1 through ssh
        greedy = _alone(one, tokenizer)
        assert _served(srv, tokenizer, temperature=0) == greedy
        supervisor = srv.service.engine.program
        remote = supervisor.worker.workers[1]._remote
        pid = int(Path(remote.pidfile).read_text())  # the rank itself, not the ssh client
        assert pid not in supervisor.worker.pids and _alive(pid)
        events = []
        thread = _stream(srv, tokenizer, events)
        assert _wait(lambda: any(kind == "chunk" for kind, _ in events))
        os.kill(pid, signal.SIGSTOP)  # the remote rank stops answering: only its machine can end it
        thread.join(120)
        kind, error = events[-1]
        assert kind == "end" and f"of 2 within {RANK_TIMEOUT:g} s while running a call" in error, error
        assert _wait(lambda: not _alive(pid))  # killed on its machine through the pid file
        assert _wait(lambda: supervisor.restarts == 1 and _health(srv) == 200)
        assert log.read_text().split().count("node-b") >= 3  # start, kill, start again
        assert _served(srv, tokenizer, temperature=0) == greedy
    finally:
        srv.stop()


def test_where_ranks_cannot_run_is_refused_in_one_line(programs, tmp_path):
    _, tp, _ = programs
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "node-a", "ips": ["10.0.0.1"]},
                                    {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]))
    with pytest.raises(ValueError, match="puts rank 0 on node-a: rank 0 runs beside the server"):
        load_service(tp, placement=RankPlacement(hostfile))
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "node-b"}]))
    with pytest.raises(ValueError, match=r"rank 1 \(node-b\) lists no \"ips\" for the ring to use"):
        load_service(tp, placement=RankPlacement(hostfile))
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["192.0.2.7:5001"]]))  # TEST-NET-1: nobody's address
    with pytest.raises(ValueError, match="rank 1 would run here, but 192.0.2.7 is not an address of this machine"):
        load_service(tp, placement=RankPlacement(hostfile))
    hostfile.write_text(json.dumps({"hosts": "node-a"}))
    with pytest.raises(ValueError, match="expected MLX's ring hostfile .* or mlx.launch's"):
        load_service(tp, placement=RankPlacement(hostfile))
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "node-b", "ips": ["b"]}]))
    with pytest.raises(ValueError, match="puts rank 1 on node-b: run ranks on other machines with `mlx.launch"):
        run_ranks(["generate", str(tp)], 2, hostfile)
    # A machine ssh cannot reach: ssh's own reason ends the one line (an ssh that fails as the real one does).
    unreachable = "sh -c 'echo \"ssh: connect to host $0 port 22: Connection refused\" >&2; exit 255'"
    with pytest.raises(OSError) as refused:
        load_service(tp, placement=RankPlacement(hostfile, ssh=unreachable, starting_port=consecutive_free_ports(2)))
    assert str(refused.value) == ("rank 1 of 2 exited (exit status 255: ssh: connect to host node-b port 22: "
                                  "Connection refused) while loading; the rank group was stopped")


class _FakeRank:
    """A rank's worker as the group sees it: each frame sent is answered on a pipe with `outputs` (None: the rank
    exits instead, closing its pipe)."""

    def __init__(self, outputs):
        self.outputs, self.killed = outputs, False
        self._read, self._write = os.pipe()

    def fileno(self) -> int:
        return self._read

    def send(self, kind: bytes, payload: bytes) -> None:
        if self.outputs is None:
            os.close(self._write)
            return
        body = b"o" + _encode(self.outputs)
        os.write(self._write, _HEADER.pack(len(body)) + body)

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def exit_status(self, wait: float = 0.0) -> str:
        return "killed by signal 9"


def _group(*ranks: _FakeRank) -> RankGroup:
    group = RankGroup.__new__(RankGroup)  # the call path only: no processes
    group.ranks, group.step_timeout, group.workers = len(ranks), 5.0, list(ranks)
    group._tmp = tempfile.TemporaryDirectory()
    return group


def test_the_group_returns_rank_0s_outputs_and_stops_on_a_rank_that_disagrees_or_exits():
    token, logprob = torch.tensor([[7]]), torch.tensor([-0.5])
    agree = _group(_FakeRank([token, logprob]), _FakeRank([token, logprob + 1e-7]))  # floats may differ in the ulp
    outputs = agree.execute([torch.zeros(1)])
    assert torch.equal(outputs[0], token) and torch.equal(outputs[1], logprob)
    assert agree.alive()
    other = _group(_FakeRank([token, logprob]), _FakeRank([token + 1, logprob]))  # the control: another token
    with pytest.raises(WorkerDied, match="rank 1 of 2 sampled other tokens than rank 0"):
        other.execute([torch.zeros(1)])
    assert not any(rank.alive() for rank in other.workers)  # every rank stopped: the supervisor starts a new group
    gone = _group(_FakeRank([token, logprob]), _FakeRank(None))
    with pytest.raises(WorkerDied, match=r"rank 1 of 2 exited \(killed by signal 9\) while running a call"):
        gone.execute([torch.zeros(1)])
    assert not any(rank.alive() for rank in gone.workers)
