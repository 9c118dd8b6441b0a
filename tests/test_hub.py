"""Round trips through a real local Hub server (tests/hub_server.py): push, card, fresh-process loads, failures."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest
import torch
import yaml
from hub_fixtures import *  # noqa: F401,F403  (local_hub, hub_env, hub_in_process, run_python)
from hub_fixtures import point_at_local_hub, run_python

from turboquant_hf.cli import commands as cli
from turboquant_hf.reporting import card as tq_card
from turboquant_hf.reporting import sizing

GENERIC = "This is the model card of a 🤗 transformers model"
SMOL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOL_REPO = "tester/SmolLM2-135M-Instruct-tq3"


def _api(hub):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=hub.token)


def _front(text: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "README.md has no YAML front matter"
    return yaml.safe_load(m.group(1))


def _validate_yaml(hub, text: str) -> None:
    """The Hub's metadata check (what `ModelCard.validate` calls; huggingface_hub 1.x sends that to huggingface.co
    whatever the endpoint, so post it to the local server directly)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    hf_raise_for_status(get_session().post(f"{hub.url}/api/validate-yaml", json={"repoType": "model", "content": text}))


def _tree_digest(directory: str) -> dict:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


# ---------------------------------------------------------------------------------------------------------------
def test_local_hub_speaks_huggingface_hub(hub_in_process, tmp_path):
    """create_repo (new and existing), upload_folder, hf_hub_download, snapshot_download, model_info,
    ModelCard.load, get_safetensors_metadata (a Range request) against the server."""
    from huggingface_hub import ModelCard, hf_hub_download, snapshot_download
    from safetensors.torch import save_file

    hub, api = hub_in_process, _api(hub_in_process)
    save_file({"w.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "README.md").write_text("---\nlicense: mit\ntags:\n- a\n---\n# hello\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("x")
    assert api.create_repo("basics").repo_id == "tester/basics"
    assert api.create_repo("tester/basics", exist_ok=True).repo_id == "tester/basics"
    api.upload_folder(folder_path=str(tmp_path), repo_id="tester/basics")
    with open(hf_hub_download("tester/basics", "sub/x.txt")) as f:
        assert f.read() == "x"
    snap = snapshot_download("tester/basics")
    assert sorted(os.listdir(snap)) == ["README.md", "model.safetensors", "sub"]
    info = api.model_info("tester/basics")
    assert {s.rfilename for s in info.siblings} == {"README.md", "model.safetensors", "sub/x.txt"}
    assert info.card_data.license == "mit"
    card = ModelCard.load("tester/basics")
    assert card.data.tags == ["a"]
    _validate_yaml(hub, str(card))
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError):
        _validate_yaml(hub, "---\nlicense: [1, 2]\n---\n")
    meta = api.get_safetensors_metadata("tester/basics")
    assert meta.files_metadata["model.safetensors"].tensors["w.weight"].shape == [3, 4]
    assert any(r[:2] == ("GET", "/tester/basics/resolve/main/model.safetensors") and r[2] == 206 for r in hub.log)
    from huggingface_hub.errors import EntryNotFoundError

    with pytest.raises(EntryNotFoundError):
        hf_hub_download("tester/basics", "nope.json")


def test_tiny_push_to_hub_fresh_process_roundtrip(hub_in_process, hub_env, tiny_llama_dir, tmp_path):
    """Quantize a tiny Llama straight from a Hub repo, model.push_to_hub + tokenizer.push_to_hub, then in a
    fresh process from_pretrained(repo_id) gives bit-identical logits and a pipeline generates; the README on
    the Hub is ours, with the base card's license and language."""
    hub = hub_in_process
    api = _api(hub)
    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    (base / "README.md").write_text("---\nlicense: mit\nlanguage:\n- en\ntags:\n- tiny\n---\n# a tiny base model\n")
    api.create_repo("tester/tiny-base", exist_ok=True)
    api.upload_folder(folder_path=str(base), repo_id="tester/tiny-base")

    logits_path = tmp_path / "logits.pt"
    run_python(f"""
        import torch, turboquant_hf
        from transformers import AutoModelForCausalLM, AutoTokenizer
        cfg = turboquant_hf.TurboQuantConfig(bits=3, module_bits={{"down_proj": 4}})
        model = AutoModelForCausalLM.from_pretrained("tester/tiny-base", quantization_config=cfg)
        with torch.no_grad():
            torch.save(model(torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3]])).logits, {str(logits_path)!r})
        model.push_to_hub("tiny-tq3", tags=["my-tag"])
        AutoTokenizer.from_pretrained("tester/tiny-base").push_to_hub("tiny-tq3")
    """, hub_env)
    files = hub.files("tester/tiny-tq3")
    assert {"config.json", "model.safetensors", "tq_config.json", "tokenizer.json", "README.md"} <= set(files)
    readme = files["README.md"].decode()
    assert GENERIC not in readme
    assert readme.startswith("---\n") and "## Size" in readme and 'from_pretrained("tester/tiny-tq3"' in readme

    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.load("tester/tiny-tq3")
    _validate_yaml(hub, str(card))
    data = card.data.to_dict()
    ModelCardData(**data, ignore_metadata_errors=False)
    assert data["base_model"] == "tester/tiny-base"
    assert data["base_model_relation"] == "quantized"
    assert data["license"] == "mit" and data["language"] == ["en"]
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"turboquant", "quantized", "3-bit", "4-bit", "my-tag"} <= set(data["tags"])

    out = run_python(f"""
        import json, torch, turboquant_hf
        from transformers import AutoModelForCausalLM, pipeline
        model = AutoModelForCausalLM.from_pretrained("tester/tiny-tq3")
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3]])).logits
        ref = torch.load({str(logits_path)!r})
        pipe = pipeline("text-generation", model="tester/tiny-tq3")
        text = pipe("the a of", max_new_tokens=5, do_sample=False)[0]["generated_text"]
        print(json.dumps({{"equal": bool(torch.equal(logits, ref)), "text": text,
                          "cls": type(model.model.layers[0].mlp.down_proj).__name__}}))
    """, hub_env)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["equal"], "logits after the Hub round trip differ from the model that was pushed"
    assert result["cls"] == "TurboQuantLinear"
    assert result["text"].startswith("the a of") and len(result["text"]) > len("the a of")


# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_build(smollm2_dir, shakespeare, local_hub, hub_env, tmp_path_factory):
    """The real SmolLM2-135M, 3-bit, built by `turboquant-hf quantize --eval --push-to-hub` against the local Hub
    (whose copy of the base repo holds only its card: license and language come from there)."""
    mp = pytest.MonkeyPatch()
    point_at_local_hub(mp, local_hub, hub_env)
    try:
        d = tmp_path_factory.mktemp("smol")
        card_dir = d / "base_card"
        card_dir.mkdir()
        (card_dir / "README.md").write_text(
            "---\nlicense: apache-2.0\nlanguage:\n- en\nlibrary_name: transformers\n---\n# SmolLM2\n")
        api = _api(local_hub)
        api.create_repo(SMOL_ID, exist_ok=True)
        api.upload_folder(folder_path=str(card_dir), repo_id=SMOL_ID)
        text = d / "hamlet_macbeth.txt"
        text.write_text(shakespeare)
        out = d / "SmolLM2-135M-Instruct-tq3"
        rc = cli.main(["quantize", smollm2_dir, "--out", str(out), "--bits", "3", "--eval", str(text),
                       "--max-tokens", "512", "--base-model", SMOL_ID, "--push-to-hub", SMOL_REPO, "--json"])
        assert rc == 0
        yield {"dir": str(out), "text": str(text)}
    finally:
        mp.undo()


