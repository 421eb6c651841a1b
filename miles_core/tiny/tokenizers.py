"""Deterministic tiny tokenizers for hub-free tests.

Each builder trains a ~1k-token vocabulary with the `tokenizers` library on the built-in
`CORPUS` and hands it to the real transformers class (v5 constructors take in-memory
`vocab=` / `merges=`), so `save_pretrained(dir)` writes a `tokenizer.json` that
`AutoTokenizer.from_pretrained(dir)` and the diffusers pipelines load back as the same class.

Training reuses the normalizer / pre-tokenizer that the transformers class installs itself,
so the trained merges match how the class splits text at inference time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # keep the import light: transformers is only needed when building
    import transformers

__all__ = [
    "CORPUS",
    "QWEN_IMAGE_TEMPLATE",
    "clip_tokenizer",
    "t5_tokenizer",
    "qwen2_tokenizer",
    "gemma_tokenizer",
]

VOCAB_SIZE = 1000

# diffusers QwenImagePipeline.prompt_template_encode (0.42.1). It is in the corpus, repeated,
# so every word of its prefix is one token and the prefix encodes to the pipeline's
# hard-coded prompt_template_encode_start_idx = 34 tokens.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)

_SENTENCES = (
    "A red apple sits on a wooden table next to a blue ceramic cup.",
    "The small yellow bird perched on the branch of an old oak tree.",
    "A photograph of a cat sleeping on a green sofa in the afternoon sun.",
    "Two white horses run across a wide field under a cloudy grey sky.",
    "An astronaut riding a horse on the surface of the moon, digital art.",
    "A bowl of fresh oranges, lemons and limes on a kitchen counter.",
    "The city skyline at night, with bright neon lights reflected in the river.",
    "A little girl in a pink dress holds a purple balloon at the park.",
    "Snow covered mountains rise above a calm lake in the early morning.",
    "A vintage black car parked on a narrow street paved with stones.",
    "Three brown dogs play with an orange ball on a sandy beach.",
    "A glass vase filled with sunflowers stands by the open window.",
    "The ocean waves crash against the dark rocks during a storm.",
    "A cozy library with tall shelves of books and a soft leather chair.",
    "A robot made of shiny silver metal walks through a quiet forest.",
    "A painting of a lighthouse on a cliff, in the style of watercolor.",
    "Close-up of a butterfly with blue and gold wings resting on a flower.",
    "A plate of pasta with tomato sauce, basil leaves and grated cheese.",
    "An old man reading a newspaper on a bench beside a fountain.",
    "A bright green frog sitting on a lily pad in a muddy pond.",
    "The desert at sunset, long shadows across the orange dunes.",
    "A wooden boat floats on a still lake surrounded by pine trees.",
    "A child draws a rainbow with colored chalk on the sidewalk.",
    "A tall glass of iced coffee with cream on a marble table.",
    "A square box, a round ball and a triangle on a white background.",
    "Large text that reads 'HELLO WORLD' painted on a brick wall.",
    "A fluffy white cloud shaped like a rabbit drifts over the hills.",
    "A knight in silver armor stands before a huge stone castle.",
    "A smooth, shiny, rough, soft, striped and spotted texture sample.",
    "Five small candles burn on a chocolate birthday cake.",
    "A man and a woman walk a dog along a quiet road in autumn.",
    "The camera slowly pans left to reveal a busy market at noon.",
    "A video of rain falling on a window, with blurry lights behind it.",
    "A cinematic shot of a train crossing a bridge over a deep valley.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and 10, 20, 100, 2024 on a sign.",
    "It's a sunny day; we're going outside, and they'll stay in!",
    "A detailed macro photo of water drops on a green leaf, 4k, high quality.",
    "Left of the table is a lamp; right of the lamp is a small plant.",
    "An anime style portrait of a girl with long blue hair and red eyes.",
    "A low angle view of a giant tree with roots above the ground.",
    "A purple umbrella leans against a yellow door on a rainy evening.",
    "Colorful hot air balloons float over green valleys at dawn.",
    "A steaming bowl of ramen with noodles, eggs and spring onions.",
    "A tiny mouse nibbles cheese beside an enormous wheel of gouda.",
    "Futuristic spaceships hover above a glowing blue alien planet.",
    "A watercolor sketch of fishermen pulling nets onto their boats.",
    "Soft pastel flowers bloom across a meadow full of bees.",
    "A jazz musician plays a golden saxophone in a smoky club.",
    "Ancient ruins covered in moss and vines deep in the jungle.",
    "A polar bear cub climbs over thick blue ice floes.",
    "Heavy trucks drive along a dusty highway through the prairie.",
    "A chef slices vegetables quickly on a scratched cutting board.",
    "Crystal chandeliers hang from the painted ceiling of a ballroom.",
    "A skateboarder jumps high over concrete stairs in the plaza.",
    "Fireworks explode in red, white and violet above the harbor.",
    "A grandmother knits a thick wool scarf by the crackling fireplace.",
    "An owl with amber eyes watches quietly from a hollow trunk.",
    "Children build a sandcastle with towers, walls and a moat.",
    "A sleek modern kitchen with white cabinets and copper pans.",
    "Lightning strikes a distant hill during a violent thunderstorm.",
    "A herd of elephants crosses a shallow muddy river together.",
    "Bright graffiti letters cover the side of an abandoned warehouse.",
    "A paper lantern glows warmly above a narrow alley in Kyoto.",
    "Tulips of every shade line the canals in early spring.",
    "A mechanic repairs an engine, his hands black with grease.",
    "Dew glitters on spider webs strung between tall grasses.",
    "A pixel art scene of a knight fighting a dragon in a cave.",
    "Zoom in on a wristwatch with a cracked face and brass gears.",
    "Jellyfish drift through dark water, glowing pink and cyan.",
    "A farmer carries baskets of ripe peaches through the orchard.",
    "Quiet snowflakes settle on a frozen pond beneath bare birches.",
    "A marathon runner crosses the finish line, arms raised high.",
    "Vibrant parrots squawk loudly from the canopy of a rainforest.",
    "A hand-drawn map shows islands, mountains and hidden treasure.",
    "An empty subway platform lit by flickering fluorescent tubes.",
    "Giant waves curl over a surfer wearing a black wetsuit.",
    "Oil painting of a harvest feast with bread, grapes and wine.",
    "A curious fox peeks out from behind a snowy fir tree.",
    "Wide shot: the crowd cheers as the band takes the stage.",
)

# The corpus: varied English sentences plus the Qwen-Image template (repeated so its words
# win merges early even in a small vocabulary).
CORPUS: tuple[str, ...] = _SENTENCES + (QWEN_IMAGE_TEMPLATE.format("a photo of a red cat"),) * 20

# Printable ASCII, used to seed the Unigram alphabet so no ASCII character is unknown.
_ASCII = [chr(i) for i in range(32, 127)]


def _plain_corpus() -> tuple[str, ...]:
    """CORPUS without `<|...|>` markers: those are added tokens, matched before the
    pre-tokenizer at inference, so their characters should not be spent on merges."""
    import re

    return tuple(re.sub(r"<\|[a-z_]+\|>", "", s) for s in CORPUS)


def _model_json(tok: Any) -> dict:
    """The trained model section of a `tokenizers.Tokenizer` (vocab, merges, ...)."""
    import json

    return json.loads(tok.to_str())["model"]


def _train_bpe(
    template: Any,
    head: list[str],
    suffix: str = "",
    pre_tokenizer: Any = None,
    corpus: tuple[str, ...] | None = None,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train BPE on `corpus` split the way `template` (a transformers tokenizer) splits text.

    Hand-rolled rather than `tokenizers.trainers.BpeTrainer`, whose tie-breaking between
    equally frequent pairs follows hash-map order and so changes from call to call. Here ties
    go to the lexicographically smallest pair. Returns (vocab: `head`, then the remaining
    corpus characters, then merged tokens, up to VOCAB_SIZE entries; merges in order).
    """
    import heapq
    from collections import Counter, defaultdict

    corpus = _plain_corpus() if corpus is None else corpus
    backend = template.backend_tokenizer
    pre = pre_tokenizer if pre_tokenizer is not None else backend.pre_tokenizer
    word_counts: Counter[str] = Counter()
    for text in corpus:
        text = backend.normalizer.normalize_str(text) if backend.normalizer else text
        word_counts.update(piece for piece, _ in pre.pre_tokenize_str(text))

    words: list[list[str]] = []
    freq: list[int] = []
    for w, c in sorted(word_counts.items()):
        syms = list(w)
        syms[-1] += suffix  # CLIP marks the last symbol of a word with `</w>`
        words.append(syms)
        freq.append(c)

    vocab: dict[str, int] = {}
    for t in head + sorted({s for w in words for s in w}):
        vocab.setdefault(t, len(vocab))

    pair_count: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += freq[i]
            where[p].add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while heap and len(vocab) < VOCAB_SIZE:
        neg, pair = heapq.heappop(heap)
        if -neg != pair_count.get(pair, 0):
            continue  # stale heap entry
        merged = pair[0] + pair[1]
        merges.append(pair)
        vocab.setdefault(merged, len(vocab))
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair)):
            w, c = words[i], freq[i]
            for p in zip(w, w[1:]):
                pair_count[p] -= c
                touched.add(p)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == pair:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pair_count[p] += c
                where[p].add(i)
                touched.add(p)
        for p in touched:
            if pair_count[p] > 0:
                heapq.heappush(heap, (-pair_count[p], p))
    return vocab, merges


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for raw bytes, in byte order."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_char)


