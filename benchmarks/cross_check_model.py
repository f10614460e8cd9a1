"""A model directory every client of the cross-check can use without the HF hub: a preset's seeded weights
(pdlab.engine.load_model, saved with save_pretrained, as pdlab.external.vllm.model_dir saves them for vLLM)
and a tokenizer of the same vocabulary, so `pdlab serve` loads it (recipe `model: {path: DIR}`) and
`vllm bench serve` / AIPerf take `--tokenizer DIR`.

The tokenizer is word-level: token i is the word `w<i>` (ids 0-3 are <pad>, <s>, </s>, <unk>: the presets'
pad, BOS and EOS ids). Its vocabulary is written down rather than trained, because a random-token prompt
must survive decode -> text -> encode unchanged: the clients draw random token ids, send them as text, and
`pdlab serve` tokenizes that text again. With one word per token and whitespace between words, the prompt
the server counts is the prompt the client drew, token for token (a BPE tokenizer merges across the
boundaries of random tokens, so lengths drift).

    python benchmarks/cross_check_model.py DIR [--preset cpu-demo] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2, 3: pad_token_id, bos_token_id, eos_token_id (presets)


def word_tokenizer(vocab_size: int):
    """A PreTrainedTokenizerFast whose token i is `w<i>` (beyond the special ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def build(out: str, preset: str = "cpu-demo", seed: int = 0) -> str:
    """Write the preset's model and its word tokenizer into `out` (kept when it is already there)."""
    from pdlab.engine.model import PRESETS, load_model

    out = os.path.abspath(out)
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out
    os.makedirs(out, exist_ok=True)
    model = load_model(preset, dtype="float32", seed=seed)
    model.config._attn_implementation = "sdpa"  # pdlab's attention is registered in this process only
    model.save_pretrained(out)
    tok = word_tokenizer(PRESETS[preset].vocab_size)
    ids = list(range(len(SPECIALS), len(SPECIALS) + 50))
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids, "the tokenizer does not round-trip"
    tok.save_pretrained(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--preset", default="cpu-demo")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(build(a.out, a.preset, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
