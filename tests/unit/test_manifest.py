"""The sidecar manifest (snapckpt/ondisk/manifest.py): build/parse round trip and every refusal of a bad
manifest, the name checks that keep files inside a checkpoint directory, size and checksum checks on real
files (a truncated file, a flipped byte), and which directories ``list_committed`` counts as committed."""
from __future__ import annotations

import json
import os
import re
import zlib

import pytest
import xxhash

from snapckpt.errors import CheckpointCorruptError, CommitError
from snapckpt.ondisk import manifest as M
from snapckpt.ondisk.manifest import validate_dirname
from snapckpt.storage.posix import PosixStorage

FS = PosixStorage(fsync=False)


def _rec(data: bytes, kind: str = "torch") -> dict:
    return {"nbytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest(), "kind": kind}


def _write_checkpoint(root, dirname: str, files_by_rank: dict, step: int = 1) -> dict:
    """Write ``{rank: {name: bytes}}`` into ``root/dirname`` with its manifest; return the manifest."""
    d = root / dirname
    (d / M.SIDECAR).mkdir(parents=True)
    parts = {}
    for rank, files in files_by_rank.items():
        parts[rank] = {}
        for name, data in files.items():
            (d / name).write_bytes(data)
            parts[rank][name] = _rec(data)
    m = M.build_manifest(step=step, dirname=dirname, world_size=len(files_by_rank), run_id="r1", parts=parts)
    (d / M.MANIFEST).write_bytes(json.dumps(m).encode())
    return m


def test_build_then_parse_round_trip():
    parts = {0: {"rank_00000.pt": _rec(b"abc")}, 1: {"model.safetensors": _rec(b"xy" * 9, "bytes")}}
    m = M.build_manifest(step=100, dirname="step_00000100", world_size=2, run_id="run", parts=parts,
                         requested_unix=123.5)
    assert m["format"] == "snapckpt" and m["format_version"] == M.FORMAT_VERSION == 1
    assert m["requested_unix"] == 123.5 and m["created_unix"] >= 123.5 and m["checksum"] == "xxh3_64"
    assert m["files"] == {
        "rank_00000.pt": {"rank": 0, "nbytes": 3, "xxh3_64": xxhash.xxh3_64(b"abc").hexdigest(), "kind": "torch"},
        "model.safetensors": {"rank": 1, "nbytes": 18, "xxh3_64": xxhash.xxh3_64(b"xy" * 9).hexdigest(),
                              "kind": "bytes"}}
    assert M.parse_manifest(json.dumps(m).encode(), "step_00000100") == m


def test_kind_defaults_to_torch():
    m = M.build_manifest(step=1, dirname="d", world_size=1, run_id="r",
                         parts={0: {"a.pt": {"nbytes": 1, "xxh3_64": "00"}}})
    assert m["files"]["a.pt"]["kind"] == "torch"


@pytest.mark.parametrize("ranks,word", [((0,), "missing [1]"), ((0, 1, 2), "unexpected [2]"), ((1, 2), "missing [0]")])
def test_build_refuses_a_set_of_parts_other_than_every_rank(ranks, word):
    parts = {r: {f"rank_{r}.pt": _rec(b"x")} for r in ranks}
    with pytest.raises(CommitError, match=re.escape(word)):
        M.build_manifest(step=5, dirname="d", world_size=2, run_id="r", parts=parts)


def test_build_refuses_one_file_claimed_by_two_ranks():
    parts = {0: {"same.pt": _rec(b"a")}, 1: {"same.pt": _rec(b"b")}}
    with pytest.raises(CommitError, match="'same.pt' written by ranks 0 and 1"):
        M.build_manifest(step=5, dirname="d", world_size=2, run_id="r", parts=parts)


def _good() -> dict:
    return M.build_manifest(step=3, dirname="d", world_size=1, run_id="r", parts={0: {"a.pt": _rec(b"a")}})


@pytest.mark.parametrize("mutate,word", [
    (lambda m: m.update(format="other"), "not a snapckpt manifest"),
    (lambda m: m.update(format_version=2), "format_version 2 is not supported"),
    (lambda m: m.pop("step"), "'step' is missing"),
    (lambda m: m.update(world_size="1"), "'world_size' is missing or not int"),
    (lambda m: m.update(files=[]), "'files'"),
    (lambda m: m.update(dirname="elsewhere"), "names directory 'elsewhere'"),
    (lambda m: m["files"].update({"../../etc/passwd": m["files"]["a.pt"]}), "outside its checkpoint directory"),
    (lambda m: m["files"].update({".snapckpt/manifest.json": m["files"]["a.pt"]}), "outside its checkpoint"),
    (lambda m: m["files"]["a.pt"].update(nbytes="1"), "malformed"),
    (lambda m: m["files"]["a.pt"].update(rank=None), "malformed"),
    (lambda m: m["files"]["a.pt"].pop("xxh3_64"), "malformed"),
])
def test_parse_refuses_a_bad_manifest(mutate, word):
    m = _good()
    mutate(m)
    with pytest.raises(CheckpointCorruptError, match=re.escape(word)):
        M.parse_manifest(json.dumps(m).encode(), "d")


@pytest.mark.parametrize("data", [b"", b"{not json", b"\x80\x03}q\x00.", b"[" * 50_000, b"[]", b"null"])
def test_parse_refuses_non_json_and_non_objects_and_names_the_source(data):
    with pytest.raises(CheckpointCorruptError) as ei:
        M.parse_manifest(data, source="/ckpt/d/.snapckpt/manifest.json")
    assert str(ei.value).endswith("[/ckpt/d/.snapckpt/manifest.json]")


def test_parse_accepts_a_legacy_crc32_record():
    m = _good()
    rec = m["files"]["a.pt"]
    del rec["xxh3_64"]
    rec["crc32"] = f"{zlib.crc32(b'a'):08x}"
    assert M.record_checksum(M.parse_manifest(json.dumps(m).encode())["files"]["a.pt"]) == ("crc32", rec["crc32"])


@pytest.mark.parametrize("name", ["step_00000100", "checkpoint-5", "run 1: [a]-é", "ünï 步 🚀", "x" * 200,
                                  "global_step10", "a..b"])
def test_validate_dirname_accepts_plain_names(name):
    assert M.validate_dirname(name) == name


@pytest.mark.parametrize("name", ["", None, 5, "a/b", "/abs", "..", ".", ".hidden", "x\\y", "nul\x00",
                                  "tab\there", "x" * 201, "é" * 101])
def test_validate_dirname_refuses_paths_hidden_and_control_characters(name):
    with pytest.raises(ValueError):
        M.validate_dirname(name)


@pytest.mark.parametrize("name", ["rank_00000.pt", ".metadata", "model.safetensors", "__0_0.distcp",
                                  ".snapckpt/hf_extra.json", "a b:c", "a/b",
                                  "global_step5/zero_pp_rank_0_mp_rank_00_optim_states.pt", "a/.metadata"])
def test_validate_file_name_accepts_relative_paths_and_sidecar_files(name):
    assert M.validate_file_name(name) == name


@pytest.mark.parametrize("name", ["", None, 3, ".", "..", "../x.pt", "a/../b", "a/./b", "a//b", "a/",
                                  "a/.snapckpt", "a/.snapckpt/x", "/abs", "x\\y", "nul\x00", "cr\r",
                                  ".snapckpt", ".snapckpt2", ".snapckpt/manifest.json", ".snapckpt/part_00001.json",
                                  ".snapckpt/fail_00000.json", ".snapckpt/.hidden", ".snapckpt/a/b",
                                  ".snapckpt/", ".snapckpt/.."])
def test_validate_file_name_refuses_escapes_and_reserved_names(name):
    with pytest.raises(ValueError, match="one path component"):
        M.validate_file_name(name)


def test_marker_and_partial_names():
    assert M.partial_dirname("step_00000007", "abc") == ".step_00000007.partial-abc"
    assert M.part_marker_name(3) == ".snapckpt/part_00003.json"
    assert M.fail_marker_name(12) == ".snapckpt/fail_00012.json"
    with pytest.raises(ValueError):  # a rank's marker is never an integration's file name
        M.validate_file_name(M.part_marker_name(3))


def test_checksum_writer_counts_and_hashes_what_passes_through(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        w = M.ChecksumWriter(f)
        for chunk in (b"hello ", b"", memoryview(b"world")):
            w.write(chunk)
        w.flush()
    assert w.nbytes == 11 and (tmp_path / "f").read_bytes() == b"hello world"
    assert w.hexdigest == xxhash.xxh3_64(b"hello world").hexdigest()
    assert M.file_checksum(FS, str(tmp_path / "f")) == w.hexdigest
    assert M.crc32_file(FS, str(tmp_path / "f")) == f"{zlib.crc32(b'hello world'):08x}"


def test_intact_checkpoint_passes_size_and_checksum_checks(tmp_path):
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"A" * 1000, "b.bin": b"bb"}, 1: {"c.pt": os.urandom(5000)}})
    seen = []
    M.check_sizes(FS, str(tmp_path / "d"), m)
    M.check_checksums(FS, str(tmp_path / "d"), m, progress=seen.append)
    assert sum(seen) == 1000 + 2 + 5000


