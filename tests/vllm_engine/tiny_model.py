"""Tiny random-weight models and a word-level tokenizer, built locally (no model hub).

:func:`build` makes a Llama (one KV-cache group); :func:`build_hybrid` a
Gemma-3-style text model whose layers alternate sliding-window and full
attention, which vLLM serves with two KV-cache groups of different kinds;
:func:`build_mla` a DeepSeek-V2 model with multi-head latent attention (dense
MLPs, no MoE), whose KV cache is one latent row per token and layer.

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
from typing import Any

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
    _save_spread(LlamaForCausalLM(config), out)
    return out


def build_hybrid(
    out: Path,
    *,
    layers: int = 4,
    sliding_window: int = 128,
    seed: int = 2,
) -> Path:
    """A Gemma-3 text model alternating sliding-window and full-attention layers; ``out``.

    Same tokenizer and sizes as :func:`build`. Seed 2 (and 3) give greedy outputs
    identical with the OffloadingConnector on and off on the engine tests'
    prompts (measured); seed 1 has a near-tie in one filler request.
    """
    import json

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    build(out)  # the tokenizer, and a config to take its special token ids from
    llama = json.loads((out / "config.json").read_text())
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=llama["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        max_position_embeddings=llama["max_position_embeddings"],
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        pad_token_id=llama["pad_token_id"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    _save_spread(Gemma3ForCausalLM(config), out)
    return out


def build_mla(
    out: Path,
    *,
    layers: int = 2,
    seed: int = 4,
) -> Path:
    """A DeepSeek-V2 model with multi-head latent attention (MLA), every layer dense; ``out``.

    Same tokenizer and hidden size as :func:`build`. vLLM caches one latent row per
    token and layer (``kv_lora_rank + qk_rope_head_dim`` values: no K/V split, one
    KV head); vLLM's CPU MLA kernel only takes a 576-wide row, so the latent rank is
    DeepSeek's 512 (rope 64) while the rest is tiny. ``first_k_dense_replace`` equal
    to the layer count makes every MLP dense (no MoE); ``q_lora_rank`` None gives a
    plain query projection.

    The attention projections are drawn narrower (0.05) than the rest (0.2). A
    request served from offload computes its uncached tokens through vLLM's
    context-chunk MLA path (its partial attention outputs rounded to bf16, then
    merged), not the full prefill the baseline runs; with 0.2 everywhere the second
    layer's peaked attention amplifies that into logprob changes of 0.5 nats and
    more: seeds 1, 2 and 4 changed their tokens within the first two, with vLLM's
    own ExampleConnector just as with ours (measured). With 0.05 the change was at
    most about 0.1 nats over five seeds, and seed 4's top-2 margin over the first 8
    tokens of the test's repeated prompt is at least 0.125 (measured).
    """
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    build(out)  # the tokenizer, and a config to take its special token ids from
    llama = json.loads((out / "config.json").read_text())
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=llama["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=layers,  # no MoE layer
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=llama["max_position_embeddings"],
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        pad_token_id=llama["pad_token_id"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    _save_spread(DeepseekV2ForCausalLM(config), out, attention_std=0.05)
    return out


def _save_spread(model: Any, out: Path, *, attention_std: float = 0.2) -> None:
    """Widely spread weights (greedy outputs then depend on the KV), saved as bf16.

    ``attention_std``: the spread of the attention layers' matrices (``self_attn``).
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, attention_std if ".self_attn." in name else 0.2)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    build(parser.parse_args().out)


if __name__ == "__main__":
    main()
