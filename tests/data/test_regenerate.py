"""Regeneration against a real local OpenAI-compatible server and in-process; kill + resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.readers import conversation_key
from data.regenerate import HTTPGenerator, LocalGenerator, done_ids, read_rows, regenerate
from data.serve import start_server

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parents[1] / "fixtures" / "data"


MAX_TOKENS = 6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from models.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("regen") / "target", "qwen3", num_layers=2)


@pytest.fixture(scope="module")
def target(target_dir):
    from models.target import TargetModel

    return TargetModel.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def server(target):
    srv, url = start_server(target, model_name="tiny", max_tokens_cap=64, delay=0.05)
    yield srv, url
    srv.shutdown()


def conversations(n):
    convs = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"old answer {i}"}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "old follow-up"}]
        convs.append({"id": str(i), "key": conversation_key(msgs), "messages": msgs})
    return convs


def write_jsonl(path, convs):
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))


def test_server_and_in_process_regenerate_the_same_turns(server, target, tmp_path):
    _, url = server
    convs = conversations(4)
    http = regenerate(convs, tmp_path / "http.jsonl",
                      HTTPGenerator(url, "tiny", max_tokens=MAX_TOKENS, thinking=False, concurrency=2), progress=False)
    local = regenerate(convs, tmp_path / "local.jsonl",
                       LocalGenerator(target, max_tokens=MAX_TOKENS, thinking=False, batch_size=3), progress=False)
    assert http.done == local.done == 4 and http.failed == local.failed == 0
    assert http.turns == local.turns == 6  # conversations 0 and 3 have two assistant turns
    a, b = read_rows(tmp_path / "http.jsonl"), read_rows(tmp_path / "local.jsonl")
    assert [r["id"] for r in a] == ["0", "1", "2", "3"]
    for ra, rb, conv in zip(a, b, convs):
        assert ra["messages"] == rb["messages"]  # greedy: the server and in-process give the same tokens
        for new, old in zip(ra["messages"], conv["messages"]):
            assert new["role"] == old["role"]
            if old["role"] == "user":
                assert new == old  # user turns are kept verbatim
            else:
                assert new["content"] != old["content"]  # every assistant turn was regenerated
    # random tiny weights never say EOS within 6 tokens: every turn is counted as truncated
    assert http.truncated == 4 and http.tokens_generated == 6 * MAX_TOKENS


def test_killed_run_resumes_to_the_uninterrupted_result(server, tmp_path):
    _, url = server
    convs = conversations(10)
    src = tmp_path / "src.jsonl"
    write_jsonl(src, [{"messages": c["messages"]} for c in convs])
    args = ["--source", str(src), "--server", url, "--model", "tiny", "--thinking", "off",
            "--max-tokens", str(MAX_TOKENS), "--concurrency", "2", "--no-progress"]
    from data.regenerate import main

    main(args + ["--out", str(tmp_path / "whole.jsonl")])

    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "data.regenerate", *args, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_text().count("\n")
    assert 3 <= written < 10, f"the run was not interrupted halfway ({written} rows written)"
    with out.open("a") as f:
        f.write('{"id": "9", "messages": [{"role": "us')  # a line cut short by the kill
    main(args + ["--out", str(out)])
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 10  # no duplicate, no lost row
    assert read_rows(out) == read_rows(tmp_path / "whole.jsonl")


def test_retries_with_backoff_and_failed_rows_are_retried_on_rerun(target, tmp_path):
    srv, url = start_server(target, fail_first=2)
    try:
        convs = conversations(2)[1:]  # one single-turn conversation
        gen = HTTPGenerator(url, "tiny", max_tokens=MAX_TOKENS, retries=0, backoff=0.01)
        report = regenerate(convs, tmp_path / "out.jsonl", gen, progress=False)
        assert report.failed == 1 and report.done == 0 and report.errors["RegenerationError"]["count"] == 1
        assert "HTTP 503" in report.errors["RegenerationError"]["first"]  # the reason, not only a count
        assert "HTTP 503" in (tmp_path / "out.jsonl.failed.jsonl").read_text()
        gen.retries = 3
        report = regenerate(convs, tmp_path / "out.jsonl", gen, progress=False)  # 2nd request fails, 3rd succeeds
        assert report.failed == 0 and report.done == 1 and srv.state["requests"] == 3
        assert not (tmp_path / "out.jsonl.failed.jsonl").exists()
    finally:
        srv.shutdown()


class Interrupted(Exception):
    pass


class StopsAfter:
    """Wraps a generator and dies after ``n`` finished rows, like a killed process."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def run(self, convs):
        for k, item in enumerate(self.inner.run(convs)):
            if k == self.n:
                raise Interrupted
            yield item


