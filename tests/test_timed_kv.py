"""A timed engine's tokens come from the KV its pool holds, as a real model's do: the prefill side writes each
prompt token's KV (a function of token, position, layer and K|V), the decode side samples from a digest of
the blocks it holds. So disaggregated tokens equal unified tokens only when a hand-over moved the right
bytes into the right blocks: moving nothing, garbling one block, or filling the wrong layer changes them.
The hand-overs here use the copy functions the workers use (copy_blocks, modelled_copy, PullCopier,
PushCopier), in one process."""

import numpy as np
import pytest
import torch

from engine_helpers import prompts, run
from pdlab.engine import Engine, EngineConfig, SamplingParams
from pdlab.engine.model import load_stand_in
from pdlab.engine.timed import KV_VALUES, kv_values
from pdlab.kv.modelled import modelled_copy
from pdlab.kv.pull import PullCopier
from pdlab.kv.push import PushCopier, PushJob
from pdlab.kv.copy import copy_blocks
from pdlab.recipe import StepTiming, TimingProfile

TIMING = TimingProfile(step=StepTiming(fixed_ms=0.1))  # fast: these tests are about bytes, not time
OUT = 6
BS = 8


def engine(role: str = "unified", dtype: str = "float32") -> Engine:
    return Engine(load_stand_in("tiny-llama", dtype=dtype), EngineConfig(block_size=BS, kv_blocks=64), role=role,
                  step_timing=TIMING)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=OUT, ignore_eos=True)


def unified(prompt: list[int], dtype: str = "float32") -> list[int]:
    outs, _ = run(engine(dtype=dtype), [prompt], max_tokens=OUT)
    return outs["0"]


def prefill(pre: Engine, rid: str, prompt: list[int]):
    pre.add(rid, prompt, params())
    (out,) = pre.step().tokens
    assert out.finish_reason == "handoff"
    return pre.handoff(rid)


def decode(dec: Engine, rid: str, first: int) -> list[int]:
    dec.admit(rid, first)
    toks = [first]
    while dec.has_work():
        toks += [o.token_id for o in dec.step().tokens if o.req_id == rid]
    return toks


def pulled(prompt: list[int], copy=copy_blocks, pre=None, dec=None, rid: str = "r", dtype: str = "float32"):
    """Prefill on one engine, the decode engine reserves and pulls the blocks with `copy` (skipping a prefix
    it already holds, as a decode worker does), then decodes."""
    pre, dec = pre or engine("prefill", dtype), dec or engine("decode", dtype)
    info = prefill(pre, rid, prompt)
    res = dec.reserve(rid, prompt, info.first_token, params())
    skip = res.cached_blocks
    copy(pre.kv, info.block_ids[skip:], dec.kv, res.block_ids[skip:])
    pre.release(rid)
    return decode(dec, rid, info.first_token)


def test_a_hand_over_of_the_right_bytes_gives_the_unified_tokens():
    for n in (5, 16, 30):  # a partial last block, whole blocks, several blocks
        p = prompts([n], seed=n)[0]
        assert pulled(p) == unified(p)
        assert pulled(p, copy=modelled_copy(block_bytes=4096, layers=2, timing=None)) == unified(p)
    p = prompts([30], seed=4)[0]
    assert pulled(p, dtype="bfloat16") == unified(p, dtype="bfloat16")  # values are exact in bf16 too


def test_a_hand_over_that_moves_nothing_changes_the_tokens():
    p = prompts([30], seed=5)[0]
    want = unified(p)
    got = pulled(p, copy=lambda *a: 0)
    assert got[0] == want[0]  # the first token is the prefill side's, sampled from its own pool
    assert got[1:] != want[1:] and all(a != b for a, b in zip(got[1:], want[1:]))


@pytest.mark.parametrize("which", [0, 1, 3])
def test_one_garbled_block_changes_the_tokens(which):
    """The copy lands every block, then one of them is overwritten with other (valid-looking) values."""
    p = prompts([30], seed=6)[0]  # 4 blocks of 8

    def garbling(src, src_blocks, dst, dst_blocks, **kw):
        n = copy_blocks(src, src_blocks, dst, dst_blocks, **kw)
        dst[:, :, dst_blocks[which]] = dst[:, :, dst_blocks[which]] % KV_VALUES + 1  # each value moved by one
        return n

    assert pulled(p, copy=garbling)[1:] != unified(p)[1:]


