"""``miles-core generate``: sample a checkpoint (optionally with a LoRA) to files, through
the same embedded engine that serves rollouts, in evaluation mode (``rollout: false``).

Prompt *p* with ``--num-outputs N`` and ``--seed S`` gives outputs seeded ``S .. S+N-1``
(as a rollout request does), written to ``--out DIR`` as ``DIR/p{p:03d}_s{seed}.png``.
Video outputs are written as MP4 (``.mp4``, H.264, every frame, at ``--fps``) through
imageio with imageio-ffmpeg, which ships its own ffmpeg (the ``video`` extra: ``pip install
-c constraints.txt -e '.[video]'``); without them, as animated GIFs (``.gif``) with a
one-line note. An image-to-video family takes a conditioning image: ``--image PATH`` for
every prompt, or, without it, each row of a .jsonl prompt file under ``--image-key``
(relative to the file's folder). Each file gets a line in ``DIR/manifest.jsonl``
(``prompt_index``, ``prompt``, ``seed``, ``file``, and ``image`` when there is one),
appended as the file is written. An existing output file is never overwritten: the
command checks every name before loading the model and stops (exit status 2) naming the
first that exists."""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_core.cli.model_options import add_model_options, device_and_dtype, family_name
from miles_core.config.parser import OneLineParser
from miles_core.errors import UsageError
from miles_core.plugin_manager import get_host

MANIFEST = "manifest.jsonl"
REQUEST_FLAGS = {
    "seed": "--seed",
    "height": "--height",
    "width": "--width",
    "num_inference_steps": "--num-inference-steps",
    "num_outputs_per_prompt": "--num-outputs",
    "guidance_scale": "--guidance-scale",
    "num_frames": "--num-frames",
    "fps": "--fps",
    "negative_prompt": "--negative-prompt",
    "true_cfg_scale": "--true-cfg-scale",
    "extra_sampling_params": "--guidance-scale-2 / --flow-shift",
    "image_path": "--image",
}


