import pytest

from pdlab.devices import Device, format_devices, overlaps, parse_devices


def test_single_device():
    assert parse_devices("cpu:0") == [Device("cpu", 0)]
    assert str(Device("cuda", 3)) == "cuda:3"


def test_range_and_list_forms():
    assert parse_devices("cuda:0-3") == [Device("cuda", i) for i in range(4)]
    assert parse_devices("cuda:4,5") == [Device("cuda", 4), Device("cuda", 5)]
    assert parse_devices("cpu:0-1,3") == [Device("cpu", 0), Device("cpu", 1), Device("cpu", 3)]
    assert parse_devices(["cpu:0", "cpu:1"]) == [Device("cpu", 0), Device("cpu", 1)]


@pytest.mark.parametrize("bad", ["gpu:0", "cpu", "cpu:", "cpu:a", "cpu:3-1", "cuda:0-", ""])
def test_bad_specs_raise_naming_the_spec(bad):
    with pytest.raises(ValueError, match="device"):
        parse_devices(bad)


def test_duplicates_and_mixed_kinds_rejected():
    with pytest.raises(ValueError, match="twice"):
        parse_devices(["cpu:0", "cpu:0-1"])
    with pytest.raises(ValueError, match="mixes"):
        parse_devices(["cpu:0", "cuda:0"])
    with pytest.raises(ValueError):
        parse_devices([])


def test_overlaps():
    assert overlaps("cuda:0-3", "cuda:4-7") == []
    assert overlaps("cuda:0-3", "cuda:3,4") == [Device("cuda", 3)]
    assert overlaps(["cpu:0"], [Device("cpu", 0)]) == [Device("cpu", 0)]
    assert overlaps("cpu:0", "cuda:0") == []  # different kinds never overlap


def test_format_devices_round_trips():
    assert format_devices(parse_devices("cpu:0-1,3")) == "cpu:0-1,3"
    assert format_devices(parse_devices("cuda:5")) == "cuda:5"
