import pickle

import msgpack
import pytest

from pdlab.serve import messages as m


@pytest.mark.parametrize("msg", [
    m.Submit("r1", [1, 2, 3], {"max_tokens": 4}),
    m.Submit("r2", [5], {}, push={"dst": "decode0", "pool": "pdlab-x", "blocks": [3, 4], "skip": 1}),
    m.Pull("r1", [1, 2], {"max_tokens": 2}, 7, "prefill0", {"kind": "shm", "name": "pdlab-p"}, [0, 1]),
    m.Ready("decode0", 123, {"kind": "shm", "name": "pdlab-a", "shape": [2, 2, 8, 16, 2, 16], "dtype": "float32"},
            8, 16),
    m.Ready("unified0", 1, None, 8, 16),
    m.Tokens("unified0", [["r1", 5, 0, False], ["r2", 9, 3, True]]),
    m.PrefillDone("prefill0", "r1", 4, [0, 1], 16, 1.0, 2.0, {"bytes": 10}),
    m.Finished("decode0", "r1", False, "boom"),
    m.Stop(),
    m.Heartbeat("x", 1.5, 1.25),
])
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_cuda_ipc_handle_bytes_survive():
    h = {"kind": "cuda-ipc", "handle": b"\x00\xff" * 32, "event_handle": None}
    assert m.decode(m.encode(m.Ready("p", 1, h, 1, 16))).pool == h


def test_unknown_type_fields_and_garbage_rejected():
    with pytest.raises(m.MessageError, match="unknown message type"):
        m.decode(msgpack.packb(["Evil", {}]))
    with pytest.raises(m.MessageError, match="unknown fields"):
        m.decode(msgpack.packb(["Release", {"req_id": "a", "x": 1}]))
    with pytest.raises(m.MessageError):
        m.decode(msgpack.packb(["Release", {}]))  # missing field
    with pytest.raises(m.MessageError):
        m.decode(b"\xc1\x00garbage")
    with pytest.raises(m.MessageError):
        m.decode(msgpack.packb({"type": "Stop"}))
    with pytest.raises(m.MessageError):
        m.decode(pickle.dumps(m.Stop()))  # pickles are not messages


def test_encode_only_registered_types():
    class Stop:  # same name, not ours
        pass

    with pytest.raises(m.MessageError):
        m.encode(Stop())


def test_a_prompt_is_packed_as_it_is_not_copied_token_by_token(monkeypatch):
    """The router sends every prompt in a Submit: dataclasses.asdict would copy it element by element (0.5 ms a
    1,000 tokens on the box it was found on, the router's whole time per request at a burst). A field of plain
    data goes to msgpack as it is; only a dataclass nested in a field is turned into its dict."""
    from dataclasses import dataclass

    prompt = list(range(3, 20_003))
    monkeypatch.setattr(m, "asdict", lambda obj: pytest.fail("a plain message went through asdict"))
    assert m.decode(m.encode(m.Submit("r1", prompt, {"max_tokens": 1}))).prompt_ids == prompt
    monkeypatch.undo()

    @dataclass
    class Record:
        bytes: int

    assert m.decode(m.encode(m.Step("w", {"transfer": Record(5)}))).record == {"transfer": {"bytes": 5}}
    with pytest.raises(TypeError, match="cannot send object"):
        m.encode(m.Step("w", {"x": object()}))
