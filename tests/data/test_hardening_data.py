"""Hardening of the data layer: no lost or mismatched .bin/.idx, one-line errors for files that are not UTF-8, bad
output locations and malformed records, and no datasets progress bars."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from qlm_core.data import files
from qlm_core.data.indexed import IndexedDataset, IndexedWriter, remove_stale_temporaries
from qlm_core.data.preprocess import preprocess
from qlm_core.data.sft import load_conversations
from qlm_core.errors import QlmError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from conftest import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


def write_pair(prefix, count=20, start=0):
    with IndexedWriter(prefix, np.uint16) as writer:
        for i in range(count):
            writer.add_document([start + i, 1, 2])
    return {s: Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx")}


def same_pair(prefix, saved):
    return all(Path(f"{prefix}{s}").read_bytes() == data for s, data in saved.items())


def leftovers(folder):
    return sorted(p.name for p in Path(folder).iterdir() if ".tmp" in p.name)


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def test_a_failed_write_keeps_the_old_pair(tmp_path):
    saved = write_pair(tmp_path / "p")
    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "p", np.uint16) as writer:
        writer.add_document([5, 6, 7])
        raise RuntimeError("the run fails")
    assert same_pair(tmp_path / "p", saved) and leftovers(tmp_path) == []


def test_the_old_pair_stays_whole_until_the_new_one_is_complete(tmp_path):
    # what a kill -9 at any moment before close() would find on disk
    saved = write_pair(tmp_path / "p")
    writer = IndexedWriter(tmp_path / "p", np.uint16)
    writer.add_documents(np.arange(300) % 7, [100, 200])
    writer._bin.file.flush()
    assert same_pair(tmp_path / "p", saved)
    assert [d.tolist() for d in IndexedDataset(tmp_path / "p")][:2] == [[0, 1, 2], [1, 1, 2]]
    writer.close()
    assert len(IndexedDataset(tmp_path / "p")) == 2 and leftovers(tmp_path) == []


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path):
    (tmp_path / "p.bin.tmp-999999999").write_bytes(b"killed")
    (tmp_path / "p.idx.tmp-999999999").write_bytes(b"killed")
    live = tmp_path / f"p.bin.tmp-{os.getppid()}"  # a run still writing: left alone
    live.write_bytes(b"busy")
    (tmp_path / "other.bin.tmp-999999999").write_bytes(b"another prefix")
    write_pair(tmp_path / "p")
    assert leftovers(tmp_path) == sorted([live.name, "other.bin.tmp-999999999"])


def test_a_run_killed_between_its_two_renames_is_finished_not_lost(tmp_path):
    """The new .bin is in place, its complete .idx still a dead run's temporary: the next run completes the pair
    (it used to delete that .idx as stale, leaving neither the old dataset nor the new one)."""
    old = write_pair(tmp_path / "p", count=3)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    new = write_pair(new_dir / "p", count=5, start=10)
    (tmp_path / "p.bin").write_bytes(new[".bin"])  # the first rename happened
    (tmp_path / "p.idx.tmp-999999999").write_bytes(new[".idx"])  # the second did not
    assert old[".idx"] != new[".idx"]
    remove_stale_temporaries(tmp_path / "p")
    assert same_pair(tmp_path / "p", new) and leftovers(tmp_path) == []
    assert [d.tolist() for d in IndexedDataset(tmp_path / "p")][0] == [10, 1, 2]


def test_a_pair_that_does_not_belong_together_is_refused(tmp_path):
    write_pair(tmp_path / "a", 20)
    write_pair(tmp_path / "b", 21)
    (tmp_path / "a.bin").write_bytes((tmp_path / "b.bin").read_bytes())
    with pytest.raises(QlmError, match=r"a\.bin \(126 bytes\) and .*a\.idx .*do not belong together"):
        IndexedDataset(tmp_path / "a")
    write_pair(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes((tmp_path / "c.idx").read_bytes()[:-5])
    with pytest.raises(QlmError, match=r"c\.idx is .* bytes but its header describes .*truncated"):
        IndexedDataset(tmp_path / "c")


def enospc_on(suffix):
    original = IndexedWriter._write

    def write(staged, data):
        if staged.final.suffix == suffix and len(data):
            staged.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(staged, data)
    return staticmethod(write)


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_full_disk_is_one_error_and_keeps_the_old_pair(tmp_path, monkeypatch, suffix):
    saved = write_pair(tmp_path / "p")
    monkeypatch.setattr(IndexedWriter, "_write", enospc_on(suffix))
    with pytest.raises(QlmError, match="cannot write the indexed dataset .*p.bin/.idx.*No space left on device; "
                                       "free disk space"):
        write_pair(tmp_path / "p", 30)
    assert same_pair(tmp_path / "p", saved) and leftovers(tmp_path) == []


def test_unwritable_output_folders(tmp_path, monkeypatch):
    # as root a chmod 0o555 folder stays writable, so the refusal is injected where the writer opens files
    saved = write_pair(tmp_path / "ro" / "p")
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: (
        refuse(path) if str(tmp_path / "ro") in os.fsdecode(path) else real_open(path, flags, *a, **k)))
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: (
        refuse(path) if str(tmp_path / "ro") in os.fsdecode(path) else real_mkdir(path, *a, **k)))
    with pytest.raises(QlmError, match=r"ro.*Permission denied; write to a folder you can write to"):
        write_pair(tmp_path / "ro" / "p")
    with pytest.raises(QlmError, match="Permission denied"):
        write_pair(tmp_path / "ro" / "new" / "p")
    monkeypatch.undo()
    assert same_pair(tmp_path / "ro" / "p", saved) and sorted(os.listdir(tmp_path / "ro")) == ["p.bin", "p.idx"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(QlmError, match=r"afile is a file, not a folder; choose another output prefix"):
        write_pair(tmp_path / "afile" / "sub" / "p")
    (tmp_path / "made").mkdir()
    with pytest.raises(QlmError, match="no documents"), IndexedWriter(tmp_path / "made" / "x" / "y" / "p"):
        raise QlmError("no documents")
    assert os.listdir(tmp_path / "made") == []  # the folders the failed writer made are gone again


def test_check_utf8_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_CHUNK", 4)
    good = tmp_path / "good.txt"
    good.write_text("abc\u00e9\u20ac\U0001f600 end", encoding="utf-8")  # multi-byte characters cut by every chunk
    files.check_utf8(good)
    bad = tmp_path / "bad.txt"
    bad.write_bytes("abc\u00e9\u20ac".encode() + b"xx\xffz")
    with pytest.raises(QlmError, match=r"bad.txt is not UTF-8 \(byte 0xff at offset 10\); re-encode it as UTF-8"):
        files.check_utf8(bad)
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"abcdefg\xe2\x82")  # ends inside a character
    with pytest.raises(QlmError, match=r"byte 0xe2 at offset 7"):
        files.check_utf8(cut)


@pytest.mark.parametrize("name,content,message", [
    ("latin.jsonl", '{"text": "caf\u00e9"}\n'.encode("latin-1"),
     r"latin.jsonl is not UTF-8 \(byte 0xe9 at offset 13\)"),
    ("notes.txt", b"hello\n\nw\xffrld\n", r"notes.txt is not UTF-8 \(byte 0xff at offset 8\)"),
    ("wide.json", '[{"text": "a"}]'.encode("utf-16"), r"wide.json is not UTF-8 .*UTF-16"),
])
def test_preprocess_inputs_that_are_not_utf8(tmp_path, tokenizer_dir, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(QlmError, match=message):
        preprocess([tmp_path / name], tokenizer_dir, tmp_path / "out" / "p", cache_dir=str(tmp_path / "c"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,content,message", [
    ("empty.jsonl", b"", "empty.jsonl is empty"),
    ("list.jsonl", b'{"text": "a"}\n[1, 2]\n', r"line 2 is a JSON array, not an object"),
    ("cut.jsonl", b'{"text": "a"}\n{"text": \n', r"line 2 is not valid JSON"),
    ("fake.parquet", b"not parquet at all", r"cannot read .*fake.parquet as parquet \(.*magic bytes"),
])
def test_preprocess_malformed_inputs(tmp_path, tokenizer_dir, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(QlmError, match=message):
        preprocess([tmp_path / name], tokenizer_dir, tmp_path / "p", cache_dir=str(tmp_path / "c"))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(QlmError, match="folder.jsonl is a folder, not a file"):
        preprocess([tmp_path / "folder.jsonl"], tokenizer_dir, tmp_path / "p", cache_dir=str(tmp_path / "c"))
    with pytest.raises(QlmError, match="tokenizer directory .*folder.jsonl holds no tokenizer files"):
        preprocess([tmp_path / name], tmp_path / "folder.jsonl", tmp_path / "p", cache_dir=str(tmp_path / "c"))
    with pytest.raises(QlmError, match=f"tokenizer directory .*{name} is a file, not a directory"):
        preprocess([tmp_path / name], tmp_path / name, tmp_path / "p", cache_dir=str(tmp_path / "c"))


def test_input_names_are_not_glob_patterns(tmp_path, tokenizer_dir):
    # datasets reads data_files as glob patterns: "[x]" would match nothing (StopIteration) or another file
    write_jsonl(tmp_path / "in [x].jsonl", ["the quick fox", "the lazy dog"])
    write_jsonl(tmp_path / "in x.jsonl", ["another file"] * 5)
    stats = preprocess([tmp_path / "in [x].jsonl"], tokenizer_dir, tmp_path / "o [y]" / "p*",
                       cache_dir=str(tmp_path / "c"))
    assert stats.documents == 2 and len(IndexedDataset(tmp_path / "o [y]" / "p*")) == 2


def test_sft_files_that_are_not_utf8_or_malformed(tmp_path):
    bad = tmp_path / "chat.jsonl"
    bad.write_bytes(b'{"messages": [{"role": "user", "content": "gr\xfc\xdf"}]}\n')
    with pytest.raises(QlmError, match=r"chat.jsonl is not UTF-8 \(byte 0xfc at offset 45\)"):
        load_conversations(bad, cache_dir=str(tmp_path / "c"))
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for records, message in [
        ([{"messages": ok}, {"messages": [{"content": "hi"}]}], r"chat.jsonl record 2 .*message role None"),
        ([{"messages": ok}, {"messages": ["hi"]}], r"record 2 .*a turn of 'messages' is a str, not an object"),
        ([{"messages": "hi"}], r"record 1 .*'messages' is a str, not a list"),
        ([{"messages": [{"role": "user", "content": 5}]}], r"record 1 .*the user turn's content holds int"),
        ([{"instruction": "a", "output": 3}], r"record 1 \(alpaca format\): output holds int"),
        ([{"conversations": ["x"]}], r"record 1 \(sharegpt format\): a turn of 'conversations' is a str"),
    ]:
        bad.write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(QlmError, match=message):
            load_conversations(bad, cache_dir=str(tmp_path / "c"))


def test_no_datasets_progress_bars_or_logs(tmp_path, tokenizer_dir, capfd):
    import datasets

    datasets.enable_progress_bars()
    datasets.utils.logging.set_verbosity_warning()
    preprocess([write_jsonl(tmp_path / "a.jsonl", ["the quick fox"] * 5)], tokenizer_dir, tmp_path / "p",
               cache_dir=str(tmp_path / "c"))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    load_conversations(tmp_path / "chat.jsonl", cache_dir=str(tmp_path / "c"))
    with pytest.raises(QlmError):  # a failed json parse: datasets logs it at ERROR level, then raises
        preprocess([write_jsonl(tmp_path / "b.jsonl", ["x"]).with_name("b.jsonl")], tokenizer_dir, tmp_path / "p",
                   json_key="missing", cache_dir=str(tmp_path / "c"))
    (tmp_path / "list.jsonl").write_bytes(b'{"text": "a"}\n[1]\n')
    with pytest.raises(QlmError):
        preprocess([tmp_path / "list.jsonl"], tokenizer_dir, tmp_path / "p", cache_dir=str(tmp_path / "c"))
    err = capfd.readouterr().err
    assert "it/s" not in err and "Generating train split" not in err and "Failed to load JSON" not in err, err


def test_cli_prints_one_line(run_qlm, tmp_path, tokenizer_dir):
    (tmp_path / "in [x].jsonl").write_bytes(b'{"text": "\xff"}\n')
    code, stdout, stderr = run_qlm("data", "preprocess", "--input", tmp_path / "in [x].jsonl", "--tokenizer",
                                   tokenizer_dir, "--output", tmp_path / "out")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "in [x].jsonl is not UTF-8 (byte 0xff at offset 10)" in lines[0], stderr


@pytest.mark.parametrize("stage", ["load", "tokenize"])
def test_a_full_datasets_cache_is_one_error(tmp_path, tokenizer_dir, monkeypatch, stage):
    from datasets import arrow_writer

    saved = write_pair(tmp_path / "p")
    corpus = write_jsonl(tmp_path / "a.jsonl", [f"the quick fox {stage}"] * 3)
    if stage == "tokenize":  # the file is already in the cache: only the map writes
        preprocess([corpus], tokenizer_dir, tmp_path / "first", cache_dir=str(tmp_path / "c"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for name in ("write", "write_batch", "write_table", "write_examples_on_file", "write_rows_on_file"):
        if hasattr(arrow_writer.ArrowWriter, name):
            monkeypatch.setattr(arrow_writer.ArrowWriter, name, full)
    with pytest.raises(QlmError, match="the datasets cache could not be written.*No space left on device; free disk"):
        preprocess([corpus], tokenizer_dir, tmp_path / "p", append_eod=True, cache_dir=str(tmp_path / "c"))
    assert same_pair(tmp_path / "p", saved)


@pytest.mark.parametrize("system", ["no O_TMPFILE", "no way to link"])
def test_systems_without_unnamed_files_or_links(tmp_path, monkeypatch, system):
    from qlm_core.data import indexed

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    if system == "no O_TMPFILE":
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    else:
        monkeypatch.setattr(indexed, "_linkat_empty_path", refuse)
        monkeypatch.setattr(os, "link", refuse)
    saved = write_pair(tmp_path / "p")
    writer = IndexedWriter(tmp_path / "p", np.uint16)
    writer.add_documents(np.arange(10), [4, 6])
    if system == "no O_TMPFILE":  # a named temporary from the start, beside the untouched pair
        assert leftovers(tmp_path) == [f"p.bin.tmp-{os.getpid()}"]
    assert same_pair(tmp_path / "p", saved)
    writer.close()
    assert [d.tolist() for d in IndexedDataset(tmp_path / "p")] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert leftovers(tmp_path) == []
