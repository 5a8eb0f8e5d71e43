"""A small OpenAI-compatible chat server for a transformers vision-language model, for local tests
of the ``vlm_judge`` reward without vLLM or SGLang.

    python scripts/serve_vlm_judge.py --model llava-hf/llava-1.5-7b-hf --port 8000     # a real VLM
    python scripts/serve_vlm_judge.py --tiny /tmp/tiny-vlm --port 0                    # tiny random LLaVA

``--model`` loads any ``AutoModelForImageTextToText`` + ``AutoProcessor`` (hub id or local folder);
``--tiny DIR`` builds a LLaVA with a few layers, a 20-word vocabulary and random weights, saves it to
DIR and serves it from there through the same ``from_pretrained`` path. When ready the server prints
one line, ``serving <model name> on http://127.0.0.1:<port>`` (``--port 0``: a free port).

Endpoints: ``GET /health``, ``GET /v1/models`` and ``POST /v1/chat/completions`` with the fields the
judge uses: ``model``, ``messages`` (text, and images as ``image_url`` data URIs or ``data:`` URLs),
``max_tokens``, ``temperature`` (0: greedy), ``seed``, ``logprobs`` / ``top_logprobs`` (log-softmax of
the raw logits in fp32, as vLLM reports them by default) and ``logit_bias`` ({token id: bias}).
Requests are served by threads; the model runs one request at a time.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The tiny model's vocabulary: chat markup, the words a judge's answer is read from, and digits; 20
# words, so that top_logprobs (at most 20) lists the whole distribution. Other words read as <unk>.
TINY_VOCAB = ["</s>", "<unk>", "<image>", "USER", "ASSISTANT", "Yes", "No", "Score", ":", "/", *[str(n) for n in range(10)]]
TINY_INIT_STD = 0.5  # weights' spread: wide enough that answers depend visibly on the image (default 0.02)
TINY_IMAGE_SIZE = 16  # pixels; the image processor resizes every image to this
TINY_PATCH_SIZE = 8  # -> (16 / 8)^2 = 4 image tokens per image
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }} : "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT : {% endif %}"
)
MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit, also vLLM's default


def build_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random LLaVA (CLIP vision tower, Llama text model) and its processor to ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_VOCAB)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # "Score: 7/10" -> Score, :, 7, /, 10
    words.add_special_tokens(["</s>", "<unk>", "<image>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="</s>", eos_token="</s>")
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": TINY_IMAGE_SIZE},
                                            crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=TINY_PATCH_SIZE,
                               vision_feature_select_strategy="default", chat_template=TINY_CHAT_TEMPLATE,
                               image_token="<image>", num_additional_image_tokens=1)  # CLIP's class token
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=TINY_IMAGE_SIZE, patch_size=TINY_PATCH_SIZE, projection_dim=16,
                              initializer_range=TINY_INIT_STD)
    text = LlamaConfig(vocab_size=len(TINY_VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       pad_token_id=0, eos_token_id=0, initializer_range=TINY_INIT_STD)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=TINY_VOCAB.index("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         initializer_range=TINY_INIT_STD)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


class ChatModel:
    """A VLM behind the chat-completions fields above; ``complete(request) -> response dict``."""

    def __init__(self, path: str, name: str, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch = torch
        self.name = name
        self.device = torch.device(device)
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = self.processor.tokenizer
        self.lock = threading.Lock()  # one generate() at a time

    def complete(self, request: dict) -> dict:
        torch = self.torch
        messages, images = _chat_messages(request.get("messages"))
        max_tokens = _int_field(request, "max_tokens", 16, 1, 4096)
        top = _int_field(request, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        temperature = float(request.get("temperature", 1.0) or 0.0)
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt").to(self.device)
        inputs = {k: v.to(self.model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        extra = {}
        if request.get("logit_bias"):
            extra["logits_processor"] = [_LogitBias(request["logit_bias"], torch)]
        if temperature > 0:
            extra.update(do_sample=True, temperature=temperature, top_p=float(request.get("top_p", 1.0)), top_k=0)
        with self.lock, torch.no_grad():
            if request.get("seed") is not None:
                torch.manual_seed(int(request["seed"]))
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=temperature > 0, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id, **extra)
        prompt_len = inputs["input_ids"].shape[1]
        ids = out.sequences[0, prompt_len:].tolist()
        eos = self.tokenizer.eos_token_id
        finish = "stop" if ids and ids[-1] == eos else "length"
        choice = {"index": 0, "finish_reason": finish, "logprobs": None,
                  "message": {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}}
        if request.get("logprobs"):
            content = []
            for step, token in enumerate(ids):
                logprobs = torch.log_softmax(out.logits[step][0].float(), dim=-1)  # fp32
                entry = self._token(token, logprobs[token].item())
                values, indices = logprobs.topk(top)
                entry["top_logprobs"] = [self._token(i, v) for v, i in zip(values.tolist(), indices.tolist())]
                content.append(entry)
            choice["logprobs"] = {"content": content}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(ids), "total_tokens": prompt_len + len(ids)}}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class _LogitBias:
    """OpenAI's ``logit_bias``: ``{token id: bias}`` added to the logits before choosing a token."""

    def __init__(self, bias: dict, torch) -> None:
        try:
            self.bias = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise BadRequest("logit_bias must map token ids to numbers") from None

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            if 0 <= token < scores.shape[-1]:
                scores[:, token] += value
        return scores


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 and this message."""


def _int_field(request: dict, key: str, default: int, low: int, high: int) -> int:
    value = request.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _chat_messages(messages) -> tuple[list[dict], list]:
    """OpenAI messages -> (messages in the processor's chat format, PIL images in order)."""
    from PIL import Image

    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    converted, images = [], []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message needs a role and content")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise BadRequest("message content must be a string or a list of parts")
        out = []
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                out.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url", "")
                header, _, data = url.partition(",")
                if not header.startswith("data:image/") or ";base64" not in header:
                    raise BadRequest("images must be data:image/...;base64 URLs (this server fetches nothing)")
                try:
                    images.append(Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB"))
                except (binascii.Error, OSError) as exc:
                    raise BadRequest(f"image cannot be decoded: {exc}") from None
                out.append({"type": "image"})
            else:
                raise BadRequest(f"unsupported content part type {kind!r}")
        converted.append({"role": message["role"], "content": out})
    return converted, images


def make_server(chat: ChatModel, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": chat.name, "object": "model", "owned_by": "local"}]})
            else:
                self._send(404, _error(f"no route {self.path}", "NotFoundError"))

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/chat/completions":
                self._send(404, _error(f"no route {self.path}", "NotFoundError"))
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not isinstance(request, dict):
                    raise BadRequest("the body must be a JSON object")
                if request.get("model") != chat.name:
                    self._send(404, _error(f"The model `{request.get('model')}` does not exist.", "NotFoundError"))
                    return
                self._send(200, chat.complete(request))
            except (BadRequest, ValueError) as exc:
                self._send(400, _error(str(exc), "BadRequestError"))
            except Exception as exc:  # a model failure is the server's fault: 500, and the server stays up
                self._send(500, _error(f"{type(exc).__name__}: {exc}", "InternalServerError"))

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="hub id or local folder of an image-text-to-text model")
    source.add_argument("--tiny", metavar="DIR", help="build a tiny random LLaVA into DIR and serve it")
    parser.add_argument("--served-model-name", help="the name requests must give (default: --model, or 'tiny-vlm')")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed when ready)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    path = str(build_tiny_model(args.tiny)) if args.tiny else args.model
    name = args.served_model_name or ("tiny-vlm" if args.tiny else args.model)
    server = make_server(ChatModel(path, name, args.device, args.dtype), args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {name} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
