"""DeepSpeed's portable checkpoint is written shard-wise: each rank writes the fragments of the weights and
Adam moments it steps, and no rank gathers the full state. The checkpoint still converts and resumes."""

import math
import os

import pytest
import torch
from launch import assert_same, dalle_args, launch, restart_from_step_2
from torch.distributed.checkpoint import FileSystemReader

import train_dalle
from dalle_pytorch.convert import convert
from dalle_pytorch.files import safe_load
from distributed.deepspeed_portable import flat_blocks


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 5), (3, 4, 5, 2)])
def test_flat_blocks_tile_the_range(shape):
    """Every flat range of a tensor becomes rectangular blocks that cover it once, in order."""
    n = math.prod(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            blocks = flat_blocks(start, stop, shape)
            assert len(blocks) <= 2 * len(shape) - 1
            covered = torch.zeros(shape, dtype=torch.long)
            flat = start
            for first, offsets, sizes in blocks:
                assert first == flat  # in order, each a contiguous run of the range
                covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                flat += math.prod(sizes)
            expected = torch.zeros(n, dtype=torch.long)
            expected[start:stop] = 1
            assert flat == stop and torch.equal(covered.view(-1), expected)


def tensor_bytes_per_file(dcp_dir) -> dict[str, int]:
    """Bytes of tensor data per storage file, from DCP's metadata: the chunks each file holds (a file's own
    size adds a serialization header per entry, which would weigh the many small entries)."""
    md = FileSystemReader(str(dcp_dir)).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        meta = md.state_dict_metadata[index.fqn]
        chunks = [c for c in getattr(meta, "chunks", []) if tuple(c.offsets) == tuple(index.offset)]
        size = sum(c.sizes.numel() * meta.properties.dtype.itemsize for c in chunks)
        out[info.relative_path] = out.get(info.relative_path, 0) + size
    return out


@pytest.mark.launcher
@pytest.mark.parametrize("stage", ["2", "3"])
def test_every_rank_writes_its_share(stage, vae_path, tmp_path, capsys):
    args = ["--keep_n_checkpoints", "5", "--zero_stage", stage]
    launch("deepspeed", "train_dalle.py", dalle_args(vae_path, str(tmp_path / "ds"), 4, steps=4, extra=args))
    run = tmp_path / "ds" / "dalle"
    full = safe_load(str(run / "dalle.safetensors"))["weights"]
    for step in ("step-00000002", "step-00000004"):  # weights, moments and step in both
        dcp_dir = run / "checkpoints" / step / "dcp"
        sizes = tensor_bytes_per_file(dcp_dir)
        assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"], sizes  # written by both ranks
        total = sum(sizes.values())
        assert total >= 3 * 4 * sum(w.numel() for w in full.values())  # fp32 weights and both moments
        assert all(0.4 < s / total < 0.6 for s in sizes.values()), sizes  # about half each
        assert all(os.path.getsize(dcp_dir / name) >= s for name, s in sizes.items())

    converted = convert(str(run / "checkpoints" / "step-00000004"), str(tmp_path / "converted.pt"))
    assert_same(full, safe_load(converted)["weights"])

    restart_from_step_2(run, tmp_path / "one" / "dalle")
    train_dalle.main([*dalle_args(vae_path, str(tmp_path / "one"), 8, steps=4), "--resume", "auto"])
    assert "step-00000002 at step 2" in capsys.readouterr().out
    assert_same(full, safe_load(str(tmp_path / "one" / "dalle" / "dalle.safetensors"))["weights"])
