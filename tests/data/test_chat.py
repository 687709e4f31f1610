"""Loss masks from the rendered template, truncation, packing, and the prepare CLI end to end."""

import json
from pathlib import Path

import pytest

from data.chat import loss_spans, tokenize_conversation
from data.packing import document_bounds, pack_rows
from models.tiny import tiny_tokenizer

FIX = Path(__file__).parents[1] / "fixtures" / "data"
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

SINGLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
          {"role": "assistant", "content": "Blue, like the sky.", "reasoning_content": "Pick a common one."}]
MULTI = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?",
                                             "reasoning_content": "Greet back."},
         {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5",
                                                       "reasoning_content": "Simple sum."},
         {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."}]


def expected_answers(messages, template, thinking):
    """What the target generates per assistant turn, end-of-turn token included."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            think = ""
            if template == "chatml" and thinking is not False and m.get("reasoning_content"):
                think = f"<think>\n{m['reasoning_content']}\n</think>\n\n"
            out.append(think + m["content"] + EOT[template])
    return out


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("thinking", [True, False, None])
@pytest.mark.parametrize("conv", ["single", "multi"])
def test_masked_spans_decode_to_answer_plus_end_of_turn(template, thinking, conv):
    tok = tiny_tokenizer(template)
    messages = SINGLE if conv == "single" else MULTI
    rows, dropped = tokenize_conversation(tok, messages, thinking)
    assert dropped == 0
    spans = [tok.decode(r.input_ids[a:b]) for r in rows for a, b in loss_spans(r.loss_mask)]
    assert spans == expected_answers(messages, template, thinking)
    answers = [m for m in messages if m["role"] == "assistant"]
    for k, r in enumerate(rows):  # every row is a real rendering: the row's text is what the server would have seen
        text = tok.decode(r.input_ids)
        assert text.startswith("<|im_start|>" if template == "chatml" else "<|begin_of_text|>")
        if thinking is False and template == "chatml":
            # thinking off: the served prompt holds the empty think block right before the answer
            # (each turn is its own row: see test_row_splitting_only_where_history_is_re_rendered)
            assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + answers[k]["content"]
                                 + "<|im_end|>\n")


def test_row_splitting_only_where_history_is_re_rendered():
    chatml, llama = tiny_tokenizer("chatml"), tiny_tokenizer("llama3")
    assert len(tokenize_conversation(chatml, MULTI, True)[0]) == 1  # history renders as served: one row
    assert len(tokenize_conversation(llama, MULTI, None)[0]) == 1
    # thinking off: the served prompt carries an empty think block that re-rendered history lacks
    rows = tokenize_conversation(chatml, MULTI, False)[0]
    assert len(rows) == 3 and all(len(loss_spans(r.loss_mask)) == 1 for r in rows)


def test_truncation_never_leaves_a_row_without_loss_tokens():
    tok = tiny_tokenizer("chatml")
    prompt = tok.apply_chat_template(SINGLE[:2], add_generation_prompt=True, tokenize=False)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    rows, dropped = tokenize_conversation(tok, SINGLE, None, max_length=prompt_len)  # cut right before the answer
    assert rows == [] and dropped == 1
    rows, dropped = tokenize_conversation(tok, SINGLE, None, max_length=prompt_len + 5)
    assert dropped == 0 and rows[0].truncated
    assert sum(rows[0].loss_mask) == 5 and len(rows[0].input_ids) == prompt_len + 5


def test_packing_keeps_document_boundaries():
    rows = [([1] * 5, [0, 0, 1, 1, 1]), ([2] * 4, [0, 1, 1, 1]), ([3] * 7, [0] * 6 + [1]), ([4] * 3, [0, 1, 1])]
    packed = pack_rows(rows, max_length=10)
    assert [len(p["input_ids"]) for p in packed] == [9, 10]
    assert packed[0]["doc_ids"] == [0] * 5 + [1] * 4
    assert packed[0]["position_ids"] == list(range(5)) + list(range(4))
    assert document_bounds(packed[1]["doc_ids"]) == [(0, 7), (7, 10)]
    assert packed[1]["loss_mask"] == [0] * 6 + [1] + [0, 1, 1]


def test_packing_edges_and_unpacked_rows():
    """No rows pack into no rows (not one empty row), in the plan too; one-token documents are documents of their own;
    an unpacked row is one document with positions from 0."""
    from data.packing import document_columns, unpacked_rows
    from data.rows import pack_plan

    assert pack_rows([], max_length=10) == [] and pack_plan([], 10) == []
    assert document_bounds([]) == [] and document_bounds([0]) == [(0, 1)]
    assert document_bounds([0, 1, 1, 2]) == [(0, 1), (1, 3), (3, 4)]
    assert document_columns([1, 3]) == ([0, 1, 1, 1], [0, 0, 1, 2])
    rows = [([5, 6, 7], [0, 1, 1]), ([8], [1])]
    assert unpacked_rows(rows) == [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "doc_ids": [0, 0, 0], "position_ids": [0, 1, 2]},
        {"input_ids": [8], "loss_mask": [1], "doc_ids": [0], "position_ids": [0]}]


def test_prepare_cli_end_to_end(tmp_path, capsys):
    from datasets import load_from_disk

    from data.prepare import main
    from models.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "target", "qwen3", num_layers=4)
    out = tmp_path / "prepared"
    main(["--target", str(target), "--source", str(FIX / "openai.jsonl"), "--out", str(out), "--thinking", "on",
          "--max-length", "160", "--pack", "--no-progress"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ds = load_from_disk(str(out))
    stats = json.loads((out / "stats.json").read_text())
    assert line["prepare"]["rows"] == stats["rows"] == len(ds) < stats["documents"] == 3  # packing merged rows
    assert stats["tokens"] == sum(ds["num_tokens"]) and stats["loss_tokens"] == sum(ds["num_loss_tokens"])
    tok = tiny_tokenizer("chatml")
    spans = []
    for row in ds:
        for a, b in document_bounds(row["doc_ids"]):
            assert row["position_ids"][a:b] == list(range(b - a))
            spans += [tok.decode(row["input_ids"][a:b][s:e]) for s, e in loss_spans(row["loss_mask"][a:b])]
    assert spans == ["7<|im_end|>", "Hello!<|im_end|>", "1, 2, 3<|im_end|>",
                     "<think>\nadd them\n</think>\n\n4<|im_end|>"]
    meta = json.loads((out / "draftsmith_data.json").read_text())
    assert meta["packed"] and meta["thinking"] is True and len(meta["tokenizer_hash"]) == 16


@pytest.mark.parametrize("module", ["data.prepare", "data.regenerate", "data.extract", "data.bench", "data.serve"])
def test_every_cli_has_help(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "usage: python -m " + module in text and len(text) > 400


def test_parallel_tokenization_gives_the_same_rows_and_scale_keys_exist(tmp_path):
    from datasets import load_from_disk

    from data.prepare import prepare
    from models.tiny import save_tiny_target
    from train.config import load_config

    target = save_tiny_target(tmp_path / "target", "qwen3", num_layers=2)
    for n in (None, 2):
        prepare(str(target), str(FIX / "openai.jsonl"), tmp_path / f"p{n}", max_length=160, pack=True,
                num_proc=n, progress=False, log=lambda *_: None)
    one, two = load_from_disk(str(tmp_path / "pNone")), load_from_disk(str(tmp_path / "p2"))
    assert one.to_list() == two.to_list() and len(one) == 2
    cfg = load_config(["recipe=tiny", "data.regenerate_batch_size=3", "data.rebuild=true"])
    assert cfg.data.regenerate_batch_size == 3 and cfg.data.rebuild


@pytest.mark.filterwarnings("ignore::dill.PicklingWarning")  # the reproduced failure warns first
def test_packing_works_where_datasets_cannot_pickle_an_arrow_table(tmp_path, pyarrow_pickled_by_value):
    """Packing hands the tokenized rows to ``Dataset.from_generator``, which hashes its arguments: kept rows
    whose index lay in memory made that hash pickle an Arrow table, which fails on such a node."""
    import pickle

    from datasets import Dataset, load_from_disk

    from data.prepare import prepare
    from models.tiny import save_tiny_target

    with pytest.raises(pickle.PicklingError, match="MonthDayNano"):  # the node's failure, reproduced here
        Dataset.from_dict({"input_ids": [[1, 2]]})
    target = save_tiny_target(tmp_path / "target", "qwen3", num_layers=2)
    prepare(str(target), str(FIX / "openai.jsonl"), tmp_path / "packed", max_length=160, pack=True,
            progress=False, log=lambda *_: None)
    assert len(load_from_disk(str(tmp_path / "packed"))) == 2


def test_generated_ids_lose_the_trailing_end_of_turn_token():
    """vLLM keeps the stop token in its output ids; the trailer already holds it, so the answer's ids must drop it
    (kept, the ids no longer spell the answer and the generated ids are thrown away for a re-tokenization)."""
    from data.chat import Segment, answer_ids, encode

    tok = tiny_tokenizer("chatml")
    eot = tok.convert_tokens_to_ids(EOT["chatml"])
    ids = encode(tok, "hello world") + [eot]
    assert answer_ids(tok, Segment("hello world", "answer", ids), eot) == ids[:-1]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello world", "token_ids": ids}]
    (row,), dropped = tokenize_conversation(tok, messages, None)
    assert dropped == 0 and row.retokenized == 0  # the generated ids were used, not the text
    assert [row.input_ids[a:b] for a, b in loss_spans(row.loss_mask)] == [ids]  # answer + one end-of-turn token


def test_answer_ids_keep_the_prefix_the_template_renders_before_them():
    """A template may render an empty think block before the generated text (Qwen3's last turn): the row must hold
    that block's tokens and then the generated ids, not the generated ids alone."""
    from data.chat import Segment, answer_ids, encode

    tok = tiny_tokenizer("chatml")
    eot = tok.convert_tokens_to_ids(EOT["chatml"])
    ids = encode(tok, "hello world") + [eot]
    think = "<think>\n\n</think>\n\n"
    assert answer_ids(tok, Segment(think + "hello world", "answer", ids), eot) == encode(tok, think) + ids[:-1]
    # the same through a template that always renders a think block for an assistant turn
    tok.chat_template = tok.chat_template.replace(
        "{% if message.reasoning_content is defined and message.reasoning_content %}"
        "<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}",
        "<think>\n{{ message.reasoning_content or '' }}\n</think>\n\n")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello world", "token_ids": ids}]
    (row,), _ = tokenize_conversation(tok, messages, None)
    assert row.retokenized == 0
    assert [tok.decode(row.input_ids[a:b]) for a, b in loss_spans(row.loss_mask)] == [think + "hello world<|im_end|>"]
    assert tok.decode(row.input_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + think \
        + "hello world<|im_end|>\n"


def test_generated_ids_may_hold_token_id_0():
    """Id 0 is a real token ('!' here): generated ids holding it are used as they are, not re-tokenized."""
    from data.chat import Segment, answer_ids, encode

    tok = tiny_tokenizer("chatml")
    ids = encode(tok, "Hi!")
    assert 0 in ids
    assert answer_ids(tok, Segment("Hi!", "answer", ids), None) == ids
    messages = [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Hi!", "token_ids": ids}]
    (row,), _ = tokenize_conversation(tok, messages, None)
    assert row.retokenized == 0


def test_a_row_that_fits_max_length_exactly_is_not_truncated():
    tok = tiny_tokenizer("chatml")
    (full,), _ = tokenize_conversation(tok, SINGLE, None)
    n = len(full.input_ids)
    (row,), _ = tokenize_conversation(tok, SINGLE, None, max_length=n)
    assert not row.truncated and row.input_ids == full.input_ids
    (row,), _ = tokenize_conversation(tok, SINGLE, None, max_length=n - 1)
    assert row.truncated and row.input_ids == full.input_ids[:-1]


def test_an_empty_answer_is_a_template_error_not_a_row():
    """An empty assistant turn would only teach ending the turn at once: refused like a template the
    mask derivation cannot follow (counted as a template error by data.prepare)."""
    from data.chat import TemplateError

    tok = tiny_tokenizer("chatml")
    with pytest.raises(TemplateError, match="assistant turn 1"):
        tokenize_conversation(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}], None)


def test_the_tokenizer_fingerprint_covers_the_chat_template():
    from data.chat import tokenizer_fingerprint

    tok = tiny_tokenizer("chatml")
    before = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tiny_tokenizer("chatml")) == before and len(before) == 16
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert tokenizer_fingerprint(tok) != before


def test_a_row_of_exactly_max_length_packs_alone():
    """A row as long as the budget is allowed (only longer ones are refused); pack_plan groups the
    rows the way pack_rows does, exact fits included."""
    from data.rows import pack_plan

    rows = [([1] * 10, [1] * 10), ([2] * 6, [1] * 6), ([3] * 4, [1] * 4), ([4] * 3, [1] * 3)]
    packed = pack_rows(rows, max_length=10)
    assert [p["input_ids"] for p in packed] == [[1] * 10, [2] * 6 + [3] * 4, [4] * 3]
    assert pack_plan([10, 6, 4, 3], 10) == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(ValueError, match="row of 11 tokens is longer than max_length 10"):
        pack_rows([([1] * 11, [1] * 11)], max_length=10)
    with pytest.raises(ValueError, match="row of 11 tokens is longer than max_length 10"):
        pack_plan([3, 11], 10)


def test_rows_identity_sees_the_last_rows_tokens_and_the_row_order():
    """Another last row, another order or a middle row of another length is other data: a resume
    must not take it."""
    from datasets import Dataset

    from data.rows import rows_identity

    def ds(rows):
        return Dataset.from_dict({"input_ids": rows, "num_tokens": [len(r) for r in rows],
                                  "num_loss_tokens": [1] * len(rows)})

    base = rows_identity(ds([[1, 2], [3, 4, 5], [6, 7]]))
    assert rows_identity(ds([[1, 2], [3, 4, 5], [6, 7]])) == base
    assert rows_identity(ds([[1, 2], [3, 4, 5], [6, 8]])) != base
    assert rows_identity(ds([[1, 2], [6, 7], [3, 4, 5]])) != base
    assert rows_identity(ds([[1, 2], [3, 4], [6, 7]])) != base  # a middle row of another length


def test_tokenization_processes_are_capped_at_8(monkeypatch):
    import data.rows

    monkeypatch.setattr(data.rows.os, "cpu_count", lambda: 64)
    assert data.rows.auto_num_proc(19_999) is None and data.rows.auto_num_proc(20_000) == 8  # one below 20k
    assert data.rows.auto_num_proc(50_000) == 8
    monkeypatch.setattr(data.rows.os, "cpu_count", lambda: None)
    assert data.rows.auto_num_proc(50_000) == 1


def test_each_conversation_adds_its_counters_in_a_tally_row():
    """stats.json's truncated, dropped, template-error and re-tokenized counts come from one tally row per
    conversation (no tokens: filtered out before saving)."""
    from data.rows import TALLIES, tokenize_batch

    tok = tiny_tokenizer("chatml")
    prompt = tok.apply_chat_template(SINGLE[:2], add_generation_prompt=True, tokenize=False)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    wrong_ids = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello", "token_ids": [5, 6]}]
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yes"}]
    batch = {"conversation": [json.dumps(c) for c in (SINGLE, SINGLE, wrong_ids, empty, short)]}
    out = tokenize_batch(batch, tok, None, None)
    assert {k: sum(out[k]) for k in TALLIES} == {"truncated": 0, "retokenized": 1, "dropped_no_loss": 0,
                                                 "template_errors": 1}
    out = tokenize_batch({"conversation": batch["conversation"][:2]}, tok, None, prompt_len + 3)
    assert {k: sum(out[k]) for k in TALLIES} == {"truncated": 2, "retokenized": 0, "dropped_no_loss": 0,
                                                 "template_errors": 0}
    out = tokenize_batch({"conversation": batch["conversation"][:2]}, tok, None, prompt_len)
    assert {k: sum(out[k]) for k in TALLIES} == {"truncated": 0, "retokenized": 0, "dropped_no_loss": 2,
                                                 "template_errors": 0}
    assert [n for n in out["num_tokens"]] == [0, 0]  # two tally rows, no training row


def test_tokenize_to_disk_counts_every_tally_and_saves_only_rows_with_tokens(tmp_path):
    """stats.json's counts: conversations in, documents out, tokens and loss tokens of the saved rows, and the
    summed tallies (two truncated conversations count 2, not the largest one); tally rows are never saved."""
    from datasets import load_from_disk

    from data.rows import COLUMNS, tokenize_to_disk

    tok = tiny_tokenizer("chatml")
    (full,), _ = tokenize_conversation(tok, SINGLE, None)
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    convs = [{"messages": m} for m in (SINGLE, SINGLE, empty)]
    out = tmp_path / "rows"
    counts = tokenize_to_disk(tok, convs, out, tmp_path / "scratch", thinking=None, max_length=len(full.input_ids) - 1,
                              pack=False, progress=False)
    ds = load_from_disk(str(out))
    assert ds.column_names == COLUMNS and len(ds) == 2
    assert counts == {"truncated": 2, "retokenized": 0, "dropped_no_loss": 0, "template_errors": 1,
                      "conversations": 3, "documents": 2, "tokens": sum(ds["num_tokens"]),
                      "loss_tokens": sum(ds["num_loss_tokens"]), "rows": 2}
    loss, tokens = list(ds["num_loss_tokens"]), list(ds["num_tokens"])
    assert loss == [sum(m) for m in ds["loss_mask"]] and all(a < b for a, b in zip(loss, tokens))
    assert ds[0]["doc_ids"] == [0] * ds[0]["num_tokens"] and ds[0]["position_ids"] == list(range(ds[0]["num_tokens"]))


def test_tokenize_to_disk_packs_the_kept_rows_and_names_what_left_none(tmp_path):
    from datasets import load_from_disk

    from data.rows import tokenize_to_disk

    tok = tiny_tokenizer("chatml")
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yes"}]
    run = lambda convs, **kw: tokenize_to_disk(tok, [{"messages": m} for m in convs], tmp_path / "out",  # noqa: E731
                                               tmp_path / "scratch", thinking=None, progress=False,
                                               **{"max_length": None, "pack": False, **kw})
    (one,), _ = tokenize_conversation(tok, short, None)
    n = len(one.input_ids)
    counts = run([short, empty, short, short], max_length=2 * n, pack=True)  # the template error left out
    ds = load_from_disk(str(tmp_path / "out"))
    assert counts["documents"] == 3 and counts["rows"] == len(ds) == 2
    assert list(ds["num_tokens"]) == [2 * n, n] and ds[0]["doc_ids"] == [0] * n + [1] * n
    assert ds[0]["num_loss_tokens"] == 2 * sum(one.loss_mask)
    with pytest.raises(ValueError, match="the chat template failed on every conversation \\(2\\)"):
        run([empty, empty])
    with pytest.raises(ValueError, match="no row has loss tokens after tokenization"):
        run([short, empty], max_length=1)  # only prompt tokens left: dropped, not a template error
    with pytest.raises(ValueError, match="no conversation to tokenize"):
        run([])


def test_rows_identity_sees_every_split_and_the_loss_counts():
    """The held-out split is part of what a resume trains against, and so is how many tokens of each row are
    labelled (relabelled data of the same tokens is other data)."""
    from datasets import Dataset

    from data.rows import rows_identity

    def ds(rows, loss):
        return Dataset.from_dict({"input_ids": rows, "num_tokens": [len(r) for r in rows], "num_loss_tokens": loss})

    train, held_out = ds([[1, 2], [3, 4, 5], [6, 7]], [1, 2, 1]), ds([[8, 9]], [1])
    base = rows_identity(train, held_out)
    assert rows_identity(train, ds([[8, 10]], [1])) != base
    assert rows_identity(ds([[1, 2], [3, 4, 5], [6, 7]], [1, 1, 1]), held_out) != base


# GLM 4.x's template structure (GLM-4.5): a [gMASK]<sop> prefix, role tokens that open each turn and no end-of-turn
# token; thinking in <think></think> (an empty block when off), "/nothink" appended to user turns when off.
GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ '\\n' + m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ '\\n' + m.content }}"
    "{{ '/nothink' if (enable_thinking is defined and not enable_thinking) else '' }}"
    "{% elif m.role == 'tool' %}<|observation|>{{ '\\n' + m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>"
    "{{ '\\n<think>' + (m.reasoning_content or '') + '</think>' }}{{ '\\n' + m.content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{{ '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' }}{% endif %}")
