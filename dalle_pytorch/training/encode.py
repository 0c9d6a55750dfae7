"""Encode WebDataset shards once into token shards: each sample's image as its image tokenizer's codes
(`codes.npy`), its caption as text (`txt`, every line kept), under the same keys. DALLE then trains on the codes
(`--wds codes.npy,txt --image_text_folder OUT`) and never decodes a JPEG or runs the VAE again; dalle-mini
encoded CC12M with its VQGAN once so. With --text_encoder, every caption line's features too (`feats.npz`: the
real tokens' last hidden states, float16), so that training (`--wds codes.npy,feats.npz`) runs no text encoder
per step either, as LlamaGen extracts its T5 features once.

    python -m dalle_pytorch.training.encode --shards 'data/{00000..00099}.tar' --wds jpg,txt \\
        --vae_path runs/vae/vae.safetensors --out tokens/          # or --out s3://bucket/tokens/
        [--text_encoder t5 --text_encoder_path google/flan-t5-xl --text_seq_len 120]
    torchrun --nproc_per_node 8 -m dalle_pytorch.training.encode ...    # srun, mpirun, deepspeed: the same

Every rank encodes shards i with i % world_size == rank (no collective: the ranks never wait for each other). A
shard is written to a temporary name and renamed when complete, with its `_stats.json` (the samples it holds, so
the training's index is made without reading it), so a restarted job redoes only the shards it had not finished.
`OUT/encode.json` records the image tokenizer's fingerprint (and the text encoder's): train_dalle.py refuses codes
(features) of another tokenizer (encoder).
`train_dalle.py --precompute_tokens --wds ...` runs this into its run directory first.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..data import storage
from ..data.build import DataSpec, build_dataset
from ..data.folders import image_transform
from ..data.samples import CODES_KEY, FEATURES_KEY, Skip, caption_lines, image_of
from ..data.shards import RETRIES, ShardError, open_shard
from ..data.wds import REASONS, WebDatasetPairs, shard_urls
from .session import add_up

META = "encode.json"


def encode_shards(urls, keys: str, vae, vae_id: str, out: str, rank: int, world: int, *, batch_size: int = 64,
                  retries: int = RETRIES, say=print, text_encoder=None, text_seq_len: int = 0) -> int:  # fmt: skip
    """Encode this rank's shards of `urls` into `out`; returns how many it wrote now (finished ones are kept).
    `text_encoder` (inference/text_encoders.py): each caption line's features too, at most `text_seq_len` tokens."""
    image_key, _, caption_key = keys.partition(",")
    if storage.scheme(out) == "local":
        os.makedirs(storage.local_path(out), exist_ok=True)
    record = text_encoder.record() if text_encoder is not None else None
    check_meta(out, vae_id, record)
    if rank == 0:
        meta = {"vae_fingerprint": vae_id, "image_size": vae.image_size, "fmap_size": vae.fmap_size,
                "num_tokens": vae.num_tokens, "wds": keys, "sources": list(urls)}  # fmt: skip
        if record is not None:
            meta.update(text_encoder=record, text_seq_len=text_seq_len, text_feature_dim=text_encoder.dim)
        storage.write_bytes(storage.join(out, META), json.dumps(meta, indent=1).encode())
    captions = None if text_encoder is None else (text_encoder, text_seq_len)
    transform = image_transform(vae.image_size, 1.0, train=False)  # the centre crop, once for all epochs
    mode = "RGBA" if vae.channels == 4 else "RGB"
    written = 0
    for i in range(rank, len(urls), world):
        dest = _path(out, i, ".tar")
        if storage.exists(dest):
            continue
        t = time.perf_counter()
        try:
            shard = open_shard(urls[i], retries)
        except ShardError as e:
            say(f"warning: shard {e.url} is unreadable: {e.why}; not encoded (run again to retry it)")
            storage.write_bytes(_path(out, i, ".unreadable"), (e.why + "\n").encode())
            continue
        if shard.truncated_at is not None:
            say(f"warning: shard {urls[i]} is truncated at byte {shard.truncated_at}: {len(shard)} samples before it")
        n, skipped = encode_shard(
            shard, dest, vae, image_key, caption_key, transform, mode, batch_size, captions=captions
        )
        shard.close()
        written += 1
        why = ", ".join(f"{k} {v}" for k, v in skipped.items() if v)
        say(
            f"{urls[i]} -> {dest}: {n} samples in {time.perf_counter() - t:.1f}s"
            + (f" (skipped: {why})" if why else "")
        )
    return written


