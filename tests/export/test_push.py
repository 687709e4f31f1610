"""export.push and the model card: the exact Hub operations, the card's content, the token never leaked.

The Hub client is patched at ``HfApi``'s methods, so the test asserts the calls (with their
arguments) that would go out; nothing touches a network. The validate report is built by
``inference.report.build_report`` itself from loop results, so the card is tested on the real schema.
"""

from __future__ import annotations

import json

import pytest
import torch

from export.push import main, push
from models.config import DFlashConfig
from models.drafter import DFlashDraftModel

TOKEN = "hf_fakeTokenThatMustNeverBeWritten123"
quiet = lambda *_: None  # noqa: E731


@pytest.fixture
def folder(tmp_path):
    """A drafter export with its provenance block, as export.hf writes it."""
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=36,
                       target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=290, block_size=16,
                       draftsmith={"target": "Qwen/Qwen3-8B", "target_revision": "abc123", "recipe": "qwen3-8b",
                                   "steps": 1234, "target_quantization": "mlx-4bit-g64",
                                   "data": {"source": "nvidia/Nemotron-Post-Training-Dataset-v2", "split": "chat"}})
    torch.manual_seed(0)
    out = tmp_path / "export"
    DFlashDraftModel(cfg).save_pretrained(out, dtype=torch.bfloat16)
    return out


@pytest.fixture
def report(tmp_path):
    """A report.json exactly as ``python -m inference.validate`` writes it (two categories)."""
    from inference.report import PromptRun, build_report
    from inference.stats import GenerationResult

    def result(lengths, decode_s):
        tokens = list(range(1 + sum(lengths)))
        pos = [sum(1 for a in lengths if a - 1 >= k) for k in range(1, 16)]
        return GenerationResult(tokens=tokens, acceptance_lengths=lengths, position_accepts=pos, block_size=16,
                                prefill_s=0.1, decode_s=decode_s)

    runs = [PromptRun("c1", "code", 20, [result([5, 7, 3], 0.3)], [result([1] * 15, 0.9)]),
            PromptRun("c2", "code", 30, [result([2, 2], 0.2)], [result([1] * 4, 0.3)]),
            PromptRun("m1", "math", 25, [result([9, 1, 4, 2], 0.4)], [result([1] * 16, 1.2)])]
    env = {"backend": "mlx", "device": "Apple M3 Max (Metal)", "dtype": "bfloat16", "draft_dtype": "bfloat16",
           "target": "mlx-community/Qwen3-8B-4bit", "target_quantization": "4-bit affine, group 64",
           "block_size": 16, "temperature": 0.0}
    rep = build_report(runs, 16, True, env)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(rep))
    return path, rep


@pytest.fixture
def hub(monkeypatch):
    """Record every HfApi call instead of sending it; a token in the environment."""
    from huggingface_hub import HfApi

    calls = []

    def recorder(name):
        def call(self, **kwargs):
            calls.append((name, kwargs))
            if name == "upload_folder":  # what would be uploaded, read at call time
                from pathlib import Path

                calls.append(("files", sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())))
                return type("CommitInfo", (), {"commit_url": "http://127.0.0.1/commit/1"})()
            return None
        return call

    for name in ("create_repo", "repo_info", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, name, recorder(name))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return calls


