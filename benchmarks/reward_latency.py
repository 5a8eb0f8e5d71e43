"""Seconds per image of the ocr and vlm_judge rewards on this machine.

    python benchmarks/reward_latency.py [--images 16] [--skip-ocr] [--skip-vlm]

- **ocr**: Tesseract (tesserocr) on black text in Pillow's default font on white at 320x96,
  512x512 and 1024x1024, and on 512x512 uniform noise; prints the text read and the scores of
  exact text, a blank image and a wrong word, then milliseconds per image.
- **vlm_judge**: starts ``scripts/serve_vlm_judge.py --tiny`` (a random tiny LLaVA) on a free port,
  reports the time until it answers, then milliseconds per 512x512 noise image in ``yes_no`` mode
  with 1, 4 and 8 requests in flight. The tiny model makes this the cost of everything around
  the model: PNG encoding, HTTP, decoding and preprocessing on the server.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward_models  # noqa: E402
from reward_models.ocr import render_text  # noqa: E402


def bench_ocr(count: int) -> None:
    reward = reward_models.build("ocr")
    words = ["OPEN SOON", "", "CLOSED", "diffalign 2026"]  # exact, blank, wrong word, exact
    prompts = ['a sign that says "OPEN SOON"'] * 3 + ['a poster with "diffalign 2026"']
    for size, font_size in (((320, 96), 40), ((512, 512), 48), ((1024, 1024), 96)):
        images = render_text([words[i % 4] for i in range(count)], size, font_size)
        batch_prompts = [prompts[i % 4] for i in range(count)]
        reward(images[:4], prompts, [{}] * 4)  # warm-up
        start = time.perf_counter()
        scores = reward(images, batch_prompts, [{}] * count)
        per_image = (time.perf_counter() - start) / count
        read = [text.strip() for text in reward.last_texts[:4]]
        print(f"ocr {size[0]}x{size[1]}: scores {[round(s, 3) for s in scores[:4].tolist()]} read {read} "
              f"{per_image * 1000:.1f} ms/image")
    noise = torch.rand(count, 3, 512, 512, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    scores = reward(noise, ['"OPEN SOON"'] * count, [{}] * count)
    print(f"ocr 512x512 noise: max score {scores.max().item():.3f} "
          f"{(time.perf_counter() - start) / count * 1000:.1f} ms/image")


def bench_vlm(count: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        server = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "serve_vlm_judge.py"), "--tiny",
                                   str(Path(folder) / "model"), "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
        try:
            waiting = reward_models.build("vlm_judge", base_url=url, model="tiny-vlm", retries=1200, backoff=0.1,
                                          max_backoff=0.1)
            waiting(torch.rand(1, 3, 8, 8), ["x"], [{}])
            print(f"vlm_judge: tiny server answering {time.perf_counter() - start:.1f} s after its start")
            images = torch.rand(count, 3, 512, 512, generator=torch.Generator().manual_seed(0))
            for concurrency in (1, 4, 8):
                judge = reward_models.build("vlm_judge", base_url=url, model="tiny-vlm", concurrency=concurrency)
                judge(images[:4], ["a cat"] * 4, [{}] * 4)  # warm-up
                start = time.perf_counter()
                judge(images, ["a cat"] * count, [{}] * count)
                print(f"vlm_judge yes_no 512x512, concurrency {concurrency}: "
                      f"{(time.perf_counter() - start) / count * 1000:.1f} ms/image")
        finally:
            server.terminate()
            server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16, help="images per timed call")
    parser.add_argument("--skip-ocr", action="store_true")
    parser.add_argument("--skip-vlm", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_ocr:
        bench_ocr(args.images)
    if not args.skip_vlm:
        bench_vlm(args.images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
