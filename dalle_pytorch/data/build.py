"""The two builders both trainers and `convert` share: the dataset from the data flags, and the text
tokenizer from the tokenizer flags (a BPE trained on the captions once, on rank 0, then read by every rank)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..config import flag
from .stream import is_stream
from .tokenizer import ByteTokenizer, HugTokenizer, Tokenizer, YttmTokenizer
from .wds import StreamOptions


@dataclass(frozen=True)
class DataSpec:
    """What a run's data flags say, in one object: where the samples are, their shape, how they are drawn and how
    shards are read. build_dataset() turns it into a dataset for one rank."""

    folder: str  # --image_folder (VAE) or --image_text_folder: a folder, or shard URLs with `wds`; "": built-in
    folder_flag: str  # its flag, for messages
    wds: str  # WebDataset keys (jpg,txt), or ""
    captions: bool  # image/caption pairs (DALLE, CLIP) or images only (VAE)
    image_size: int
    channels: int = 3
    resize_ratio: float = 1.0  # random resized crops keep at least this fraction (1: centre crop)
    val_folder: str = ""  # --val_image_text_folder / --val_image_folder
    val_folder_flag: str = "--val_image_text_folder"
    heldout_captions: int = 0  # --val_heldout_captions (DALLE)
    seed: int = 0  # the sample order's (and the built-in data's)
    dataset_size: int = 0  # samples of the built-in data
    stream: StreamOptions = field(default_factory=StreamOptions)  # how shards are read

    @property
    def keys(self) -> str:
        """The WebDataset keys read: image and caption, or the image alone."""
        return self.wds if self.captions else self.wds.split(",")[0]

    def validation(self) -> DataSpec:
        """The validation folder's (or shards') spec: read as training reads, centre-cropped."""
        return replace(self, folder=self.val_folder, folder_flag=self.val_folder_flag, resize_ratio=1.0)


def build_dataset(spec: DataSpec, rank: int = 0, world_size: int = 1):
    """(image, caption) samples: WebDataset shards (`wds` names the keys, `folder` holds the URLs), an image or
    caption folder, or the built-in synthetic set when no folder is given. `captions`: pairs are needed (DALLE).
    `rank` of `world_size`: the stream's share of the shards."""
    if spec.wds:
        from .wds import WebDatasetPairs

        if not spec.folder:
            raise ValueError(f"--wds needs the shard URLs in {spec.folder_flag}, e.g. 'shards/{{000..099}}.tar'")
        if spec.captions and "," not in spec.wds:
            raise ValueError(f"--wds must name the image and caption keys, as in --wds jpg,txt (got {spec.wds!r})")
        return WebDatasetPairs(
            spec.folder, spec.keys, spec.image_size, spec.channels, spec.resize_ratio, rank, world_size, spec.seed,
            spec.stream,
        )  # fmt: skip
    if spec.folder:
        from .folders import CaptionFolder, ImageFolder

        folder = CaptionFolder if spec.captions else ImageFolder
        return folder(spec.folder, spec.image_size, spec.channels, spec.resize_ratio)
    if spec.channels != 3:
        raise ValueError(f"the built-in dataset is RGB: use --channels 3 or give {spec.folder_flag}")
    from .shapes import ShapesDataset

    return ShapesDataset(spec.dataset_size, spec.image_size, seed=spec.seed)


def describe(dataset) -> str:
    if is_stream(dataset):
        return dataset.describe()
    return f"{len(dataset)} samples"


def _captions(dataset, limit: int = 20000) -> list[str]:
    if is_stream(dataset):
        return dataset.captions(limit)
    return [
        dataset.caption(i) if hasattr(dataset, "caption") else dataset[i][1] for i in range(min(len(dataset), limit))
    ]


