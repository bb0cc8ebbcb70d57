"""A prefix cache across requests: frozen target + drafter caches in a token radix trie, under an LRU byte budget.

An entry holds the caches after some token sequence was run through the target (its key). A new prompt reuses the
entry that covers the longest prefix of it, so only the rest is prefilled:
- caches that can be cut back to any length (`can_trim`: mlx-lm's `KVCache`) serve every prompt that shares any
  prefix with the entry's key;
- recurrent layers (GatedDeltaNet) and sliding windows cannot be cut back, so such entries serve only prompts that
  extend their whole key. The server stores those at message boundaries and at the end of every request.

Caches are handled only through mlx-lm's cache protocol (`dflash_mlx.targets.caches`): a snapshot holds
`copy_cache` copies, is cut back with `trim`, and is charged the live caches' `nbytes`. A copy never shares a
mutable container with the live cache; its arrays are new array objects over the same buffers (MLX arrays are
values: a later in-place write into the live cache gives it a new buffer rather than change the copy, since the
shared buffer cannot be donated). Nothing is copied when a request ends; the copy keeps the whole buffer alive,
and that is what the budget counts.

Why not mlx-lm's `LRUPromptCache` (mlx_lm.models.cache, 0.32): it trims every cache of an entry by the same
number of tokens (`trim_prompt_cache`) and charges only `c.nbytes` of caches, so an entry cannot carry target
features still pending for the drafter, whose caches cover fewer tokens than the target's. It takes
`is_trimmable()` as "can be cut to any prefix": our rollback caches answer True (they drop their newest write),
so inserting a hybrid entry drops the shorter message-boundary entries on its path as redundant, and a prompt that
branches before the last write then fails (qwen3_5, key written in two steps of 6, prompt sharing 4 tokens:
DFlashError "cannot roll back 8 tokens"). An exact hit returns no token to prefill, which an entry that cannot be
cut back cannot serve (we need the logits of the prompt's last token), and it offers no shorter entry instead;
ours looks up at most `limit` tokens. Its copies (`copy.deepcopy`) cost no more than ours (MLX arrays share
buffers), so that is no reason either way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..targets.caches import can_trim, copy_cache


def _thaw(frozen: Any, held: int, length: int) -> Any:
    """A live cache equal to `frozen` (which holds `held` tokens) cut back to its first `length` tokens."""
    live = copy_cache(frozen)
    if length < held:
        if not can_trim(frozen):
            raise ValueError(f"a {type(frozen).__name__} holding {held} tokens cannot be cut to {length}")
        live.trim(held - length)
    return live


@dataclass
class Snapshot:
    """Target and drafter caches after `length` tokens; `pending` holds target features not yet in the drafter's
    cache (the drafter's caches then cover `length - pending.shape[1]` tokens)."""

    target: List[Any]
    draft: Optional[List[Any]]
    pending: Optional[mx.array]
    length: int
    nbytes: int
    cuttable: bool

    @classmethod
    def take(cls, target_cache: Sequence[Any], draft_cache: Optional[Sequence[Any]],
             pending: Optional[mx.array], length: int) -> "Snapshot":
        live = list(target_cache) + list(draft_cache or [])
        nbytes = sum(c.nbytes for c in live) + (pending.nbytes if pending is not None else 0)
        target = [copy_cache(c) for c in target_cache]
        draft = None if draft_cache is None else [copy_cache(c) for c in draft_cache]
        mx.eval([c.state for c in target + (draft or [])], pending if pending is not None else [])
        cuttable = all(can_trim(c) for c in target + (draft or []))
        return cls(target, draft, pending, length, nbytes, cuttable)

    def restore(self, length: int) -> Tuple[List[Any], Optional[List[Any]], Optional[mx.array]]:
        """Live (target caches, draft caches, pending features) after the first `length` tokens of the key."""
        if length != self.length and not self.cuttable:
            raise ValueError(f"this snapshot holds {self.length} tokens and cannot be cut to {length}")
        target = [_thaw(c, self.length, length) for c in self.target]
        if self.draft is None:
            return target, None, None
        n_pending = 0 if self.pending is None else self.pending.shape[1]
        in_draft = self.length - n_pending
        draft = [_thaw(c, in_draft, min(in_draft, length)) for c in self.draft]
        pending = None
        if length > in_draft:
            pending = self.pending[:, : length - in_draft]
        return target, draft, pending


class _Node:
    """A radix-trie node: children keyed by the first token of their edge label."""

    __slots__ = ("edge", "children", "entry", "parent")

    def __init__(self, edge: Tuple[int, ...], parent: Optional["_Node"]):
        self.edge = edge
        self.children: dict = {}
        self.entry: Optional[Snapshot] = None
        self.parent = parent


@dataclass
class Hit:
    """The result of a lookup: restore `snapshot` at `length` tokens (0: nothing usable)."""

    snapshot: Optional[Snapshot]
    length: int


class PrefixCache:
    """Snapshots keyed by token sequences, least recently used dropped first beyond `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.root = _Node((), None)
        self.lru: "OrderedDict[int, _Node]" = OrderedDict()  # id(node) -> node, oldest first
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        # Called with (key, snapshot) for each entry dropped for the budget (e.g. to keep it on disk).
        self.on_evict: Optional[Callable[[Tuple[int, ...], Snapshot], None]] = None

    def __len__(self) -> int:
        return len(self.lru)

    # -- trie walking ------------------------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int]):
        """Follow `tokens` down the trie. Returns (path of (node, depth at its end)), the node where matching
        stopped, and how many tokens matched in total (possibly partway along that node's edge)."""
        node, depth, path = self.root, 0, [(self.root, 0)]
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                return path, None, depth
            edge = child.edge
            n = 0
            limit = min(len(edge), len(tokens) - depth)
            while n < limit and edge[n] == tokens[depth + n]:
                n += 1
            depth += n
            if n < len(edge):
                return path, child, depth
            node = child
            path.append((node, depth))
        return path, None, depth

    @staticmethod
    def _subtree_entries(node: _Node):
        stack = [node]
        while stack:
            n = stack.pop()
            if n.entry is not None:
                yield n
            stack.extend(n.children.values())

    # -- public API --------------------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], limit: int) -> Hit:
        """The snapshot that covers the most of `tokens[:limit]` (a prompt keeps at least one token to prefill)."""
        tokens = list(tokens)
        path, partial, matched = self._walk(tokens)
        best: Optional[Tuple[int, _Node]] = None

        def consider(length: int, node: _Node):
            nonlocal best
            if length > 0 and (best is None or length > best[0]):
                best = (length, node)

        for node, depth in path:
            if node.entry is None:
                continue
            if depth <= limit:
                consider(depth, node)
            elif node.entry.cuttable:
                consider(limit, node)
        # Entries below the point where the prompt left the trie share `matched` tokens with it; only cuttable
        # ones can be restored that short.
        below = partial if partial is not None else path[-1][0]
        for node in self._subtree_entries(below) if matched else ():
            if node.entry.cuttable and node is not path[-1][0]:
                consider(min(matched, limit), node)
        if best is None:
            self.misses += 1
            return Hit(None, 0)
        self.hits += 1
        self.lru.move_to_end(id(best[1]))
        return Hit(best[1].entry, best[0])

    def insert(self, tokens: Sequence[int], snapshot: Snapshot) -> bool:
        """Store `snapshot` under `tokens` (replacing an entry with the same key); False if it exceeds the budget."""
        tokens = tuple(tokens)
        if snapshot.nbytes > self.max_bytes or not tokens:
            return False
        node = self._make_path(tokens)
        if node.entry is not None:
            self.nbytes -= node.entry.nbytes
        node.entry = snapshot
        self.nbytes += snapshot.nbytes
        self.lru[id(node)] = node
        self.lru.move_to_end(id(node))
        if snapshot.cuttable:
            # A cuttable entry serves every prefix of its key: shorter cuttable entries on its path are redundant.
            ancestor = node.parent
            while ancestor is not None:
                if ancestor.entry is not None and ancestor.entry.cuttable:
                    self._remove(ancestor)
                ancestor = ancestor.parent
        while self.nbytes > self.max_bytes and self.lru:
            oldest = next(iter(self.lru.values()))
            if self.on_evict is not None:
                self.on_evict(self._key(oldest), oldest.entry)
            self._remove(oldest)
            self.evictions += 1
        return True

    def items(self) -> Iterator[Tuple[Tuple[int, ...], Snapshot]]:
        """(key, snapshot) of every entry, least recently used first."""
        for node in list(self.lru.values()):
            yield self._key(node), node.entry

    def clear(self) -> None:
        self.__init__(self.max_bytes)

    # -- internals -----------------------------------------------------------------------------------------------
    @staticmethod
    def _key(node: _Node) -> Tuple[int, ...]:
        edges = []
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(edges) for t in edge)

    def _make_path(self, tokens: Tuple[int, ...]) -> _Node:
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node)
                node.children[tokens[depth]] = leaf
                return leaf
            edge = child.edge
            n = 0
            limit = min(len(edge), len(tokens) - depth)
            while n < limit and edge[n] == tokens[depth + n]:
                n += 1
            if n < len(edge):
                # Split the edge: a new inner node holds the shared part.
                middle = _Node(edge[:n], node)
                node.children[edge[0]] = middle
                child.edge = edge[n:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            node = child
            depth += n
        return node

    def _remove(self, node: _Node) -> None:
        if node.entry is not None:
            self.nbytes -= node.entry.nbytes
            node.entry = None
        self.lru.pop(id(node), None)
        # Prune empty leaves and merge single-child inner nodes so the trie stays small.
        while node is not self.root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self.root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child