@torch.no_grad()
def encode_shard(shard, dest: str, vae, image_key: str, caption_key: str, transform, mode: str, batch_size: int,
                 threads: int = 4, captions=None):  # fmt: skip
    """(samples written, skipped by reason): `shard`'s samples as codes + caption text into the tar `dest` (a path,
    or an object store's URL: written here first, then put whole); the images are decoded in `threads` threads
    ahead of the VAE (PIL and torch's ops release the GIL). `captions`: (text encoder, text_seq_len), each
    caption line's features into FEATURES_KEY as well."""
    device = next(vae.parameters()).device
    skipped = dict.fromkeys(REASONS, 0)
    local = storage.local_path(dest)
    tmp = f"{local or os.path.join(tempfile.gettempdir(), os.path.basename(dest))}.tmp{os.getpid()}"
    n = 0
    with tarfile.open(tmp, "w") as tar:
        pending: list[tuple[str, bytes, torch.Tensor]] = []

        def flush():
            codes = vae.get_codebook_indices(torch.stack([p[2] for p in pending]).to(device).float()).cpu().numpy()
            dtype = np.int16 if vae.num_tokens <= np.iinfo(np.int16).max else np.int32
            features = _features(captions, [p[1] for p in pending]) if captions else [None] * len(pending)
            for (key, caption, _), ids, feats in zip(pending, codes, features):
                buf = io.BytesIO()
                np.save(buf, ids.astype(dtype), allow_pickle=False)
                _add(tar, f"{key}.{CODES_KEY}", buf.getvalue())
                _add(tar, f"{key}.txt", caption)
                if feats is not None:
                    _add(tar, f"{key}.{FEATURES_KEY}", feats)
            pending.clear()

        def decode(sample):
            try:  # every line of the caption (img2dataset's json records: their caption), as UTF-8 text
                caption = "\n".join(caption_lines(sample, caption_key)).encode() if caption_key else b""
                return sample["__key__"], caption, image_of(sample, image_key, transform, mode, None)
            except Skip as e:
                return e

        for item in _ahead(decode, (shard.read(j) for j in range(len(shard))), 2 * batch_size, threads):
            if isinstance(item, Skip):
                skipped[item.reason] += 1
                continue
            pending.append(item)
            n += 1
            if len(pending) == batch_size:
                flush()
        if pending:
            flush()
    stats = {"successes": n, "source": shard.url, "skipped": skipped}
    storage.write_bytes(f"{dest[: -len('.tar')]}_stats.json", json.dumps(stats, indent=1).encode())
    if local:
        os.replace(tmp, local)  # complete: a restarted job keeps it
    else:
        try:
            with open(tmp, "rb") as f:
                storage.write_bytes(dest, f.read())  # a token shard is small (codes, captions): one put
        finally:
            os.remove(tmp)
    return n, skipped


def _features(captions, texts: list[bytes]) -> list[bytes]:
    """Each sample's caption lines through the text encoder, in one pass: FEATURES_KEY's bytes per sample."""
    encoder, text_seq_len = captions
    lines = [t.decode().split("\n") for t in texts]
    ids, _ = encoder.tokenizer.tokenize([line for ls in lines for line in ls], text_seq_len)
    feats = encoder.features(ids).cpu().numpy()  # (lines, T, dim) float16, zero after the real tokens
    lengths = (ids > 0).sum(1).numpy().astype(np.int32)
    out, k = [], 0
    for ls in lines:
        n = len(ls)
        buf = io.BytesIO()
        real = np.concatenate([feats[k + i, : lengths[k + i]] for i in range(n)])
        np.savez(buf, lengths=lengths[k : k + n], features=real)
        out.append(buf.getvalue())
        k += n
    return out