def test_truncated_file_fails_the_size_check(tmp_path):
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"A" * 1000}})
    os.truncate(tmp_path / "d" / "a.pt", 999)
    with pytest.raises(CheckpointCorruptError, match="999 bytes, the manifest says 1000"):
        M.check_sizes(FS, str(tmp_path / "d"), m)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        M.check_checksums(FS, str(tmp_path / "d"), m)


def test_missing_file_fails_the_size_check(tmp_path):
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"A"}})
    os.unlink(tmp_path / "d" / "a.pt")
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        M.check_sizes(FS, str(tmp_path / "d"), m)


def test_a_changed_set_of_files_is_told_apart_from_changed_bytes(tmp_path):
    """A directory changed in place (a listed file deleted, files added: re-sharded weights) is described by
    ``file_set_changes``; the files still there are checked through ``present_files``: intact -> no error,
    a flipped byte in one of them -> still ``CheckpointCorruptError``."""
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"A" * 64, "b.pt": b"B" * 64}})
    d = str(tmp_path / "d")
    assert M.file_set_changes(FS, d, m) == ([], [])
    os.unlink(tmp_path / "d" / "b.pt")
    (tmp_path / "d" / "b-00001-of-00002.pt").write_bytes(b"x")
    (tmp_path / "d" / "sub").mkdir()
    assert M.file_set_changes(FS, d, m) == (["b.pt"], ["b-00001-of-00002.pt", "sub"])
    present = M.present_files(FS, d, m)
    assert sorted(present["files"]) == ["a.pt"]
    M.check_checksums(FS, d, present)
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        M.check_sizes(FS, d, m)  # the full manifest still names the gone file
    (tmp_path / "d" / "a.pt").write_bytes(b"A" * 63 + b"a")
    with pytest.raises(CheckpointCorruptError, match=r"a\.pt has xxh3_64"):
        M.check_checksums(FS, d, present)


