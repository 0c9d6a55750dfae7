"""The tar header reader against Python's tarfile: the same members in every format tarfile writes, and a prefix of
them wherever the archive is cut."""

from __future__ import annotations

import io
import tarfile

import pytest

from dalle_pytorch.data.tar_members import members


def _archive(fmt) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        d = tarfile.TarInfo("a/dir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        names = ["a/0001.jpg", "a/0001.txt", "b/" + "x" * 150 + ".jpg", "c/empty.txt", "d/caf\u00e9-\u6f22.json"]
        if fmt == tarfile.USTAR_FORMAT:
            names = names[:2] + ["b/" + "x" * 120 + "/y.jpg", names[3]]  # ustar: a prefix, ASCII only
        for i, name in enumerate(names):
            data = bytes([i]) * (0 if "empty" in name else 700 * (i + 1))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("a/link.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "0001.jpg"
        tar.addfile(link)
    return buf.getvalue()


def _reference(data: bytes):
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_members_tarfile_reads(fmt):
    data = _archive(fmt)
    found, cut = members(lambda offset, n: data[offset : offset + n], len(data))
    assert cut is None
    assert found == _reference(data)
    assert all(data[o : o + n] == bytes([i]) * n for i, (_, o, n) in enumerate(found))


def test_a_cut_archive_gives_a_prefix_and_where_it_breaks():
    data = _archive(tarfile.PAX_FORMAT)
    whole = _reference(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.getmembers()
        archive_end = tar.offset  # where the end-of-archive blocks begin
    for end in range(0, len(data), 97):
        found, cut = members(lambda offset, n: data[offset : offset + n], end)
        assert found == whole[: len(found)]
        assert all(o + n <= end for _, o, n in found)
        assert (cut is None) == (end == 0 or end >= archive_end + 512)
    header = whole[1][1] - 512  # a/0001.txt's header
    garbage = data[:header] + b"\x07" * 512 + data[header + 512 :]
    found, cut = members(lambda offset, n: garbage[offset : offset + n], len(garbage))
    assert cut == header and found == whole[:1]


def test_garbage_in_a_number_or_a_pax_record_is_a_cut_not_a_crash_or_a_hang():
    data = bytearray(_archive(tarfile.PAX_FORMAT))
    whole = _reference(bytes(data))
    header = whole[1][1] - 512
    bad_size = bytes(data[: header + 124]) + b"0000000009x\0" + bytes(data[header + 136 :])
    found, cut = members(lambda offset, n: bad_size[offset : offset + n], len(bad_size))
    assert found == whole[:1] and cut is not None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("k/" + "y" * 120 + ".txt")  # a pax header carries its path
        tar.addfile(info, io.BytesIO(b""))
    raw = buf.getvalue()
    pax = raw.index(b" path=")
    looping = raw[: pax - 3] + b"000" + raw[pax:]  # the record's length field says 0
    found, cut = members(lambda offset, n: looping[offset : offset + n], len(looping))
    assert found == [] and cut == 0
