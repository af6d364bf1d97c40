"""Where a draft starts (``draft.init``) and the ``draft_init`` stage that saves it before any training.

* ``config``: a fresh Llama of ``draft.arch`` sharing the target tokenizer (:func:`distill.drafts.build_llama`).
* ``layer_pruned``: a self-draft made of some of the target's own layers (:mod:`distill.drafts`), chosen by
  ``draft.layers`` (fixed rule or measured search).
* ``pretrained``: any causal LM (``draft.name_or_path``: HF directory or hub id) whose tokenizer passes
  :func:`models.vocab.check_tokenizers_compatible` against the target's and whose output vocabulary passes
  :func:`distill.teacher.shared_vocab_size`.

The ``draft_init`` stage saves a layer-pruned or pretrained draft as it starts to ``<run>/drafts/<init>`` (the
"before distillation" draft of the report); ``distill`` / ``baseline`` then start from that saved draft when its
recorded settings match, so the layer search runs once per run. With ``draft.quantize=int8`` every draft built from
``draft`` is also saved as ``<name>_int8`` (fp32 weights + ``"quantize": "int8"``; see :mod:`decode.fast_settings`).

The reference target: a small Llama pretrained here on public text, for machines with no model hub.

``python -m train +experiment=reference_target`` trains a byte-level BPE tokenizer and a Llama model on the data
root's ``corpus/`` books plus the training splits of the task domains, then writes a standard Hugging Face
directory with ``specdraft.json`` (the config, the data fingerprint and the validation loss per domain).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from data.loading import DataOptions, files_fingerprint, load_domain
from data.text import cached_pack_blocks, iter_texts, train_bpe_tokenizer
from distill.config import TrainerConfig
from distill.drafts import LlamaArch, build_llama, count_parameters
from distill.trainer import evaluate_loss, train
from models.checkpoints import save_hf_atomic


log = logging.getLogger(__name__)


def init_dir(rc, run_dir: Path) -> Path:
    """``<run>/drafts/<draft.init>``: where the ``draft_init`` stage saves the undistilled draft."""
    return Path(run_dir) / "drafts" / rc.draft.init


def _init_settings(rc) -> dict:
    """What determines the initial draft (compared before reusing a saved one)."""
    d = asdict(rc.draft)
    d.pop("quantize", None)
    d.pop("draft_vocab_size", None)  # applied when training starts (distill/pipeline.py), not to the initial draft
    if rc.draft.init != "config":
        d.pop("arch", None)
    if rc.draft.init != "layer_pruned":
        d.pop("layers", None)
    settings = {"draft": d, "target": str(rc.target.name_or_path), "seed": rc.seed}
    if rc.draft.init == "layer_pruned" and rc.draft.layers.method == "search":
        settings.update(domain=rc.data.domain, num_draft_tokens=rc.decode.num_draft_tokens,
                        max_prompt_tokens=rc.eval.max_prompt_tokens)
    return json.loads(json.dumps(settings, default=str))


def load_pretrained_draft(name_or_path: str, target, tokenizer):
    """``(draft, draft_tokenizer)`` from a Hugging Face directory or hub id, checked against the target.

    Raises:
        models.checkpoints.CheckpointError: the checkpoint cannot be loaded (names the path).
        models.vocab.TokenizerMismatchError: its tokenizer maps some token to another id than the target's.
        distill.teacher.VocabMismatchError: it has fewer output rows than the tokenizer has tokens.
    """
    from decode.common import output_vocab_size
    from distill.teacher import shared_vocab_size
    from models.checkpoints import check_vocab_covers_tokenizer, load_causal_lm
    from models.vocab import check_tokenizers_compatible

    draft, tok = load_causal_lm(name_or_path, role="draft")
    check_tokenizers_compatible(tokenizer, tok, draft_name=f"draft.name_or_path {name_or_path!r}")
    shared_vocab_size(output_vocab_size(target), output_vocab_size(draft), len(tokenizer))
    check_vocab_covers_tokenizer(draft, tokenizer, role=f"draft {name_or_path!r}")
    return draft, tok


def _search_score_fn(rc, opts, target, tokenizer):
    """The score the layer search maximises on ``draft.layers.search.prompts`` validation prompts of
    ``data.domain``: the mean accepted length of greedy speculative decoding, or (``metric=expected_acceptance``)
    :func:`expected_acceptance_score`."""
    from data.blocks import domain_prompts
    from data.text import encode_prompt
    from decode.common import output_vocab_size
    from distill.generation import make_acceptance_eval

    s = rc.draft.layers.search
    texts = domain_prompts(rc.data.domain, "validation", opts, s.prompts, tokenizer)
    prompts = [encode_prompt(tokenizer, t, rc.eval.max_prompt_tokens)[0] for t in texts]
    if s.metric == "expected_acceptance":
        return expected_acceptance_score(target, prompts, s.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    evaluate = make_acceptance_eval(
        target, prompts, num_draft_tokens=rc.decode.num_draft_tokens, max_new_tokens=s.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        vocab_size=output_vocab_size(target))
    return lambda draft: evaluate(draft)["mean_accepted_length"]


@torch.inference_mode()
def expected_acceptance_score(target, prompts: list[torch.Tensor], max_new_tokens: int, pad_token_id=None):
    """A scorer ``f(draft) -> float`` in [0, 1]: the expected per-token acceptance rate of ``draft`` along the
    target's own greedy continuations of ``prompts`` (each ``(1, P)``).

    The continuations (``max_new_tokens`` each, stopping at the target's EOS) and the target's next-token
    distributions p over their positions are computed once; a draft is scored by one teacher-forced forward per
    prompt: the mean over the generated positions of ``sum_v min(p_v, q_v) = 1 - TVD(p, q)``, the probability that
    speculative sampling accepts the draft's token there (Leviathan et al. 2023, Sec. 3.1, beta = 1 - D_LK).
    """
    from decode import autoregressive_generate

    seqs, starts, ps = [], [], []
    for ids in prompts:
        out = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
        n = int(out.num_new_tokens[0])
        seq = out.sequences[:, : ids.size(1) + n]  # (1, P + n)
        # positions P - 1 .. P + n - 2 predict the n generated tokens
        p = torch.softmax(target(seq).logits[0, ids.size(1) - 1 : -1].float(), -1)  # (n, V)
        seqs.append(seq), starts.append(ids.size(1) - 1), ps.append(p)
    total = sum(p.size(0) for p in ps)

    @torch.inference_mode()
    def score(draft) -> float:
        acc = 0.0
        for seq, start, p in zip(seqs, starts, ps):
            q = torch.softmax(draft(seq).logits[0, start : start + p.size(0)].float(), -1)  # (n, V')
            v = min(p.size(-1), q.size(-1))
            acc += float(torch.minimum(p[:, :v], q[:, :v]).sum())
        return acc / max(total, 1)

    return score


def build_initial_draft(rc, opts, target, tokenizer, events=None) -> tuple[torch.nn.Module, dict]:
    """The draft before training, per ``draft.init``, and a description of how it was made (for
    ``specdraft.json``: ``init``, plus ``layers`` / ``layer_search`` or ``pretrained_from``).

    Raises:
        ValueError: see :func:`distill.drafts.build_layer_pruned`, :func:`distill.drafts.search_layers`,
            :func:`load_pretrained_draft`.
    """
    from distill.drafts import build_layer_pruned, build_llama, resolve_layers, search_layers

    init = rc.draft.init
    if init == "config":
        from distill.drafts import describe_shape_warnings

        draft = build_llama(rc.draft.arch, tokenizer, seed=rc.seed)
        warnings = describe_shape_warnings(draft, target)
        for w in warnings:
            log.warning("draft.arch: %s", w)
        return draft, {"init": "config", **({"shape_warnings": warnings} if warnings else {})}
    if init == "pretrained":
        draft, _ = load_pretrained_draft(rc.draft.name_or_path, target, tokenizer)
        return draft, {"init": "pretrained", "pretrained_from": str(rc.draft.name_or_path)}
    choice = rc.draft.layers
    n = target.config.num_hidden_layers
    info: dict = {"init": "layer_pruned", "layer_method": choice.method, "target_layers": n}
    if choice.method == "search":
        on = (lambda layers, score: events("layer_search_candidate", layers=layers, mean_accepted_length=score)) \
            if events else None
        found = search_layers(target, _search_score_fn(rc, opts, target, tokenizer), choice.k, choice.search, on)
        layers = found["layers"]
        info["layer_search"] = {**found, "strategy": choice.search.strategy, "beam_width": choice.search.width,
                                "max_evaluations": choice.search.max_evaluations, "prompts": choice.search.prompts,
                                "max_new_tokens": choice.search.max_new_tokens, "split": "validation",
                                "metric": choice.search.metric,
                                "source": "Draft & Verify (Zhang et al., ACL 2024), greedy/beam variant"}
    else:
        layers = resolve_layers(choice, n)
    info["layers"] = layers
    log.info("layer-pruned self-draft keeps target layers %s of %d", layers, n)
    return build_layer_pruned(target, layers), info


def save_draft(model, tokenizer, out: Path, meta: dict, quantize: str = "none") -> dict[str, str]:
    """Save ``model`` (fp32 HF checkpoint + ``specdraft.json`` = ``meta``) to ``out``; with ``quantize="int8"``
    also to ``<out>_int8`` with ``"quantize": "int8"`` and ``"fp32_draft": <out name>`` in its ``specdraft.json``.
    Returns name -> path of what was written."""
    out = Path(out)
    save_hf_atomic(model, tokenizer, out, extra={**meta, "quantize": "none"})
    written = {out.name: str(out)}
    if quantize != "none":
        q = out.with_name(f"{out.name}_{quantize}")
        save_hf_atomic(model, tokenizer, q, extra={**meta, "quantize": quantize, "fp32_draft": out.name})
        written[q.name] = str(q)
    return written


def reuse_initial_draft(rc, run_dir: Path):
    """The saved ``draft_init`` draft when its recorded settings equal the current ones, else ``None``."""
    from models.checkpoints import load_causal_lm, read_specdraft_meta

    d = init_dir(rc, run_dir)
    meta = read_specdraft_meta(d)
    if meta.init_settings is None or meta.init_settings != _init_settings(rc):
        return None
    model, _ = load_causal_lm(d, role=f"draft ({rc.draft.init}, saved by draft_init)")
    return model, {k: getattr(meta, k) for k in ("init", "layers", "layer_method", "target_layers", "layer_search",
                                                 "pretrained_from") if k in meta.present}


def initial_draft(rc, opts, run_dir: Path, target, tokenizer, events=None) -> tuple[torch.nn.Module, dict]:
    """The saved initial draft of this run when it matches the config, else a new one (see
    :func:`build_initial_draft`)."""
    if rc.draft.init != "config":
        reused = reuse_initial_draft(rc, run_dir)
        if reused is not None:
            log.info("starting from the %s draft saved in %s", rc.draft.init, init_dir(rc, run_dir))
            return reused
    return build_initial_draft(rc, opts, target, tokenizer, events)


def run_draft_init(rc, opts, run_dir: Path, events=None) -> dict:
    """The ``draft_init`` stage: build the ``draft.init`` draft and save it (undistilled) to ``<run>/drafts/<init>``.

    Raises:
        ValueError: ``draft.init=config`` (a fresh random draft is not worth evaluating; use the distill stage).
    """
    from core.runtime import torch_threads
    from data.loading import files_fingerprint
    from distill.drafts import count_parameters
    from distill.trainer import evaluate_loss
    from models.checkpoints import load_causal_lm

    if rc.draft.init == "config":
        raise ValueError("stage draft_init needs draft.init=layer_pruned or draft.init=pretrained (a fresh "
                         "draft.init=config draft is random); remove draft_init from stages or pick another draft")
    out = init_dir(rc, run_dir)
    with torch_threads(rc.trainer.num_threads):
        target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target")
        draft, info = build_initial_draft(rc, opts, target, tokenizer, events)
        from data.blocks import domain_blocks

        val = domain_blocks(rc.data.domain, "validation", tokenizer, rc.data.block_size, opts)[:64]
        meta = {"kind": rc.draft.init, **info, "target": str(rc.target.name_or_path), "domain": rc.data.domain,
                "distilled": False, "draft_parameters": count_parameters(draft),
                "target_parameters": count_parameters(target),
                "validation_loss_nats_per_token": evaluate_loss(draft, val),
                "target_validation_loss_nats_per_token": evaluate_loss(target, val),
                "data_fingerprint_sha256": files_fingerprint(rc.data.domain, opts),
                "init_settings": _init_settings(rc)}
    written = save_draft(draft, tokenizer, out, meta, rc.draft.quantize)
    log.info("%s draft saved to %s", rc.draft.init, out)
    return {**meta, "path": str(out), "written": written}


@dataclass
class ReferenceConfig:
    """Settings of the reference-target stage (the ``reference`` section of conf/config.yaml)."""

    output_dir: str = "reference_target"  # where the HF directory goes (conf/config.yaml: paths.reference_target)
    domains: list[str] = field(default_factory=lambda: ["corpus", "medical", "code", "chat", "math"])
    vocab_size: int = 4096
    block_size: int = 256
    arch: LlamaArch = field(default_factory=lambda: LlamaArch(hidden_size=256, num_layers=6, num_heads=8,
                                                              intermediate_size=640))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=1000, micro_batch_size=16,
                                                                         lr=3e-3, warmup_steps=50, save_every=100))
    eval_blocks_per_domain: int = 32


def _tokenizer_texts(domains, opts):
    for d in domains:
        yield from iter_texts(load_domain(d, opts)["train"])


def build_reference_target(rc: ReferenceConfig, opts: DataOptions, work_dir: Path, seed: int = 0) -> dict:
    """Train tokenizer + model and save them to ``rc.output_dir``; returns the metadata written.

    ``work_dir`` holds the resumable training state (so an interrupted build resumes with trainer.resume=true).
    """
    work_dir = Path(work_dir)
    log.info("training byte-level BPE tokenizer (vocab %d) on %s", rc.vocab_size, rc.domains)
    tokenizer = train_bpe_tokenizer(_tokenizer_texts(rc.domains, opts), rc.vocab_size)
    fingerprints = {d: files_fingerprint(d, opts) for d in rc.domains}
    data_fp = hashlib.sha256("".join(fingerprints[d] for d in rc.domains).encode()).hexdigest()

    def blocks_of(split):
        parts = []
        for d in rc.domains:
            ds = cached_pack_blocks(
                [fingerprints[d], d, split, opts.validation_fraction, opts.test_fraction],
                lambda d=d: load_domain(d, opts)[split].map(
                    lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=["id", "source", "prompt", "completion"]),
                tokenizer, rc.block_size)
            parts.append(torch.tensor(ds["input_ids"], dtype=torch.long).view(-1, rc.block_size))
        return parts

    train_parts = blocks_of("train")
    train_blocks = torch.cat(train_parts)
    log.info("reference target: %d training blocks of %d tokens", train_blocks.size(0), rc.block_size)
    model = build_llama(rc.arch, tokenizer, seed=seed)
    stats = train(model, train_blocks, work_dir, rc.trainer, seed=seed, desc="reference target")
    val = {}
    for d, blocks in zip(rc.domains, blocks_of("validation")):
        val[d] = evaluate_loss(model, blocks[: rc.eval_blocks_per_domain]) if blocks.numel() else float("nan")
    meta = {
        "kind": "reference_target",
        "parameters": count_parameters(model),
        "validation_loss_nats_per_token": val,
        "data_fingerprint_sha256": data_fp,
        "data_file_fingerprints": fingerprints,
        "config": {**asdict(rc), "seed": seed, "data": asdict(opts)},
        "train": {k: v for k, v in stats.items() if k != "config"},
    }
    from distill.launch import distributed_state

    dist = distributed_state()
    from data.text import REFERENCE_CHAT_TEMPLATE

    # the chat template renders exactly the plain "User: ...\nAssistant:" text the model was trained on, so the
    # default target exercises the chat-template path (data/text.py) without changing a token
    tokenizer.chat_template = REFERENCE_CHAT_TEMPLATE
    if dist.is_main_process:
        save_hf_atomic(model, tokenizer, rc.output_dir, extra=meta)
    dist.wait_for_everyone()
    return meta