def test_in_process_interrupted_run_resumes_to_the_same_rows(target, tmp_path):
    convs = conversations(5)
    make = lambda: LocalGenerator(target, max_tokens=MAX_TOKENS, thinking=True, batch_size=2)
    regenerate(convs, tmp_path / "whole.jsonl", make(), progress=False)
    out = tmp_path / "resumed.jsonl"
    with pytest.raises(Interrupted):
        regenerate(convs, out, StopsAfter(make(), 3), progress=False)
    assert len(done_ids(out)) == 3
    report = regenerate(convs, out, make(), progress=False)
    assert report.already_done == 3 and report.done == 2
    assert read_rows(out) == read_rows(tmp_path / "whole.jsonl")


def test_prepare_regenerates_through_the_server(server, target_dir, tmp_path):
    from datasets import load_from_disk

    from data.chat import loss_spans
    from data.prepare import main

    _, url = server
    out = tmp_path / "prepared"
    main(["--target", str(target_dir), "--source", str(FIX / "sharegpt.jsonl"), "--out", str(out),
          "--regenerate", url, "--model", "tiny", "--thinking", "off", "--max-tokens", str(MAX_TOKENS),
          "--no-progress"])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["regenerate"]["done"] == 2 and stats["regenerate"]["turns"] == 3
    # A run resumed after its answers were all written (killed while tokenizing): this run generated
    # nothing, but stats.json still says what the rows' answers hold (it once said 0 of everything).
    from data.reuse import META_FILE, PARTIAL_FILE

    (out / META_FILE).rename(out / PARTIAL_FILE)  # as the folder is before it is finished
    main(["--target", str(target_dir), "--source", str(FIX / "sharegpt.jsonl"), "--out", str(out),
          "--regenerate", url, "--model", "tiny", "--thinking", "off", "--max-tokens", str(MAX_TOKENS),
          "--no-progress"])
    again = json.loads((out / "stats.json").read_text())
    assert again["regenerate"]["done"] == 0 and again["regenerate"]["already_done"] == 2
    assert again["regenerated_answers"] == stats["regenerated_answers"] == {
        "rows": 2, "truncated": stats["regenerate"]["truncated"], "turns": 3,
        "tokens_generated": stats["regenerate"]["tokens_generated"]}
    regenerated = read_rows(out / "regenerated.jsonl")
    # an answer cut at max tokens has no end-of-turn label (the target never ended the turn there)
    cut = [reason == "length" for r in regenerated for reason in r["regen"]["finish_reasons"]]
    answers = [m["content"] + ("" if c else "<|im_end|>")
               for m, c in zip((m for r in regenerated for m in r["messages"] if m["role"] == "assistant"), cut)]
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    ds = load_from_disk(str(out))
    spans = [tok.decode(row["input_ids"][a:b]) for row in ds for a, b in loss_spans(row["loss_mask"])]
    assert spans == answers  # the training rows hold the target's answers, not the data set's


def test_prepare_with_one_failed_conversation_stops_and_keeps_the_answers(target, target_dir, tmp_path):
    """One conversation the server failed is an error naming the count (a rerun retries it), never rows
    prepared without it."""
    from data.prepare import prepare
    from data.regenerate import RegenerationError

    srv, url = start_server(target, model_name="tiny", fail_first=1)
    out = tmp_path / "prepared"
    try:
        with pytest.raises(RegenerationError, match="1 of 2 conversations failed to regenerate"):
            prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), out, regenerate=url, thinking=False,
                    progress=False, log=lambda *_: None,
                    gen_kwargs={"model": "tiny", "max_tokens": MAX_TOKENS, "retries": 0, "concurrency": 1})
    finally:
        srv.shutdown()
    assert not (out / "draftsmith_data.json").exists() and len(read_rows(out / "regenerated.jsonl")) == 1


