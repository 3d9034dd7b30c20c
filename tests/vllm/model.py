"""A tiny seeded Llama (float32, safetensors) and a byte-level BPE tokenizer, made locally.

vLLM loads them like any Hugging Face model directory; no hub is needed. The weights are random
(seeded): the outputs mean nothing, but they are deterministic, which is what comparing a single
instance with prefill/decode disaggregation token for token needs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 2048

    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer for one token."""
        head_dim = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head_dim * 4


def corpus_text() -> str:
    """Local text to train the tokenizer on and cut prompts from: this repository's docs."""
    parts = [p.read_text(errors="replace") for p in sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(parts)


def make(out: Path, shape: ModelShape, seed: int = 0) -> Path:
    """Write the model and tokenizer into `out` (made once per shape and seed: the directory
    records both in `shape.json` and is reused when they match)."""
    stamp = json.dumps({"shape": dataclasses.asdict(shape), "seed": seed}, sort_keys=True)
    if (out / "shape.json").exists() and (out / "shape.json").read_text() == stamp:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = shape.max_positions
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        torch_dtype="float32", tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "shape.json").write_text(stamp)
    return out


def prompts(model_dir: Path, lengths: list[int]) -> list[str]:
    """Prompts cut from the docs text, each about `lengths[i]` tokens (different text each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(corpus_text(), add_special_tokens=False)["input_ids"]
    out, pos = [], 0
    for n in lengths:
        if pos + n > len(ids):
            pos = 0
        out.append(tok.decode(ids[pos:pos + n]))
        pos += n + 17
    return out
