"""Tiny hub-free tokenizers: round trip through save_pretrained / AutoTokenizer, coverage,
determinism and the Qwen-Image template prefix length."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from miles_core.tiny import tokenizers as tt

BUILDERS = {
    "clip": tt.clip_tokenizer,
    "t5": tt.t5_tokenizer,
    "qwen2": tt.qwen2_tokenizer,
    "gemma": tt.gemma_tokenizer,
}
PROMPT = "A red apple on a wooden table, photographed at sunset."
ASCII = "".join(chr(i) for i in range(32, 127)) + " Zebra_42 & {json: [1, 2]} ~`|\\"
NON_ASCII = "Café naïve 日本語 emoji 🙂 ß Ω"


@pytest.fixture(scope="module", params=list(BUILDERS))
def built(request):
    return request.param, BUILDERS[request.param]()


def test_vocab_size_and_class(built):
    name, tok = built
    expected = {"clip": "CLIPTokenizer", "t5": "T5Tokenizer", "qwen2": "Qwen2Tokenizer", "gemma": "GemmaTokenizer"}
    assert type(tok).__name__ == expected[name]
    assert 500 <= len(tok) <= 1500


def test_round_trip(built, tmp_path):
    name, tok = built
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is type(tok)
    assert loaded(PROMPT).input_ids == tok(PROMPT).input_ids
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.bos_token_id,
    )
    assert loaded.model_max_length == tok.model_max_length
    assert loaded.chat_template == tok.chat_template


def test_different_prompts_differ(built):
    _, tok = built
    a = tok("a red cat").input_ids
    b = tok("a blue dog").input_ids
    assert a != b


def test_no_unknown_tokens(built):
    name, tok = built
    texts = [ASCII, PROMPT]
    if name != "t5":  # T5's Unigram has no byte fallback; real T5 maps unseen chars to <unk> too
        texts.append(NON_ASCII)
    for text in texts:
        # content ids only: CLIP's unk is its eos, which the post-processor appends
        content = tok(text, add_special_tokens=False).input_ids
        assert content and tok.unk_token_id not in content, (name, text)


def test_byte_level_decodes_back(built):
    name, tok = built
    if name == "t5":
        text = ASCII.strip()
    else:
        text = NON_ASCII
    ids = tok(text, add_special_tokens=False).input_ids
    decoded = tok.decode(ids)
    if name == "clip":  # CLIP lowercases and re-spaces words
        assert decoded.replace(" ", "") == text.lower().replace(" ", "")
    elif name == "t5":
        assert decoded.replace(" ", "") == text.replace(" ", "")
    else:
        assert decoded == text


def test_deterministic():
    for name, build in BUILDERS.items():
        a, b = build(), build()
        assert a.get_vocab() == b.get_vocab(), name
        assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str(), name


def test_special_ids():
    t5 = tt.t5_tokenizer()
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert t5("a cat").input_ids[-1] == 1
    gemma = tt.gemma_tokenizer()
    assert [gemma.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]
    assert gemma("a cat").input_ids[0] == 2
    assert gemma.convert_tokens_to_ids("<0x00>") != gemma.unk_token_id
    clip = tt.clip_tokenizer()
    ids = clip("a cat").input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    assert clip.pad_token == clip.eos_token == "<|endoftext|>"
    qwen = tt.qwen2_tokenizer()
    assert qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"
    for t in ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
        assert qwen(t, add_special_tokens=False).input_ids == [qwen.convert_tokens_to_ids(t)]


def test_clip_pads_and_truncates_to_77():
    tok = tt.clip_tokenizer()
    assert tok.model_max_length == 77
    short = tok("a cat", padding="max_length", max_length=77, truncation=True).input_ids
    long = tok("a red cat " * 100, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(short) == len(long) == 77
    assert short[-1] == tok.pad_token_id and long[-1] == tok.eos_token_id


def test_qwen_image_template_prefix_is_34_tokens():
    import inspect
    import re

    from diffusers.pipelines.qwenimage import pipeline_qwenimage

    src = inspect.getsource(pipeline_qwenimage.QwenImagePipeline.__init__)
    template = eval(re.search(r"self\.prompt_template_encode = (\".*\")", src).group(1))
    start_idx = int(re.search(r"self\.prompt_template_encode_start_idx = (\d+)", src).group(1))
    assert template == tt.QWEN_IMAGE_TEMPLATE and start_idx == 34
    tok = tt.qwen2_tokenizer()
    prefix = template.split("{}")[0]
    assert len(tok(prefix).input_ids) == start_idx
    # the prefix's ids are a prefix of the full templated prompt's ids, so dropping
    # start_idx tokens leaves exactly the user prompt + suffix
    full = tok(template.format(PROMPT)).input_ids
    assert full[:start_idx] == tok(prefix).input_ids


def test_qwen_chat_template():
    tok = tt.qwen2_tokenizer()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a cat"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>a cat<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