def test_resume_is_keyed_on_conversation_content_not_row_number(target, tmp_path):
    make = lambda: LocalGenerator(target, max_tokens=MAX_TOKENS, thinking=False, batch_size=2)
    convs = conversations(3)
    regenerate(convs, tmp_path / "regen.jsonl", make(), progress=False)
    before = {r["key"]: r for r in read_rows(tmp_path / "regen.jsonl")}
    # the source is edited: a new conversation comes first, so every old one moves down a row
    new = {"messages": [{"role": "user", "content": "a brand new question"}, {"role": "assistant", "content": "x"}]}
    edited = [new] + [{"messages": c["messages"]} for c in convs] + [new]  # ... and once more at the end
    edited = [{"id": str(i), "key": conversation_key(c["messages"]), **c} for i, c in enumerate(edited)]
    report = regenerate(edited, tmp_path / "regen.jsonl", make(), progress=False)
    assert report.already_done == 3 and report.done == 1  # only the new conversation is generated
    assert report.duplicates == 1  # its second copy shares the answer (once counted as "already done")
    rows = {r["key"]: r for r in read_rows(tmp_path / "regen.jsonl")}
    fresh = rows[edited[0]["key"]]
    assert fresh["messages"][0]["content"] == "a brand new question"  # not row 0's old answer
    for conv in edited[1:-1]:
        assert rows[conv["key"]] == before[conv["key"]]


class Budget:
    """A source that fails if more than ``n`` conversations are read before the first result comes back."""

    def __init__(self, convs, n):
        self.convs, self.n, self.results = convs, n, 0

    def __iter__(self):
        for k, conv in enumerate(self.convs):
            assert self.results or k < self.n, "the whole source was read before regenerating (no streaming)"
            yield conv


def test_regeneration_streams_its_source(server, target, tmp_path):
    _, url = server
    convs = conversations(12)
    for gen in (HTTPGenerator(url, "tiny", max_tokens=2, concurrency=2),
                LocalGenerator(target, max_tokens=2, batch_size=2)):
        source = Budget(convs, 5)
        for _ in gen.run(iter(source)):
            source.results += 1
        assert source.results == 12


def _generated_ids(path):
    return [m["token_ids"] for r in read_rows(path) for m in r["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("via", ["local", "http"])
def test_training_rows_hold_the_generated_token_ids(via, server, target_dir, tmp_path):
    from datasets import load_from_disk

    from data.chat import loss_spans
    from data.prepare import prepare
    from models.tiny import tiny_tokenizer

    _, url = server
    out = tmp_path / "prepared"
    prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), out, regenerate="local" if via == "local" else url,
            thinking=False, progress=False, gen_kwargs={"max_tokens": 12, "model": "tiny"})
    generated = _generated_ids(out / "regenerated.jsonl")
    tok = tiny_tokenizer("chatml")
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    generated = [ids[:-1] if ids and ids[-1] == end_of_turn else ids for ids in generated]
    # the point: decoding then re-tokenizing is not the identity on the target's random output
    assert any(tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids for ids in generated)
    trained = [row["input_ids"][a:b] for row in load_from_disk(str(out)) for a, b in loss_spans(row["loss_mask"])]
    cut = [reason == "length" for r in read_rows(out / "regenerated.jsonl") for reason in r["regen"]["finish_reasons"]]
    assert any(cut)  # random tiny weights: some answers are cut at 12 tokens, and get no end-of-turn label
    assert trained == [ids + ([] if c else [end_of_turn]) for ids, c in zip(generated, cut)]


