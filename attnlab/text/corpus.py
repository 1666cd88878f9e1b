"""The built-in synthetic corpus of ``attnlab demo``, ``train`` and ``ablate``."""

from __future__ import annotations

# Runs such as "ababab" and "acacac": after an "a" the next letter is whichever
# letter came *before* the "a", so the current token alone cannot tell; the one
# head has to look back at the previous token. "xyz" runs need no look-back.
PATTERNS = ("ab", "ac", "ad", "xyz")


def pattern_corpus(n_runs: int = 3000, seed: int = 0) -> str:
    """The built-in synthetic corpus: space-separated runs of repeating patterns."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(PATTERNS) * rng.randint(3, 6) for _ in range(n_runs)) + " "
