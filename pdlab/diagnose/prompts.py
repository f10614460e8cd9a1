"""Seeded prompts of a set length, in the form the server takes (pdlab.external.probe found which).

Every prompt is drawn afresh (from the run's nonce and the request's number), so no two share a prefix beyond
chance and a prefix cache cannot skip a probe's prefill, even one an earlier diagnosis filled. As token ids they
come from a low range every vocabulary has (synthetic presets have 512 or 4096 tokens). As text, for a server
that refuses token ids, they are common English words, about one token each in the usual BPE vocabularies; the
server's own count (`usage.prompt_tokens`) is then what the analysis uses, and the record keeps both.
"""

from __future__ import annotations

import random
from typing import Union

ID_RANGE = (10, 500)  # token ids drawn from [10, 500): past the usual special tokens, inside any vocabulary
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def prompt(n: int, seed: tuple[int, int], as_text: bool) -> Union[list[int], str]:
    """A prompt of `n` tokens (about `n` words as text), reproducible from `seed`."""
    rng = random.Random(f"{seed[0]}:{seed[1]}")
    if as_text:
        return " ".join(rng.choice(WORDS) for _ in range(n))
    lo, hi = ID_RANGE
    return [rng.randrange(lo, hi) for _ in range(n)]
