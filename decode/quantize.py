"""INT8 drafts: dynamic int8 quantization of a draft's ``nn.Linear`` layers with PyTorch's own quantization
(in ``decode`` so that evaluation and training both reach it).

``draft.quantize=int8`` applies :func:`torch.ao.quantization.quantize_dynamic` (weights int8 per output channel,
stored once; activations quantized per batch at run time; Jacob et al. 2018, "Quantization and Training of Neural Networks
for Efficient Integer-Arithmetic-Only Inference", affine scheme r = S (q - Z)) to every ``nn.Linear`` of the draft,
the LM head included; embeddings and norms stay fp32.

How it is stored: a quantized module is not a ``from_pretrained``-able Hugging Face checkpoint, so an INT8 draft
directory holds the **fp32** Hugging Face checkpoint (config, safetensors, tokenizer) plus ``"quantize": "int8"`` in
its ``specdraft.json``. ``AutoModelForCausalLM.from_pretrained`` (and transformers' ``assistant_model``) gets the
fp32 draft; :func:`load_draft` (our evaluation and decoder) rebuilds the INT8 draft from it at load time, which is
deterministic (same fp32 weights -> same int8 weights).

Device: ``quantize_dynamic`` kernels (fbgemm / x86 / qnnpack) run on CPU only. On CUDA there is no int8 dynamic
path in PyTorch core, so :func:`quantize_draft` raises a clear error for a model on a GPU (decode on CPU, or use
``draft.quantize=none``). ``torch.ao.quantization`` is marked deprecated in favour of torchao; it still ships with
the installed torch and is the library the project uses until torchao is a dependency.

A trimmed draft head (:class:`data.draft_vocab.TrimmedLMHead`, N kept rows) is quantized the same way: its
``quantized`` attribute holds the dynamic int8 Linear over its N rows, which its forward then uses (the fp32 rows
stay for saving). The lean decoder forward (``decode/fast_llama.py``) runs int8 drafts of the Llama-like families
without projection biases by calling the quantized modules in its own layer loop (the same fbgemm kernels and
packed weights as the Hugging Face forward, so on unpadded rows the two agree to float rounding); other quantized
models fall back to the Hugging Face forward. Activations are quantized with one scale per call over every row of
the batch, so a row's int8 logits depend on the other rows, pad positions included (which the two forwards fill
differently: a left-padded batch differs by about 1e-2 between them, also in its unpadded rows). Either way
speculative decoding stays lossless: the target alone decides every emitted token, and sampled decoding uses the
int8 draft's own q from the forward that proposed the token.
"""
from __future__ import annotations

import os
import warnings

import torch

__all__ = ["QUANTIZE_MODES", "quantize_draft", "is_quantized", "check_quantize_meta", "check_quantize_device",
           "load_draft", "fuse_int8_rows"]

QUANTIZE_MODES = ("none", "int8")


