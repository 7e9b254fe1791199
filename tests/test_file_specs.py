"""File specs for integrations: several native files per rank, raw and safetensors files, memory-only
files, permission bits, no tracker, and the collective ``load_with`` fallback from one tier to the other."""
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import SnapshotError
from snapckpt.formats import Concat, MemoryOnly, RawBytes, TorchSave, safetensors_file


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    big = torch.arange(40, dtype=torch.float32)
    return model, big


def test_native_files_round_trip_both_tiers(snap_env):
    """Every kind of spec written and read back from both tiers; a spec's ``mode`` is the file's permission
    bits on disk (safetensors files get ``safetensors.torch.save_file``'s own, ``0o600`` in 0.8), recorded in
    the manifest and given back by ``LoadCandidate.modes()`` from memory and from disk; the others have the
    default mode."""
    model, big = _state()
    view = big[8:20]  # a contiguous view into a larger storage: only its bytes are written
    tensors = {k: v for k, v in model.state_dict().items()}
    tensors["view"] = view
    expected = {k: v.clone() for k, v in tensors.items()}
    files = {
        "model.safetensors": safetensors_file(tensors, {"format": "pt"}),
        "state.json": RawBytes(json.dumps({"step": 3}).encode(), mode=0o744),
        "optim.pt": TorchSave({"w": model[0].weight, "n": 3}, mode=0o640),
        "blob.bin": Concat([b"HEAD", view, b"TAIL"]),
        "mirror.pt": MemoryOnly({"w": model[0].weight}),
    }
    with Checkpointer(snap_env.ckpt_dir) as ck:
        h = ck.save_files(files, 3, StorageType.DISK, dirname="checkpoint-3", tracker_name=None)
        with torch.no_grad():  # contract 1: the files hold the values at save time
            for p in model.parameters():
                p.add_(100.0)
            big.add_(100.0)
        h.wait()
        d = os.path.join(snap_env.ckpt_dir, "checkpoint-3")
        assert sorted(os.listdir(d)) == [".snapckpt", "blob.bin", "model.safetensors", "optim.pt", "state.json"]
        assert not os.path.exists(os.path.join(snap_env.ckpt_dir, "latest"))  # tracker_name=None
        st = load_file(os.path.join(d, "model.safetensors"))
        assert sorted(st) == sorted(expected)
        for k, v in expected.items():
            assert torch.equal(st[k], v), k
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            assert json.loads(f.read(n))["__metadata__"] == {"format": "pt"}
        assert json.load(open(os.path.join(d, "state.json"))) == {"step": 3}
        raw = open(os.path.join(d, "blob.bin"), "rb").read()
        assert raw == b"HEAD" + expected["view"].numpy().tobytes() + b"TAIL"
        assert torch.equal(torch.load(os.path.join(d, "optim.pt"))["w"], expected["0.weight"])
        manifest = json.load(open(os.path.join(d, ".snapckpt", "manifest.json")))
        assert {k: v["kind"] for k, v in manifest["files"].items()} == {
            "model.safetensors": "bytes", "state.json": "bytes", "optim.pt": "torch", "blob.bin": "bytes"}
        save_file(expected, os.path.join(snap_env.tmp, "ref.safetensors"))  # safetensors' own mode (0.8: 0o600)
        modes = {"model.safetensors": stat.S_IMODE(os.stat(os.path.join(snap_env.tmp, "ref.safetensors")).st_mode),
                 "state.json": 0o744, "optim.pt": 0o640}
        umask = os.umask(0)
        os.umask(umask)
        assert {n: stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) for n in files if n != "mirror.pt"} == \
            {**modes, "blob.bin": 0o666 & ~umask}
        assert {k: v["mode"] for k, v in manifest["files"].items() if "mode" in v} == modes

        seen = []

        def read(cand):
            seen.append(cand.tier)
            if cand.tier == StorageType.MEMORY and len(seen) == 1:
                files = cand.files()
                assert torch.equal(files["mirror.pt"]["w"], expected["0.weight"])  # MemoryOnly is there
                assert files["blob.bin"] == raw and files["state.json"] == b'{"step": 3}'
                assert cand.modes() == modes
                raise RuntimeError("pretend the framework refused it")  # -> all ranks fall back to disk
            cand.verify()
            assert cand.modes() == modes
            return cand.files()

        files, cand = ck.load_with(read)
        assert seen == [StorageType.MEMORY, StorageType.DISK]
        assert cand.tier == StorageType.DISK and cand.path == d and cand.step == 3 and cand.dirname == "checkpoint-3"
        assert "mirror.pt" not in files and files["model.safetensors"] == open(
            os.path.join(d, "model.safetensors"), "rb").read()


def test_empty_part_and_bad_specs(snap_env):
    model, big = _state()
    with Checkpointer(snap_env.ckpt_dir) as ck:
        ck.save_files({}, 1, StorageType.DISK, dirname="empty", tracker_name="latest",
                       tracker_content="empty").wait()
        assert open(os.path.join(snap_env.ckpt_dir, "latest")).read() == "empty"
        assert os.listdir(os.path.join(snap_env.ckpt_dir, "empty")) == [".snapckpt"]
        with pytest.raises(SnapshotError, match="contiguous"):
            Concat([big.view(5, 8).t()])
        for mode in (0o4755, 0o10000, -1, "644", True):
            with pytest.raises(ValueError, match="permission bits such as 0o644"):
                RawBytes(b"x", mode=mode)
        with pytest.raises(SnapshotError, match="share memory"):
            safetensors_file({"a": big, "b": big})
        with pytest.raises(ValueError, match="one path component"):
            ck.save_files({"../x.pt": {}}, 2, StorageType.DISK, dirname="d2", tracker_name=None)
        with pytest.raises(ValueError, match="one path component"):
            ck.save_files({".snapckpt": {}}, 2, StorageType.DISK, dirname="d2", tracker_name=None)
        with pytest.raises(ValueError, match="single directory name"):
            ck.save_files({"x.pt": {}}, 2, StorageType.DISK, dirname="../d2", tracker_name=None)


def test_hidden_native_file_names(snap_env):
    """Native layouts use hidden names (torch DCP's ``.metadata``): written and listed in the manifest."""
    with Checkpointer(snap_env.ckpt_dir) as ck:
        ck.save_files({".metadata": RawBytes(b"meta")}, 1, StorageType.DISK, dirname="iter_0000001",
                       tracker_name=None).wait()
        d = os.path.join(snap_env.ckpt_dir, "iter_0000001")
        assert open(os.path.join(d, ".metadata"), "rb").read() == b"meta"
        files, _ = ck.load_with(lambda c: c.files())
        assert files == {".metadata": b"meta"}
