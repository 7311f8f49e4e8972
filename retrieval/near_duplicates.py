"""`index add`'s near-duplicate check, its options declared once (``retrieval.options``): what is done with a new
image that nearly copies an indexed one, and from which cosine on. A leaf (no NumPy, no faiss), so that the command
line declares its options without loading the index code; the check itself is ``retrieval.index.curation.add_check``."""

from __future__ import annotations

from dataclasses import dataclass

from retrieval.errors import ParameterError
from retrieval.options import declared_options, field_problem, option

DEFAULT_THRESHOLD = 0.95  # the check's cosine unless told: few false reports (docs/BENCHMARKS.md, near-duplicates)
DUPLICATE_ACTIONS = ("report", "skip", "off")
SECTION = "near-duplicates"


@dataclass(frozen=True)
class DuplicateCheck:
    """What `index add` does with a new image whose nearest indexed image is at least ``duplicate_threshold``
    alike; checked when made (a ParameterError names the field)."""

    duplicates: str = option("report", SECTION, "new images whose nearest indexed image is at least "
                             "--duplicate-threshold alike: report them, skip them (catalogued as duplicates, not "
                             "searched), or off (no check).", choices=DUPLICATE_ACTIONS)
    duplicate_threshold: float = option(DEFAULT_THRESHOLD, SECTION, "the cosine from which a new image is a "
                                        "near-duplicate (`retrieval index duplicates INDEX --threshold auto` "
                                        "calibrates one for the index's model).", low=-1.0, high=1.0)

    def __post_init__(self) -> None:
        for declared in declared_options(DuplicateCheck):
            problem = field_problem(declared, getattr(self, declared.name))
            if problem is not None:
                raise ParameterError(declared.name, problem.removeprefix(f"{declared.flag} "))