def encoded_stream(pairs: WebDatasetPairs, spec: DataSpec, vae, vae_id: str, run, backend, text_encoder=None,
                   text_seq_len: int = 0) -> WebDatasetPairs:  # fmt: skip
    """--precompute_tokens with --wds: the shards of `pairs` (read as `spec` says) encoded into the run's tokens/
    (every rank its share; a resumed run keeps what was done), then streamed as codes (and with a `text_encoder`,
    its cached caption features). The ranks wait for each
    other by looking at the files, not in a collective, so a long encoding does not run into --dist_timeout."""
    out = os.path.join(run.path, "tokens")
    os.makedirs(out, exist_ok=True)
    failed = os.path.join(out, f"failed-rank{backend.rank}")
    mine = [_path(out, i, ".unreadable") for i in range(backend.rank, len(pairs.shards), backend.world_size)]
    for marker in [*mine, failed]:  # an earlier try's failures: tried again
        if os.path.exists(marker):
            os.remove(marker)
    backend.barrier()
    t = time.perf_counter()
    try:
        n = encode_shards(pairs.shards, spec.keys, vae.to(backend.device).eval(), vae_id, out, backend.rank,
                          backend.world_size, retries=spec.stream.retries, say=run.print, text_encoder=text_encoder,
                          text_seq_len=text_seq_len)  # fmt: skip
    except Exception as e:
        with open(failed, "w") as f:  # the other ranks, waiting for this rank's shards, stop too
            f.write(f"{type(e).__name__}: {e}\n")
        raise
    last = time.perf_counter()
    while not all(os.path.exists(_path(out, i, ".tar")) or os.path.exists(_path(out, i, ".unreadable"))
                  for i in range(len(pairs.shards))):  # fmt: skip
        for name in sorted(os.listdir(out)):
            if name.startswith("failed-rank"):
                with open(os.path.join(out, name)) as f:
                    why = f.read().strip()
                raise ValueError(f"{name[len('failed-') :]} stopped encoding its shards ({why}): see its log")
        if time.perf_counter() - last > 60:
            run.print("waiting for the other ranks to finish encoding their shards")
            last = time.perf_counter()
        time.sleep(1)
    backend.barrier()
    run.print(f"image codes of {len(pairs.shards)} shards in {out} ({n} encoded now, {time.perf_counter() - t:.0f}s)")
    caption = FEATURES_KEY if text_encoder is not None else "txt"  # the caption is written as txt (and features)
    codes = dataclasses.replace(spec, folder=out, wds=f"{CODES_KEY},{caption}")
    tokens = build_dataset(codes, backend.rank, backend.world_size)
    tokens.count(os.path.join(out, "shards.json"), lambda counts: add_up(backend, counts), run.print)
    return tokens


def check_codes(folder_or_urls: str, vae_id: str, text_encoder=None) -> None:
    """Token shards (`--wds codes.npy,...`) must hold the codes of the image tokenizer the run trains with, and
    their cached features (`feats.npz`) those of its text encoder."""
    if os.path.isdir(folder_or_urls) or folder_or_urls.endswith("/"):
        meta = storage.join(folder_or_urls, META)
    else:
        meta = storage.join(storage.dirname(shard_urls(folder_or_urls)[0]), META)
    try:
        recorded = json.loads(storage.read_bytes(meta, retries=1))
    except (ShardError, ValueError):
        return
    if recorded.get("vae_fingerprint") != vae_id:
        raise ValueError(
            f"{meta}: these codes were made by another image tokenizer (fingerprint {recorded.get('vae_fingerprint')}, "
            f"the run's {vae_id}): pass the tokenizer that encoded them, or encode the shards again"
        )
    if text_encoder is None:
        return
    made = recorded.get("text_encoder")
    if made is None:
        raise ValueError(f"{meta}: these token shards hold no caption features: encode them with --text_encoder")
    if made["fingerprint"] != text_encoder.fingerprint:
        raise ValueError(
            f"{meta}: these caption features were made by another text encoder ({made['path']}, fingerprint "
            f"{made['fingerprint']}; the run's {text_encoder.fingerprint}): pass --text_encoder_path {made['path']}, "
            "or encode the shards again"
        )


def _path(out: str, i: int, ext: str) -> str:
    return storage.join(out, f"tokens-{i:06d}{ext}")


