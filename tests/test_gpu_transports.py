"""The GPU transports' bookkeeping, on CPU: one cuda-ipc export per consumer, and host copies made only of
pieces contiguous on both sides. The copies themselves run in tests/test_transfer.py's CUDA test."""

import pytest
import torch

from pdlab.kv.cuda_ipc import CudaIpcTransport, own_handle
from pdlab.kv.copy import block_runs, host_device_pieces
from pdlab.kv.factory import make_transport

SHAPE = (3, 2, 10, 4, 2, 8)  # layers, K|V, blocks, block_size, kv_heads, head_dim


@pytest.fixture
def fake_reduce(monkeypatch):
    """torch's reduce_tensor, as it behaves: every call takes a fresh ref-count slot (offset)."""
    import torch.multiprocessing.reductions as red

    slots = []

    def reduce(t):
        slots.append(len(slots))
        return None, (None, t.shape, t.stride(), 0, None, t.dtype, 0, b"mem", 64, 0, False, b"/torch_rc",
                      slots[-1], None, False)

    monkeypatch.setattr(red, "reduce_tensor", reduce)
    return slots


def test_cuda_ipc_exports_one_handle_per_peer(fake_reduce):
    t = make_transport("cuda-ipc", "prefill0", "pdlab-x-", "cuda:0", ("GPU-abc", "1"),
                       {"peers": ("decode0", "decode1")})
    t.pool = torch.zeros(SHAPE)
    h = t.export()
    offsets = {p: x["ref_offset"] for p, x in h["per_peer"].items()}
    assert offsets == {"decode0": 0, "decode1": 1}  # each consumer decrements its own counter
    assert h["per_peer"]["decode0"]["gpu"] == "GPU-abc"  # the entry as the launcher passed it
    mine = own_handle(h, "decode1")
    assert mine["ref_offset"] == 1 and mine["name"] == "prefill0-kv"
    with pytest.raises(RuntimeError, match="not for this worker"):
        own_handle(h, "decode7")


def test_cuda_ipc_without_peers_keeps_one_inline_handle(fake_reduce):
    t = CudaIpcTransport("p", "cuda:0", ["0"])
    t.pool = torch.zeros(SHAPE)
    h = t.export()
    assert "per_peer" not in h and h["ref_offset"] == 0 and own_handle(h, "anyone") is h


@pytest.mark.parametrize("src_blocks,dst_blocks", [([1, 2, 3], [5, 6, 7]), ([9, 0, 4], [1, 8, 2])])
def test_host_pieces_are_contiguous_and_copy_exactly_the_blocks(src_blocks, dst_blocks):
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    pieces = host_device_pieces(src, dst, block_runs(src_blocks, dst_blocks))
    assert pieces and all(d.is_contiguous() and s.is_contiguous() for d, s in pieces)
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(dst[:, :, dst_blocks], src[:, :, src_blocks])
    others = [b for b in range(SHAPE[2]) if b not in dst_blocks]
    assert not dst[:, :, others].any()


def test_host_pieces_of_one_layer():
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    for d, s in host_device_pieces(src[1:2], dst[1:2], block_runs([3, 4], [0, 1])):
        d.copy_(s)
    assert torch.equal(dst[1, :, 0:2], src[1, :, 3:5]) and not dst[0].any() and not dst[2].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_ipc_exports_take_one_ref_slot_each():
    """torch's own reduce_tensor, on a GPU: each peer's export has a ref-count slot of its own."""
    t = CudaIpcTransport("prefill0", "cuda:0", ["0"], peers=("decode0", "decode1"))
    t.kv_alloc(SHAPE, torch.bfloat16)
    h = t.export()
    a, b = h["per_peer"]["decode0"], h["per_peer"]["decode1"]
    assert (a["ref_handle"], a["ref_offset"]) != (b["ref_handle"], b["ref_offset"])
    assert a["gpu"] == b["gpu"] == "0" and a["storage_size"] == b["storage_size"]
