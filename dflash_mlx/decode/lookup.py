"""Prompt-lookup drafting: drafts copied from the context, free to propose and often right for many tokens.

Answers that edit code, add type hints, quote a retrieved passage or carry on a chat about a file repeat long
stretches of what they were given. `LookupIndex` holds every token the target has seen in this conversation (the
prompt, earlier chat turns, a server's cached prefix, the committed tokens) and, for the newest suffix of n tokens
(n from `min_n` to `max_n`, longest first), finds where it last occurred before and proposes the tokens that
followed it there. The match is then extended backwards (up to `max_match`) to measure how long it really is: the
source choice (`sources.py`) tracks acceptance per match length, since a 2-token match is a guess and a 20-token
match is usually a copy in progress.

Cost: each new token adds `max_n - min_n + 1` dictionary entries (the n-grams it completes); a proposal is
`max_n - min_n + 1` lookups plus the backward walk. Both are O(1) in the context length, so the index stays
O(new tokens) per pass however long the conversation grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

class DraftMethod(str):
    """A drafting method that needs no drafter model, by its command-line name: what `load(..., drafter="lookup")`
    returns where a drafter model would be, for `stream_generate`, the chat and the server to pass along. It
    compares equal to its name, so `drafter == "lookup"` keeps reading naturally."""


LOOKUP_ONLY = DraftMethod("lookup")  # `--draft lookup`, `drafter="lookup"`: prompt lookup alone
MTP_HEADS = DraftMethod("mtp")  # `--draft mtp`, `load(target, drafter="mtp")`: the target's own MTP layers


def drafter_model(drafter) -> Tuple[Optional[object], bool]:
    """(the drafter model or None, whether prompt lookup alone was asked for) from a drafter argument: a drafter,
    None, or the name of a method without a model ("lookup")."""
    if isinstance(drafter, str):
        return None, drafter == LOOKUP_ONLY
    return drafter, False


@dataclass
class LookupDraft:
    """A continuation copied from the context."""

    tokens: List[int]  # what followed the earlier occurrence (at least one token)
    match: int  # tokens of the newest suffix equal to the context before the earlier occurrence (>= min_n)


class LookupIndex:
    """The n-grams of a token stream, each mapped to where its most recent occurrence was followed by a token.

    Args:
        min_n: shortest suffix that may propose (shorter ones match almost anywhere).
        max_n: longest suffix looked up directly; longer matches are found by extending a max_n match backwards.
        max_match: where the backward extension stops (longer matches are counted as this long).
    """

    def __init__(self, min_n: int = 2, max_n: int = 6, max_match: int = 32):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_match = min_n, max_n, max_match
        self.tokens: List[int] = []
        # n-gram -> index of the token that followed its most recent occurrence. The newest suffix itself is not
        # in the table until a token follows it, so a lookup always finds an earlier occurrence.
        self._follow: Dict[Tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (the prompt, then each pass's committed tokens)."""
        seq, follow = self.tokens, self._follow
        for t in tokens:
            end = len(seq)  # the n-grams ending just before `end` are now followed by t
            for n in range(self.min_n, min(self.max_n, end) + 1):
                follow[tuple(seq[end - n : end])] = end
            seq.append(int(t))

    def occurred(self, ngram: Sequence[int]) -> bool:
        """Whether `ngram` (min_n..max_n tokens) occurred earlier, followed by a token."""
        return tuple(ngram) in self._follow

    def propose(self, limit: int) -> Optional[LookupDraft]:
        """Up to `limit` tokens that followed the longest recent match of the newest suffix, or None."""
        seq = self.tokens
        end = len(seq)
        if limit < 1:
            return None
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._follow.get(tuple(seq[end - n :]))
            if start is None:
                continue
            # Extend the match backwards: how many tokens before the suffix also agree.
            match = n
            while match < self.max_match and start - match - 1 >= 0 and seq[start - match - 1] == seq[end - match - 1]:
                match += 1
            return LookupDraft(self.continuation(start, limit), match)
        return None

    def continuation(self, start: int, limit: int) -> List[int]:
        """Up to `limit` tokens copied from `start` on. A copy that runs into the newest token continues as the
        run it is in repeats (as an LZ77 copy whose source overlaps its output): in a repeating run of period p
        (the newest suffix last seen p tokens back) the copy goes on cyclically, so a loop of any period is
        drafted as wide as the pass allows instead of p tokens at a time."""
        seq = self.tokens
        period = len(seq) - start
        if period <= 0:
            return []
        if start + limit <= len(seq):
            return seq[start : start + limit]
        return [seq[start + k % period] for k in range(limit)]