GLM_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def glm_tokenizer():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GLM_SPECIALS})
    tok.chat_template = GLM_TEMPLATE
    return tok


@pytest.mark.parametrize("thinking", [True, False, None])
def test_a_template_without_an_end_of_turn_token_labels_the_next_role_token(thinking):
    """GLM's turn ends when the target writes the role token of the next turn (<|user|>, <|observation|> before a
    tool result): that token is labelled after every answer, the last one included (a user turn would follow), so
    the drafter learns the stop; the rows are still what the server saw, turn after turn."""
    tok = glm_tokenizer()
    tool = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    for messages, stops in ((SINGLE, ["<|user|>"]), (MULTI, ["<|user|>"] * 3), (tool, ["<|observation|>", "<|user|>"])):
        rows, dropped = tokenize_conversation(tok, messages, thinking)
        assert dropped == 0
        spans = [tok.decode(r.input_ids[a:b]) for r in rows for a, b in loss_spans(r.loss_mask)]
        answers = [m for m in messages if m["role"] == "assistant"]
        assert len(spans) == len(answers)
        for span, m, stop in zip(spans, answers, stops):
            # thinking off: the served prompt ends with the empty think block, the target writes what follows
            think = "" if thinking is False else f"\n<think>{m.get('reasoning_content') or ''}</think>"
            assert span == f"{think}\n{m['content']}{stop}"
        for r in rows:  # every row renders as served: the prefix, and the stop token last
            text = tok.decode(r.input_ids)
            assert text.startswith("[gMASK]<sop>") and text.endswith("<|user|>") and r.loss_mask[-1] == 1


