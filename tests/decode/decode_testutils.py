"""Helpers for the decode tests: tiny target/draft pairs, left padding, the Hugging Face greedy reference."""
from __future__ import annotations

import copy

import torch

from tinymodels import perturbed_copy, tiny_llama  # noqa: F401  (perturbed_copy: re-exported)


def make_pair(seed: int, noise: float, vocab_target: int = 64, vocab_draft: int | None = None, independent=False):
    """(target, draft): a 2-layer target and a draft sharing its first ``min(V)`` ids.

    The draft is a noisy copy of the target (``noise`` 0 = identical weights) or, with ``independent``, a
    1-layer model of its own. Padded rows (ids >= the shared vocabulary) get large logits in whichever model has
    them, so a decoder that does not restrict to the shared ids would emit them.
    """
    vocab_draft = vocab_draft or vocab_target
    shared = min(vocab_target, vocab_draft)
    target = tiny_llama(vocab_size=vocab_target, hidden_size=32, num_layers=2, seed=seed)
    if independent:
        draft = tiny_llama(vocab_size=vocab_draft, hidden_size=32, num_layers=1, seed=seed + 1000)
    else:
        base = perturbed_copy(target, noise, seed + 1) if noise > 0 else copy.deepcopy(target)
        draft = tiny_llama(vocab_size=vocab_draft, hidden_size=32, num_layers=2, seed=seed + 2000)
        sd = {k: v for k, v in base.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        draft.load_state_dict(sd, strict=False)
        with torch.no_grad():
            draft.model.embed_tokens.weight[:shared] = base.model.embed_tokens.weight[:shared]
            draft.lm_head.weight[:shared] = base.lm_head.weight[:shared]
    for m in (target, draft):
        with torch.no_grad():
            if m.lm_head.weight.shape[0] > shared:
                # padded rows: 4x copies of real rows -> they win the argmax often unless sliced away
                extra = m.lm_head.weight.shape[0] - shared
                m.lm_head.weight[shared:] = 4.0 * m.lm_head.weight[:extra]
    return target.eval(), draft.eval()


def random_prompts(lengths, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def left_pad(prompts, pad_id: int = 0):
    """List of 1-D prompts -> ``(input_ids (B, P), attention_mask (B, P))`` left padded."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_greedy(target, ids, mask, max_new_tokens: int, eos_token_id=None, pad_token_id: int = 0):
    """transformers' own greedy output, padded with ``pad_token_id`` to ``(B, P + max_new_tokens)``.

    The attention mask is always passed explicitly (generate would otherwise infer one from pad_token_id).
    """
    out = target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    full = torch.full((ids.shape[0], ids.shape[1] + max_new_tokens), pad_token_id, dtype=torch.long)
    full[:, : out.shape[1]] = out
    return full


def pooled_chisquare_pvalue(counts, expected_probs, n: int) -> float:
    """Chi-square goodness of fit of ``counts`` against ``expected_probs * n`` (flat tensors), the cells expected fewer
    than 5 times pooled into one."""
    import torch
    from scipy import stats

    exp = expected_probs.flatten().double() * n
    counts = counts.flatten().double()
    big = exp >= 5
    obs, e = counts[big], exp[big]
    if exp[~big].sum() > 0:
        obs, e = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([e, exp[~big].sum()[None]])
    return float(stats.chisquare(obs.numpy(), (e * obs.sum() / e.sum()).numpy()).pvalue)