def test_flipped_byte_passes_sizes_but_fails_checksums_for_its_rank_only(tmp_path):
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"A" * 4096}, 1: {"b.pt": b"B" * 4096, "c.pt": b"C" * 10}})
    path = tmp_path / "d" / "b.pt"
    data = bytearray(path.read_bytes())
    data[2000] ^= 0x01
    path.write_bytes(bytes(data))
    d = str(tmp_path / "d")
    M.check_sizes(FS, d, m)  # the quick check cannot see it
    M.check_checksums(FS, d, m, rank=0)  # rank 0's files are intact
    for workers in (1, 4):  # sequential and parallel paths
        with pytest.raises(CheckpointCorruptError, match=r"b\.pt has xxh3_64 .* \(corrupted\)"):
            M.check_checksums(FS, d, m, rank=1, max_workers=workers)


def test_legacy_crc32_manifest_is_verified_too(tmp_path):
    m = _write_checkpoint(tmp_path, "d", {0: {"a.pt": b"legacy"}})
    rec = m["files"]["a.pt"]
    del rec["xxh3_64"]
    rec["crc32"] = f"{zlib.crc32(b'legacy'):08x}"
    M.check_checksums(FS, str(tmp_path / "d"), m)
    rec["crc32"] = "00000000"
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        M.check_checksums(FS, str(tmp_path / "d"), m)
    del rec["crc32"]
    with pytest.raises(CheckpointCorruptError, match="holds none of the checksums"):
        M.check_checksums(FS, str(tmp_path / "d"), m)


