"""The test hub (tests/hub_server.py): huggingface_hub, transformers, datasets and lm-eval reach olah
through HF_ENDPOINT alone, in fresh processes whose only other way out is a proxy that refuses; the
paper's data sets come in their real configs, splits and columns; the gated stand-in needs its token;
and what was fetched loads again with the hub out of reach (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1),
while anything that was not fails loudly."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hub_layouts import MATH_SUBJECTS, MMLU_SUBJECTS, math500

ROOT = Path(__file__).resolve().parents[1]

# What a study's prepare step does on the submitting node (and the compute node again, offline):
# the model and its tokenizer by hub id, and every data set the paper names, by its real configs.
LOADS = textwrap.dedent("""
    import json, os, sys
    import datasets, torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_id, local = sys.argv[1], sys.argv[2]
    report = {"snapshot": sorted(os.listdir(snapshot_download(model_id)))}
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
    mine = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).state_dict()
    report["same_weights"] = all(torch.equal(v, mine[k]) for k, v in model.state_dict().items())
    prompt = tokenizer("2 + 2 =", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    report["generated"] = tokenizer.decode(out[0, prompt.input_ids.shape[1]:])
    report["datasets"] = {}
    for path, names in [("DigitalLearningGmbH/MATH-lighteval", ["default", "algebra"]),
                        ("HuggingFaceH4/MATH-500", ["default"]),
                        ("cais/mmlu", ["college_physics", "college_chemistry", "college_biology"])]:
        for name in names:
            loaded = datasets.load_dataset(path, name)
            report["datasets"][f"{path}:{name}"] = {
                "splits": {split: loaded[split].num_rows for split in loaded},
                "features": {split: loaded[split].features.to_dict() for split in loaded},
                "first": {split: loaded[split][0] for split in loaded}}
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        report["configs"] = {path: datasets.get_dataset_config_names(path)
                             for path in ("DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "cais/mmlu")}
    print("REPORT", json.dumps(report))
""")

NOT_FETCHED = textwrap.dedent("""
    import json, sys
    model, data = sys.argv[1], sys.argv[2]
    errors = {}
    try:
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(model)
    except OSError as error:
        errors["transformers"] = str(error)
    try:
        from trainer.model.models import resolve
        resolve(model)
    except Exception as error:
        errors["trainer"] = str(error)
    try:
        import datasets
        datasets.load_dataset(*data.split(":"))
    except Exception as error:
        errors["datasets"] = f"{type(error).__name__}: {error}"
    print("REPORT", json.dumps(errors))
""")

GATED = textwrap.dedent("""
    import json, os, sys
    from huggingface_hub import hf_hub_download, snapshot_download
    from transformers import AutoConfig, AutoTokenizer

    gated, token = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    report = {}
    if token is None:
        for label, given in (("none", None), ("wrong", "hf_not_the_token")):
            try:
                hf_hub_download(gated, "config.json", token=given)
            except Exception as error:
                report[label] = [type(error).__name__, str(error)]
        try:
            AutoConfig.from_pretrained(gated)
        except Exception as error:
            report["transformers"] = [type(error).__name__, str(error)]
    else:  # the token from HF_TOKEN, as a study's jobs get it
        report["files"] = sorted(os.listdir(snapshot_download(gated, allow_patterns=["*.json"])))
        report["model_type"] = AutoConfig.from_pretrained(gated).model_type
        report["vocab"] = len(AutoTokenizer.from_pretrained(gated))
    print("REPORT", json.dumps(report))
""")


ONLY_LOOPBACK = textwrap.dedent("""
    import json, os
    from huggingface_hub.utils import get_session
    answers = {}
    for url in (os.environ["HF_ENDPOINT"] + "/api/datasets/cais/mmlu/revision/main", "https://huggingface.co/api/models/gpt2"):
        try:
            answers[url] = get_session().get(url, timeout=10).status_code
        except Exception as error:
            answers[url] = f"{type(error).__name__}: {error}"
    print("REPORT", json.dumps(answers))
""")


def client(code: str, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    if check and done.returncode != 0:
        pytest.fail(f"client failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def report(done: subprocess.CompletedProcess) -> dict:
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.fixture(scope="module")
def fetched(hub, smollm2, tmp_path_factory):
    """The prepare step against the hub, into a fresh HF_HOME: its report and the HF_HOME."""
    home = tmp_path_factory.mktemp("hf-home")
    return report(client(LOADS, hub.env(home), hub.model_id, str(smollm2))), home


def test_model_by_hub_id(fetched):
    """snapshot_download brings the repository; transformers loads model and tokenizer by hub id, and
    they are the model klstudy imports (the same weights, bit for bit)."""
    loaded, _ = fetched
    assert loaded["snapshot"] == [".gitattributes", "README.md", "chat_template.jinja", "config.json",
                                  "generation_config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json"]
    assert loaded["same_weights"] and loaded["generated"].strip()


def test_data_sets_in_their_real_layouts(fetched):
    """Configs, splits, row counts, columns and types as the hub's data sets have them."""
    sets = fetched[0]["datasets"]
    assert fetched[0]["configs"] == {"DigitalLearningGmbH/MATH-lighteval": sorted([*MATH_SUBJECTS, "default"]),
                                     "HuggingFaceH4/MATH-500": ["default"], "cais/mmlu": sorted(MMLU_SUBJECTS)}
    string = {"dtype": "string", "_type": "Value"}
    math = sets["DigitalLearningGmbH/MATH-lighteval:default"]
    assert math["splits"] == {"train": 7500, "test": 5000}
    assert math["features"]["train"] == {"problem": string, "level": string, "solution": string, "type": string}
    assert sets["DigitalLearningGmbH/MATH-lighteval:algebra"]["splits"] == {"train": 1744, "test": 1187}
    assert sets["DigitalLearningGmbH/MATH-lighteval:algebra"]["first"]["test"]["type"] == "Algebra"
    assert math["first"]["train"]["level"].startswith("Level ") and "\\boxed{" in math["first"]["train"]["solution"]
    m500 = sets["HuggingFaceH4/MATH-500:default"]
    assert m500["splits"] == {"test": 500}
    assert m500["features"]["test"] == {"problem": string, "solution": string, "answer": string, "subject": string,
                                        "level": {"dtype": "int64", "_type": "Value"}, "unique_id": string}
    assert m500["first"]["test"] == json.loads(math500()["test.jsonl"].decode().splitlines()[0])
    for subject, (test, validation, dev) in MMLU_SUBJECTS.items():
        mmlu = sets[f"cais/mmlu:{subject}"]
        assert mmlu["splits"] == {"test": test, "validation": validation, "dev": dev}
        features = mmlu["features"]["test"]
        assert list(features) == ["question", "subject", "choices", "answer"]
        assert features["answer"] == {"names": ["A", "B", "C", "D"], "_type": "ClassLabel"}
        assert features["choices"]["feature"] == string
        assert mmlu["first"]["dev"]["subject"] == subject and len(mmlu["first"]["dev"]["choices"]) == 4


def test_offline_from_the_cache_alone(hub, fetched, smollm2):
    """With HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1 and the hub out of reach, everything fetched loads the
    same; a model or a config that was never fetched fails, naming what is missing."""
    loaded, home = fetched
    env = hub.env(home, offline=True)
    again = report(client(LOADS, env, hub.model_id, str(smollm2)))
    assert again == {key: value for key, value in loaded.items() if key != "configs"}
    errors = report(client(NOT_FETCHED, env, hub.stand_ins[0], "DigitalLearningGmbH/MATH-lighteval:geometry"))
    assert "couldn't find them in the cached files" in errors["transformers"]
    assert f"model {hub.stand_ins[0]!r} is neither a local directory nor in the Hugging Face cache" in errors["trainer"]
    assert "geometry" in errors["datasets"], errors["datasets"]


def test_gated_stand_in_needs_its_token(hub, tmp_path):
    """Without a token, or with a wrong one, the gated repository is refused as the hub refuses a gated
    one (GatedRepoError); with HF_TOKEN it is served."""
    refused = report(client(GATED, hub.env(tmp_path / "none"), hub.gated_id))
    assert refused["none"][0] == "GatedRepoError" and "401" in refused["none"][1]
    assert refused["wrong"][0] == "GatedRepoError" and "403" in refused["wrong"][1]
    assert hub.gated_id in refused["transformers"][1] and "gated" in refused["transformers"][1].lower()
    served = report(client(GATED, {**hub.env(tmp_path / "token"), "HF_TOKEN": hub.token}, hub.gated_id, "-"))
    assert {"config.json", "tokenizer.json"} <= set(served["files"]) and served["model_type"] == "llama"
    assert served["vocab"] > 40000


def test_clients_reach_only_the_hub(hub, tmp_path):
    """In a client's environment the hub answers, and a request anywhere else goes to the refusing proxy
    (no name is even looked up) and fails at once."""
    answers = report(client(ONLY_LOOPBACK, hub.env(tmp_path)))
    assert answers.pop(f"{hub.endpoint}/api/datasets/cais/mmlu/revision/main") == 200
    assert answers == {"https://huggingface.co/api/models/gpt2": "ConnectError: [Errno 111] Connection refused"}


def test_lm_eval_reads_data_sets_by_hub_id(hub, smollm2, tmp_path):
    """klstudy's lm-eval tasks (dataset_path HuggingFaceH4/MATH-500, cais/mmlu college_physics) get their
    documents from the hub: the generated rows, fetched through nginx."""
    out = tmp_path / "eval"
    client("from eval.__main__ import main; raise SystemExit(main())", hub.env(tmp_path / "hf"), "run",
           "--model", str(smollm2), "--suite", "math500", "mmlu_college_physics", "--limit", "2", "--greedy",
           "--max-gen-toks", "8", "--batch-size", "2", "--out", str(out))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    docs = {task: [s["doc"] for s in samples if s["task"] == task] for task in ("math500", "mmlu_college_physics")}
    served = [json.loads(line) for line in math500()["test.jsonl"].decode().splitlines()[:2]]
    assert docs["math500"] == served
    assert len(docs["mmlu_college_physics"]) == 2 and {d["subject"] for d in docs["mmlu_college_physics"]} == {
        "college_physics"}
    log = (hub.logs / "nginx-access.log").read_text()
    assert "/datasets/HuggingFaceH4/MATH-500/resolve/" in log and "/datasets/cais/mmlu/resolve/" in log


PARAMETERS = "import json, sys; from sweep.study.budget import hub_parameter_count; " \
             "print('REPORT', json.dumps([hub_parameter_count(hub_id) for hub_id in sys.argv[1:]]))"


def test_the_plan_reads_a_hub_models_size_from_its_headers(hub, smollm2, tmp_path):
    """The dry run's checkpoint check (sweep.study.budget) sizes a model the cache lacks from the safetensors
    headers the hub serves: the paper's 7B stand-in counts as the weights it is; a gated model without a
    token, and any model offline, count as unknown."""
    from sweep.study.budget import _tensor_elements

    local = sum(_tensor_elements(path) for path in Path(smollm2).glob("*.safetensors"))
    counts = report(client(PARAMETERS, hub.env(tmp_path / "hf"), hub.stand_ins[0], hub.gated_id))
    assert counts == [local, None] and local > 100e6
    assert report(client(PARAMETERS, hub.env(tmp_path / "hf", offline=True), hub.stand_ins[0])) == [None]
