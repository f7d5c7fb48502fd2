"""Build a tiny, seeded Llama checkpoint that real vLLM can serve on a CPU, with no network.

A byte-level BPE tokenizer is trained on a small built-in text, wrapped as a Hugging Face fast
tokenizer with a Llama-3.1-style chat template (tools and tool calls included), and saved beside a randomly initialised
`LlamaForCausalLM` (2 layers, hidden 128, 2 heads, 1 KV head: head_dim 64, which vLLM's CPU attention
accepts). Its output is gibberish; the API, the scheduler, the KV cache and the metrics are vLLM's.

Runs in the vLLM environment (torch, transformers, tokenizers):
    .venv-vllm/bin/python -m enginesim.tiny_model DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

# Llama 3.1's special tokens the tool-call parser looks for come last, so the earlier ids stay.
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|python_tag|>", "<|eom_id|>"]
# Llama 3.1's shape: the tools' JSON in the first message, an assistant's tool calls as
# {"name": ..., "parameters": ...} JSON, a tool's result as an `ipython` turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if loop.first and tools %}"
    "{{ 'Call a function as {\"name\": its name, \"parameters\": its arguments}. Functions:\n' }}"
    "{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set args = call['function']['arguments'] %}"
    "{{ '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": ' }}"
    "{{ args if args is string else args | tojson }}{{ '}' }}{% endfor %}"
    "{% elif message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = """
The gateway reads every request, checks who is calling and what data it carries, reserves a budget,
redacts what policy says, and routes it to a qualified deployment of the model. Engines batch the
requests that arrive, keep their keys and values in a paged cache, and stream tokens back. A tenant's
prompts share cached prefixes with that tenant only. Deadlines bound every attempt; a fallback happens
before the first byte or not at all. Budgets, quotas and ledgers count tokens and money, exactly once.
0123456789 !"#$%&'()*+,-./:;<=>?@[]^_`{|}~ abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ
""".strip()


def build(out: Path, seed: int = 0, vocab_size: int = 1024) -> str:
    """Write the checkpoint to `out`; return a digest of its files (stable for a seed)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    digest = hashlib.sha256()
    for path in [*sorted(out.glob("*.safetensors")), out / "tokenizer.json"]:
        digest.update(path.read_bytes())
    (out / "llmgw-tiny-model.json").write_text(json.dumps({"seed": seed, "sha256": digest.hexdigest()}))
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m enginesim.tiny_model")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build(Path(args.dir), args.seed))


if __name__ == "__main__":
    main()
