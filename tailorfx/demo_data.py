"""The demo's data: the Python standard library's own source as a corpus (one document per file,
every HOLDOUT_EVERY-th file held out) and a byte-level BPE tokenizer trained on it."""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

# generated tables and test suites: not the prose-and-code a language model should learn from
SKIP_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__phello__"})
HOLDOUT_EVERY = 20


def stdlib_files(root: Optional[Path] = None) -> List[Path]:
    """The standard library's *.py files, top-level modules first, then by path (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py")
             if f.is_file() and not (SKIP_PARTS & set(f.relative_to(root).parts))
             and not f.relative_to(root).parts[0].startswith("config-")]
    return sorted(files, key=lambda f: (len(f.relative_to(root).parts), f.relative_to(root).as_posix()))


def build_corpus(max_bytes: int, max_file_bytes: Optional[int] = None,
                 root: Optional[Path] = None) -> Tuple[List[str], List[str]]:
    """(train texts, held-out texts): one document per file, files taken in order while they fit
    in `max_bytes` (files over `max_file_bytes` skipped); of the files taken, every
    HOLDOUT_EVERY-th (the 11th, 31st, ...) is held out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    taken, total = [], 0
    for f in stdlib_files(root):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        n = len(text.encode("utf-8"))
        if not text.strip() or total + n > max_bytes or (max_file_bytes is not None and n > max_file_bytes):
            continue
        taken.append(text)
        total += n
    held_out = lambda i: i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2  # noqa: E731
    return [t for i, t in enumerate(taken) if not held_out(i)], [t for i, t in enumerate(taken) if held_out(i)]


def train_tokenizer(texts: Sequence[str], vocab: int, cache_dir: Path):
    """A byte-level BPE tokenizer trained on `texts` (cached in `cache_dir`); returns
    (tokenizers.Tokenizer, its path, whether it came from the cache)."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    key = hashlib.sha256()
    for t in texts:
        key.update(hashlib.sha256(t.encode("utf-8")).digest())
    path = Path(cache_dir) / f"tokenizer-bpe{vocab}-{key.hexdigest()[:12]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path)), path, True
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(texts), vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return Tokenizer.from_file(str(path)), path, False
