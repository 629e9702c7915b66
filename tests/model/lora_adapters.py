"""PEFT adapters made at test time over a tiny checkpoint, and transformers' greedy output with one merged."""

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# A chat template for the tiny word-level tokenizer (which has none): roles and turn ends as vocabulary words
CHAT_TEMPLATE = ("{% for m in messages %}{{ 'w3' if m['role'] != 'assistant' else 'w4' }} {{ m['content'] }} w5 "
                 "{% endfor %}{% if add_generation_prompt %}w4 {% endif %}")


def write_adapter(base: Path, out: Path, targets: list[str], seed: int, rank: int = 8, rslora: bool = False,
                  **extra) -> Path:
    """A PEFT LoRA adapter over `base` with random, non-zero lora_B (PEFT starts B at zero: a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            use_rslora=rslora, lora_dropout=0.0, **extra))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft.save_pretrained(out)
    return out


def merged_greedy(base: Path, adapter: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers + PEFT with the adapter merged into the weights: greedy, float32, no EOS stop."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = merged.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()