def build_parser(families: Sequence[str] = (), prog: str = "miles-core generate") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    add_model_options(parser, families, checkpoint_help="diffusers pipeline directory or hub id")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt")
    prompts.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="prompts: FILE.jsonl (one JSON object per line, the prompt under --input-key) or FILE.txt (one prompt per non-empty line)",
    )
    parser.add_argument("--input-key", default="input", metavar="KEY", help="prompt key of a .jsonl prompt file (default: input)")
    parser.add_argument(
        "--image",
        metavar="PATH",
        default=None,
        help="conditioning image of every prompt, for an image-to-video family (Wan 2.2 I2V-A14B needs one, TI2V-5B takes one)",
    )
    parser.add_argument(
        "--image-key",
        default="image",
        metavar="KEY",
        help="without --image: the conditioning-image key of a .jsonl prompt file's rows, relative to its folder (default: image)",
    )
    parser.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        default=None,
        help="negative prompt when guidance is on (default: the family's)",
    )
    parser.add_argument("--num-outputs", type=int, default=1, metavar="N", help="outputs per prompt (default: 1)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of output 0; output i uses S+i (default: 0)")
    parser.add_argument(
        "--num-inference-steps",
        type=int,
        default=None,
        metavar="N",
        help="denoising steps (default: the pipeline's own default)",
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        metavar="G",
        help="classifier-free guidance scale; 1 or less turns it off (default: the pipeline's own default)",
    )
    parser.add_argument(
        "--guidance-scale-2",
        type=float,
        default=None,
        metavar="G",
        help="guidance scale of Wan 2.2's low-noise expert (default: --guidance-scale, as diffusers' WanPipeline)",
    )
    parser.add_argument(
        "--true-cfg-scale", type=float, default=None, metavar="G", help="true-CFG scale of the families that have it (Qwen-Image)"
    )
    parser.add_argument(
        "--flow-shift",
        type=float,
        default=None,
        metavar="S",
        help="schedule shift, as --diffusion-flow-shift in training (default: the checkpoint's)",
    )
    parser.add_argument("--height", type=int, default=None, metavar="H", help="default: the pipeline's native size")
    parser.add_argument("--width", type=int, default=None, metavar="W", help="default: the pipeline's native size")
    parser.add_argument("--num-frames", type=int, default=None, metavar="N", help="frames of a video family (default: the family's)")
    parser.add_argument(
        "--fps", type=float, default=None, help="frame rate of a video family, and of the written MP4 or GIF (default: 16 for the file)"
    )
    parser.add_argument(
        "--lora",
        metavar="DIR",
        default=None,
        help="a diffusers LoRA (the directory a training run saves), loaded with pipeline.load_lora_weights or the family's own loader",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    return parser


def run(argv: Sequence[str], prog: str = "miles-core generate") -> int:
    registry = get_host().registries.model_family
    parser = build_parser(registry.names(), prog)
    args = parser.parse_args(list(argv))
    try:
        _generate(args, registry, prog)
    except UsageError as exc:
        parser.error(str(exc))
    return 0


# -- before the model ----------------------------------------------------------------------


def _resolve_family(checkpoint: str, explicit: str | None, registry: Any) -> str:
    try:
        return family_name(checkpoint, explicit, registry)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


Prompt = tuple[str, dict, "str | None"]
"""A prompt, its metadata and its conditioning image (None: text only)."""


def _load_prompt_file(path: Path, input_key: str, image_key: str | None = None, image_required_by: str | None = None) -> list[Prompt]:
    from miles_core.errors import PromptDataError
    from miles_core.rollout.data import load_prompts

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        try:
            records = load_prompts(path, input_key=input_key, image_key=image_key, image_required_by=image_required_by)
        except PromptDataError as exc:
            raise UsageError(f"--prompt-file {exc}") from None
        return [(r.prompt, r.metadata, r.image) for r in records]
    if suffix == ".txt":
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--prompt-file {path}: cannot read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--prompt-file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        prompts: list[Prompt] = [(line.strip(), {}, None) for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"--prompt-file {path}: no prompts (empty file)")
        return prompts
    raise UsageError(f"--prompt-file {path}: expected a .jsonl or .txt file")


def _prompts(args: Any, family_name: str, image_input: str) -> list[Prompt]:
    """The prompts with their conditioning images, checked against the family's
    ``image_input`` before the model loads: ``--image`` for every prompt, else a .jsonl
    file's rows under ``--image-key`` (read only for a family that takes an image)."""
    image = None
    if args.image is not None:
        if image_input == "none":
            raise UsageError(f"--image {args.image}: the {family_name} family takes no conditioning image (it is text-to-image/video)")
        if not Path(args.image).is_file():
            raise UsageError(f"--image {args.image}: no such image file")
        image = str(Path(args.image).absolute())
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt: must not be empty")
        prompts: list[Prompt] = [(args.prompt, {}, None)]
    else:
        from_rows = image is None and image_input != "none"
        prompts = _load_prompt_file(
            Path(args.prompt_file),
            args.input_key,
            image_key=args.image_key if from_rows else None,
            image_required_by=family_name if from_rows and image_input == "required" else None,
        )
    if image is not None:
        prompts = [(prompt, metadata, image) for prompt, metadata, _ in prompts]
    elif image_input == "required" and any(row_image is None for _, _, row_image in prompts):
        raise UsageError(f"--image: the {family_name} family is image-to-video and needs a conditioning image (give --image PATH)")
    return prompts


def _pipeline_default(pipeline_class: type, name: str, fallback: Any) -> Any:
    """A keyword default of the pipeline's ``__call__`` (what diffusers would use)."""
    try:
        parameter = inspect.signature(pipeline_class.__call__).parameters.get(name)
    except (TypeError, ValueError):
        return fallback
    if parameter is None or parameter.default is inspect.Parameter.empty or parameter.default is None:
        return fallback
    return parameter.default


def _request_error(exc: Exception) -> UsageError:
    field = getattr(exc, "field", None)
    flag = REQUEST_FLAGS.get(field or "", field)
    message = str(exc).split(": ", 1)[1] if field and str(exc).startswith(f"{field}: ") else str(exc)
    return UsageError(f"{flag} {message}" if flag else message)


def _generate(args: Any, registry: Any, prog: str) -> None:
    from miles_core.errors import RequestError
    from miles_core.request import RolloutRequest

    if args.num_outputs < 1:
        raise UsageError(f"--num-outputs {args.num_outputs}: must be at least 1")
    if args.num_inference_steps is not None and args.num_inference_steps < 1:
        raise UsageError(f"--num-inference-steps {args.num_inference_steps}: must be at least 1")
    if args.fps is not None and not (math.isfinite(args.fps) and args.fps > 0):
        raise UsageError(f"--fps {args.fps}: must be a positive number")
    if args.lora is not None and not Path(args.lora).exists():
        raise UsageError(f"--lora {args.lora}: no such file or directory")
    family_name = _resolve_family(args.hf_checkpoint, args.diffusion_model_family, registry)
    prompts = _prompts(args, family_name, registry.get(family_name).spec.image_input)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")

    requests = []
    for index, (prompt, _, image) in enumerate(prompts):
        request = RolloutRequest(
            prompt=prompt,
            negative_prompt=args.negative_prompt,
            seed=args.seed,
            width=args.width,
            height=args.height,
            num_inference_steps=args.num_inference_steps or 1,  # the real default is filled in below
            num_outputs_per_prompt=args.num_outputs,
            guidance_scale=args.guidance_scale if args.guidance_scale is not None else 0.0,
            num_frames=args.num_frames,
            fps=args.fps,
            true_cfg_scale=args.true_cfg_scale,
            extra_sampling_params={
                key: value
                for key, value in (("guidance_scale_2", args.guidance_scale_2), ("flow_shift", args.flow_shift))
                if value is not None
            },
            rollout=False,
            request_id=f"generate-p{index:03d}",
            image_path=None if image is None else (image,),
        )
        try:
            request.validate()
        except RequestError as exc:
            raise _request_error(exc) from None
        requests.append(request)

    # Every name is checked before the model loads; files are also created exclusively, so
    # a file that appears meanwhile is not overwritten either.
    for index in range(len(prompts)):
        for i in range(args.num_outputs):
            for suffix in (".png", ".mp4", ".gif"):
                path = out / _file_name(index, args.seed + i, suffix)
                if path.exists():
                    raise UsageError(f"--out {out}: {path.name} exists; refusing to overwrite it (choose another --out or --seed)")

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.family import ModelFamily, pipeline_class_for
    from miles_core.quiet import show_hub_libraries

    show_hub_libraries()  # a hub id with its download progress; a tiny pipeline loads quietly (load_pipeline)
    family_cls = registry.get(family_name).load()
    pipeline_class = pipeline_class_for(family_cls, args.hf_checkpoint)
    steps = args.num_inference_steps or int(_pipeline_default(pipeline_class, "num_inference_steps", 28))
    guidance = args.guidance_scale if args.guidance_scale is not None else float(_pipeline_default(pipeline_class, "guidance_scale", 4.0))
    own_loader = family_cls.load_lora is not ModelFamily.load_lora  # e.g. Cosmos 3's transformer adapter API
    if args.lora is not None and not own_loader and not hasattr(pipeline_class, "load_lora_weights"):
        raise UsageError(
            f"--lora {args.lora}: the {family_name} family's pipeline ({pipeline_class.__name__}) has no LoRA loader (load_lora_weights)"
        )
    device, dtype = device_and_dtype(args.device, args.dtype)
    try:
        engine = EmbeddedEngine.from_checkpoint(args.hf_checkpoint, family_name, device=device, dtype=dtype)
    except Exception as exc:
        raise UsageError(f"--hf-checkpoint {args.hf_checkpoint}: cannot load it as {family_name}: {_first_line(exc)}") from None
    pipeline = engine.family.pipeline
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)
    if args.lora is not None:
        try:
            engine.family.load_lora(args.lora)
        except Exception as exc:
            raise UsageError(f"--lora {args.lora}: cannot load it into the {family_name} pipeline: {_first_line(exc)}") from None

    from dataclasses import replace

    requests = [replace(r, num_inference_steps=steps, guidance_scale=guidance) for r in requests]
    try:
        for request in requests:
            request.validate()
            engine.family.resolve_params(request)  # the model's own size rules, before any output
    except RequestError as exc:
        raise _request_error(exc) from None

    out.mkdir(parents=True, exist_ok=True)
    written = 0
    gif_noted = False
    for index, ((prompt, metadata, image), request) in enumerate(zip(prompts, requests)):
        outputs = engine.generate_sync(request)
        for output in outputs:
            name = write_output(out, index, output.seed, output.generated_output, args.fps)
            row = {"prompt_index": index, "prompt": prompt, "seed": output.seed, "file": name}
            if image is not None:
                row["image"] = image
            if metadata:
                row["metadata"] = metadata
            with (out / MANIFEST).open("a", encoding="utf-8") as manifest:
                manifest.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
            if name.endswith(".gif") and not gif_noted:
                gif_noted = True
                print(f"{prog}: note: {GIF_NOTE}", file=sys.stderr)
            if output.extra_outputs and written == 1:
                print(
                    f"{prog}: note: {', '.join(sorted(output.extra_outputs))} output(s) are not written yet",
                    file=sys.stderr,
                )
    lora = f" with LoRA {args.lora}" if args.lora else ""
    print(f"wrote {written} file(s) from {family_name} {args.hf_checkpoint}{lora} to {out} (see {out / MANIFEST})", file=sys.stderr)