def _byte_of_char(c: str) -> int:
    # Inverse of the GPT-2 bytes_to_unicode map: printable bytes map to themselves, the other
    # 68 bytes map in order onto U+0100.. .
    o = ord(c)
    if o < 256:
        return o
    shifted = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return shifted[o - 256]


def _ordered_vocab(head: list[str], trained: dict, tail: list[str] = ()) -> dict[str, int]:
    """`head` tokens first, then trained tokens not already present, then `tail`."""
    out: dict[str, int] = {}
    for t in [*head, *trained, *tail]:
        if t not in out:
            out[t] = len(out)
    return out


def clip_tokenizer(model_max_length: int = 77) -> transformers.CLIPTokenizer:
    """Tiny CLIP tokenizer (byte-level BPE, `</w>` word suffix), pad = eos as in SD3."""
    from transformers import CLIPTokenizer

    template = CLIPTokenizer()
    bytes_ = _byte_chars()
    # Real CLIP order: 256 byte chars, the same with `</w>`, merges, then the two specials.
    trained, merges = _train_bpe(template, bytes_ + [c + "</w>" for c in bytes_], suffix="</w>")
    vocab = _ordered_vocab([], trained, ["<|startoftext|>", "<|endoftext|>"])
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )


def t5_tokenizer(model_max_length: int = 512) -> transformers.T5Tokenizer:
    """Tiny T5 / UMT5 tokenizer (Unigram + Metaspace): `<pad>`=0, `</s>`=1, `<unk>`=2."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import T5Tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    template = T5Tokenizer(extra_ids=0)
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = template.backend_tokenizer.pre_tokenizer
    trainer = trainers.UnigramTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(_plain_corpus(), trainer=trainer)
    pieces = [(t, float(s)) for t, s in _model_json(tok)["vocab"] if t not in specials]
    # Two sources of run-to-run noise: EM scores differ in the last bits (parallel float
    # sums), and the trainer appends its required single characters below the learned pieces
    # in hash-map order. Round the scores, put every such low character (and any missing
    # printable ASCII, so ASCII text never hits <unk>) on one floor score, sort by (score, token).
    lowest = min(s for t, s in pieces if len(t) > 1)
    floor = round(lowest - 1.0, 6)
    scores = {t: (round(s, 6) if len(t) > 1 or s > lowest + 0.5 else floor) for t, s in pieces}
    for c in _ASCII + ["▁"]:
        scores.setdefault(c, floor)
    ranked = sorted(scores.items(), key=lambda ts: (-ts[1], ts[0]))
    pieces = [(t, 0.0) for t in specials] + ranked
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


# Qwen2.5-VL added tokens, in their real order (ids follow the BPE vocabulary).
_QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added but not special in Qwen2.5 (kept when decoding with skip_special_tokens).
_QWEN_ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

# ChatML as Qwen2-VL renders it: string content or a list of {"type": text|image|video} parts.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_tokenizer(model_max_length: int = 131072) -> transformers.Qwen2Tokenizer:
    """Tiny Qwen2 tokenizer (byte-level BPE) with Qwen2.5-VL special tokens and ChatML
    template; eos = `<|im_end|>`, pad = `<|endoftext|>` as in Qwen-Image's tokenizer."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    template = Qwen2Tokenizer()
    bytes_ = _byte_chars()
    trained, merges = _train_bpe(template, bytes_)
    vocab = _ordered_vocab(bytes_, trained, _QWEN_SPECIAL + _QWEN_ADDED)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in _QWEN_SPECIAL if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=model_max_length,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN_ADDED])
    return tok


# Gemma 3 chat tokens (LTX-2 uses a Gemma 3 text encoder).
_GEMMA_TURN = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_tokenizer(model_max_length: int = 1024) -> transformers.GemmaTokenizer:
    """Tiny Gemma tokenizer: BPE with byte fallback (`<0x00>`..`<0xFF>`), spaces as `▁`;
    ids `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, `<mask>`=4; prepends `<bos>`."""
    from tokenizers import pre_tokenizers
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    template = GemmaTokenizer()
    # The class does not pre-split (the normalizer turns spaces into `▁` first); for training,
    # split before each `▁` so merges stay inside words and the small vocab is spent on words.
    split = pre_tokenizers.Split("▁", behavior="merged_with_next")
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    vocab, merges = _train_bpe(template, specials + _GEMMA_TURN + byte_tokens, pre_tokenizer=split)
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=model_max_length,
        chat_template=GEMMA_CHAT_TEMPLATE,
        add_bos_token=True,  # real Gemma 3 prepends <bos>; LTX-2's encoder expects it
        add_eos_token=False,
    )
    tok.add_special_tokens({"extra_special_tokens": _GEMMA_TURN})
    return tok
