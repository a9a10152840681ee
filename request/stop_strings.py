"""Stop strings found in text that arrives a piece at a time, in time linear in the pieces.

One Aho-Corasick automaton over the stop strings (built once per request, O(total stop
length)) is fed each new piece of text; its state is the longest suffix of everything fed so
far that is a prefix of some stop string. So nothing already seen is scanned again: a piece of
d characters costs O(d) amortized (at most d + the longest stop string in one call), however
many stop strings there are, and the text that may still become a stop string (what a stream
must hold back) is `partial_len` characters, never more than the longest stop string minus 1.

Matches follow `StopChecker`'s rule (stop_checker.py): of the stop strings that end inside the
newest piece, the one that starts earliest wins, and at one start the one listed first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    stop: str  # the stop string
    back: int  # where it starts, counted back from the end of the text fed so far


class StopStringMatcher:
    """Streaming matcher for one request's stop strings; `feed` each piece in order."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]  # trie edges; node 0 is the root (empty prefix)
        self._depth = [0]
        self._rank = [-1]  # list index of the stop string that ends at this node, or -1
        for rank, stop in enumerate(stops):
            if not stop:
                raise ValueError("stop strings must not be empty")
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._rank.append(-1)
                node = nxt
            if self._rank[node] < 0:  # a string listed twice: the first listing wins
                self._rank[node] = rank
        self._stops = tuple(stops)
        n = len(self._goto)
        self._fail = [0] * n
        self._match = [0] * n  # deepest node on the fail chain (self included) ending a stop string
        self._open = [0] * n  # depth of the deepest node on the fail chain that has children
        self._link()
        self._node = 0

    def _link(self) -> None:
        """Failure links in breadth-first order, and what each node inherits through them."""
        order: deque[int] = deque([0])
        while order:
            node = order.popleft()
            parent_fail = self._fail[node]
            for ch, child in self._goto[node].items():
                if node:
                    f = parent_fail
                    while f and ch not in self._goto[f]:
                        f = self._fail[f]
                    self._fail[child] = self._goto[f].get(ch, 0)
                order.append(child)
            if node:  # the root keeps 0 and 0: no match, nothing open
                f = self._fail[node]
                self._match[node] = node if self._rank[node] >= 0 else self._match[f]
                self._open[node] = self._depth[node] if self._goto[node] else self._open[f]

    @property
    def partial_len(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of a stop
        string: the tail that must be held back (< the longest stop string)."""
        return self._open[self._node]

    def feed(self, piece: str, find: bool = True) -> StopMatch | None:
        """Consumes `piece`; with `find`, returns the earliest stop string that ends inside it
        (None: none does). Without `find` (before min_tokens) matches are ordinary text."""
        goto, fail, depth = self._goto, self._fail, self._depth
        rank, match = self._rank, self._match
        node, best, best_key = self._node, None, None
        for i, ch in enumerate(piece):
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            if find and (m := match[node]):
                # the longest stop string ending here starts earliest; ties keep the first listed
                key = (i + 1 - depth[m], rank[m])
                if best_key is None or key < best_key:
                    best, best_key = m, key
        self._node = node
        if best is None:
            return None
        return StopMatch(self._stops[rank[best]], len(piece) - best_key[0])