def test_vllm_engine_is_started_used_and_stopped(target_dir, tmp_path, monkeypatch):
    """data.regenerate=vllm with a stand-in engine: the same HTTP API, on CPU, bound to 127.0.0.1."""
    import re
    import urllib.request

    from data.prepare import prepare

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("DRAFTSMITH_ENGINE_COMMAND", "{python} -m data.serve --target {target} --host {host} "
                       "--port {port} --max-tokens-cap 8 --exit-after 300")
    log = tmp_path / "regenerate-server.log"
    # a --model name meant for a running server is not asked of the engine started here: it serves the target
    stats = prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), tmp_path / "prepared", regenerate="vllm",
                    thinking=False, progress=False, server_log=log,
                    gen_kwargs={"max_tokens": MAX_TOKENS, "model": "served-elsewhere"}, log=lambda *_: None)
    assert stats["regenerate"]["done"] == 2 and stats["regenerate"]["turns"] == 3
    url = re.search(r"serving .* at (http://127\.0\.0\.1:\d+/v1)", log.read_text()).group(1)
    with pytest.raises(OSError):  # stopped before prepare returned
        urllib.request.urlopen(url + "/models", timeout=5)


def test_engine_that_dies_or_serves_another_model_is_stopped_with_a_clear_error(target_dir, tmp_path, monkeypatch):
    import json

    from data.engine import EngineError, running_engine
    from data.prepare import prepare
    from data.regenerate import ServerUnavailable

    log = tmp_path / "engine.log"
    died = "{python} -c \"import sys; print('CUDA out of memory'); sys.exit(3)\""
    with pytest.raises(EngineError, match="(?s)exited with code 3 .*CUDA out of memory"):
        with running_engine("vllm", "t", log, command=died, timeout=60, log=lambda *_: None):
            pass
    # an engine that answers but serves another model: refused by the pre-flight, and stopped
    (tmp_path / "www" / "v1").mkdir(parents=True)
    (tmp_path / "www" / "v1" / "models").write_text(json.dumps({"data": [{"id": "another-model"}]}))
    monkeypatch.setenv("DRAFTSMITH_ENGINE_COMMAND", f"{{python}} -m http.server --bind {{host}} --directory "
                       f"{tmp_path / 'www'} {{port}}")
    lines = []
    with pytest.raises(ServerUnavailable, match="serves \\['another-model'\\], not the target"):
        prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), tmp_path / "prepared", regenerate="sglang",
                progress=False, server_log=log, log=lines.append)
    assert any(line == "sglang stopped" for line in lines)
    assert not (tmp_path / "prepared").exists()  # nothing regenerated: no folder left behind


def test_in_process_regeneration_places_the_target_as_the_flags_say(target_dir):
    """Standalone local regeneration once loaded the target with no device: on a GPU node it ran on the CPU."""
    import argparse

    import torch

    from data.regenerate import add_generation_args, load_local_target

    p = argparse.ArgumentParser()
    add_generation_args(p)
    auto = load_local_target(p.parse_args([]), str(target_dir))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.device.type == expected and (expected != "cpu" or auto.dtype == torch.float32)
    half = load_local_target(p.parse_args(["--device", "cpu", "--dtype", "bfloat16"]), str(target_dir))
    assert half.device.type == "cpu" and half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="max_memory needs device_map"):
        load_local_target(p.parse_args(["--max-memory", "0=1GiB"]), str(target_dir))


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": 2}, "{'max_tokens': 6, 'temperature': 0.0} -> {'max_tokens': 2, 'temperature': 0.0}"),
    ({"temperature": 0.7}, "{'max_tokens': 6, 'temperature': 0.0} -> {'max_tokens': 6, 'temperature': 0.7}"),
])
def test_changed_generation_settings_are_refused_or_regenerated(target_dir, tmp_path, change, named):
    """max_tokens and temperature make the answers: a prepared folder with other ones is refused naming the
    difference, and a rebuild answers every conversation anew instead of keeping the old answers."""
    import re

    from data.prepare import prepare
    from data.reuse import DataMismatch

    out = tmp_path / "prepared"
    base = {"max_tokens": MAX_TOKENS}
    run = lambda gen, **kw: prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), out, regenerate="local",
                                    thinking=False, progress=False, reuse=True, gen_kwargs=dict(gen), **kw)
    first = run(base)
    assert first["regenerate"]["done"] == 2
    assert run(base) == first  # the same settings: re-used as it is
    new = {**base, **change}
    with pytest.raises(DataMismatch, match="other settings \\(generation: " + re.escape(named) + ".*data.rebuild=true"):
        run(new)
    stats = run(new, rebuild=True)
    assert stats["regenerate"]["already_done"] == 0 and stats["regenerate"]["done"] == 2  # answered anew
    meta = json.loads((out / "draftsmith_data.json").read_text())
    assert meta["generation"] == {"max_tokens": new["max_tokens"], "temperature": new.get("temperature", 0.0)}
    lengths = [len(ids) for ids in _generated_ids(out / "regenerated.jsonl")]
    assert len(lengths) == 3 and max(lengths) <= new["max_tokens"]  # the answers the new settings made


