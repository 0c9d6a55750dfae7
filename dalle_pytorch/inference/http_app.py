"""serve.py's HTTP service: the models loaded once, a JSON API and a web page, requests batched by serving.Batcher.

    POST /generate  {"text": "...", "num_images": 4, "seed": 1, "temperature": 1, "top_k": 0, "top_p": 1,
                     "cond_scale": 1, "keep": 0}
                    -> {"images": [base64 PNG, ...], "scores": [...], "seeds": [...], "seed": 1,
                        "commands": ["python generate.py ...", ...], "command": "python generate.py ..."}
    GET  /health    200 once the models are loaded
    GET  /          the page: type a caption, see the images, their CLIP scores, seeds and commands

Image i of a request with seed S has seed S + i and is what `python generate.py --seed S+i --num_images 1` (with the
request's settings) writes as 0000.png, byte for byte. A bad request gets a 4xx whose body is one line saying what
to change ({"error": "..."}); a client that leaves before its batch starts takes no decode step."""

import asyncio
import base64
import io
import os
import secrets
import shlex
from dataclasses import dataclass

import torch

from ..compat.flags import top_k_arg
from ..config import flag
from ..models.sampling import DECODINGS, SJD_WINDOW
from .batcher import Batcher, Settings
from .export import WEIGHTS
from .pipeline import SamplingConfig, best_of

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
FIELDS = ("text", "num_images", "seed", "temperature", "top_k", "top_p", "cond_scale", "keep")


@dataclass
class ServeConfig:
    """serve.py's flags."""

    dalle_path: str = flag("", "the DALLE export to serve (train_dalle.py's dalle.safetensors; required)")
    clip_path: str = flag(
        "", "a CLIP that scores the images, best first: train_clip.py's export, or open_clip's (ViT-B-32:openai)"
    )
    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = flag(8000, "port to listen on")
    max_batch: int = flag(16, "image rows sampled together at most (requests arriving together share them)")
    max_wait: float = flag(0.05, "seconds the first waiting request waits for others to share its batch")
    max_num_images: int = flag(16, "the most images one request may ask for")
    max_text_chars: int = flag(1000, "the longest caption accepted, in characters")
    weights: str = flag(
        "auto", "the DALLE's weights: auto (the EMA where the run kept one), ema or raw", choices=WEIGHTS
    )
    text_encoder_path: str = flag(
        "", "where the DALLE's frozen text encoder lives on this machine (default: where it was trained)"
    )
    decoding: str = flag(
        "sequential",
        "sequential, or sjd: speculative Jacobi decoding (the same images, fewer passes)",
        choices=DECODINGS,
    )
    sjd_window: int = flag(SJD_WINDOW, "--decoding sjd: draft tokens per pass")
    device: str = flag("", "cpu, cuda, cuda:1 ... (empty: cuda when available)")
    debug: bool = flag(False, "show tracebacks for user errors")

    def __post_init__(self):
        if not self.dalle_path:
            raise ValueError("--dalle_path is required: the dalle.safetensors that train_dalle.py wrote")
        if self.max_num_images < 1 or self.max_text_chars < 1:
            raise ValueError("--max_num_images and --max_text_chars must be at least 1")


class BadRequest(ValueError):
    """A request that cannot be served as it is: answered 400 with this one line."""


@dataclass
class Request:
    text: str
    num_images: int
    seed: int
    sampling: SamplingConfig
    keep: int

    @classmethod
    def parse(cls, body, cfg: ServeConfig, reranks: bool) -> "Request":
        if not isinstance(body, dict):
            raise BadRequest('the body must be a JSON object: {"text": "a red circle", "num_images": 4}')
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}: the fields are {', '.join(FIELDS)}")
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest('"text" must be a caption, e.g. {"text": "a red circle"}')
        if len(text) > cfg.max_text_chars:
            raise BadRequest(f'"text" has {len(text)} characters, at most {cfg.max_text_chars}: shorten it')
        n = _number(body, "num_images", 4, int)
        if not 1 <= n <= cfg.max_num_images:
            raise BadRequest(f'"num_images" must be from 1 to {cfg.max_num_images} (got {n})')
        seed = _number(body, "seed", None, int)
        if seed is None:
            seed = secrets.randbelow(2**31)
        if not 0 <= seed < 2**62:
            raise BadRequest(f'"seed" must be from 0 to 2**62 (got {seed})')
        keep = _number(body, "keep", 0, int)
        if keep and not reranks:
            raise BadRequest('"keep" ranks the images with CLIP: start serve.py with --clip_path')
        if not 0 <= keep <= n:
            raise BadRequest(f'"keep" must be from 0 to "num_images" {n} (got {keep})')
        try:
            sampling = SamplingConfig(
                temperature=_number(body, "temperature", 1.0, float),
                top_k=top_k_arg(str(_number(body, "top_k", 0, float))),
                top_p=_number(body, "top_p", 1.0, float), cond_scale=_number(body, "cond_scale", 1.0, float),
                weights=cfg.weights, decoding=cfg.decoding, sjd_window=cfg.sjd_window,
            )  # fmt: skip
        except ValueError as e:
            raise BadRequest(str(e).replace("--", "")) from None
        if sampling.top_k < 0 or isinstance(sampling.top_k, float) and not 0 < sampling.top_k < 1:
            raise BadRequest(
                f'"top_k" must be a count of tokens (0: all) or a fraction in (0, 1) (got {sampling.top_k:g})'
            )
        return cls(text.strip(), n, seed, sampling, keep)

    def command(self, dalle_path: str, seed: int, weights: str) -> str:
        """The generate.py command that writes image `seed` of this request as its 0000.png."""
        s = self.sampling
        argv = ["python", "generate.py", "--dalle_path", dalle_path, "--text", self.text, "--num_images", "1"]
        argv += ["--seed", str(seed), "--temperature", f"{s.temperature:g}", "--top_k", f"{s.top_k:g}"]
        argv += ["--top_p", f"{s.top_p:g}", "--cond_scale", f"{s.cond_scale:g}"]
        if weights != "auto":
            argv += ["--weights", weights]
        if s.decoding != "sequential":
            argv += ["--decoding", s.decoding, "--sjd_window", str(s.sjd_window)]
        return shlex.join(argv)


