"""A re-ranking request, declared once: ``RerankConfig`` (the command line's ``--rerank*`` options, the API's
``rerank`` object and the docs' table are made from it), what is wrong with one (``config_problems``) and the API's
form of it (``rerank_from_json``).

Plain Python (the server and the command line import it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retrieval.options import declared_options, field_problem, hint_members, option
from retrieval.rerank.methods import NONE, RERANKERS, method_names

MAX_CANDIDATES = 1000  # the shortlist one query re-ranks at most: kreciprocal holds a few (m + 1)^2 matrices
# (8 MiB each at the cap) and takes ~0.13 s (docs/BENCHMARKS.md, "Re-ranking")
DEFAULT_CANDIDATES = 100
MAX_NEIGHBOURS = 100  # k, k1 and k2 at most: neighbour lists longer than this re-rank nothing a shortlist holds
MAX_ALPHA = 10.0  # sim^alpha: beyond 10 every weight but the nearest is ~0 (Radenović et al. use 3)


# --- the options, declared once ----------------------------------------------------------------------------------
SECTION = "re-ranking"
# the neighbourhood sizes a request may leave unset: the gallery's typical class size sets them
# (``retrieval.rerank.defaults``); where nothing has, the papers' values, which are also the largest derived ones
PAPER_NEIGHBOURHOOD = {"k": 10, "k1": 20, "k2": 6}  # Radenović et al.'s k; Zhong et al.'s k1 and k2
FROM_GALLERY = "set by the gallery's class sizes (docs/INDEX.md)"


@dataclass(frozen=True)
class RerankConfig:
    """How a search re-ranks its shortlist. Each field is declared once: the command line's ``--rerank*`` options,
    the API's ``rerank`` object (the field names are its keys) and the docs' table are made from it."""

    method: str = option(NONE, SECTION, "re-rank each query's shortlist: qe (αQE) and dba (database-side "
                         "augmentation), Radenović et al. TPAMI 2018; kreciprocal, Zhong et al. CVPR 2017.",
                         choices=method_names, flag="--rerank")
    candidates: int = option(DEFAULT_CANDIDATES, SECTION, "the shortlist re-ranked per query: the top results, "
                             "whose stored vectors the method reads (results beyond it keep their order).", low=1,
                             high=MAX_CANDIDATES, unit="results", flag="--rerank-candidates")
    k: int | None = option(None, SECTION, "qe: the top candidates added to the query; dba: the neighbours added to "
                           "each candidate.", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k",
                           default_text=FROM_GALLERY)
    alpha: float = option(3.0, SECTION, "qe and dba: a neighbour weighs its cosine similarity to the power alpha "
                          "(0: a plain average).", low=0, high=MAX_ALPHA, flag="--rerank-alpha")
    k1: int | None = option(None, SECTION, "kreciprocal: the neighbourhood of the k-reciprocal sets (k1 / 2 for "
                            "their expansion).", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k1",
                            default_text=FROM_GALLERY)
    k2: int | None = option(None, SECTION, "kreciprocal: the neighbours averaged by the local query expansion (1: "
                            "none).", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k2", default_text=FROM_GALLERY)
    lambda_value: float = option(0.3, SECTION, "kreciprocal: the weight of the original distance in the final one "
                                 "(1 - lambda for the Jaccard distance).", low=0, high=1, flag="--rerank-lambda")

    def __post_init__(self) -> None:
        problems = config_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def active(self) -> bool:
        """Whether it re-ranks anything (method is not none)."""
        return self.method != NONE

    def unset(self) -> tuple[str, ...]:
        """The neighbourhood sizes its method reads that were left unset (for the gallery to choose)."""
        return tuple(name for name in RERANKERS[self.method].params
                     if name in PAPER_NEIGHBOURHOOD and getattr(self, name) is None) if self.active else ()

    def resolved(self) -> RerankConfig:
        """Every neighbourhood size set: an unset one takes the paper's value (the largest a gallery derives, so a
        cost computed from it bounds the cost of any gallery's)."""
        return dataclasses.replace(self, **{name: value for name, value in PAPER_NEIGHBOURHOOD.items()
                                            if getattr(self, name) is None})

    def params(self) -> dict[str, Any]:
        """The parameters its method reads, with the shortlist size (what a report and an answer show)."""
        if not self.active:
            return {}
        resolved = self.resolved()
        return {"candidates": self.candidates,
                **{name: getattr(resolved, name) for name in RERANKERS[self.method].params}}

    def describe(self, defaults: str | None = None) -> dict[str, Any]:
        """Method, title, paper and parameters, as the API's answers and the evaluate report show them;
        ``defaults``: where the sizes left unset came from (``retrieval.rerank.defaults.Neighbourhood.basis``)."""
        if not self.active:
            return {"method": NONE}
        method = RERANKERS[self.method]
        return {"method": self.method, "title": method.title, "paper": method.paper, "params": self.params(),
                **({"defaults": defaults} if defaults else {})}


def config_problems(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with a ``RerankConfig``'s field ``values``, each problem naming its flag (or ``names[field]``
    instead): types, choices and ranges as declared. Each range is checked alone (what a JSON schema can say); a
    neighbourhood larger than the shortlist (k, k1 or k2 above the candidates a query has) takes all of it."""
    renamed = names or {}
    problems = []
    for declared in declared_options(RerankConfig):
        problem = field_problem(declared, values[declared.name])
        if problem is not None:
            problems.append(problem.replace(declared.flag, renamed.get(declared.name, declared.flag), 1))
    return problems


NO_RERANK = RerankConfig()
API_KEY = "rerank"  # the key (JSON) and query parameter of POST /search and /search/batch
MAX_PROBLEM_CHARS = 200


def rerank_from_json(value: Any) -> RerankConfig:
    """The API's ``rerank``: a method name, or an object of ``RerankConfig``'s field names (``method`` required).
    A ValueError names the JSON key at fault, the allowed values and the fix."""
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, dict):
        raise ValueError(f'"{API_KEY}" must be a method name ({", ".join(method_names())}) or an object such as '
                         f'{{"method": "qe", "k": 10}}, got {type(value).__name__}')
    declared = declared_options(RerankConfig)
    fields = [d.name for d in declared]
    unknown = sorted(str(key)[:40] for key in set(value) - set(fields))
    if unknown:
        raise ValueError(f'"{API_KEY}" has unknown keys {", ".join(map(repr, unknown[:5]))}; its keys are '
                         f'{", ".join(fields)}')
    if "method" not in value:
        raise ValueError(f'"{API_KEY}" needs "method": one of {", ".join(method_names())}')
    values = dataclasses.asdict(NO_RERANK) | value
    for option_ in declared:  # JSON has one number type: 5.0 is the integer 5 where an integer is declared
        given = values[option_.name]
        if int in hint_members(option_.hint) and isinstance(given, float) and given.is_integer():
            values[option_.name] = int(given)
    problems = config_problems(values, {name: f'"{API_KEY}.{name}"' for name in fields})
    if problems:  # each cut: a problem quotes the value sent, which a client may make as long as its body
        raise ValueError("; ".join(p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS] + "… (cut)"
                                   for p in problems))
    return RerankConfig(**values)
