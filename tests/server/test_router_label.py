"""`sobrio router label` against the session's server (both shipped models): each question asked of each
model, graded as RouteLLM grades (first letter; last integer), written as a training file `train` reads."""

import json

import pytest

from sobrio.cli import main
from sobrio.gateway.router_data import read_labelled
from sobrio.gateway.router_label import grade

QUESTIONS = [
    {"id": "mc1", "prompt": "Question: Which planet is closest to the Sun?\nA. Venus\nB. Mercury\nC. Mars\n"
                            "D. Earth\nAnswer:", "answer": "B", "subject": "astronomy"},
    {"id": "mc2", "prompt": "Question: What is the chemical symbol of gold?\nA. Au\nB. Ag\nC. Gd\nD. Go\n"
                            "Answer:", "answer": "A", "subject": "chemistry"},
    {"id": "n1", "prompt": "Question: What is 3 + 4?\nAnswer:", "answer": "7", "source": "toy"},
]


def test_grading_is_routellms():
    assert grade("B", " B. Mercury") and not grade("B", "The answer is B") and not grade("B", "")
    assert grade("1,200", "so he pays 1,200 dollars") and grade("#### 72", "72 clips in all, total 72")
    assert not grade("109", "He will be 109 years old 10 years from now")  # the last integer decides
    assert not grade("7", "no number")


def test_label_writes_a_training_file_from_both_models(server, tmp_path, capsys):
    data, out = tmp_path / "qa.jsonl", tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    assert main(["router", "label", "--strong", "gemma3-270m", "--weak", "smollm2-135m", "--data", str(data),
                 "--out", str(out), "--url", f"{server.base_url}/v1", "--max-tokens", "8", "--timeout", "60"]) == 0
    labelled = read_labelled(out)
    assert labelled.ids == ["mc1", "mc2", "n1"] and labelled.prompts == [q["prompt"] for q in QUESTIONS]
    assert labelled.subjects == ["astronomy", "chemistry", "toy"]
    assert set(labelled.strong.tolist()) <= {0.0, 1.0} and set(labelled.weak.tolist()) <= {0.0, 1.0}
    assert "3 questions" in capsys.readouterr().out
    data.write_text(json.dumps({"id": "x", "prompt": "p", "answer": "maybe"}) + "\n")
    assert main(["router", "label", "--strong", "a", "--weak", "b", "--data", str(data), "--out", str(out)]) == 2


@pytest.mark.parametrize("answer", ["B", "42"])
def test_a_question_without_a_prompt_is_refused(tmp_path, answer):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"id": "x", "answer": answer}) + "\n")
    assert main(["router", "label", "--strong", "a", "--weak", "b", "--data", str(data),
                 "--out", str(tmp_path / "o.jsonl")]) == 2


def test_a_model_with_a_remote_backend_is_asked_there(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sobrio.gateway.router_label import Endpoint, endpoint

    config = tmp_path / "gateway.toml"
    config.write_text('[[models.big.remote]]\nurl = "http://10.0.0.7:8000/v1"\nmodel = "big-there"\n'
                      'api_key_env = "BIG_KEY"\n')
    monkeypatch.setenv("BIG_KEY", "k-1")
    args = SimpleNamespace(config=str(config), url="http://127.0.0.1:9/v1", api_key_env=None)
    assert endpoint("big", args) == Endpoint("http://10.0.0.7:8000/v1", "big-there", "k-1")
    assert endpoint("small", args) == Endpoint("http://127.0.0.1:9/v1", "small", None)
