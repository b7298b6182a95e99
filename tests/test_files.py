import pytest

from decoderlm.files import atomic_write


def test_a_crash_during_a_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"good")

    def crash(tmp):
        open(tmp, "wb").write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, crash)
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