def test_prepare_that_fails_after_regenerating_keeps_the_answers(target_dir, tmp_path, monkeypatch):
    """Hours of regenerated answers survive a failure in a later step (tokenizing): the folder is kept with its
    answers and a rerun reports them as already done instead of generating them again."""
    import data.rows
    from data.prepare import prepare
    from data.reuse import META_FILE, PARTIAL_FILE

    out = tmp_path / "prepared"
    run = lambda: prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), out, regenerate="local", thinking=False,
                          progress=False, gen_kwargs={"max_tokens": MAX_TOKENS})

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(data.rows, "tokenize_to_disk", disk_full)
        with pytest.raises(OSError, match="No space left"):
            run()
    answers = (out / "regenerated.jsonl").read_text()
    assert answers.count("\n") == 2 and (out / PARTIAL_FILE).is_file() and not (out / META_FILE).exists()
    stats = run()
    assert stats["regenerate"]["already_done"] == 2 and stats["regenerate"]["done"] == 0
    assert (out / "regenerated.jsonl").read_text() == answers and (out / META_FILE).is_file()


def test_answers_of_the_same_target_at_another_quantization_are_refused(target, target_dir, tmp_path, capsys):
    """The same folder quantized (bnb-4bit) is another model for the drafter: same tokenizer and fingerprint, other
    tokens. Its answers are refused for the unquantized target (and the other way round) unless forced."""
    import copy

    from data.prepare import load_prepared, prepare
    from data.reuse import DataMismatch

    out = tmp_path / "prepared"
    prepare(str(target_dir), str(FIX / "sharegpt.jsonl"), out, regenerate="local", thinking=False, progress=False,
            gen_kwargs={"max_tokens": MAX_TOKENS})
    ds, meta = load_prepared(out, target=target)  # the target that answered: accepted
    assert meta["regenerated_by_quantization"] == "none" and len(ds) == 3  # thinking off: a row per turn
    quantized = copy.copy(target)
    quantized.quantization = "bnb-4bit"
    with pytest.raises(DataMismatch, match="holds answers regenerated by .*quantization none.*not by this target "
                                           ".*quantization bnb-4bit"):
        load_prepared(out, target=quantized)
    load_prepared(out, target=quantized, force=True)  # forced: a warning, not an error
    assert "warning: " in capsys.readouterr().err


def test_local_generation_cuts_the_answer_at_eos(target, monkeypatch):
    """generate runs past EOS for the other rows of a batch; the answer ends right before the EOS: its ids and
    text hold neither the end-of-turn token nor what came after it."""
    import torch

    eos = target.eos_token_ids()[0]
    tail = [7, 8, eos, 9]

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor([tail] * input_ids.shape[0], device=input_ids.device)], dim=1)

    monkeypatch.setattr(target.model, "generate", fake_generate)
    rows = LocalGenerator(target, max_tokens=MAX_TOKENS, thinking=False, batch_size=2).regenerate_batch(
        conversations(2))
    tok = target.tokenizer
    answers = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert len(answers) == 3  # conversation 0 has two assistant turns
    for m in answers:
        assert m["token_ids"] == [7, 8]
        assert m["content"] == tok.decode([7, 8]) and "<|im_end|>" not in m["content"]
    assert [r["regen"]["finish_reasons"] for r in rows] == [["stop", "stop"], ["stop"]]


