"""Training data: files to token rows, with a mask of the tokens worth learning and held-out prompts.

Inputs (paths, directories or globs, mixed freely):
- plain text or code files: the whole file is trainable;
- `.jsonl` / `.json` records: `messages` (OpenAI style), `conversations` (ShareGPT `from`/`value`), `prompt` with
  an optional `response`/`completion`/`output`, or `text`. Chats are rendered with the target's chat template and
  only the assistant turns are trainable.
Optionally the target answers every prompt itself (`regenerate`, greedy, batched with mlx-lm's `batch_generate`):
the drafter then learns exactly the distribution it has to predict at decoding time (the recipe's choice).

Documents are shuffled, a few are held out as evaluation prompts, and the rest are packed end to end into rows of
`seq_len` tokens (each document closed by EOS).
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DFlashError

TEXT_EXTENSIONS = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts",
                   ".java", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".html", ".css", ".tex")
RECORD_EXTENSIONS = (".jsonl", ".json")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                   "system": "system"}


@dataclass
class Document:
    """One tokenized document; `trainable[i]` says whether token i is a label worth learning."""

    tokens: List[int]
    trainable: List[int]
    prompt: List[int]  # the ids a generation starts from (chat: up to the first assistant turn)
    chat: bool = False


@dataclass
class PreparedData:
    tokens: np.ndarray  # [N, S] int32
    trainable: np.ndarray  # [N, S] uint8
    eval_prompts: List[List[int]]
    summary: Dict[str, object] = field(default_factory=dict)


# -- finding and reading ------------------------------------------------------------------------------------------
def collect_files(specs: Sequence[str], extensions: Sequence[str] = TEXT_EXTENSIONS + RECORD_EXTENSIONS) -> List[Path]:
    """Files named by paths, directories (searched recursively for `extensions`) and glob patterns; sorted, unique."""
    found: Dict[str, Path] = {}
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_file():
            matches = [path]
        elif path.is_dir():
            matches = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in extensions]
        else:
            matches = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
            if not matches:
                raise DFlashError(f"--data {spec}: no such file, directory or matching glob")
        for p in matches:
            found[str(p.resolve())] = p
    if not found:
        raise DFlashError(f"--data {' '.join(specs)}: no readable files (extensions: {' '.join(extensions)})")
    return [found[k] for k in sorted(found)]


def _json_items(text: str) -> Iterator[dict]:
    """The elements of a top-level JSON array one by one; a truncated tail (as in some dataset dumps) just ends it."""
    decoder = json.JSONDecoder()
    i, n = text.index("[") + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return
        yield item


def read_records(path: Path) -> Iterator[dict]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".json":
        if text.lstrip().startswith("["):
            yield from _json_items(text)
        else:
            yield json.loads(text)
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as e:
                raise DFlashError(f"{path}:{n}: not JSON ({e}); fix the line or remove the file from --data") from None


def record_messages(record: dict) -> Optional[List[Dict[str, str]]]:
    """A chat record as [{role, content}], or None for a plain `text` record."""
    if "messages" in record:
        return [{"role": m["role"], "content": m.get("content") or ""} for m in record["messages"]]
    if "conversations" in record:
        out = []
        for m in record["conversations"]:
            role = _SHAREGPT_ROLES.get(str(m.get("from", m.get("role", ""))).lower())
            if role is None:
                continue
            out.append({"role": role, "content": m.get("value", m.get("content")) or ""})
        return out
    if "prompt" in record:
        out = [{"role": "user", "content": str(record["prompt"])}]
        for key in ("response", "completion", "output"):
            if record.get(key):
                out.append({"role": "assistant", "content": str(record[key])})
                break
        return out
    return None


# -- tokenizing ----------------------------------------------------------------------------------------------------
def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_chat_template", False):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # templates raise on role orders they do not accept
            raise DFlashError(f"the target's chat template rejected a conversation: {e}") from None
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def _encode(tokenizer, text: str, special: bool) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def eos_id(tokenizer) -> int:
    ids = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    ids = sorted([ids] if isinstance(ids, int) else ids)  # a plain transformers tokenizer may give one int
    return int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else ids[0])


def chat_document(tokenizer, messages: List[Dict[str, str]]) -> Optional[Document]:
    """Render a conversation; only assistant turns are trainable. None if it has no user turn."""
    firsts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    cut = firsts[0] if firsts else len(messages)
    if not any(m["role"] == "user" for m in messages[:cut]):
        return None
    prompt = _encode(tokenizer, _render(tokenizer, messages[:cut], True), False)
    if not firsts:
        return Document(list(prompt), [0] * len(prompt), prompt, chat=True)
    tokens = _encode(tokenizer, _render(tokenizer, messages, False), False)
    trainable = [0] * len(tokens)
    for i in firsts:
        # Token spans from rendering prefixes: templates render a conversation's prefix as a prefix of its text.
        begin = len(_encode(tokenizer, _render(tokenizer, messages[:i], True), False))
        end = len(_encode(tokenizer, _render(tokenizer, messages[: i + 1], False), False))
        for j in range(begin, min(end, len(tokens))):
            trainable[j] = 1
    return Document(tokens, trainable, prompt, chat=True)


def prompt_chats(tokenizer, path: Path) -> List[Tuple[List[Dict[str, str]], Document]]:
    """Prompts to answer: each record's turns before its first assistant turn, and their document (a chat with no
    answer yet: `.prompt` holds the rendered ids, generation prompt included). Records without a user turn are
    skipped."""
    if not Path(path).is_file():
        raise DFlashError(f"prompts file '{path}' does not exist")
    chats = []
    for record in read_records(path):
        messages = record_messages(record) or []
        firsts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        messages = messages[: firsts[0]] if firsts else messages
        doc = chat_document(tokenizer, messages)
        if doc is not None:
            chats.append((messages, doc))
    return chats


def write_answers(chats: List[Tuple[List[Dict[str, str]], Document]], answer, decode, out: Path, *, batch: int,
                  minutes: Optional[float] = None, log=print) -> Tuple[int, int]:
    """Answer `chats` (from `prompt_chats`) `batch` at a time and write one chat record per line to `out`:
    `{"messages": [..., {"role": "assistant", "content": ...}]}`. `answer(docs)` gives each doc's answer ids (EOS
    left out), `decode(ids)` its text. No new batch starts after `minutes`. Returns (answers, answer tokens)."""
    import time

    import os

    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial")  # an existing `out` stays whole until the new one is complete
    tic, written, tokens = time.perf_counter(), 0, 0
    with tmp.open("w") as f:
        for begin in range(0, len(chats), batch):
            if minutes is not None and time.perf_counter() - tic > 60 * minutes:
                break
            group = chats[begin : begin + batch]
            for (messages, _), ids in zip(group, answer([doc for _, doc in group])):
                reply = {"role": "assistant", "content": decode(ids)}
                f.write(json.dumps({"messages": messages + [reply]}) + "\n")
                written, tokens = written + 1, tokens + len(ids)
            f.flush()
            seconds = time.perf_counter() - tic
            log(f"{written}/{len(chats)} answered, {tokens} tokens, {tokens / max(seconds, 1e-9):.0f} tok/s")
    os.replace(tmp, out)
    return written, tokens


def text_document(tokenizer, text: str, prompt_tokens: int) -> Optional[Document]:
    tokens = _encode(tokenizer, text, True) + [eos_id(tokenizer)]
    if len(tokens) < 4:
        return None
    return Document(tokens, [1] * len(tokens), tokens[: min(prompt_tokens, len(tokens) // 2)])


def read_documents(tokenizer, files: Sequence[Path], *, max_tokens: Optional[int] = None, prompt_tokens: int = 64,
                   seed: int = 0, progress: bool = True) -> Tuple[List[Document], Dict[str, int]]:
    """Tokenize files in a seeded random order until `max_tokens` (if given) are read."""
    from tqdm import tqdm

    order = list(files)
    np.random.default_rng(seed).shuffle(order)
    docs: List[Document] = []
    total = 0
    counts = {"files": 0, "chats": 0, "texts": 0}
    bar = tqdm(total=max_tokens, desc="tokenizing data", unit="tok", disable=not progress, unit_scale=True)
    for path in order:
        if max_tokens is not None and total >= max_tokens:
            break
        counts["files"] += 1
        if path.suffix.lower() in RECORD_EXTENSIONS:
            items: Iterable = read_records(path)
        else:
            items = [{"text": path.read_text(encoding="utf-8", errors="replace")}]
        for record in items:
            if max_tokens is not None and total >= max_tokens:
                break
            messages = record_messages(record) if isinstance(record, dict) else None
            if messages is not None:
                doc = chat_document(tokenizer, messages)
                counts["chats"] += doc is not None
            elif isinstance(record, dict) and isinstance(record.get("text"), str):
                doc = text_document(tokenizer, record["text"], prompt_tokens)
                counts["texts"] += doc is not None
            else:
                raise DFlashError(f"{path}: a record has none of messages, conversations, prompt, text")
            if doc is not None:
                docs.append(doc)
                total += len(doc.tokens)
                bar.update(len(doc.tokens))
    bar.close()
    counts["tokens"] = total
    return docs, counts


# -- the target answers the prompts itself ---------------------------------------------------------------------------
def regenerate(model, tokenizer, docs: List[Document], *, max_tokens: int = 256, batch_size: int = 16,
               progress: bool = True, stats: Optional[Dict[str, float]] = None) -> List[Document]:
    """Replace every document by its prompt plus the target's greedy answer (trainable), in batches of
    `batch_size` prompts decoded together (mlx-lm's `batch_generate`). `stats` receives tokens, seconds, tok/s."""
    import time

    from mlx_lm.generate import batch_generate
    from tqdm import tqdm

    eos = eos_id(tokenizer)
    out: List[Document] = []
    generated, tic = 0, time.perf_counter()
    with tqdm(total=len(docs), desc="target answers", unit="doc", disable=not progress) as bar:
        for begin in range(0, len(docs), batch_size):
            batch = docs[begin : begin + batch_size]
            result = batch_generate(model, tokenizer, [d.prompt for d in batch], max_tokens=max_tokens,
                                    return_token_ids=True)
            for d, ids in zip(batch, result.token_ids):
                generated += len(ids)
                ids = list(ids) + ([eos] if len(ids) < max_tokens else [])  # stopped at EOS: keep it as a label
                out.append(Document(d.prompt + ids, [0] * len(d.prompt) + [1] * len(ids), d.prompt, d.chat))
            bar.update(len(batch))
            bar.set_postfix_str(f"{generated / (time.perf_counter() - tic):.1f} tok/s", refresh=False)
    seconds = time.perf_counter() - tic
    if stats is not None:
        stats.update(tokens=generated, seconds=round(seconds, 2), tok_s=round(generated / max(seconds, 1e-9), 2))
    return out


# -- packing -----------------------------------------------------------------------------------------------------------
def split_eval(docs: List[Document], num_eval: int, seed: int) -> Tuple[List[Document], List[Document]]:
    """Hold out `num_eval` documents (seeded) whose prompts measure τ; the rest train."""
    if num_eval <= 0:
        return docs, []
    if len(docs) <= num_eval:
        raise DFlashError(f"only {len(docs)} documents: too few to hold out {num_eval} evaluation prompts; add data "
                          "or lower --eval-prompts")
    order = np.random.default_rng(seed + 1).permutation(len(docs))
    held = set(order[:num_eval].tolist())
    return [d for i, d in enumerate(docs) if i not in held], [docs[i] for i in sorted(held)]


def pack(docs: Sequence[Document], seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """Concatenate documents and cut rows of `seq_len` tokens (the incomplete tail is dropped)."""
    tokens = np.fromiter((t for d in docs for t in d.tokens), dtype=np.int32)
    trainable = np.fromiter((t for d in docs for t in d.trainable), dtype=np.uint8)
    rows = len(tokens) // seq_len
    if rows == 0:
        raise DFlashError(f"the data has {len(tokens)} tokens, fewer than one row of --seq-len {seq_len}; add data "
                          "or lower --seq-len")
    n = rows * seq_len
    return tokens[:n].reshape(rows, seq_len), trainable[:n].reshape(rows, seq_len)


def prepare_data(tokenizer, specs: Sequence[str], *, seq_len: int, max_tokens: Optional[int] = None,
                 num_eval: int = 4, prompt_tokens: int = 64, seed: int = 0, model=None,
                 regenerate_tokens: int = 0, batch_size: int = 16, progress: bool = True) -> PreparedData:
    """Read, (optionally) regenerate with `model`, hold out eval prompts, shuffle and pack into rows."""
    files = collect_files(specs)
    docs, counts = read_documents(tokenizer, files, max_tokens=max_tokens, prompt_tokens=prompt_tokens, seed=seed,
                                  progress=progress)
    train_docs, eval_docs = split_eval(docs, num_eval, seed)
    if regenerate_tokens > 0:
        if model is None:
            raise DFlashError("regenerating responses needs the target model")
        gen: Dict[str, float] = {}
        train_docs = regenerate(model, tokenizer, train_docs, max_tokens=regenerate_tokens, batch_size=batch_size,
                                progress=progress, stats=gen)
        counts["generation"] = gen
    order = np.random.default_rng(seed + 2).permutation(len(train_docs))
    tokens, trainable = pack([train_docs[i] for i in order], seq_len)
    summary = dict(counts, documents=len(train_docs), eval_documents=len(eval_docs), rows=int(tokens.shape[0]),
                   seq_len=seq_len, trainable_tokens=int(trainable.sum()), regenerated=regenerate_tokens > 0,
                   sources=[str(s) for s in specs])
    return PreparedData(tokens, trainable, [d.prompt for d in eval_docs], summary)
