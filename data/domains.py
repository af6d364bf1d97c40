"""The one lookup of a domain name: a built-in domain (:mod:`data.registry`), else one declared in configuration
(:mod:`data.declared`). Everything that takes a domain name (``data.domain``, ``eval.domains``, ``lora.domain``,
mixtures, routing) resolves it here."""
from __future__ import annotations

from .declared import find_declared, unknown_domain_error
from .registry import DOMAINS, Domain, check_report_name  # noqa: F401  (re-exported: the name rule of domains)


def get_domain(name: str) -> Domain:
    """Look up a domain: a built-in one, else one declared in configuration (:mod:`data.declared`:
    ``data.declared_domains.<name>`` or ``conf/domain/<name>.yaml``).

    Raises:
        UnknownDomainError: ``name`` is neither; the message lists the known names and how to declare one.
        DataFormatError: the declaration of ``name`` is invalid (names its file and the key).
    """
    if name in DOMAINS:
        return DOMAINS[name]
    dom = find_declared(name)
    if dom is None:
        raise unknown_domain_error(name) from None
    return dom