def test_a_regenerated_answer_ending_with_its_stop_token_keeps_its_ids_on_a_glm_template():
    """vLLM's ids end with the stop token the target wrote (<|user|>): it is the turn's label, not part of the
    answer, and the generated ids are used as they are; a cut answer gets no stop label."""
    from data.chat import encode

    tok = glm_tokenizer()
    user = tok.convert_tokens_to_ids("<|user|>")
    ids = encode(tok, "\n<think></think>\nhello world") + [user]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello world", "token_ids": ids}]
    (row,), _ = tokenize_conversation(tok, messages, None)
    assert row.retokenized == 0 and [row.input_ids[a:b] for a, b in loss_spans(row.loss_mask)] == [ids]
    (cut,), _ = tokenize_conversation(tok, [messages[0], {**messages[1], "cut": True}], None)
    assert cut.input_ids[-1] == user and cut.loss_mask[-1] == 0


# ------------------------------------------------------------------ gpt-oss (harmony) and Gemma 4 templates
@pytest.mark.parametrize("template, thought, end", [
    ("harmony", "<|channel|>analysis<|message|>Pick a common one.<|end|><|start|>assistant<|channel|>final<|message|>",
     "<|return|>"),
    ("gemma", "<|channel>thought\nPick a common one.<channel|>", "<turn|>"),
])
@pytest.mark.parametrize("field", ["reasoning_content", "thinking"])
def test_reasoning_reaches_templates_that_read_thinking_and_is_labelled(template, thought, end, field):
    """gpt-oss's harmony and Gemma 4 read a message's reasoning from ``thinking``; data carries it as
    ``reasoning_content`` (servers) or ``thinking``: either way the analysis / thought channel is rendered and
    labelled with the final answer, and the end-of-turn token after it."""
    tok = tiny_tokenizer(template)
    messages = [{k if k != "reasoning_content" else field: v for k, v in m.items()} for m in SINGLE]
    (row,), dropped = tokenize_conversation(tok, messages, thinking=True)
    assert dropped == 0
    labelled = tok.decode([i for i, m in zip(row.input_ids, row.loss_mask) if m])
    assert labelled == thought + "Blue, like the sky." + end
    (plain,), _ = tokenize_conversation(tok, messages, thinking=False)  # thinking off drops it, whichever field
    channel = "<|channel|>final<|message|>" if template == "harmony" else ""  # the model writes the channel itself
    assert tok.decode([i for i, m in zip(plain.input_ids, plain.loss_mask) if m]) == \
        channel + "Blue, like the sky." + end