@dataclass
class TextTokenizerConfig:
    """The text tokenizer: train_dalle.py's and train_clip.py's (without --dalle_path), and what a run's config.json
    records of it (`config.pick(TextTokenizerConfig, record)`)."""

    tokenizer: str = flag(
        "yttm",
        "text tokenizer: yttm or byte (either gives way to a --bpe_path), clip (OpenAI CLIP's BPE, bundled: "
        "lucidrains' DALLE-pytorch's default), chinese (bert-base-chinese's WordPiece, its vocab.txt from "
        "--bpe_path or the cn-clip package)",
        choices=("yttm", "byte", "clip", "chinese"),
    )
    bpe_path: str = flag("", "a YouTokenToMe BPE model to use (default: train one on the captions)")
    hug: bool = flag(False, "--bpe_path is a Hugging Face tokenizers JSON file")
    bpe_vocab_size: int = flag(256, "vocabulary of the BPE trained on the captions")
    text_encoder: str = flag(
        "",
        "read captions through a frozen pretrained encoder: t5 (T5's encoder, as Parti, Imagen, LlamaGen) or clip "
        "(CLIP's text tower); its last hidden states are projected into the --text_seq_len caption positions. "
        "Empty: --tokenizer's ids and an embedding learned from scratch",
        choices=("", "t5", "clip"),
    )
    text_encoder_path: str = flag(
        "",
        "--text_encoder's weights and tokenizer: a folder as transformers' save_pretrained writes it, or a Hugging "
        "Face name (google/flan-t5-xl, openai/clip-vit-large-patch14) downloaded once into its cache",
    )


def build_text_tokenizer(
    cfg: TextTokenizerConfig,
    run_dir: str,
    dataset=None,
    resuming: bool = False,
    is_main: bool = True,
    share: Callable[[str | None], str] = lambda text: text,
    log: Callable[[str], None] = print,
    lowercase: bool = True,
) -> Tokenizer:
    """The tokenizer `cfg` chooses. The default BPE lives in the run directory: with `dataset` it is trained on its
    captions on rank 0 (a resumed run keeps the vocabulary it has) and `share`d from there to every rank; without,
    the run's is read. The predecessor's tokenizers (`clip`, `chinese`) read their vocabulary from `bpe_path` when
    it is given. `lowercase`: a --bpe_path YouTokenToMe model reads lowercased captions (train_dalle.py's
    --bpe_lowercase; runs recorded before it existed, and train_clip.py, lowercase). With --text_encoder, the
    encoder's own tokenizer."""
    if cfg.text_encoder or cfg.text_encoder_path:
        if not cfg.text_encoder:
            raise ValueError("--text_encoder_path needs --text_encoder t5 or clip (which kind of encoder it holds)")
        from .encoder_tokenizer import EncoderTokenizer

        return EncoderTokenizer(cfg.text_encoder, cfg.text_encoder_path)
    if cfg.tokenizer in ("clip", "chinese"):
        return pretrained_text_tokenizer(cfg.tokenizer, cfg.bpe_path, cfg.hug)
    if cfg.bpe_path:  # the user's own model reads text as they trained it
        if cfg.hug:
            return HugTokenizer.from_file(cfg.bpe_path)
        return YttmTokenizer.from_file(cfg.bpe_path, lowercase=lowercase)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = os.path.join(run_dir, "bpe.yttm")
    if dataset is not None:
        # trained once, on rank 0, which sends the model's text to every rank with `share` (through the
        # process group): the other hosts need not see rank 0's disk
        text = None
        if is_main:
            if not (resuming and os.path.exists(path)):
                YttmTokenizer.train(_captions(dataset), cfg.bpe_vocab_size, path)
                log(f"trained a {cfg.bpe_vocab_size}-token BPE on the captions: {path}")
            with open(path) as f:
                text = f.read()
        return YttmTokenizer(share(text))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the run's BPE is written there when training starts")
    return YttmTokenizer.from_file(path)


def pretrained_text_tokenizer(kind: str, path: str = "", hug: bool = False) -> Tokenizer:
    """The predecessor's `clip` or `chinese` tokenizer, its vocabulary from `path` when given."""
    if hug:
        raise ValueError(
            f"--hug reads --bpe_path as a tokenizer of its own, --tokenizer {kind} as {kind}'s vocabulary: drop --hug"
        )
    if kind == "clip":
        from .clip_bpe import ClipTokenizer

        return ClipTokenizer.from_file(path)  # the bundled vocabulary without --bpe_path
    from .chinese import ChineseTokenizer

    return ChineseTokenizer.from_file(path)  # --bpe_path, or the cn-clip package's copy
