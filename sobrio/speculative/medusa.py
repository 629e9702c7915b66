"""Medusa-style draft heads (Cai et al. 2024): head k reads the target's last hidden state h_t (after its final
norm), and the token x_{t+1} the target chose from it, and guesses the token k places after that, x_{t+k+1}.
Each head is one residual block, z + SiLU(W z + b), followed by the target's LM head restricted to a draft
vocabulary: the tokens the target itself produced most often on the training prompts (FR-Spec's idea). On
a small model the LM head is a fifth of the weights; 4,096 of SmolLM2's 49,152 rows cost each head 1/12 of
that, and a token outside them is simply never drafted.

The heads come from `sobrio train-draft` (draft_training/train.py): a folder with `draft_heads.safetensors` (the blocks,
the draft vocabulary's ids, its rows of the target's head and input embedding) and `config.json`.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sobrio.errors import ConfigError

WEIGHTS, CONFIG = "draft_heads.safetensors", "config.json"


@dataclass
class DraftHeadsConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    base_model: str  # what it was trained for (a name; the tokenizer check is by vocab_size)
    method: str = "medusa"


class ResBlock(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)  # starts as the identity: head k begins as the target's guess

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


class DraftHeads(torch.nn.Module):
    """Reads h_t and the token it produced, x_{t+1} (its input embedding; Hydra's and EAGLE's point: the heads
    know which of the target's candidates was chosen): z = W [h_t; e(x_{t+1})], then head k is
    block_k(z) against the draft vocabulary's head rows. A token outside the draft vocabulary embeds as 0."""

    def __init__(self, config: DraftHeadsConfig, vocab_ids: torch.Tensor, head_rows: torch.Tensor,
                 embed_rows: torch.Tensor):
        super().__init__()
        d = config.hidden_size
        assert head_rows.shape == embed_rows.shape == (config.draft_vocab_size, d) and len(vocab_ids) == len(head_rows)
        assert bool((vocab_ids[1:] > vocab_ids[:-1]).all()), "draft vocabulary: sorted token ids"
        self.config = config
        self.fuse = torch.nn.Linear(2 * d, d)
        with torch.no_grad():  # starts as z = h_t
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d] = torch.eye(d)
            self.fuse.bias.zero_()
        self.blocks = torch.nn.ModuleList(ResBlock(d) for _ in range(config.num_heads))
        self.register_buffer("vocab_ids", vocab_ids.long())
        self.register_buffer("head_rows", head_rows.float())  # frozen: the target's head, draft vocabulary only
        self.register_buffer("embed_rows", embed_rows.float())  # frozen: the target's input embeddings of it

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] target token ids -> [N, d]: their embedding in the draft vocabulary, 0 outside it."""
        index = torch.searchsorted(self.vocab_ids, tokens).clamp(max=len(self.vocab_ids) - 1)
        inside = self.vocab_ids[index] == tokens
        return self.embed_rows[index] * inside[:, None]

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] and the tokens they produced [N] -> [N, heads, draft vocabulary]."""
        z = self.fuse(torch.cat([hidden.float(), self.embed(tokens)], dim=-1))
        return torch.stack([block(z) @ self.head_rows.T for block in self.blocks], dim=1)

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """-> [N, heads] token ids of the target's vocabulary: each head's most likely token."""
        return self.vocab_ids[self.logits(hidden, tokens).argmax(dim=-1)]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().clone() for k, v in self.state_dict().items()}  # tied rows may share storage
        save_file(tensors, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "DraftHeads":
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
            raise ConfigError(f"--speculative-config: {folder} holds no draft heads ({WEIGHTS} and {CONFIG}; "
                              "`sobrio train-draft` writes them)", "--speculative-config")
        config = DraftHeadsConfig(**json.loads((folder / CONFIG).read_text()))
        tensors = load_file(str(folder / WEIGHTS))
        try:
            heads = cls(config, tensors["vocab_ids"], tensors["head_rows"], tensors["embed_rows"])
            heads.load_state_dict(tensors)
        except (KeyError, RuntimeError, AssertionError) as exc:  # e.g. heads from before d80f941 (no embed_rows)
            raise ConfigError(f"--speculative-config: {folder} holds draft heads of another layout ({exc}): train "
                              "them again with this version's `sobrio train-draft`", "--speculative-config") from None
        return heads.eval()


class DraftHeadProposer:
    """Drafts from the heads, on the hidden state that produced each request's last token (the runner keeps
    the rows it sampled from): head k's guess is the k-th draft."""

    needs_hidden = True

    def __init__(self, heads: DraftHeads, num_speculative_tokens: int):
        assert num_speculative_tokens <= heads.config.num_heads
        self.heads, self.k = heads, num_speculative_tokens

    def propose_batch(self, todo: list, hidden: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        todo = [(req, limit) for req, limit in todo if req.request_id in hidden]
        if not todo:
            return {}
        rows = torch.stack([hidden[req.request_id] for req, _ in todo])
        newest = torch.tensor([req.output_token_ids[-1] for req, _ in todo])
        guesses = self.heads.propose(rows, newest)[:, :self.k].tolist()
        return {req.request_id: row[:limit] for (req, limit), row in zip(todo, guesses)}