def test_a_template_that_reads_reasoning_content_gets_a_thinking_field_there():
    from data.chat import reasoning_field, render

    assert [reasoning_field(tiny_tokenizer(t)) for t in ("chatml", "harmony", "gemma", "llama3")] == [
        "reasoning_content", "thinking", "thinking", "reasoning_content"]
    tok = tiny_tokenizer("chatml")
    text = render(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t"}])
    assert "<think>\nt\n</think>" in text


def test_the_harmony_date_and_reasoning_effort_are_pinned_and_the_clock_restored(monkeypatch):
    """gpt-oss's template writes today's date into every prompt (strftime_now): renders, prepared data and served
    prompts changed from day to day. draftsmith renders with CHAT_DATE and reasoning effort medium, and leaves
    transformers' clock as it found it."""
    import datetime

    from transformers.utils import chat_template_utils

    from data import chat

    tok = tiny_tokenizer("harmony")
    clock = chat_template_utils.datetime
    first = chat.render(tok, SINGLE[:2], add_generation_prompt=True)
    assert "Current date: 2025-08-05\n" in first and "Reasoning: medium<|end|>" in first
    assert chat_template_utils.datetime is clock  # restored
    monkeypatch.setattr(chat, "CHAT_DATE", datetime.datetime(2031, 1, 2))
    assert "Current date: 2031-01-02\n" in chat.render(tok, SINGLE[:2], add_generation_prompt=True)
    direct = tok.apply_chat_template(SINGLE[:2], tokenize=False, add_generation_prompt=True)
    assert f"Current date: {datetime.datetime.now():%Y-%m-%d}" in direct  # transformers' own call: today
