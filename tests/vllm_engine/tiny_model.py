"""A tiny random-weight Llama and a word-level tokenizer, built locally (no model hub).

Every word ``w<i>`` of the vocabulary is exactly one token, so a prompt of N
words is N + 1 tokens (with BOS) and block boundaries are predictable. The
weights are drawn with a fixed seed and a wide spread, so greedy decoding is
deterministic and not degenerate: a change in the KV bytes a request attends to
changes its tokens.

    python -m tests.vllm_engine.tiny_model OUT_DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def build(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1000,
    max_positions: int = 4096,
    seed: int = 1,
) -> Path:
    """Write the model and tokenizer to ``out`` (created); returns ``out``.

    The default seed gives weights without near-ties on the test prompts. With
    seed 0, one filler request's 5th token flips between two almost equal
    logits as soon as vLLM's OffloadingConnector is on - with vLLM's own
    worker and filesystem tier just as with ours (measured): the connector
    changes logprobs by about 1e-3, so exact greedy equality needs a model
    whose top logits are not that close.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(vocab - len(SPECIAL_TOKENS))]
    token_ids = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=token_ids, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    bos = token_ids["<s>"]
    tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = max_positions
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(token_ids),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=token_ids["</s>"],
        pad_token_id=token_ids["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)  # spread logits: greedy outputs depend on the KV
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    build(parser.parse_args().out)


if __name__ == "__main__":
    main()
