"""The pair-based losses of the loss library; importing this module registers them all.

Each topic lives in its own module (one job each); this module only imports them so that
``retrieval.losses`` (which imports it) runs every ``@register_loss``:

- contrastive.py  contrastive (unified eq. 5; distance form)
- triplet.py      triplet (loop eq. 14 / symm eq. 3), hphn_triplet (loop 3.3.2)
- nca.py          nca_triplet (sct eq. 1), sct (sct eq. 13)
- lifted.py       lifted (symm eq. 5), lifted_min (loop eq. 16), generalized_lifted (unified eq. 9)
- npair.py        npair (symm eq. 7), angular (symm eq. 9), angular_npair (dcdl eq. 4)
- weighting.py    binomial (unified eq. 12), vthm (Table 1: equal weights on VTHM pairs), raw (eq. 17),
                  ms (eq. 17 + VTHM, section 5.1)
"""

from __future__ import annotations

from retrieval.losses import contrastive, lifted, nca, npair, triplet, weighting  # noqa: F401
from retrieval.losses.base import AnchorPairs, DistancePairLoss, PairLoss

__all__ = ["AnchorPairs", "DistancePairLoss", "PairLoss"]