def test_push_sends_the_exact_operations_and_never_writes_the_token(folder, report, hub, capsys):
    result = main(["--folder", str(folder), "--repo", "me/Qwen3-8B-DFlash", "--private", "--revision", "dev",
                   "--report", str(report[0])])
    assert hub == [
        ("create_repo", {"repo_id": "me/Qwen3-8B-DFlash", "repo_type": "model", "private": True, "exist_ok": True}),
        ("repo_info", {"repo_id": "me/Qwen3-8B-DFlash", "repo_type": "model"}),  # --private: still private?
        ("create_branch", {"repo_id": "me/Qwen3-8B-DFlash", "branch": "dev", "repo_type": "model", "exist_ok": True}),
        ("upload_folder", {"repo_id": "me/Qwen3-8B-DFlash", "folder_path": str(folder), "repo_type": "model",
                           "revision": "dev", "commit_message": "Upload DFlash drafter (draftsmith)",
                           "allow_patterns": ["config.json", "model.safetensors", "model-*-of-*.safetensors",
                                              "model.safetensors.index.json", "modeling_dflash.py", "README.md"],
                           "ignore_patterns": [".*", "**/.*", "__pycache__/*", "*.tmp"],
                           "delete_patterns": ["*.safetensors", "*.safetensors.index.json", "modeling_dflash.py"]}),
        ("files", ["README.md", "config.json", "model.safetensors", "modeling_dflash.py"]),
    ]
    assert result["uploaded"] and result["url"] == "http://127.0.0.1/commit/1"
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err
    assert all(TOKEN.encode() not in p.read_bytes() for p in folder.iterdir())
    # validate's --out folder names the same report (it was "not found")
    again = main(["--folder", str(folder), "--repo", "me/Qwen3-8B-DFlash", "--report", str(report[0].parent),
                  "--dry-run"])
    assert again["card"] == result["card"]


