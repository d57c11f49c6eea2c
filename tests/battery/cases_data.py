"""`qlm data preprocess` and the data files `qlm train` reads: data loss, encodings, output locations, bad inputs.

Faults a root user cannot cause with permissions (a read-only folder, a full disk) are injected with a
sitecustomize.py on the case's PYTHONPATH that patches os.open / os.mkdir or IndexedWriter._write."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from battery.case import Case, all_of
from battery.fixtures import recipe_text

REPO = Path(__file__).resolve().parents[2]
DOCS = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(40)]


def write_jsonl(path: Path, texts, key="text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def environment(root: Path, inject: str | None = None) -> dict:
    env = {"HF_DATASETS_CACHE": str(root / "hf-cache")}
    if inject is not None:
        (root / "inject").mkdir()
        (root / "inject" / "sitecustomize.py").write_text(inject)
        env["PYTHONPATH"] = f"{root / 'inject'}{os.pathsep}{REPO}"
    return env


def preprocess(root, fx, inputs, output="out/p", *extra, inject=None):
    argv = ["data", "preprocess"]
    for path in inputs:
        argv += ["--input", path]
    argv += ["--tokenizer", fx.tokenizer(), "--output", root / output, *extra]
    return argv, environment(root, inject)


def old_pair(root: Path, output="out/p") -> None:
    """An existing dataset at OUTPUT and a copy of its bytes under root/orig to compare with afterwards."""
    from qlm_core.data.indexed import IndexedWriter

    with IndexedWriter(root / output, "uint16") as writer:
        for i in range(50):
            writer.add_document(list(range(i, i + 7)))
    (root / "orig").mkdir()
    for suffix in (".bin", ".idx"):
        (root / "orig" / f"p{suffix}").write_bytes(Path(f"{root / output}{suffix}").read_bytes())


def old_pair_intact(root: Path, output="out/p") -> str | None:
    for suffix in (".bin", ".idx"):
        path = Path(f"{root / output}{suffix}")
        if not path.is_file():
            return f"old {path.name} is gone"
        if path.read_bytes() != (root / "orig" / f"p{suffix}").read_bytes():
            return f"old {path.name} was changed"
    return None


def nothing_written(root: Path, output="out") -> str | None:
    path = root / output
    if path.exists():
        return f"{output} was written: {sorted(p.name for p in path.rglob('*'))[:4] if path.is_dir() else ''}"
    return None


def mentions(*words):
    def check(root, out):
        missing = [w for w in words if w not in out.stderr]
        return f"message does not name {missing}: {out.stderr.strip()[-200:]}" if missing else None
    return check


ENOSPC = """
import errno, os
import qlm_core.data.indexed as indexed
_write = indexed.IndexedWriter._write
def write(staged, data):
    if staged.final.suffix == {suffix!r} and len(data):
        staged.write(bytes(data)[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(staged, data)
indexed.IndexedWriter._write = staticmethod(write)
"""

READ_ONLY = """
import errno, os
FOLDER = {folder!r}
_open, _mkdir = os.open, os.mkdir
def inside(path):
    path = os.path.abspath(os.fsdecode(path))
    return path == FOLDER or path.startswith(FOLDER + os.sep)
def open_(path, flags, mode=0o777, *, dir_fd=None):
    if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
    return _open(path, flags, mode, dir_fd=dir_fd)
def mkdir(path, mode=0o777, *, dir_fd=None):
    if inside(os.path.dirname(os.path.abspath(os.fsdecode(path)))):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
    return _mkdir(path, mode, dir_fd=dir_fd)
os.open, os.mkdir = open_, mkdir
"""


def big_corpus(root: Path, documents: int) -> Path:
    path = root / "big.jsonl"
    with open(path, "w") as out:
        for i in range(documents):
            out.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog " * 4}) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------- setups

def failed_run_bad_line(root, fx):
    old_pair(root)
    bad = write_jsonl(root / "in.jsonl", DOCS)
    with open(bad, "a") as out:
        out.write('{"text": "cut off\n')
    return preprocess(root, fx, [bad])


def failed_run_json_key(root, fx):
    old_pair(root)
    return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS, key="body")], "out/p", "--json-key", "content")


def failed_run_no_text(root, fx):
    old_pair(root)
    return preprocess(root, fx, [write_jsonl(root / "in.jsonl", ["", "", ""])])


def failed_run_second_input(root, fx):
    old_pair(root)
    return preprocess(root, fx, [write_jsonl(root / "a.jsonl", DOCS), root / "missing.jsonl"])


def disk_full(suffix):
    def setup(root, fx):
        old_pair(root)
        return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)], inject=ENOSPC.format(suffix=suffix))
    return setup


def killed(with_old: bool):
    def setup(root, fx):
        if with_old:
            old_pair(root)
        return preprocess(root, fx, [big_corpus(root, 120000)])
    return setup


def killed_check(with_old: bool):
    def check(root, out):
        if with_old:
            return old_pair_intact(root)
        names = sorted(p.name for p in (root / "out").glob("*")) if (root / "out").exists() else []
        return f"a killed run left {names}" if names else None
    return check


def stale_temporaries(root, fx):
    old_pair(root)
    for suffix in (".bin", ".idx"):
        (root / "out" / f"p{suffix}.tmp-999999999").write_bytes(b"half written")
    return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)])


def fresh_pair_readable(root, out):
    from qlm_core.data.indexed import IndexedDataset

    dataset = IndexedDataset(root / "out" / "p")
    return None if len(dataset) == len(DOCS) else f"{len(dataset)} documents, not {len(DOCS)}"


def write_txt(path: Path) -> Path:
    path.write_text("first paragraph\n\nsecond one\n\n\nthird\n")
    return path


def fresh_pair_count(count):
    def check(root, out):
        from qlm_core.data.indexed import IndexedDataset

        dataset = IndexedDataset(root / "out" / "p")
        return None if len(dataset) == count else f"{len(dataset)} documents, not {count}"
    return check


def pretrain_recipe(root, fx, prefix) -> Path:
    text = recipe_text(fx.hf(), Path(prefix)).replace('kind = "sft"', 'kind = "pretrain"')
    text = text.replace('chat_template = "chatml"\n', "")
    path = root / "recipe.toml"
    path.write_text(text)
    return path


def mismatched_pair(root, fx):
    from qlm_core.data.indexed import IndexedWriter

    for name, count in (("a", 30), ("b", 31)):
        with IndexedWriter(root / name, "uint16") as writer:
            for i in range(count):
                writer.add_document([1, 2, 3, i])
    (root / "a.bin").write_bytes((root / "b.bin").read_bytes())  # a .bin copied from another run
    return ["train", pretrain_recipe(root, fx, root / "a"), "--output", root / "run"], environment(root)


def truncated_idx(root, fx):
    from qlm_core.data.indexed import IndexedWriter

    with IndexedWriter(root / "a", "uint16") as writer:
        for i in range(30):
            writer.add_document([1, 2, 3, i])
    (root / "a.idx").write_bytes((root / "a.idx").read_bytes()[:-13])
    return ["train", pretrain_recipe(root, fx, root / "a"), "--output", root / "run"], environment(root)


def not_utf8(name, content: bytes):
    def setup(root, fx):
        (root / name).write_bytes(content)
        return preprocess(root, fx, [root / name])
    return setup


def chunk_boundary(root, fx):
    # a valid UTF-8 file whose 2-byte "é" straddles the checker's 1 MiB chunk boundary
    line = '{"text": "' + "a" * ((1 << 20) - 11) + 'é"}\n'
    path = root / "edge.jsonl"
    path.write_bytes(line.encode() + b'{"text": "short"}\n')
    assert path.read_bytes()[(1 << 20) - 1:(1 << 20) + 1] == "é".encode()
    return preprocess(root, fx, [path])


def sft_train(records_or_bytes, name="chat.jsonl"):
    def setup(root, fx):
        path = root / "data" / name
        path.parent.mkdir()
        if isinstance(records_or_bytes, bytes):
            path.write_bytes(records_or_bytes)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in records_or_bytes))
        (root / "recipe.toml").write_text(recipe_text(fx.hf(), path))
        return ["train", root / "recipe.toml", "--output", root / "run"], environment(root)
    return setup


def output_under_file(root, fx):
    (root / "afile").write_text("not a folder")
    return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)], "afile/sub/p")


def output_is_folder(root, fx):
    (root / "out" / "p.bin").mkdir(parents=True)
    return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)])


def read_only(nested: bool):
    def setup(root, fx):
        folder = root / "ro"
        folder.mkdir()
        old_pair(root, "ro/p")
        folder.chmod(0o555)  # root ignores it: the injected os.open / os.mkdir refuse like a read-only folder
        return preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)], "ro/sub/deeper/p" if nested else "ro/p",
                          inject=READ_ONLY.format(folder=str(folder)))
    return setup


def read_only_check(nested: bool):
    def check(root, out):
        (root / "ro").chmod(0o755)
        problem = old_pair_intact(root, "ro/p") or mentions("ro", "Permission denied")(root, out)
        if problem is None and nested and (root / "ro" / "sub").exists():
            return "ro/sub was created"
        return problem
    return check


def bracket_output(root, fx):
    return preprocess(root, fx, [write_jsonl(root / "in [x].jsonl", DOCS)], "out [bold]/p[red]")


def no_progress_noise(root, out):
    noise = [w for w in ("it/s", "examples/s", "Generating train split", "Map", "%|") if w in out.stderr]
    return f"datasets noise on stderr: {noise}: {out.stderr.strip()[:200]}" if noise else None


def broken_tokenizer(root, fx):
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text("{broken")
    argv, env = preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)])
    argv[argv.index("--tokenizer") + 1] = root / "tok"
    return argv, env


def tokenizer_at(kind):
    def setup(root, fx):
        argv, env = preprocess(root, fx, [write_jsonl(root / "in.jsonl", DOCS)])
        target = root / "tok"
        if kind == "file":
            target.write_text("not a folder")
        elif kind == "empty":
            target.mkdir()
        argv[argv.index("--tokenizer") + 1] = target
        return argv, env
    return setup


def with_file(name, content: bytes, *extra):
    def setup(root, fx):
        (root / name).write_bytes(content)
        return preprocess(root, fx, [root / name], "out/p", *extra)
    return setup


def folder_input(root, fx):
    (root / "corpus.jsonl").mkdir()
    return preprocess(root, fx, [root / "corpus.jsonl"])


U, A = {"role": "user", "content": "say 1"}, {"role": "assistant", "content": "the number 1"}
OK_RECORDS = [{"messages": [U, A]}] * 8
NO_OUT = lambda root, out: nothing_written(root, "out")  # noqa: E731

CASES = [
    # 1 data loss: a failed or killed run into an existing prefix leaves the old pair byte for byte
    Case("1 data loss", "data: failed preprocess (truncated json line) keeps the old .bin/.idx",
         failed_run_bad_line, check=all_of(lambda r, o: old_pair_intact(r), mentions("in.jsonl", "line 41"))),
    Case("1 data loss", "data: failed preprocess (--json-key absent) keeps the old .bin/.idx",
         failed_run_json_key, check=all_of(lambda r, o: old_pair_intact(r), mentions("'content'", "body"))),
    Case("1 data loss", "data: preprocess of inputs without text keeps the old .bin/.idx",
         failed_run_no_text, check=lambda r, o: old_pair_intact(r)),
    Case("1 data loss", "data: preprocess whose second input is missing keeps the old .bin/.idx",
         failed_run_second_input, check=all_of(lambda r, o: old_pair_intact(r), mentions("missing.jsonl"))),
    Case("1 data loss", "data: kill -9 during preprocess into an existing prefix keeps the old pair",
         killed(True), check=killed_check(True), interrupt=(10, signal.SIGKILL)),
    Case("1 data loss", "data: kill -9 during preprocess into a new prefix leaves nothing",
         killed(False), check=killed_check(False), interrupt=(10, signal.SIGKILL)),
    Case("1 data loss", "data: stale temporaries of a killed run are removed by the next run",
         stale_temporaries, check=fresh_pair_readable, expect_ok=True),
    Case("1 data loss", "data: train on a .bin/.idx pair that does not belong together",
         mismatched_pair, check=mentions("a.bin", "a.idx", "do not belong together")),
    Case("1 data loss", "data: train on a truncated .idx",
         truncated_idx, check=mentions("a.idx", "truncated")),
    # 2 not utf-8
    Case("2 not utf-8", "data: latin-1 jsonl corpus",
         not_utf8("latin.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1")),
         check=all_of(mentions("latin.jsonl is not UTF-8 (byte 0xe9 at offset 13)"), NO_OUT)),
    Case("2 not utf-8", "data: txt corpus with a 0xff byte",
         not_utf8("notes.txt", b"hello\n\nw\xffrld\n"), check=mentions("notes.txt is not UTF-8", "0xff")),
    Case("2 not utf-8", "data: json array corpus in cp1252",
         not_utf8("arr.json", '[{"text": "\u201cquoted\u201d"}]'.encode("cp1252")), check=mentions("arr.json", "0x93")),
    Case("2 not utf-8", "data: UTF-16 jsonl corpus",
         not_utf8("wide.jsonl", '{"text": "a"}\n'.encode("utf-16")), check=mentions("wide.jsonl", "UTF-16")),
    Case("2 not utf-8", "data: a character across the checker's 1 MiB chunk boundary is valid",
         chunk_boundary, expect_ok=True),
    Case("2 not utf-8", "data: SFT train file not UTF-8",
         sft_train(b'{"messages": [{"role": "user", "content": "gr\xfc\xdf"}]}\n'),
         check=mentions("chat.jsonl is not UTF-8", "0xfc")),
    # 3 output locations
    Case("3 output location", "data: --output under a regular file",
         output_under_file, check=all_of(mentions("afile", "is a file"), lambda r, o: None if (r / "afile").is_file()
                                       else "afile was replaced")),
    Case("3 output location", "data: --output whose .bin is a folder",
         output_is_folder, check=mentions("p.bin", "is a folder")),
    Case("3 output location", "data: --output in a read-only folder (EACCES) keeps the old pair",
         read_only(False), check=read_only_check(False)),
    Case("3 output location", "data: --output in new folders under a read-only folder",
         read_only(True), check=read_only_check(True)),
    Case("3 output location", "data: disk fills while writing .bin (ENOSPC) keeps the old pair",
         disk_full(".bin"), check=all_of(lambda r, o: old_pair_intact(r), mentions("No space left"))),
    Case("3 output location", "data: disk fills while writing .idx (ENOSPC) keeps the old pair",
         disk_full(".idx"), check=all_of(lambda r, o: old_pair_intact(r), mentions("No space left"))),
    Case("3 output location", "data: input and output paths with [markup] and spaces, no datasets bars",
         bracket_output, check=all_of(no_progress_noise, lambda r, o: None if (r / "out [bold]" / "p[red].idx").exists()
                                    else "output not written as named"), expect_ok=True),
    # 4 noise
    Case("4 noise", "data: preprocess of txt and jsonl with --workers 2 shows no datasets bars or logs",
         lambda root, fx: preprocess(root, fx, [write_jsonl(root / "a.jsonl", DOCS), write_txt(root / "b.txt")],
                                     "out/p", "--workers", "2", "--append-eod"),
         check=all_of(no_progress_noise, fresh_pair_count(len(DOCS) + 3)), expect_ok=True),
    # 5 bad inputs
    Case("5 bad input", "data: empty jsonl", with_file("empty.jsonl", b""), check=mentions("empty.jsonl", "empty")),
    Case("5 bad input", "data: a folder passed as --input", folder_input, check=mentions("corpus.jsonl", "folder")),
    Case("5 bad input", "data: jsonl with a line that is a list",
         with_file("list.jsonl", b'{"text": "a"}\n[1, 2]\n'), check=mentions("list.jsonl", "line 2 is a JSON array")),
    Case("5 bad input", "data: jsonl of bare strings",
         with_file("strings.jsonl", b'"one"\n"two"\n'), check=mentions("strings.jsonl", "line 1 is a JSON string")),
    Case("5 bad input", "data: a .parquet that is not parquet",
         with_file("fake.parquet", b"PAR? definitely not parquet"), check=mentions("fake.parquet", "parquet")),
    Case("5 bad input", "data: --json-key naming a number column",
         with_file("nums.jsonl", b'{"text": "a", "n": 1}\n', "--json-key", "n"), check=mentions("'n' holds")),
    Case("5 bad input", "data: an input of unknown type (.csv)",
         with_file("table.csv", b"a,b\n1,2\n"), check=mentions("table.csv", ".csv")),
    Case("5 bad input", "data: tokenizer folder with a broken tokenizer.json",
         broken_tokenizer, check=all_of(mentions("tok"), NO_OUT)),
    Case("5 bad input", "data: --tokenizer is a file", tokenizer_at("file"), check=mentions("tok", "is a file")),
    Case("5 bad input", "data: --tokenizer is an empty folder", tokenizer_at("empty"),
         check=mentions("tok", "no tokenizer files")),
    Case("5 bad input", "data: --tokenizer folder missing", tokenizer_at("missing"), check=mentions("tok")),
    Case("5 bad input", "data: SFT record without a role",
         sft_train(OK_RECORDS + [{"messages": [{"content": "hi"}, A]}]), check=mentions("chat.jsonl record 9", "role")),
    Case("5 bad input", "data: SFT messages that are strings",
         sft_train(OK_RECORDS + [{"messages": ["hi", "there"]}]), check=mentions("chat.jsonl record 9", "str")),
    Case("5 bad input", "data: SFT alpaca output that is a number",
         sft_train([{"instruction": "say 1", "output": 1}] * 4), check=mentions("chat.jsonl record 1", "output")),
    Case("5 bad input", "data: SFT jsonl with a broken line",
         sft_train(b'{"messages": []}\n{"messages": [\n'), check=mentions("chat.jsonl", "line 2")),
]