def _number(body: dict, name: str, default, kind):
    """body[name] as an int or float (`kind`), `default` when absent; anything else is a bad request."""
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f'"{name}" must be a{"n integer" if kind is int else " number"} (got {value!r})')
    return kind(value)


def png(image: torch.Tensor) -> str:
    """One image (c, s, s) in [0, 1] as base64 PNG, encoded as generate.py writes its files (torchvision)."""
    from torchvision.utils import save_image

    buf = io.BytesIO()
    save_image(image, buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def load_app(cfg: ServeConfig):
    """The service over the models `cfg` names, loaded once."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"serve.py needs fastapi and uvicorn ({e}): run `make install`") from None
    from .load import load_dalle, pick_device
    from .pipeline import load_reranker

    device = pick_device(cfg.device)
    dalle, vae, tokenizer = load_dalle(
        cfg.dalle_path, device, weights=cfg.weights, text_encoder_path=cfg.text_encoder_path
    )
    clip = clip_tokenizer = None
    if cfg.clip_path:
        clip, clip_tokenizer = load_reranker(cfg.clip_path, cfg.dalle_path, dalle, vae, tokenizer, device)
    return make_app(cfg, dalle, vae, tokenizer, clip, clip_tokenizer)


def make_app(cfg: ServeConfig, dalle, vae, tokenizer, clip=None, clip_tokenizer=None):
    """The FastAPI application over loaded models; its Batcher stops with the app."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import HTMLResponse, JSONResponse

    batcher = Batcher(dalle, vae, cfg.max_batch, cfg.max_wait)

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = FastAPI(title="DALLE", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    page = open(PAGE, encoding="utf-8").read().replace("{{MAX_NUM_IMAGES}}", str(cfg.max_num_images))

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        return JSONResponse({"error": str(e)}, status_code=400)

    @app.exception_handler(Exception)
    async def failed(_, e: Exception):  # the service goes on; the client hears what went wrong, in one line
        return JSONResponse({"error": f"{type(e).__name__}: {e}".splitlines()[0]}, status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "dalle_path": cfg.dalle_path, "clip": bool(clip), "batches": len(batcher.batches)}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest('the body is not JSON: send {"text": "a red circle", "num_images": 4}') from None
        req = Request.parse(body, cfg, clip is not None)
        text, truncated = tokenizer.captions(req.text, dalle.cfg.text_seq_len)
        options = req.sampling.token_options(dalle, say=lambda _: None)
        seeds = [req.seed + i for i in range(req.num_images)]
        future = batcher.submit(text, seeds, Settings(**options))
        wrapped = asyncio.wrap_future(future)
        while not wrapped.done():  # a client that left before its batch started takes no decode step
            if await request.is_disconnected():
                future.cancel()
                return JSONResponse({"error": "the client left"}, status_code=499)
            await asyncio.wait({wrapped}, timeout=0.1)
        images = wrapped.result()
        scores = [None] * len(images)
        if clip is not None:  # CLIP's ranking, best first; keep 0 keeps every image, ranked
            order, ranked = await asyncio.to_thread(best_of, clip, clip_tokenizer, req.text, images, req.keep)
            images, seeds, scores = images[order], [seeds[i] for i in order.tolist()], ranked.tolist()
        commands = [req.command(cfg.dalle_path, s, cfg.weights) for s in seeds]
        encoded = await asyncio.to_thread(lambda: [png(im) for im in images])  # one large answer holds no other
        return {
            "images": encoded,
            "scores": [None if s is None else round(s, 5) for s in scores],
            "seeds": seeds,
            "seed": req.seed,
            "commands": commands,
            "command": commands[0],
            "truncated": bool(truncated),
        }

    return app
