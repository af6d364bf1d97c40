"""The real target's chat template (SmolLM2-135M-Instruct, ChatML) renders every built-in domain's prompts as user
turns: questions, instructions and code tasks alike, never raw ``Question: ...\\nAnswer:`` text (an instruct model
answers that with its end-of-turn token at once)."""
from __future__ import annotations

import pytest

from data.text import Renderer
from data.registry import DOMAINS
from data.loading import eval_prompts

pytestmark = pytest.mark.slow

EVAL_DOMAINS = [d for d in DOMAINS if d != "corpus"]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from models.checkpoints import load_tokenizer

    return load_tokenizer(smollm2_dir, role="target")


@pytest.mark.parametrize("domain", EVAL_DOMAINS)
def test_every_domain_reaches_the_chat_model_as_a_user_turn(tok, domain):
    render = Renderer(tok)
    assert render.user_turns and render.format == "chat_template"
    examples = eval_prompts(domain, max_prompts=5, tokenizer=tok)
    for ex in examples:
        assert ex.prompt.startswith("<|im_start|>system\n"), ex.prompt[:80]
        assert ex.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n"), ex.prompt[-80:]
        user = ex.prompt.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0]
        assert user.strip() and not user.rstrip().endswith(("Answer:", "Summary:", "Note:")), user[-80:]
        assert render.format_of(ex.messages) in ("chat_template", "chat_template_user_turn")


def test_training_text_is_the_rendered_conversation(tok):
    """The cross-entropy baseline trains on the datasets' reference answers in the same template."""
    render = Renderer(tok)
    p, c = render("Question: What is anemia?\nAnswer:", " A lack of healthy red blood cells.", None)
    assert p.endswith("<|im_start|>user\nWhat is anemia?<|im_end|>\n<|im_start|>assistant\n")
    assert c == "A lack of healthy red blood cells.<|im_end|>\n"
    code = render("def add(a, b):\n    \"\"\"Add.\"\"\"\n", "    return a + b\n", None)
    assert code[0].endswith("<|im_start|>user\ndef add(a, b):\n    \"\"\"Add.\"\"\"<|im_end|>\n<|im_start|>assistant\n")
    assert code[1] == "    return a + b<|im_end|>\n"


def test_only_a_cue_line_is_dropped_not_the_end_of_a_word(tok):
    render = Renderer(tok)
    for prompt, user in [("Describe the structure of DNA:", "Describe the structure of DNA:"),
                         ("Compare plan B with plan A:", "Compare plan B with plan A:"),
                         ("Give the TL;DR:", "Give the TL;DR:"),
                         ("Summarize the note.\nText here\nSummary:", "Summarize the note.\nText here"),
                         ("Question: Why?\nAnswer:", "Why?")]:
        p, _ = render(prompt, "", None)
        assert p.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0] == user