def test_list_committed_keeps_committed_dirs_oldest_first_and_reports_damaged_ones(tmp_path):
    _write_checkpoint(tmp_path, "step_00000020", {0: {"rank_00000.pt": b"twenty"}}, step=20)
    _write_checkpoint(tmp_path, "step_00000010", {0: {"rank_00000.pt": b"ten"}}, step=10)
    _write_checkpoint(tmp_path, "step_00000030", {0: {"rank_00000.pt": b"thirty"}}, step=30)
    os.truncate(tmp_path / "step_00000030" / "rank_00000.pt", 2)  # damaged: wrong size
    (tmp_path / "step_00000040" / ".snapckpt").mkdir(parents=True)  # snapckpt's, manifest deleted
    (tmp_path / "step_00000050").mkdir()  # no sidecar, but named like a step directory
    (tmp_path / "tensorboard").mkdir()  # foreign: ignored silently
    (tmp_path / ".step_00000060.partial-r1" / ".snapckpt").mkdir(parents=True)  # in flight: never read
    (tmp_path / "latest").write_text("step_00000020")  # a file, not a directory
    problems: list = []
    got = M.list_committed(FS, str(tmp_path), problems=problems, name_pattern=re.compile(r"step_\d{8,}"))
    assert [(c.step, c.dirname) for c in got] == [(10, "step_00000010"), (20, "step_00000020")]
    assert got[0].path == str(tmp_path / "step_00000010") and got[0].manifest["step"] == 10
    assert len(problems) == 3, problems
    assert problems[0].startswith("step_00000030: ") and "truncated" in problems[0]
    assert problems[1].startswith("step_00000040: ") and "missing" in problems[1]
    assert problems[2].startswith("step_00000050: ") and "missing" in problems[2]
    # without the quick check, a wrong size is not looked at; without a pattern, step_00000050 is foreign
    problems = []
    got = M.list_committed(FS, str(tmp_path), quick_check=False, problems=problems)
    assert [c.step for c in got] == [10, 20, 30]
    assert [p.split(":")[0] for p in problems] == ["step_00000040"]


def test_list_committed_skips_a_manifest_naming_another_directory_and_a_missing_root(tmp_path):
    _write_checkpoint(tmp_path, "a", {0: {"x.pt": b"x"}})
    os.rename(tmp_path / "a", tmp_path / "b")  # copied by hand under another name
    problems: list = []
    assert M.list_committed(FS, str(tmp_path), problems=problems) == []
    assert "names directory 'a', found in 'b'" in problems[0]
    assert M.list_committed(FS, str(tmp_path / "nowhere")) == []


# moved whole from tests/test_security.py
@pytest.mark.parametrize("tag", ["a/b", "..", ".", "../escape", "/abs", ".hidden", "x\\y", "nul\x00", "",
                                 "tab\there", "x" * 201])
def test_security_tag_with_path_separators_is_refused(tag):
    """A checkpoint tag that is not one plain directory name ('/', '\\', '..', hidden, control characters
    such as NUL, over 200 bytes) is refused by validate_dirname with ValueError."""
    with pytest.raises(ValueError):
        validate_dirname(tag)


class _RetiredAfterManifestRead(PosixStorage):
    """Renames ``dirname`` to its hidden trash name right after its manifest is read: what the committer's
    retention does (persister/retention.py) while a loader of another job lists the directory."""

    def __init__(self, root, dirname: str) -> None:
        super().__init__(fsync=False)
        self.src, self.dst = str(root / dirname), str(root / f".{dirname}.deleted-r")

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if path == os.path.join(self.src, M.MANIFEST):
            os.rename(self.src, self.dst)
        return data


def test_list_committed_skips_a_directory_retired_during_its_size_check_without_calling_it_damaged(tmp_path):
    # A retired checkpoint is gone, not damaged: reporting it made a loader warn "not a loadable checkpoint"
    # and count it as damaged (latest_step() with nothing else to load raised CheckpointCorruptError).
    _write_checkpoint(tmp_path, "step_00000001", {0: {"rank_00000.pt": b"a"}}, step=1)
    _write_checkpoint(tmp_path, "step_00000002", {0: {"rank_00000.pt": b"b"}}, step=2)
    problems: list = []
    got = M.list_committed(_RetiredAfterManifestRead(tmp_path, "step_00000001"), str(tmp_path), problems=problems,
                           name_pattern=re.compile(r"step_\d{8,}"))
    assert [c.dirname for c in got] == ["step_00000002"]
    assert problems == []