def test_smollm2_card_has_true_numbers(smollm2_build, local_hub):
    """Sizes in the card equal what the safetensors files hold; perplexity/KL equal the eval run's record."""
    from safetensors import safe_open

    d = smollm2_build["dir"]
    readme = open(os.path.join(d, "README.md"), encoding="utf-8").read()
    assert readme == local_hub.files(SMOL_REPO)["README.md"].decode()
    q_bytes = q_params = fp_bytes = base_bytes = layers = 0
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for k in keys:
            t = f.get_tensor(k)
            if k.endswith(".tq_packed"):
                norms = f.get_tensor(k.replace(".tq_packed", ".tq_norms"))
                rows, groups = norms.shape
                in_features = 576 if groups == 5 else 1536  # SmolLM2: hidden 576 (padded to 640), MLP 1536
                q_bytes += t.numel() + norms.numel() * 4
                q_params += rows * in_features
                base_bytes += rows * in_features * 2
                layers += 1
            elif not k.endswith(".tq_norms"):
                fp_bytes += t.numel() * t.element_size()
                base_bytes += t.numel() * t.element_size()
    assert layers == 30 * 7
    total = q_bytes + fp_bytes
    h = tq_card.human_bytes
    row = re.search(r"^\| weights on disk \| (.+?) \| \*\*(.+?)\*\* \((.+?)× smaller\) \|$", readme, re.M)
    assert row.groups() == (h(base_bytes), h(total), f"{base_bytes / total:.1f}")
    assert f"| bits per weight, quantized layers | 16 | **{round(8 * q_bytes / q_params, 3)}** |" in readme
    assert f"| 3-bit | 210 | {tq_card.human_count(q_params)} | {h(q_bytes)} | {round(8 * q_bytes / q_params, 3)} |" \
        in readme
    assert f"Kept in full precision ({h(fp_bytes)})" in readme
    assert "`model.embed_tokens.weight`" in readme
    # quality: the numbers of the eval run, on the text it names
    ev = json.load(open(os.path.join(d, tq_card.EVAL_NAME)))
    assert ev["tokens"] == 511 and ev["text_sha256"] == hashlib.sha256(
        open(smollm2_build["text"], encoding="utf-8").read().encode()).hexdigest()
    assert ev["quantized_perplexity"] > ev["base_perplexity"] > 1 and ev["mean_kl"] > 0
    assert f"| perplexity | {ev['base_perplexity']:.3f} | {ev['quantized_perplexity']:.3f} |" in readme
    assert f"| 0 | {ev['mean_kl']:.4f} |" in readme
    assert "511 predicted tokens of `hamlet_macbeth.txt`" in readme
    # memory plan: 30 layers x 3 KV heads x 64 x 2 x 2 bytes
    assert "| KV cache per token (bf16) | 23,040 bytes |" in readme
    front = _front(readme)
    assert front["base_model"] == SMOL_ID and front["base_model_relation"] == "quantized"
    assert front["license"] == "apache-2.0" and front["language"] == ["en"]
    assert "turboquant-hf quantize HuggingFaceTB/SmolLM2-135M-Instruct --out SmolLM2-135M-Instruct-tq3 --recipe tq3" \
        in readme


def test_smollm2_from_hub_in_fresh_process(smollm2_build, smollm2_dir, hub_env):
    """from_pretrained(repo_id) in a fresh process: logits bit-identical to quantizing the base on the fly;
    pipeline(model=repo_id) generates."""
    out = run_python(f"""
        import json, torch, turboquant_hf
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
        tok = AutoTokenizer.from_pretrained({SMOL_REPO!r})
        ids = tok("To be, or not to be, that is the question", return_tensors="pt").input_ids
        hub = AutoModelForCausalLM.from_pretrained({SMOL_REPO!r})
        with torch.no_grad():
            a = hub(ids).logits
        del hub
        local = AutoModelForCausalLM.from_pretrained({smollm2_dir!r},
                                                     quantization_config=turboquant_hf.TurboQuantConfig(bits=3))
        with torch.no_grad():
            b = local(ids).logits
        del local
        pipe = pipeline("text-generation", model={SMOL_REPO!r})
        text = pipe("The king said", max_new_tokens=4, do_sample=False)[0]["generated_text"]
        print(json.dumps({{"equal": bool(torch.equal(a, b)), "text": text}}))
    """, hub_env, timeout=400)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["equal"]
    assert result["text"].startswith("The king said") and len(result["text"]) > len("The king said")


# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tq_dir(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import turboquant_hf

    d = str(tmp_path_factory.mktemp("tiny_tq"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=turboquant_hf.TurboQuantConfig())
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(d)
    return d


@pytest.mark.parametrize("failure", ["401", "500", "drop"])
def test_push_failures_are_clear_and_leave_files_alone(failure, hub_in_process, tiny_tq_dir, monkeypatch, capsys):
    hub = hub_in_process
    repo = f"tester/fail-{failure}"
    before = _tree_digest(tiny_tq_dir)
    if failure == "401":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong_token")
    elif failure == "500":
        hub.fail("POST", rf"/api/models/{repo}/commit/", status=500)
    else:
        hub.fail("POST", rf"/api/models/{repo}/commit/", drop=True)
    try:
        rc = cli.main(["push", tiny_tq_dir, repo])
    finally:
        hub.clear_failures()
    err = capsys.readouterr().err
    assert rc == cli.EXIT_HUB, err
    assert _tree_digest(tiny_tq_dir) == before, "push modified the local folder"
    assert "again" in err and f"turboquant-hf push {tiny_tq_dir} {repo}" in err
    if failure == "401":
        assert "401" in err and "HF_TOKEN" in err and "creating the repository" in err
        assert repo not in hub.repos
    elif failure == "500":
        assert "500" in err and "uploading" in err
        assert hub.commit_count(repo) == 0
    else:
        assert "connection" in err and "uploading" in err
        assert hub.commit_count(repo) == 0
    # the advertised retry works once the Hub is healthy again
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert cli.main(["push", tiny_tq_dir, repo, "--json"]) == 0
    pushed = hub.files(repo)
    assert GENERIC not in pushed["README.md"].decode() and f'from_pretrained("{repo}"' in pushed["README.md"].decode()
    assert pushed["model.safetensors"] == open(os.path.join(tiny_tq_dir, "model.safetensors"), "rb").read()


def test_plan_reads_hub_headers_only(hub_in_process, tiny_tq_dir, tiny_llama_dir, capsys):
    """plan on a Hub repo: config.json plus Range requests for the safetensors header, never the weights."""
    hub = hub_in_process
    api = _api(hub)
    api.create_repo("tester/plan-base", exist_ok=True)
    api.upload_folder(folder_path=tiny_llama_dir, repo_id="tester/plan-base")
    n = len(hub.log)
    assert cli.main(["plan", "tester/plan-base", "--bits", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    local = sizing.plan_memory(json.load(open(os.path.join(tiny_llama_dir, "config.json"))),
                            {k: (v["dtype"], v["shape"]) for k, v in __import__(
                                "turboquant_hf.format.checkpoint", fromlist=["x"]).read_safetensors_header(os.path.join(tiny_llama_dir, "model.safetensors")).items()},
                            __import__("turboquant_hf").TurboQuantConfig(bits=4))
    assert plan["weights_bytes"] == local["weights_bytes"] and plan["kv_cache_bytes_per_token"] == 512
    served = hub.log[n:]
    assert any("plan-base" in r[1] for r in served), served  # it asked this Hub, not a local folder
    # never the weights: every GET of the safetensors file is a Range request answered 206. (In two full-suite CI
    # runs no GET of the file was logged at all although the plan was right; the cause is not found yet.)
    weight_gets = [r for r in served if "model.safetensors" in r[1] and r[0] == "GET"]
    assert all(r[2] == 206 for r in weight_gets), served
    assert cli.main(["plan", "tester/no-such-repo"]) == cli.EXIT_USAGE
    assert "no-such-repo" in capsys.readouterr().err


def test_save_pretrained_push_to_hub_keeps_our_card(hub_in_process, tiny_llama_dir, tmp_path):
    """save_pretrained(..., push_to_hub=True) uploads after the card is written (transformers alone would push
    before it, with its generic card)."""
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=2))
    model.save_pretrained(str(tmp_path / "tiny-tq2"), push_to_hub=True, repo_id="tiny-tq2-saved")
    files = hub_in_process.files("tester/tiny-tq2-saved")
    readme = files["README.md"].decode()
    assert GENERIC not in readme and "2-bit" in readme and 'from_pretrained("tester/tiny-tq2-saved"' in readme
    assert files["model.safetensors"] == (tmp_path / "tiny-tq2" / "model.safetensors").read_bytes()
    assert (tmp_path / "tiny-tq2" / "README.md").read_text() == readme


def test_tq_config_only_repo_loads_by_id(hub_in_process, hub_env, tiny_llama_dir, tmp_path):
    """A Hub repo in the published form (tq_config.json, no quantization_config in config.json), loaded by repo id
    in a fresh process with an empty cache: configs are read without asking the Hub for tq_config.json, so the
    first load finds TurboQuant tensors it has no quantizer for and is refused, naming the fix; tq_config.json is
    fetched then, once, after the weights. Loading again with no arguments (from_pretrained and pipeline) gives the
    saved model's logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    folder = tmp_path / "published"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3))
    model.save_pretrained(folder, model_card=False)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    for name in os.listdir(tiny_llama_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_llama_dir, name), folder)
    ids = [[1, 5, 9, 17, 33, 65, 129, 200, 7, 3]]
    with torch.no_grad():
        save_file({"logits": model(torch.tensor(ids)).logits.contiguous()}, str(tmp_path / "expected.safetensors"))
    hub = hub_in_process
    api = _api(hub)
    api.create_repo("tester/published-form", exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id="tester/published-form")
    (tmp_path / "cache").mkdir()
    start = len(hub.log)
    out = run_python(f"""
        import torch, turboquant_hf
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, pipeline
        from turboquant_hf.format.checkpoint import CheckpointError
        expected = load_file({str(tmp_path / "expected.safetensors")!r})["logits"]
        try:
            AutoModelForCausalLM.from_pretrained("tester/published-form")
        except CheckpointError as e:
            print("REFUSED", str(e).replace(chr(10), " "))
        else:
            raise SystemExit("the first load was not refused")
        for model in (AutoModelForCausalLM.from_pretrained("tester/published-form"),
                      pipeline("text-generation", model="tester/published-form").model):
            with torch.no_grad():
                assert torch.equal(model(torch.tensor({ids})).logits, expected)
            print("LOADED", type(model.model.layers[0].mlp.down_proj).__name__)
    """, dict(hub_env, HF_HUB_CACHE=str(tmp_path / "cache")))
    refused, *loaded = out.strip().splitlines()
    assert refused.startswith("REFUSED") and "loading 'tester/published-form' again works as it is" in refused
    assert "quantization_config=TurboQuantConfig(bits=3, group_size=128)" in refused
    assert loaded == ["LOADED TurboQuantLinear", "LOADED TurboQuantLinear"]
    paths = [path for _, path, _ in hub.log[start:]]
    asked = [i for i, path in enumerate(paths) if path.endswith("/tq_config.json")]
    weights = min(i for i, path in enumerate(paths) if path.endswith("/model.safetensors"))
    assert len([i for i in asked if hub.log[start + i][0] == "GET"]) == 1 and min(asked) > weights, paths


def test_plain_model_by_hub_id_costs_no_request_more(hub_in_process, hub_env, tiny_llama_dir, tmp_path):
    """A model that is not TurboQuant, loaded by Hub id (AutoConfig, AutoModelForCausalLM, the model's own class,
    pipeline) in a fresh process with an empty cache, makes the same requests to the Hub with turboquant_hf
    imported as transformers alone makes: no tq_config.json lookup, nothing else more."""
    hub = hub_in_process
    api = _api(hub)
    api.create_repo("tester/plain-llama", exist_ok=True)
    api.upload_folder(folder_path=str(tiny_llama_dir), repo_id="tester/plain-llama")
    code = """
        import sys
        {imports}
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, pipeline
        AutoConfig.from_pretrained("tester/plain-llama")
        AutoModelForCausalLM.from_pretrained("tester/plain-llama")
        LlamaForCausalLM.from_pretrained("tester/plain-llama")
        pipeline("text-generation", model="tester/plain-llama")
        print("turboquant_hf" in sys.modules)
    """
    requests = {}
    for imported in (False, True):
        cache = tmp_path / f"cache-{imported}"
        cache.mkdir()
        start = len(hub.log)
        out = run_python(code.format(imports="import turboquant_hf" if imported else ""),
                         dict(hub_env, HF_HUB_CACHE=str(cache), TURBOQUANT_AUTOLOAD="0"))
        assert out.split() == [str(imported)]
        requests[imported] = sorted((method, path) for method, path, _ in hub.log[start:])
    assert requests[False] and not any("tq_config" in path for _, path in requests[True])
    assert requests[True] == requests[False]
