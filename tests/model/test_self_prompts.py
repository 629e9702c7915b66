"""`sobrio train-draft`'s self-written prompts (draft_training/self_prompts.py): the user turn's frame from each real
template, what the filter keeps, and a real model writing requests."""

import copy
from types import SimpleNamespace

import pytest

from sobrio.draft_training.self_prompts import MAX_WORDS, self_prompts, user_turn_frame
from sobrio.errors import ConfigError

GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_frame_is_the_templates_text_before_a_user_turn_and_its_end_token(name, request):
    tokenizer = copy.copy(request.getfixturevalue(name).get_tokenizer())
    if name == "gemma3":  # its GGUF carries no template here: Gemma's turn markup, as its own template has
        tokenizer.chat_template = GEMMA_TEMPLATE
    frame, stop = user_turn_frame(tokenizer)
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert whole.startswith(frame + "Hi there")
    assert frame.rstrip().endswith("user")  # the frame stops where the user's words begin
    end = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}[name]
    assert tokenizer.convert_tokens_to_ids(end) in stop


def test_a_model_without_a_chat_template_is_told_to_use_the_shipped_prompts(smollm2):
    tokenizer = copy.copy(smollm2.get_tokenizer())
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template.*--self-prompts 0"):
        user_turn_frame(tokenizer)


class FakeLLM:
    """Scripted completions in order (text, finish reason), and a real tokenizer's template."""

    def __init__(self, tokenizer, completions: list[tuple[str, str]]):
        self.tokenizer, self.completions, self.asked = tokenizer, completions, 0

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=True):
        self.asked = len(prompts)
        assert len({p.seed for p in params}) == len(params)  # one seed each: not the same sample n times
        script = (self.completions * (len(prompts) // len(self.completions) + 1))[:len(prompts)]
        return [SimpleNamespace(outputs=[SimpleNamespace(text=t, finish_reason=f)]) for t, f in script]


def test_only_distinct_finished_turns_of_a_sensible_length_are_kept(smollm2):
    long = " ".join(["word"] * (MAX_WORDS + 1))
    script = [("How do tides work?", "stop"), ("  how do  TIDES work?", "stop"), ("Cut off mid", "length"),
              ("Hi", "stop"), (long, "stop"), ("Plan a trip to Rome for me.", "stop")]
    fake = FakeLLM(smollm2.get_tokenizer(), script)
    kept = self_prompts(fake, 10)
    assert kept == ["How do tides work?", "Plan a trip to Rome for me."]
    assert fake.asked > 10  # asks for more than it keeps
    assert self_prompts(fake, 1) == ["How do tides work?"]  # never more than asked


def test_the_model_writes_requests_that_end_by_themselves(smollm2):
    prompts = self_prompts(smollm2, 6, max_tokens=48)
    assert 3 <= len(prompts) <= 6 and len(set(prompts)) == len(prompts)
    assert all("<|im_" not in p and len(p.split()) >= 3 for p in prompts)


@pytest.mark.parametrize("flag", ["--self-prompts", "--samples"])
def test_train_draft_refuses_a_negative_count_before_loading_anything(flag, tmp_path, capsys):
    from sobrio.cli import main

    assert main(["train-draft", "smollm2-135m", str(tmp_path / "head"), flag, "-1"]) == 2
    assert f"{flag} must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "head").exists()
