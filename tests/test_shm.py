import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from pdlab.kv import shm

SHAPE = (2, 2, 8, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def _exists(name):
    return os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_create_attach_share_bytes_and_unlink():
    seg = shm.create(SHAPE, torch.float32, tag="test")
    try:
        assert seg.name.startswith("pdlab-test-") and _exists(seg.name)
        assert seg.tensor.shape == SHAPE and float(seg.tensor.abs().sum()) == 0.0
        other = shm.attach(seg.name, SHAPE, torch.float32)
        assert not other.owner
        seg.tensor[1, 0, 3].fill_(7.0)
        assert torch.equal(other.tensor, seg.tensor)
        assert seg.name in shm.created_names() and other.name == seg.name
    finally:
        seg.unlink()
    assert not _exists(seg.name) and seg.name not in shm.created_names()
    seg.unlink()  # idempotent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    seg = shm.create(SHAPE, dtype)
    try:
        seg.tensor.fill_(1.5)
        assert shm.attach(seg.name, SHAPE, dtype).tensor.sum().item() == 1.5 * seg.tensor.numel()
    finally:
        seg.unlink()


def test_attach_missing_or_too_small_fails_clearly():
    with pytest.raises(FileNotFoundError):
        shm.attach("pdlab-does-not-exist-xyz", SHAPE, torch.float32)
    seg = shm.create((4,), torch.float32)
    try:
        with pytest.raises(ValueError, match="holds"):
            shm.attach(seg.name, SHAPE, torch.float32)
    finally:
        seg.unlink()


def test_names_must_be_prefixed():
    with pytest.raises(ValueError, match="pdlab-"):
        shm.create(SHAPE, torch.float32, name="other-name")
    with pytest.raises(ValueError):
        shm.sweep("x")
    with pytest.raises(ValueError):
        shm.sweep(shm.PREFIX)  # every run's segments


def test_sweep_removes_a_runs_segments_only():
    a = shm.create((4,), torch.float32, tag="sweeptest-run1")
    b = shm.create((4,), torch.float32, tag="sweeptest-run2")
    try:
        assert shm.sweep("pdlab-sweeptest-run1-") == [a.name]
        assert not _exists(a.name) and _exists(b.name)
    finally:
        b.unlink()


def test_sweep_tmp_removes_a_runs_folders_only(tmp_path, monkeypatch):
    """What a killed worker left in the temporary directory (its UCX log folder, its tensor group's store)
    carries its run's prefix; the cluster's stop removes those folders and nothing else."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tempfile.mkdtemp(prefix="pdlab-run1aa-decode0-ucx-")
    (tmp_path / mine / "ucx.log").write_text("left by a killed worker")
    other = tempfile.mkdtemp(prefix="pdlab-run2bb-decode0-ucx-")
    same_name_file = tmp_path / "pdlab-run1aa-a-file"
    same_name_file.write_text("not a folder")
    assert shm.sweep_tmp("pdlab-run1aa-") == [os.path.basename(mine)]
    assert not os.path.exists(mine) and os.path.isdir(other) and same_name_file.exists()
    with pytest.raises(ValueError):
        shm.sweep_tmp("run1aa-")
    with pytest.raises(ValueError):
        shm.sweep_tmp("pdlab-")  # every run's folders
    assert os.path.isdir(other)


def test_allocator_places_the_pool_once():
    alloc = shm.ShmAllocator(shm.new_name("alloc"))
    t = alloc(SHAPE, torch.float32)
    try:
        assert t.shape == SHAPE and _exists(alloc.name)
        with pytest.raises(RuntimeError):
            alloc(SHAPE, torch.float32)
    finally:
        alloc.segment.unlink()


def _child(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_attacher_exit_does_not_destroy_the_segment():
    seg = shm.create(SHAPE, torch.float32)
    try:
        seg.tensor.fill_(3.0)
        r = _child(f"""
            import torch
            from pdlab.kv import shm
            t = shm.attach({seg.name!r}, {SHAPE!r}, torch.float32).tensor
            assert float(t[0,0,0,0,0,0]) == 3.0
            t.fill_(5.0)
        """)
        assert r.returncode == 0, r.stderr
        assert _exists(seg.name) and float(seg.tensor.mean()) == 5.0
    finally:
        seg.unlink()


def test_owner_exit_unlinks():
    r = _child("""
        import torch
        from pdlab.kv import shm
        print(shm.create((16,), torch.float32, tag="exit").name)
    """)
    assert r.returncode == 0, r.stderr
    assert not _exists(r.stdout.strip())
    # an exception on the way out still unlinks
    r = _child("""
        import torch
        from pdlab.kv import shm
        print(shm.create((16,), torch.float32, tag="exc").name, flush=True)
        raise SystemExit(3)
    """)
    assert r.returncode == 3 and not _exists(r.stdout.strip())
