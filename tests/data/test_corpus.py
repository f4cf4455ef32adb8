"""The embedded corpus: what it selects, that the selection is stable, and its fingerprint."""

import os

from swift_mcore.data import corpus


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def test_stdlib_selection_is_bounded_and_sorted():
    files = corpus.corpus_files()
    names = [rel for rel, _ in files]
    assert names == sorted(names)
    total = sum(size for _, size in files)
    assert 1_000_000 < total <= corpus.MAX_CORPUS_BYTES
    assert not any("site-packages" in n or n.startswith("test/") or "/tests/" in n
                   for n in names)
    docs = list(corpus.iter_documents())
    assert len(docs) == len(files) and all(isinstance(d, str) for d in docs)


def test_selection_rules_on_a_small_tree(tmp_path):
    root = str(tmp_path)
    write(root, "b.py", "b = 2\n")
    write(root, "a.py", "a = 1\n")
    write(root, "pkg/mod.py", "x = 'é'\n")
    write(root, "test/test_a.py", "skipped\n")
    write(root, "site-packages/lib.py", "skipped\n")
    write(root, "notes.txt", "not python\n")
    write(root, "huge.py", "#" * (corpus.MAX_FILE_BYTES + 1))
    with open(os.path.join(root, "latin1.py"), "wb") as fh:
        fh.write(b"s = '\xe9'\n")  # not UTF-8: decoded with a replacement character
    names = [rel for rel, _ in corpus.corpus_files(root)]
    assert names == ["a.py", "b.py", "latin1.py", "pkg/mod.py"]
    docs = list(corpus.iter_documents(root))
    assert docs[0] == "a = 1\n" and "\ufffd" in docs[2]


def test_fingerprint_follows_content(tmp_path):
    root = str(tmp_path)
    write(root, "a.py", "a = 1\n")
    first = corpus.fingerprint(root)
    assert corpus.fingerprint(root) == first
    assert corpus.fingerprint() == corpus.fingerprint()  # the real one is stable too
    other = tmp_path / "other"
    write(str(other), "a.py", "a = 2\n")  # same name and size, one byte differs
    assert corpus.fingerprint(str(other)) != first
