"""Gradio demo: a base model and its aligned version on the same prompt and seed.

For one prompt and seed the app shows

- the two final images side by side (``gr.ImageSlider``: drag to compare);
- each image's score under the selected reward models;
- a strip per model of the x0 estimates ``decode(to_x0(model_output, x_t, t))`` at every step
  of the deterministic sampler (flow ODE / DDIM eta=0), i.e. what each model "has in mind" while
  denoising; both start from the same noise.

Run ``diffalign demo`` (or ``python demo/app.py``) with no arguments for the shipped shapes model
and the latest run under ``runs/`` that has ``final/`` weights; see ``diffalign demo --help``.
It binds 127.0.0.1 unless ``--host`` says otherwise; a public link needs ``--share``.
:func:`build_app` builds the ``gr.Blocks`` from two adapters, so tests drive it on tiny models.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import reward_models
from diffalign.adapters.base import ModelAdapter
from diffalign.errors import DiffalignError, RunDirError
from diffalign.sampling import build_kernel, draw_noise

DISPLAY_SIZE = 256  # px: small models draw 32 px images, upscaled (nearest) so pixels stay visible
PREVIEW_SIZE = 96  # px per x0 preview in the per-step strips
MAX_STEPS = 50  # slider limit: a strip wider than this is unreadable anyway
STRIP_COLUMNS = 10  # previews per row of a strip (thumbnail width = page width / 10)
STRIP_HEIGHT = 280  # px: two rows of previews; more steps scroll (gradio's default is ~450 px)
RUNS_DIR = Path("runs")


@dataclass
class Generation:
    """One deterministic sample with its per-step x0 estimates.

    ``image``: (3, H, W) fp32 in [0, 1]; ``previews``: (T, 3, H, W) fp32 in [0, 1], the x0
    estimate before step i; ``times``: (T,) the time ``t_i`` of each preview (sigma for flow
    models, DDPM timestep for epsilon models).
    """

    image: torch.Tensor
    previews: torch.Tensor
    times: torch.Tensor


@torch.no_grad()
def generate_with_previews(adapter: ModelAdapter, prompt: str, *, seed: int, num_steps: int,
                           guidance_scale: float, resolution: int) -> Generation:
    """The same rollout as :func:`diffalign.sampling.sample_images` for one prompt (same noise for
    the same seed, same deterministic steps), keeping ``decode(to_x0(...))`` at every step."""
    gen = torch.Generator("cpu").manual_seed(seed)
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    kernel = build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)
    embeds = adapter.encode_prompts([prompt], with_uncond=guidance_scale > 1)
    x = draw_noise(adapter, 1, resolution, resolution, gen).float()
    previews = []
    for i in range(num_steps):
        t = schedule[i].expand(1).to(adapter.device)
        t_next = schedule[i + 1].expand(1).to(adapter.device)
        model_output = adapter.predict(x, t, embeds, guidance_scale)
        previews.append(adapter.decode(adapter.to_x0(model_output, x, t)).float().clamp(0, 1).cpu())
        x = kernel.step(model_output, x, t, t_next, sde=False, generator=gen).prev_sample.float()
    image = adapter.decode(x).float().clamp(0, 1).cpu()
    return Generation(image[0], torch.cat(previews), schedule[:-1].clone())


def to_pil(image: torch.Tensor, size: int):
    """(3, H, W) in [0, 1] -> PIL image upscaled to ``size`` px (nearest: keeps pixels crisp)."""
    from PIL import Image

    array = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype("uint8")
    return Image.fromarray(array).resize((size, size), Image.NEAREST)


def score(rewards: dict, images: torch.Tensor, prompt: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``({reward name: [score of each image]}, {reward name: error})`` for images (N, 3, H, W)
    of one prompt. A reward that cannot score this prompt (e.g. ``shapes_eval`` on a word outside
    its grammar) is reported, not fatal: the other rewards still show."""
    prompts = [prompt] * len(images)
    scores, errors = {}, {}
    for name, fn in rewards.items():
        try:
            value = fn(images, prompts, [{} for _ in prompts])
            scores[name] = reward_models.check_reward_output(name, value, len(images)).tolist()
        except (ValueError, DiffalignError) as e:  # bad prompt for this reward, bad output
            errors[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return scores, errors


# rewards whose default score is pass / fail (1 / 0): their row says so, so that "0 0 0" reads as "both fail"
PASS_FAIL_REWARDS = {"shapes_eval": "shapes_eval (1 = pass, 0 = fail)"}


def reward_label(name: str) -> str:
    """The row label of reward ``name`` in the rewards table."""
    return PASS_FAIL_REWARDS.get(name, name)


def warnings(errors: dict[str, str]) -> list[str]:
    """One warning per distinct message of :func:`score`'s errors, naming every reward that gave it
    (ShapesEval and ShapesSoft refuse a prompt outside the shapes grammar with the same words)."""
    by_message: dict[str, list[str]] = {}
    for name, message in errors.items():
        by_message.setdefault(message, []).append(name)
    return [f"{', '.join(names)}: {message}" for message, names in by_message.items()]


def build_app(
    base_adapter: ModelAdapter,
    aligned_adapter: ModelAdapter,
    reward_names: Sequence[str],
    *,
    num_steps: int = 20,
    guidance_scale: float = 4.5,
    resolution: int | None = None,
    seed: int = 0,
    prompts: Sequence[str] = ("a photo of a cat",),
    base_label: str = "base",
    aligned_label: str = "aligned",
    display_size: int = DISPLAY_SIZE,
    preview_size: int = PREVIEW_SIZE,
):
    """The comparison app as a ``gr.Blocks`` (not launched).

    Args:
        base_adapter, aligned_adapter: the two models; they must share a latent shape so that the
            same seed gives both the same starting noise.
        reward_names: rewards (registry names) offered in the app, all selected at start.
        num_steps, guidance_scale, seed: starting values of the controls.
        resolution: image size in px (default: the base adapter's).
        prompts: the first is the starting prompt; all are offered as examples.
    """
    import gradio as gr

    resolution = resolution or base_adapter.default_resolution
    if base_adapter.latent_shape(resolution, resolution) != aligned_adapter.latent_shape(resolution, resolution):
        raise DiffalignError(f"base ({base_adapter.family}) and aligned ({aligned_adapter.family}) models have different "
                             "latent shapes; compare an aligned run with its own base model")
    device = str(base_adapter.device)
    rewards = {name: reward_models.build(name, device=device) for name in reward_names}

    def generate(prompt: str, seed: float, steps: float, guidance: float, selected: list[str]):
        prompt, seed, steps = (prompt or "").strip(), int(seed or 0), min(max(int(steps or 1), 1), MAX_STEPS)
        kw = dict(seed=seed, num_steps=steps, guidance_scale=float(guidance), resolution=resolution)
        base = generate_with_previews(base_adapter, prompt, **kw)
        aligned = generate_with_previews(aligned_adapter, prompt, **kw)
        scores, errors = score({n: rewards[n] for n in selected or []}, torch.stack([base.image, aligned.image]), prompt)
        for message in warnings(errors):
            gr.Warning(message)
        table = [[reward_label(name), round(b, 4), round(a, 4), round(a - b, 4)] for name, (b, a) in scores.items()]

        def strip(g: Generation):
            return [(to_pil(img, preview_size), f"t={float(t):.3g}") for img, t in zip(g.previews, g.times)]

        pair = (to_pil(base.image, display_size), to_pil(aligned.image, display_size))
        return pair, table, strip(base), strip(aligned)

    with gr.Blocks(title="diffalign: base vs aligned") as app:
        gr.Markdown(f"## diffalign: `{base_label}` vs `{aligned_label}`\n"
                    "Same prompt, same seed, same starting noise. Drag the slider to compare; "
                    "the strips show each model's x0 estimate at every sampling step.")
        with gr.Row():
            with gr.Column(scale=3):
                prompt_box = gr.Textbox(value=prompts[0] if prompts else "", label="prompt", elem_id="prompt")
                with gr.Row():
                    seed_box = gr.Number(value=seed, precision=0, label="seed", elem_id="seed")
                    steps_box = gr.Slider(1, MAX_STEPS, value=num_steps, step=1, label="steps", elem_id="steps")
                    guidance_box = gr.Slider(1.0, 12.0, value=guidance_scale, step=0.5, label="guidance scale")
                reward_box = gr.CheckboxGroup(list(reward_names), value=list(reward_names), label="reward models")
                button = gr.Button("Generate", variant="primary", elem_id="generate")
                table = gr.Dataframe(headers=["reward", base_label, aligned_label, "change"], label="rewards",
                                     interactive=False, elem_id="rewards")
            with gr.Column(scale=2):
                slider = gr.ImageSlider(label=f"{base_label} | {aligned_label}", type="pil", format="png",
                                        interactive=False, elem_id="comparison")
        strip = dict(columns=STRIP_COLUMNS, fit_columns=False, height=STRIP_HEIGHT, format="png", allow_preview=True)
        base_strip = gr.Gallery(label=f"{base_label}: x0 estimate at each step", elem_id="base-steps", **strip)
        aligned_strip = gr.Gallery(label=f"{aligned_label}: x0 estimate at each step", elem_id="aligned-steps", **strip)
        if len(prompts) > 1:
            gr.Examples([[p] for p in prompts], inputs=[prompt_box], label="prompts")
        inputs = [prompt_box, seed_box, steps_box, guidance_box, reward_box]
        outputs = [slider, table, base_strip, aligned_strip]
        gr.on([button.click, prompt_box.submit], generate, inputs, outputs, api_name="generate")
    return app


# ---- the `diffalign demo` command -------------------------------------------------------------
def latest_run(root: Path = RUNS_DIR) -> Path:
    """The run under ``root`` whose ``final/`` was written last."""
    finals = sorted(root.glob("*/final/diffalign.json"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not finals:
        raise RunDirError(f"no run with final weights under {root}/; train one with `diffalign train shapes/flow_grpo` "
                          "(`diffalign recipes` lists the others) or pass --aligned RUN_DIR")
    return finals[-1].parent.parent


def app_from_run(aligned_run: str | Path | None = None, base: str | None = None, reward_names: Sequence[str] | None = None,
                 *, device: str = "cpu"):
    """``build_app`` for a run directory, with its base model, sampling settings and prompts."""
    import yaml

    from diffalign.adapters import load_adapter
    from diffalign.export import load_trained_adapter

    run = Path(aligned_run) if aligned_run else latest_run()
    meta_file = run / "final" / "diffalign.json"
    if not meta_file.is_file():
        raise RunDirError(f"{str(run)!r} has no final weights (no final/diffalign.json); has the run finished?")
    meta = json.loads(meta_file.read_text())
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    sampling, prompts_cfg = config.get("sampling") or {}, config.get("prompts") or {}
    base = base or meta["base_model"]
    print(f"base: {base}; aligned: {run}", file=sys.stderr, flush=True)
    base_adapter = load_adapter(base, device=device)
    aligned = load_trained_adapter(run, device=device)
    if base_adapter.family != aligned.family:
        raise DiffalignError(f"--base {base!r} is a {base_adapter.family} model but run {str(run)!r} trained a "
                             f"{aligned.family} model ({meta['base_model']!r})")
    if not reward_names:
        reward_names = ["shapes_eval"] if aligned.family == "shapes" else [meta["reward"]]
    prompts = list(prompts_cfg.get("eval") or prompts_cfg.get("train") or [])
    if not prompts and aligned.family == "shapes":
        from diffalign.shapes import split_prompts

        prompts = split_prompts().evaluation()
    return build_app(
        base_adapter, aligned, reward_names,
        num_steps=int(sampling.get("eval_num_steps") or 20), guidance_scale=float(sampling.get("guidance_scale") or 4.5),
        resolution=(config.get("model") or {}).get("resolution"), prompts=prompts[:8] or ["a photo of a cat"],
        base_label=str(base), aligned_label=run.name,
    )


def run_from_args(args) -> int:
    """``diffalign demo``: build from the parsed arguments and serve until interrupted."""
    auth = parse_auth(getattr(args, "auth", None) or os.environ.get("DIFFALIGN_DEMO_AUTH"))
    if not 1 <= args.port <= 65535:
        raise DiffalignError(f"--port must be in 1..65535, got {args.port}")
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise DiffalignError("the demo needs gradio: pip install 'diffalign[demo]'") from None
    exposed = args.share or args.host not in LOCAL_HOSTS
    if exposed and auth is None:
        print(f"warning: the demo is reachable from other machines ({'a public gradio.live link' if args.share else args.host}) "
              f"without a login; add --auth USER:PASS", file=sys.stderr)
    reward_names = [r.strip() for r in args.rewards.split(",") if r.strip()] if args.rewards else None
    app = app_from_run(args.aligned, args.base, reward_names, device=args.device)
    # quiet: gradio's own start-up lines would tell the user to set share=True in launch(); say it
    # in this command's terms instead (the public URL, when --share asks for one, prints regardless)
    app.queue().launch(server_name=args.host, server_port=args.port, share=args.share, quiet=True,
                       prevent_thread_lock=True, **({"auth": auth} if auth else {}))
    print(f"* Running on local URL:  {app.local_url}", flush=True)
    if not args.share:
        print("* To create a public link, add --share (with --auth USER:PASS)", flush=True)
    app.block_thread()  # until Ctrl-C
    return 0


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_auth(text):
    """``USER:PASS`` -> (user, password); None when not given."""
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise DiffalignError("--auth must look like USER:PASS (both non-empty)")
    return user, password


if __name__ == "__main__":
    from diffalign.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
