"""Which drafts an evaluation reads (``eval.drafts``, a routing table, or the run directory's ``drafts/*``), and the
check, before a training run loads anything, that the drafts its stages must still write can be written."""
from __future__ import annotations

from pathlib import Path

__all__ = ["routed_drafts", "draft_paths", "check_planned_drafts"]


def routed_drafts(table_path: str, domains: list[str], eval_drafts: dict | None) -> tuple[dict, dict]:
    """``decode.draft_routing``: (draft name -> path, domain -> draft name, None for a domain routed to the target
    alone) for ``domains``, checked before any model loads.

    Raises:
        RoutingError (a ValueError): missing / invalid table, a domain without a route and no ``default``, or
            ``eval.drafts`` given as well (the table decides the drafts).
    """
    from decode.routing import RoutingError, load_routing

    if eval_drafts:
        raise RoutingError("decode.draft_routing and eval.drafts both name drafts; with a routing table the table "
                           "decides which draft decodes each domain. Drop one of them.")
    table = load_routing(table_path)
    paths: dict[str, Path] = {}
    routed: dict[str, str] = {}
    for d in domains:
        r = table.draft_for(d)
        if r.target_only:  # routed to no draft: decoded with the target alone
            routed[d] = None
            continue
        name = r.draft
        if name in paths and paths[name] != Path(r.path):  # two different checkpoints share a name
            name = f"{r.draft}@{Path(r.path).parent.name}/{Path(r.path).name}"
        paths[name] = Path(r.path)
        routed[d] = name
    return paths, routed


def draft_paths(rc, run_dir: Path) -> dict[str, Path]:
    """name -> draft directory: ``eval.drafts``, else ``<run_dir>/drafts/*``. A relative ``eval.drafts`` path
    ``drafts/<name>`` is the run directory's (a draft an earlier stage of the run writes) unless only the working
    directory has it, so an experiment can evaluate its own drafts beside one from elsewhere (``lora_med``: the
    committed general draft).

    Raises:
        ValueError: no drafts at all (says how to give some).
    """
    drafts_dir = Path(run_dir) / "drafts"
    if rc.decode.draft_routing:  # the table decides (checked: it loads, every domain has a route)
        paths = routed_drafts(rc.decode.draft_routing, rc.eval.all_domains(), rc.eval.drafts)[0]
    elif rc.eval.drafts:
        def where(p) -> Path:  # drafts/<name>: the run's, unless only the working directory has it
            p = Path(p).expanduser()
            if p.is_absolute() or p.parts[:1] != ("drafts",):
                return p
            in_run = Path(run_dir) / p
            return in_run if in_run.exists() or not p.exists() else p

        paths = {n: where(p) for n, p in rc.eval.drafts.items()}
    else:
        paths = {p.name: p for p in sorted(drafts_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")} \
            if drafts_dir.is_dir() else {}
    if not paths and not rc.decode.draft_routing:  # a table may route every domain to the target alone
        raise ValueError(f"no drafts to evaluate: none under {drafts_dir} and eval.drafts is empty. Run the distill "
                         f"and/or baseline stage first, or pass eval.drafts='{{name: /path/to/draft_dir}}'.")
    return dict(sorted(paths.items(), key=lambda kv: (kv[0] != "distilled", kv[0])))


def _later_drafts(paths: dict[str, Path], run_dir: Path) -> dict[str, Path]:
    """The drafts of ``paths`` that are the run directory's and do not exist yet (an earlier stage writes them)."""
    run_drafts = (Path(run_dir) / "drafts").resolve()
    return {n: p for n, p in paths.items() if not p.exists() and run_drafts in p.resolve().parents}


def check_planned_drafts(rc, run_dir: Path, later: dict[str, Path] | None = None) -> None:
    """Before a training run loads anything: every ``eval.drafts`` entry that its stages must still write can be
    written; ``drafts/<name>_int8`` only is under ``draft.quantize=int8``.

    Raises:
        ValueError: an ``_int8`` draft without ``draft.quantize=int8`` (names both fixes).
    """
    if later is None:
        if not rc.eval.drafts or rc.decode.draft_routing:
            return
        later = _later_drafts(draft_paths(rc, run_dir), run_dir)
    quantize = getattr(getattr(rc, "draft", None), "quantize", "none")
    for n, p in later.items():  # <name>_int8 copies are written only under draft.quantize=int8
        if p.name.endswith("_int8") and quantize != "int8":
            raise ValueError(f"eval.drafts.{n} is drafts/{p.name}, which this run writes only with "
                             f"draft.quantize=int8 (it is {quantize}): set draft.quantize=int8, or evaluate the "
                             f"fp32 draft with eval.drafts.{n}=drafts/{p.name[:-len('_int8')]}")