def test_blocks_copied_into_the_wrong_places_change_the_tokens():
    p = prompts([30], seed=7)[0]
    want = unified(p)

    def swapped_blocks(src, src_blocks, dst, dst_blocks, **kw):
        return copy_blocks(src, src_blocks, dst, list(dst_blocks[1:]) + [dst_blocks[0]], **kw)

    def swapped_layers(src, src_blocks, dst, dst_blocks, **kw):
        for layer, into in ((0, 1), (1, 0)):
            dst[into][:, dst_blocks] = src[layer][:, src_blocks]
        return 0

    assert pulled(p, copy=swapped_blocks)[1:] != want[1:]
    assert pulled(p, copy=swapped_layers)[1:] != want[1:]


def test_a_prefix_the_decode_side_already_holds_is_not_sent_and_gives_the_same_tokens():
    """Prefix-cache blocks hold what an earlier request wrote for the same tokens at the same positions."""
    shared = prompts([16], seed=8)[0]  # two whole blocks
    a, b = prompts([10, 13], seed=9, prefix=shared)
    pre, dec = engine("prefill"), engine("decode")
    assert pulled(a, pre=pre, dec=dec, rid="a") == unified(a)
    sent = []

    def counting(src, src_blocks, dst, dst_blocks, **kw):
        sent.append(len(src_blocks))
        return copy_blocks(src, src_blocks, dst, dst_blocks, **kw)

    assert pulled(b, copy=counting, pre=pre, dec=dec, rid="b") == unified(b)
    assert sent == [2]  # 29 tokens: 4 blocks, the first 2 held already


def test_the_pull_copier_on_its_thread_moves_the_kv():
    p = prompts([30], seed=10)[0]
    dec = engine("decode")
    copier = PullCopier(dec.kv, modelled_copy(block_bytes=4096, layers=2, timing=None))

    def threaded(src, src_blocks, dst, dst_blocks):
        job = copier.submit("r", src, src_blocks, dst_blocks)
        job.done.wait(30)
        assert copier.poll() == [job] and job.error is None
        return job.bytes

    try:
        assert pulled(p, copy=threaded, dec=dec) == unified(p)
    finally:
        copier.close()


@pytest.mark.parametrize("skip_layer", [None, 1])
def test_push_writes_each_layer_as_the_step_reaches_it(skip_layer):
    """PushCopier on the prefill engine's layer hook (as a push-mode prefill worker): every layer lands and
    the tokens are unified's; a push that leaves one layer out changes them."""
    p = prompts([30], seed=11)[0]
    pre, dec = engine("prefill"), engine("decode")
    res = dec.reserve("r", p, None, params())

    def copy(src, src_blocks, dst, dst_blocks, layer=None, **kw):
        return 0 if layer == skip_layer else copy_blocks(src, src_blocks, dst, dst_blocks, layer=layer, **kw)

    copier = PushCopier(pre.kv, copy)
    written = []

    def hook(layer):  # fires once layer l is written and before layer l + 1 is
        if layer == 0:  # the step has allocated the blocks (as a push-mode prefill worker's hook does)
            copier.begin([PushJob("r", pre.seqs["r"].block_table[:4], dec.kv, res.block_ids)])
        written.append([bool((pre.kv[x] != 0).any()) for x in range(2)])
        copier.on_layer(layer)

    pre.layer_hook = hook
    try:
        pre.add("r", p, params())
        copier.begin([PushJob("r", pre.seqs["r"].block_table[:4], dec.kv, res.block_ids)])
        (out,) = pre.step().tokens
        (job,) = copier.finish(timeout=30)
        assert job.error is None
    finally:
        copier.close()
    assert written == [[True, False], [True, True]]
    got = decode(dec, "r", out.token_id)
    assert (got == unified(p)) == (skip_layer is None)


def test_the_kv_values_are_a_function_of_token_position_layer_and_side():
    v = kv_values(np.array([5, 5, 6]), np.array([0, 1, 0]), layers=3)
    assert v.shape == (3, 2, 3) and v.min() >= 1 and v.max() <= KV_VALUES
    assert (v[:, :, 0] != v[:, :, 1]).all() and (v[:, :, 0] != v[:, :, 2]).all()  # position, token
    planes = v[:, :, 0].reshape(-1)
    assert len(set(planes.tolist())) == 6  # every layer and K|V differs
    assert (torch.tensor(v, dtype=torch.bfloat16).to(torch.int64).numpy() == v).all()  # exact in bf16