def test_http_client_url_port_and_api_key(monkeypatch):
    """The base URL gets /v1 once, the port (for the start command) is the scheme's default when the URL names
    none, and the API key (argument, else OPENAI_API_KEY) is sent as a bearer token."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    gen = HTTPGenerator("http://127.0.0.1:8000/", "m")
    assert gen.url == "http://127.0.0.1:8000/v1/chat/completions" and gen.port == 8000
    assert HTTPGenerator("http://h/v1/", "m").url == "http://h/v1/chat/completions"
    assert HTTPGenerator("https://h/v1", "m").port == 443 and HTTPGenerator("http://h", "m").port == 80
    assert gen._headers() == {"Content-Type": "application/json"}
    assert HTTPGenerator("http://h", "m", api_key="sk-arg")._headers()["Authorization"] == "Bearer sk-arg"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert HTTPGenerator("http://h", "m")._headers()["Authorization"] == "Bearer sk-env"


def _answer(message, **choice):
    return {"choices": [{"message": message, **choice}], "usage": {"completion_tokens": 3}}


def test_http_answers_reasoning_under_either_name_or_in_a_think_block():
    """vLLM's reasoning_content, the newer "reasoning", or a think block left in the content all become the
    answer's reasoning; SGLang's output_ids are the generated ids; no finish_reason counts as "stop"."""
    gen = HTTPGenerator("http://h", "m")
    c = gen._parse(_answer({"content": "4", "reasoning": "add"}, finish_reason="length", token_ids=[1, 2, 3]))
    assert (c.content, c.reasoning, c.finish_reason, c.tokens, c.token_ids) == ("4", "add", "length", 3, [1, 2, 3])
    c = gen._parse(_answer({"content": "5", "reasoning_content": "sum"}, finish_reason="stop", token_ids=[4]))
    assert (c.content, c.reasoning) == ("5", "sum")
    c = gen._parse(_answer({"content": "<think>\nadd\n</think>\n\n4"}, output_ids=[5, 6]))
    assert (c.content, c.reasoning, c.finish_reason, c.token_ids) == ("4", "add", "stop", [5, 6])


def test_each_turn_is_asked_with_the_answers_so_far_as_role_and_content(monkeypatch):
    """A later turn's request carries the earlier regenerated answers as role and content only (no reasoning,
    no ids); the row keeps the source id, every answer's reasoning and ids (thinking on), and its totals."""
    gen = HTTPGenerator("http://h", "m", thinking=True)
    sent = []

    def post(payload):
        sent.append(json.loads(json.dumps(payload)))
        n = len(sent)
        return _answer({"content": f"a{n}", "reasoning_content": f"r{n}"}, finish_reason="stop", token_ids=[n])

    monkeypatch.setattr(gen, "_post", post)
    q1, q2 = {"role": "user", "content": "q1"}, {"role": "user", "content": "q2"}
    old = {"role": "assistant", "content": "old"}
    conv = {"id": "7", "key": "k7", "source_id": "src-7", "messages": [q1, old, q2, old]}
    row = gen.regenerate_one(conv)
    assert sent[1]["messages"] == [q1, {"role": "assistant", "content": "a1"}, q2]
    assert sent[0]["chat_template_kwargs"] == {"enable_thinking": True} and sent[0]["return_token_ids"] is True
    assert row == {"id": "7", "key": "k7", "source_id": "src-7", "messages": [
        q1, {"role": "assistant", "content": "a1", "reasoning_content": "r1", "token_ids": [1]},
        q2, {"role": "assistant", "content": "a2", "reasoning_content": "r2", "token_ids": [2]}],
        "regen": {"turns": 2, "tokens": 6, "finish_reasons": ["stop", "stop"]}}
    gen.thinking = False  # reasoning a server returns anyway is not kept when thinking is off
    answers = [m for m in gen.regenerate_one(conv)["messages"] if m["role"] == "assistant"]
    assert answers == [{"role": "assistant", "content": "a3", "token_ids": [3]},
                       {"role": "assistant", "content": "a4", "token_ids": [4]}]


def test_the_report_counts_each_kind_of_error_and_quotes_the_first():
    from data.regen_common import RegenerationError, RegenReport

    report = RegenReport()
    report.add_error(RegenerationError("HTTP 503 " + "x" * 600))
    report.add_error(RegenerationError("HTTP 500"))
    report.add_error(ValueError("bad row"))
    first = report.errors["RegenerationError"]["first"]
    assert report.errors["RegenerationError"]["count"] == 2 and first == ("HTTP 503 " + "x" * 600)[:500]
    assert report.error_summary() == f"2 x RegenerationError (first: {first}); 1 x ValueError (first: bad row)"