# -- writing -------------------------------------------------------------------------------


def _file_name(prompt_index: int, seed: int, suffix: str) -> str:
    return f"p{prompt_index:03d}_s{seed}{suffix}"


GIF_NOTE = (
    "no MP4 encoder is installed, so videos are written as animated GIFs; for MP4 install imageio with "
    "imageio-ffmpeg (pip install -c constraints.txt -e '.[video]' in the miles-core checkout)"
)


def mp4_encoder() -> str | None:
    """The bundled ffmpeg when the video extra is installed, else None (videos fall back
    to animated GIFs): :func:`miles_core.media.video_encoder`."""
    from miles_core.media import video_encoder

    return video_encoder()


def write_output(out: Path, prompt_index: int, seed: int, pixels: Any, fps: float | None) -> str:
    """One output as ``p{prompt_index:03d}_s{seed}`` + ``.png`` (an image), ``.mp4`` (a video
    with the video extra) or ``.gif`` (a video without it); never overwrites a file."""
    from miles_core import media
    from miles_core.training.record_values import uint8_frames

    if pixels.ndim not in (3, 4):
        raise UsageError(f"the family returned an output of shape {tuple(pixels.shape)}; expected [C,H,W] or [C,F,H,W]")
    frames = uint8_frames(pixels)  # rounded as diffusers' numpy_to_pil
    if pixels.ndim == 3:
        name, write = _file_name(prompt_index, seed, ".png"), lambda path: media.write_png(path, frames, exclusive=True)
    elif mp4_encoder() is not None:
        name, write = _file_name(prompt_index, seed, ".mp4"), lambda path: media.write_mp4(path, frames, fps, exclusive=True)
    else:
        name, write = _file_name(prompt_index, seed, ".gif"), lambda path: media.write_gif(path, frames, fps, exclusive=True)
    try:
        write(out / name)
    except FileExistsError:
        raise UsageError(f"--out {out}: {name} exists; refusing to overwrite it") from None
    except Exception as exc:
        if name.endswith(".mp4"):
            raise UsageError(f"{out / name}: the MP4 encoder (imageio-ffmpeg) failed: {_first_line(exc)}") from None
        raise
    return name


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