def _ahead(fn, items, depth: int, threads: int):
    """fn(item) for each item, in order, up to `depth` of them computed ahead in a thread pool."""
    with ThreadPoolExecutor(threads) as pool:
        queue = collections.deque()
        for item in items:
            queue.append(pool.submit(fn, item))
            if len(queue) >= depth:
                yield queue.popleft().result()
        while queue:
            yield queue.popleft().result()


def check_meta(out: str, vae_id: str, text_encoder: dict | None = None) -> None:
    path = storage.join(out, META)
    if not storage.exists(path):
        return
    meta = json.loads(storage.read_bytes(path))
    recorded = meta.get("vae_fingerprint")
    if recorded != vae_id:
        raise ValueError(
            f"{storage.redact(out)} holds the codes of another image tokenizer (fingerprint {recorded}, this one "
            f"{vae_id}): encode into another --out, or pass the tokenizer that made them"
        )
    made = (meta.get("text_encoder") or {}).get("fingerprint")
    if made != (text_encoder or {}).get("fingerprint"):
        raise ValueError(
            f"{storage.redact(out)} holds caption features of another text encoder ({made or 'none'}; this run's: "
            f"{(text_encoder or {}).get('fingerprint') or 'none'}): encode into another --out"
        )


def _add(tar, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def main(argv=None) -> int:
    from distributed import set_threads, topology_from_env

    from ..config import add_flags, take
    from ..errors import user_errors
    from ..inference.image_tokenizers import ImageTokenizerConfig, load_image_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="the source shards: a folder, a brace pattern or URLs")
    p.add_argument("--wds", required=True, help="the image and caption keys of the source shards, e.g. jpg,txt")
    p.add_argument(
        "--out", required=True, help="folder or object store URL (s3://...) of the token shards (tokens-000000.tar ...)"
    )
    p.add_argument("--batch_size", type=int, default=64, help="images per VAE pass")
    p.add_argument("--shard_retries", type=int, default=RETRIES, help="retries of a shard (HTTP) that fails")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for user errors")
    p.add_argument("--text_encoder", default="", choices=("", "t5", "clip"), help="cache each caption's features too")
    p.add_argument("--text_encoder_path", default="", help="--text_encoder's folder or Hugging Face name")
    p.add_argument("--text_seq_len", type=int, default=120, help="--text_encoder: caption tokens kept (LlamaGen's 120)")
    add_flags(p, ImageTokenizerConfig, "image tokenizer (one of them)")
    args = p.parse_args(argv)
    with user_errors(args.debug):
        if "," not in args.wds:
            raise ValueError(f"--wds must name the image and caption keys, as in --wds jpg,txt (got {args.wds!r})")
        if storage.scheme(args.out) not in ("local", "fsspec"):
            raise ValueError(f"--out {storage.redact(args.out)}: give a folder, or an object store URL (s3://, gs://)")
        topo = topology_from_env()
        set_threads(0, topo)
        say = print if topo.rank == 0 else (lambda *_: None)
        vae, _, vae_id = load_image_tokenizer(take(args, ImageTokenizerConfig), say=say)
        device = torch.device(f"cuda:{topo.local_rank}" if torch.cuda.is_available() else "cpu")
        vae = vae.to(device).eval()
        text_encoder = None
        if args.text_encoder or args.text_encoder_path:
            from ..data.build import TextTokenizerConfig, build_text_tokenizer
            from ..inference.text_encoders import FrozenTextEncoder

            text = TextTokenizerConfig(text_encoder=args.text_encoder, text_encoder_path=args.text_encoder_path)
            text_encoder = FrozenTextEncoder(build_text_tokenizer(text, ""), device)
            text_encoder.check(args.text_seq_len)
        urls = shard_urls(args.shards)
        n = encode_shards(urls, args.wds, vae, vae_id, args.out, topo.rank, topo.world_size,
                          batch_size=args.batch_size, retries=args.shard_retries, text_encoder=text_encoder,
                          text_seq_len=args.text_seq_len)  # fmt: skip
        left = [i for i in range(len(urls)) if not storage.exists(_path(args.out, i, ".tar"))]
        where = storage.redact(args.out)
        print(f"rank {topo.rank}: encoded {n} shards; {len(urls) - len(left)} of {len(urls)} are in {where}")
        if left:
            print(
                f"{len(left)} shards are not encoded yet (other ranks' or failed): run again to finish", file=sys.stderr
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