def test_a_push_over_an_earlier_one_leaves_only_this_exports_files(folder, hub):
    """Pushed over a sharded export (or an HF one over an MLX 4-bit one), the old index and shards stayed in the
    repo: loaders follow the index, so the repo served the old weights under the new config. The Hub deletes
    the files ``delete_patterns`` match, except those the same commit uploads (huggingface_hub's
    upload_folder): emulated here on what an earlier sharded push left."""
    import fnmatch

    push(folder, "me/x", log=quiet)
    kwargs = dict(hub)["upload_folder"]
    uploaded = set(dict(hub)["files"])
    earlier = {"README.md", "config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "modeling_dflash.py", ".gitattributes"}
    kept = {f for f in earlier if f == ".gitattributes" or f in uploaded
            or not any(fnmatch.fnmatch(f, p) for p in kwargs["delete_patterns"])}
    assert kept | uploaded == uploaded | {".gitattributes"}  # nothing of the earlier export outlives this push


def test_card_renders_metadata_usage_recipe_and_the_reports_numbers(folder, report, hub):
    from huggingface_hub import ModelCard

    path, rep = report
    push(folder, "me/Qwen3-8B-DFlash", report=str(path), license="apache-2.0", log=quiet)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-8B" and card.data.library_name == "transformers"
    assert card.data.tags == ["dflash", "speculative-decoding", "draftsmith"] and card.data.license == "apache-2.0"
    text = card.text
    spec = '{"method": "dflash", "model": "me/Qwen3-8B-DFlash", "num_speculative_tokens": 15}'
    assert f"vllm serve Qwen/Qwen3-8B --speculative-config '{spec}'" in text
    assert ("python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH "
            "--speculative-draft-model-path me/Qwen3-8B-DFlash --speculative-num-draft-tokens 16") in text
    assert "AutoModel.from_pretrained('me/Qwen3-8B-DFlash', trust_remote_code=True)" in text
    assert "python -m inference.generate --backend mlx --target Qwen/Qwen3-8B --draft me/Qwen3-8B-DFlash" in text
    for fact in ("`1234`", "`[1, 9, 17, 25, 33]`", "`mlx-4bit-g64`", "nvidia/Nemotron-Post-Training-Dataset-v2",
                 "`abc123`", "`qwen3-8b`", "| block size | `16` |"):
        assert fact in text, fact
    # the report's own numbers: pooled tau (35 tokens / 9 cycles), per-prompt mean (5, 2, 4), category, speedup
    assert "**3.89**" in text and "mean of per-prompt taus: 3.67" in text
    assert f"**{rep['speedup']:.2f}x**" in text
    for name, c in rep["per_category"].items():
        assert (f"| {name} | {c['num_prompts']} | {c['tau']:.2f} | {c['tau_per_prompt_mean']:.2f} | "
                f"{c['speedup']:.2f} |") in text
    assert "device `Apple M3 Max (Metal)`" in text and "(4-bit affine, group 64)" in text
    # the repo's name as the title, the shape table from config.json, and no row for what the config lacks
    assert text.lstrip().startswith("# Qwen3-8B-DFlash\n")
    assert ("| drafter layers | `2` |\n| hidden size (= target's) | `32` |\n| block size | `16` |\n"
            "| target layer ids | `[1, 9, 17, 25, 33]` |\n| target layers | `36` |\n| mask token id | `290` |\n"
            "| weights | `bfloat16` |\n") in text
    assert "`None`" not in text and "| features |" not in text


def test_dry_run_needs_no_token_and_sends_nothing(folder, hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    result = push(folder, "me/x", dry_run=True)
    out = capsys.readouterr().out
    assert hub == [] and not result["uploaded"] and not (folder / "README.md").exists()
    assert '"op": "create_repo"' in out and '"op": "upload_folder"' in out and "base_model: Qwen/Qwen3-8B" in out


def test_no_token_is_refused_before_anything_is_sent(folder, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(PermissionError, match="no Hugging Face token: run `hf auth login` or set HF_TOKEN"):
        push(folder, "me/x", log=quiet)
    assert hub == []


def test_a_readme_the_user_wrote_is_uploaded_as_it_is(folder, hub):
    (folder / "README.md").write_text("# my own card\n")
    push(folder, "me/x", log=quiet)
    assert (folder / "README.md").read_text() == "# my own card\n" and hub[-1][1][0] == "README.md"


def test_report_goes_only_on_the_drafter_it_measured_in_any_export_format(report, hub, tmp_path):
    """The report records the measured drafter's norm weights (draft_signature): its fp32 checkpoint
    matches its bf16 HF export and its 4-bit MLX export; a drafter trained otherwise (same block size,
    mask id and target) is refused before anything is sent."""
    from export.mlx import export_mlx
    from models.weights import norm_signature

    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, vocab_size=300, num_target_layers=36,
                       target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=290, block_size=16)

    def trained(seed: int, out):  # norms moved away from their initial ones, as training moves them
        torch.manual_seed(seed)
        model = DFlashDraftModel(cfg)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.uniform_(0.6, 1.4)
        model.save_pretrained(out)
        return out

    fp32 = trained(0, tmp_path / "fp32")
    bf16 = tmp_path / "bf16"
    DFlashDraftModel.from_pretrained(fp32).save_pretrained(bf16, dtype=torch.bfloat16)
    mlx4 = tmp_path / "mlx4"
    export_mlx(fp32, mlx4, quantize=4, group_size=32, log=quiet)
    other = trained(1, tmp_path / "other")
    path, rep = report
    for measured, pushed, ok in ((fp32, bf16, True), (fp32, mlx4, True), (mlx4, bf16, True), (other, bf16, False)):
        path.write_text(json.dumps({**rep, "trained_block_size": 16, "mask_token_id": 290, "draft": str(measured),
                                    "draft_signature": norm_signature(measured)}))
        if ok:
            assert f"**{rep['tau']:.2f}**" in push(pushed, "me/d", report=str(path), dry_run=True, log=quiet)["card"]
        else:
            with pytest.raises(ValueError, match=f"measured with another drafter: other weights \\(its drafter "
                                                 f"'{other}' has other norm weights than this folder\\)"):
                push(pushed, "me/d", report=str(path), dry_run=True, log=quiet)
    # Reports that record the drafter's quantization (validate does now): a 4-bit folder's card shows the
    # 4-bit drafter's figures, not those measured with its bf16 weights (the same signature), and back.
    from inference.validate import describe_quantization

    for measured, pushed, ok in ((mlx4, mlx4, True), (bf16, bf16, True), (mlx4, bf16, False), (bf16, mlx4, False)):
        quant = describe_quantization(DFlashConfig.load(measured).quantization)
        path.write_text(json.dumps({**rep, "trained_block_size": 16, "mask_token_id": 290, "draft": str(measured),
                                    "draft_signature": norm_signature(measured), "draft_quantization": quant}))
        if ok:
            push(pushed, "me/d", report=str(path), dry_run=True, log=quiet)
        else:
            with pytest.raises(ValueError, match=r"measured with another drafter: drafter quantization "
                                                 r"(4-bit affine, group 32 \(this folder: none|none \(this folder: "
                                                 r"4-bit affine, group 32)\)"):
                push(pushed, "me/d", report=str(path), dry_run=True, log=quiet)
    assert hub == []


def test_mlx_card_is_mlx_only(folder, hub, tmp_path):
    d = json.loads((folder / "config.json").read_text())
    d["quantization"] = d["quantization_config"] = {"bits": 4, "group_size": 64, "mode": "affine"}
    d.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(d))
    (folder / "modeling_dflash.py").unlink()
    res = push(folder, "me/x-mlx-4bit", dry_run=True, log=quiet)
    assert "library_name: mlx" in res["card"] and "- mlx" in res["card"] and "vllm serve" not in res["card"]
    assert "MLX 4-bit affine, group 64" in res["card"]


# ------------------------------------------------------------------ a local Hub over HTTP
@pytest.fixture
def local_hub(monkeypatch):
    """A minimal Hub API on 127.0.0.1 (create repo, branch, preupload, commit) recording each request."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body: dict, code: int = 200):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            requests.append(("GET", self.path, self.headers.get("authorization"), b""))
            if "/tree/" in self.path:  # what an earlier push of a sharded export left, and the user's notes
                self._reply([{"type": "file", "oid": "b" * 40, "size": 1, "path": name} for name in
                             ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                              "notes.md", ".gitattributes")])
            elif self.path == "/api/models/me/drafter":  # repo_info: --private checks the repo is
                self._reply({"id": "me/drafter", "private": True})
            else:
                self._reply({"error": "not found"}, 404)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            requests.append(("POST", self.path, self.headers.get("authorization"), body))
            base = f"http://127.0.0.1:{self.server.server_address[1]}"
            if self.path == "/api/repos/create":
                d = json.loads(body)
                self._reply({"url": f"{base}/{d['organization']}/{d['name']}"})
            elif "/branch/" in self.path or self.path == "/api/validate-yaml":  # the client checks a card's YAML
                self._reply({})
            elif "/preupload/" in self.path:  # "regular": contents travel inline in the commit
                self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in json.loads(body)["files"]]})
            elif "/commit/" in self.path:
                self._reply({"commitUrl": f"{base}/me/drafter/commit/{'a' * 40}", "commitOid": "a" * 40})
            else:
                self._reply({"error": "unknown route"}, 404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    yield requests
    server.shutdown()


def test_push_over_http_to_a_local_hub_uploads_the_folder_and_the_card(folder, report, local_hub):
    import base64

    result = push(folder, "me/drafter", private=True, revision="dev", report=str(report[0]), log=quiet)
    routes = [(m, path) for m, path, _, _ in local_hub]
    assert routes == [("POST", "/api/repos/create"), ("GET", "/api/models/me/drafter"),
                      ("POST", "/api/models/me/drafter/branch/dev"),
                      ("GET", "/api/models/me/drafter/tree/dev?recursive=true&expand=false"),
                      ("POST", "/api/validate-yaml"), ("POST", "/api/models/me/drafter/preupload/dev"),
                      ("POST", "/api/models/me/drafter/commit/dev")]
    assert json.loads(local_hub[0][3]) == {"name": "drafter", "organization": "me", "visibility": "private",
                                           "type": "model"}
    assert "base_model: Qwen/Qwen3-8B" in json.loads(local_hub[4][3])["content"]
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in local_hub)
    assert all(TOKEN.encode() not in body for *_, body in local_hub)
    lines = [json.loads(x) for x in local_hub[6][3].decode().splitlines()]
    sent = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
    assert sent == {p.name: p.read_bytes() for p in folder.iterdir()}
    # the earlier push's index and shard go in the same commit; its config is replaced, the user's notes stay
    deleted = sorted(x["value"]["path"] for x in lines if x["key"] == "deletedFile")
    assert deleted == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    assert b"base_model: Qwen/Qwen3-8B" in sent["README.md"] and b"**3.89**" in sent["README.md"]
    assert lines[0]["value"]["summary"] == "Upload DFlash drafter (draftsmith)"
    assert result["url"].endswith("/me/drafter/commit/" + "a" * 40)


def test_pushing_to_main_creates_no_branch_and_a_repush_refreshes_the_generated_card(folder, hub):
    """--revision main (the default) is create_repo + upload_folder only; a README.md draftsmith wrote on an
    earlier push is rewritten (new license here), not uploaded stale as if the user had written it."""
    push(folder, "me/x", log=quiet)
    assert [name for name, _ in hub] == ["create_repo", "upload_folder", "files"]
    assert "license:" not in (folder / "README.md").read_text()
    push(folder, "me/x", license="apache-2.0", log=quiet)
    assert "license: apache-2.0" in (folder / "README.md").read_text()


def test_dry_run_lists_the_card_among_the_files_it_would_upload(folder, hub):
    logged = []
    push(folder, "me/x", dry_run=True, log=logged.append)
    assert "  files: ['README.md', 'config.json', 'model.safetensors', 'modeling_dflash.py']" in logged
    assert not (folder / "README.md").exists() and hub == []


@pytest.mark.parametrize("revision", [".hidden", "/main", "dev/", "a..b", "v1.lock", "my branch", "a@{1}", "tab\tname",
                                      "del\x7f"])
def test_branch_names_git_refuses_are_refused_before_anything_is_sent(folder, hub, revision):
    with pytest.raises(ValueError, match="is not a valid branch name"):
        push(folder, "me/x", revision=revision, log=quiet)
    assert hub == []


@pytest.mark.parametrize("revision", ["v1", "release/1.0", "exp-b16_lr3e-4"])
def test_any_branch_other_than_main_is_created_before_the_upload(folder, hub, revision):
    ops = push(folder, "me/x", revision=revision, dry_run=True, log=quiet)["ops"]
    assert [op["op"] for op in ops] == ["create_repo", "create_branch", "upload_folder"]
    assert ops[1]["branch"] == ops[2]["revision"] == revision


def test_a_report_of_another_mask_token_is_refused(folder, report, hub):
    """Same block size, other mask id: measured with another drafter, kept off this card."""
    path, rep = report
    path.write_text(json.dumps({**rep, "trained_block_size": 16, "mask_token_id": 7}))
    with pytest.raises(ValueError, match=r"measured with another drafter: mask token id 7 \(this folder: 290\)"):
        push(folder, "me/x", report=str(path), dry_run=True, log=quiet)


def _with_provenance(folder, prov):
    d = json.loads((folder / "config.json").read_text())
    if prov is None:
        d.pop("draftsmith", None)
    else:
        d["draftsmith"] = prov
    (folder / "config.json").write_text(json.dumps(d))


def test_card_of_a_local_or_tiny_target_names_no_base_model(folder, hub, tmp_path, monkeypatch):
    """base_model links the card to a Hub model: a local folder (here one that exists) or a tiny:<arch> stand-in
    is never written there, and tiny:<arch> is not shown as the target either."""
    local = tmp_path / "Qwen" / "Qwen3-8B"
    local.mkdir(parents=True)
    _with_provenance(folder, {"target": str(local)})
    logged = []
    card = push(folder, "me/x", dry_run=True, log=logged.append)["card"]
    assert "base_model" not in card and f"A DFlash drafter for **{local}**" in card
    assert any("not a Hub id, so the card has no base_model" in line for line in logged)
    # a relative path that reads like a Hub id names a local folder when one is there
    monkeypatch.chdir(tmp_path)
    _with_provenance(folder, {"target": "Qwen/Qwen3-8B"})
    card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
    assert "base_model" not in card and "A DFlash drafter for **Qwen/Qwen3-8B**" in card
    _with_provenance(folder, {"target": "tiny:qwen3"})
    card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
    assert "base_model" not in card and "A DFlash drafter for **TARGET**" in card and "tiny:qwen3" not in card.split(
        "## Training recipe")[0]


def test_card_says_how_many_tokens_a_block_drafts_and_when_the_recipe_is_unknown(folder, hub):
    """A block of 16 drafts 15 tokens after the accepted one (the bonus token is the target's); a folder
    without the draftsmith block says its recipe is unknown instead of an empty table."""
    card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
    assert "the drafter proposes a block of 15 tokens after the last accepted one" in card
    assert "carries no `draftsmith` provenance block" not in card
    _with_provenance(folder, None)
    card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
    assert "This folder carries no `draftsmith` provenance block" in card


def test_norm_signature_and_its_comparison(tmp_path):
    """The first 8 values of each norm, to 5 decimals; equal within 1e-2 relative to values above 1, and
    only for the same norms with as many values."""
    from safetensors.torch import save_file

    from models.weights import norm_signature, same_signature

    norm = [1.0, 1.5, 0.25, 2.0, 3.0, 0.75, 1.125, 0.5, 9.0, 9.0]
    save_file({"norm.weight": torch.tensor(norm), "layers.0.input_layernorm.weight": torch.full((4,), 1.234567),
               "fc.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    assert norm_signature(tmp_path) == {"layers.0.input_layernorm.weight": [1.23457] * 4, "norm.weight": norm[:8]}
    assert same_signature({"n": [100.0, 1.0]}, {"n": [100.5, 1.005]})
    assert not same_signature({"n": [1.0, 1.02]}, {"n": [1.0, 1.0]})
    assert not same_signature({"n": [1.0, 1.015]}, {"n": [1.0, 1.0]})  # 1.5e-2 relative: past the default 1e-2
    assert same_signature({"n": [101.0]}, {"n": [100.0]})  # exactly 1e-2 relative: still the same
    assert same_signature({"n": [1.5]}, {"n": [1.0]}, tol=0.5)
    assert not same_signature({"n": [1.5]}, {"n": [1.0]}, tol=0.4)
    assert not same_signature({"n": [1.0, 2.0]}, {"n": [1.0]}) and not same_signature({"n": [1.0]}, {"n": [1.0, 2.0]})
    assert not same_signature({"n": [1.0]}, {"n": [1.0], "m": [1.0]})


def test_card_recipe_rows_name_each_value_and_a_commit_message_is_sent_as_given(folder, hub):
    """The data and training rows show key=value pairs (a bare value list hides which is the split); an
    empty --license is refused; --commit-message reaches upload_folder."""
    _with_provenance(folder, {"target": "Qwen/Qwen3-8B", "data": {"source": "tiny", "split": "chat"},
                              "train": {"lr": 0.003, "epochs": 2}, "features": {"mode": "online"}})
    card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
    assert "| data | `source=tiny, split=chat` |" in card and "| training | `lr=0.003, epochs=2` |" in card
    assert "| features | `{'mode': 'online'}` |" in card
    with pytest.raises(ValueError, match="is not a Hub license id"):
        push(folder, "me/x", license="", dry_run=True, log=quiet)
    push(folder, "me/x", commit_message="retrained at step 900", log=quiet)
    assert dict(hub)["upload_folder"]["commit_message"] == "retrained at step 900"


def test_card_names_the_loss_weighting(folder, hub):
    """The objective recorded by training reads as words on the card: the decay's gamma, or D-PACE's alpha and
    normaliser; a block without it (an older export) has no such row."""
    for objective, said in [({"weighting": "dpace", "alpha": 0.5, "normaliser": "weights"},
                             "D-PACE (alpha 0.5, normalised by weight sum)"),
                            ({"weighting": "dpace", "alpha": 0.25, "normaliser": "rows"},
                             "D-PACE (alpha 0.25, normalised by rows)"),
                            ({"weighting": "decay", "gamma": 7.0}, "decay (gamma 7)")]:
        _with_provenance(folder, {"target": "Qwen/Qwen3-8B", "objective": objective})
        card = push(folder, "me/x", dry_run=True, log=quiet)["card"]
        assert f"| loss weighting | `{said}` |" in card
    _with_provenance(folder, {"target": "Qwen/Qwen3-8B"})
    assert "loss weighting" not in push(folder, "me/x", dry_run=True, log=quiet)["card"]


def test_cli_pushes_to_main_by_default(folder, hub):
    ops = main(["--folder", str(folder), "--repo", "me/x", "--dry-run"])["ops"]
    assert [op["op"] for op in ops] == ["create_repo", "upload_folder"] and ops[1]["revision"] == "main"