def is_quantized(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a dynamically quantized Linear module (a quantized trimmed head's included)."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    return any(isinstance(m, QLinear) for m in model.modules())


def quantize_draft(model: torch.nn.Module, mode: str = "int8") -> torch.nn.Module:
    """A copy of ``model`` (eval mode, CPU) whose ``nn.Linear`` layers are dynamic int8 (``mode="int8"``); the
    model itself when ``mode="none"``. The input model is not modified.

    Raises:
        ValueError: an unknown ``mode``; a model with parameters on a non-CPU device (dynamic int8 kernels are
            CPU-only in PyTorch); a model already int8, without any ``nn.Linear``, or not in float32.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"draft.quantize must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"draft.quantize=int8 uses torch.ao dynamic int8 quantization, whose kernels run on CPU only; "
                         f"the draft is on {sorted(devices)}. Decode on CPU, or set draft.quantize=none on a GPU.")
    if is_quantized(model):
        raise ValueError(f"draft.quantize=int8: {type(model).__name__} is already int8; quantize its fp32 draft "
                         f"(decode.quantize.load_draft does, from the draft directory)")
    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise ValueError(f"draft.quantize=int8: {type(model).__name__} has no nn.Linear layer to quantize")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        raise ValueError(f"draft.quantize=int8 takes a float32 draft (the int8 kernels compute in float32); this one "
                         f"is {', '.join(sorted(str(d)[6:] for d in dtypes))}: load it in float32 (model.float())")
    from data.draft_vocab import trimmed_head

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.ao -> torchao migration notice
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        out = torch.ao.quantization.quantize_dynamic(model.eval(), _per_row_spec(), dtype=torch.qint8,
                                                     inplace=False).eval()
        head = trimmed_head(out)
        if head is not None:  # not an nn.Linear: quantize its N kept rows the same way
            lin = torch.nn.Linear(head.in_features, head.num_kept, bias=False)
            with torch.no_grad():
                lin.weight.copy_(head.weight)
            head.quantized = torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(lin).eval(), _per_row_spec(), dtype=torch.qint8)[0]
    return out


def _per_row_spec() -> dict:
    """``quantize_dynamic``'s spec: every ``nn.Linear`` with int8 weights per output row (one scale per row, so the
    rows of several projections can be stacked into one module exactly: :func:`fuse_int8_rows`)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    return {torch.nn.Linear: per_channel_dynamic_qconfig}


def fuse_int8_rows(modules) -> torch.nn.Module | None:
    """One dynamic int8 Linear whose output rows are those of ``modules`` in order (e.g. q/k/v or gate/up
    projections that read the same input), or ``None`` when they cannot be stacked exactly (not all per-row int8
    without bias, or different input widths). Exact: each row keeps its int8 values and scale, and the activation
    is quantized from the same input, so ``fused(x)`` equals ``cat([m(x) for m in modules], -1)`` bit for bit
    (tested); one call instead of several saves the per-call activation quantization and dispatch (about 20 us a
    call on the 2-core development machine, a third of an int8 draft forward's products). The stacked module is a
    copy: while it is kept (``decode.fast_weights``), the stacked projections' int8 weights are held twice."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if len(modules) < 2 or not all(isinstance(m, QLinear) and m._packed_params.dtype == torch.qint8 for m in modules):
        return None  # float16 dynamic modules (quantize_dynamic(dtype=torch.float16)) keep their own calls
    ws = [m.weight() for m in modules]
    if any(w.qscheme() != torch.per_channel_affine or w.q_per_channel_axis() != 0 for w in ws) \
            or any(m.bias() is not None for m in modules) or len({w.shape[1] for w in ws}) != 1:
        return None
    fused = torch._make_per_channel_quantized_tensor(
        torch.cat([w.int_repr() for w in ws]), torch.cat([w.q_per_channel_scales() for w in ws]).double(),
        torch.cat([w.q_per_channel_zero_points() for w in ws]).long(), 0)
    out = QLinear(ws[0].shape[1], fused.shape[0], bias_=False, dtype=torch.qint8)
    out.set_weight_bias(fused, None)
    return out


def check_quantize_meta(path: str | os.PathLike) -> str:
    """The ``quantize`` mode recorded in ``<path>/specdraft.json`` (``"none"`` when absent), checked without
    loading the model.

    Raises:
        data.checkpoints.CheckpointError: an unknown mode (names the file and the supported modes).
    """
    from data.checkpoints import CheckpointError, read_specdraft_meta

    mode = read_specdraft_meta(path).quantize_mode
    if mode not in QUANTIZE_MODES:
        raise CheckpointError(f"{path}/specdraft.json has quantize={mode!r}; supported: {', '.join(QUANTIZE_MODES)}")
    return mode


def check_quantize_device(path: str | os.PathLike, device, dtype: torch.dtype = torch.float32,
                          role: str = "draft") -> str:
    """The draft's ``quantize`` mode (:func:`check_quantize_meta`), checked against where it would run.

    Raises:
        data.checkpoints.CheckpointError: an int8 draft with ``device`` not the CPU or ``dtype`` not float32
            (dynamic int8 kernels are CPU / fp32 only); the message names both fixes.
    """
    from data.checkpoints import CheckpointError

    mode = check_quantize_meta(path)
    if mode == "int8" and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise CheckpointError(f"{role} at {path} is an int8 draft (specdraft.json quantize=int8), whose kernels run on "
                              f"CPU in float32, but the evaluation runs on {device} in {str(dtype)[6:]}; set "
                              f"eval.device=cpu eval.dtype=float32, or evaluate its fp32 draft instead")
    return mode


def load_draft(path: str | os.PathLike, role: str = "draft", dtype: torch.dtype = torch.float32, device=None):
    """``(model, tokenizer, meta)`` of a draft directory: the Hugging Face checkpoint in ``dtype`` on ``device``
    (``None``: CPU), quantized at load time when its ``specdraft.json`` says ``"quantize": "int8"`` (see the module
    doc); ``meta`` is that ``specdraft.json``.

    Raises:
        data.checkpoints.CheckpointError: unreadable checkpoint or ``specdraft.json``, an unknown ``quantize``
            value in it (names the file), or an int8 draft asked for a GPU or a dtype other than float32.
    """
    from data.checkpoints import load_causal_lm, read_specdraft_meta

    mode = check_quantize_device(path, device or "cpu", dtype, role)
    meta = read_specdraft_meta(path)
    model, tok = load_causal_lm(path, role=role, dtype=dtype, device=device)
    return quantize_draft(model, mode), tok, meta
